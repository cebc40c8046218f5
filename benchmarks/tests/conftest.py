"""The benchmarks' own tests: the benchmark scripts beside them, and the suite's shared helpers
(``tests/helpers.py``) importable."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "benchmarks", ROOT / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
