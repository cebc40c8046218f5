"""``benchmarks/speed/overhead.py`` runs end to end, and funcmeta's meta-gradients agree with the
hand-written loop's for both inner optimizers (its "agree" column)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bench_scripts import script

SCRIPT = script("speed/overhead.py")


@pytest.mark.slow
def test_the_benchmark_runs_and_both_rows_agree():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "1", "--meta-batch", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith(("sgd", "adam"))]
    assert [(r[0], r[1]) for r in rows] == [("sgd", "yes"), ("adam", "yes")], run.stdout
