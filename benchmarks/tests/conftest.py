"""The benchmarks' own tests: ``benchmarks/`` (``_common.py``), the suite's shared helpers
(``tests/helpers.py``) and this folder (``bench_scripts.py``, which loads the scripts of
``benchmarks/<purpose>/``) importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "benchmarks", ROOT / "tests", ROOT / "benchmarks" / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from helpers import report_refusals  # noqa: E402

# a refusal of a capability this torch lacks is reported as skipped (helpers.report_refusals)
pytest_runtest_makereport = pytest.hookimpl(hookwrapper=True)(report_refusals)

# Under pytest-xdist the scripts these tests start run on one thread, as tests/conftest.py sets
# for the suite's own processes: a two-thread benchmark beside a busy worker ran past its
# 300-second limit on CI's two cores, where it takes 5 seconds alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("FUNCMETA_TEST_THREADS", "1"))
