"""The benchmarks' own tests: ``benchmarks/`` (``_common.py``), the suite's shared helpers
(``tests/helpers.py``) and this folder (``bench_scripts.py``, which loads the scripts of
``benchmarks/<purpose>/``) importable."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "benchmarks", ROOT / "tests", ROOT / "benchmarks" / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
