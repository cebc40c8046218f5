"""``benchmarks/speed/sharded.py`` runs end to end on 2 gloo ranks (a small model): its
table, the sharded meta-gradient checked against one process's, the bytes sent equal to its
formula, the same-data checks' rows and their count, and a RESULT line that judges the time
target."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from bench_scripts import script
from helpers import NEEDS_SHARDED

pytestmark = NEEDS_SHARDED

SCRIPT = script("speed/sharded.py")


@pytest.mark.slow
def test_the_benchmark_runs_on_two_ranks_and_judges_its_target():
    command = [sys.executable, str(SCRIPT), "--width", "64", "--blocks", "2", "--tasks", "4"]
    command += ["--rows", "8", "--repeats", "1", "--rounds", "1", "--max-ratio", "100"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for way in ("one process", "sharded", "tasks only", "checks ", "checks off"):
        assert any(s.startswith(way) for s in lines), run.stdout
    # the checks rows: 2 tasks, each 1 support batch + 3 inner losses + 1 query input + 1
    # gradient at the outputs compared, 8 bytes sent to the other rank each
    checks = next(s for s in lines if s.startswith("checks:"))
    assert "96 bytes of comparisons sent by rank 0" in checks, checks
    differences = [s for s in lines if "largest relative difference" in s]
    assert len(differences) == 2
    for line in differences:
        assert float(line.rsplit(" ", 1)[1]) < 1e-4, line
    traffic = next(s for s in lines if s.startswith("bytes rank 0 sends"))
    measured = int(re.search(r"= ([\d,]+); formula", traffic).group(1).replace(",", ""))
    formula = int(re.search(r"padded\) = .* = ([\d,]+);", traffic).group(1).replace(",", ""))
    assert measured == formula > 0, traffic
    assert re.match(r"RESULT PASS: sharded \d+\.\d\dx the one-process step", lines[-1]), run.stdout
