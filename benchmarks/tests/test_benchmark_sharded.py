"""``benchmarks/memory/sharded.py`` runs end to end on 2 gloo ranks (a small model) and judges
its targets: each rank's table row, the peak ratio, and a RESULT line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from bench_scripts import script
from helpers import NEEDS_SHARDED

pytestmark = NEEDS_SHARDED

SCRIPT = script("memory/sharded.py")


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["layers", "none"])
def test_the_benchmark_runs_on_two_ranks_and_judges_its_targets(checkpoint):
    small = ["--ranks", "2", "--width", "64", "--blocks", "2", "--checkpoint", checkpoint]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *small],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode in (0, 1), run.stderr
    lines = run.stdout.splitlines()
    assert len([s for s in lines if s.startswith("2 ranks")]) == 2, run.stdout + run.stderr[-3000:]
    assert any(s.startswith("largest peak of a rank / the single process's:") for s in lines)
    assert re.match(r"RESULT (PASS|FAIL)", lines[-1]), run.stdout
    assert ("PASS" in lines[-1]) == (run.returncode == 0)
