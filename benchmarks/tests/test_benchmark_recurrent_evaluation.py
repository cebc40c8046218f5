"""``benchmarks/speed/recurrent_evaluation.py`` runs end to end, and the task-batched evaluation it
times agrees with the loop over the tasks on every row (its "agree" column)."""

from __future__ import annotations

import subprocess
import sys

from bench_scripts import script

SCRIPT = script("speed/recurrent_evaluation.py")


def test_the_benchmark_runs_and_every_row_agrees():
    args = ["--tasks", "2", "3", "--repeats", "1", "--threads", "1"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("lstm", "2"),
        ("lstm", "3"),
        ("gru", "2"),
        ("gru", "3"),
    ]
    assert all(r[2] == "yes" for r in rows), run.stdout
