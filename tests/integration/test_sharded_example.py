"""``examples/sharded_maml.py`` under torchrun: two gloo ranks each hold half of the decoder's
parameters, gather no more than one block's (with the final norm's and one other layer's) at
once, and the adapted query loss falls (``--check``); the run saved there resumes on one
rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharded_maml.py"


def _torchrun(ranks: int, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(EXAMPLE), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_two_ranks_hold_half_and_one_block_then_one_rank_resumes(tmp_path):
    out = _torchrun(2, "--iterations", "10", "--check", "--save", str(tmp_path / "run"))
    lines = out.strip().splitlines()
    found = re.search(
        r"2 ranks: each holds ([\d,]+) of ([\d,]+) parameters; gathered at most ([\d,]+) bytes "
        r"at once \(one block, the final norm and one other layer: ([\d,]+)\)",
        lines[-2],
    )
    assert found, out
    held, whole, most, bound = (int(g.replace(",", "")) for g in found.groups())
    assert held * 2 == whole  # every parameter's first dimension is even
    assert 0 < most <= bound
    assert lines[-1].startswith("RESULT PASS"), out  # and the adapted query loss fell
    resumed = _torchrun(1, "--iterations", "5", "--resume", str(tmp_path / "run"))
    assert "iteration 15: query loss" in resumed  # it went on from iteration 10
    assert "1 ranks: each holds" in resumed


@pytest.mark.slow
def test_two_ranks_with_their_own_tasks_learn_and_hold_half_between_iterations():
    out = _torchrun(2, "--own-tasks", "--iterations", "10", "--check")
    lines = out.strip().splitlines()
    assert re.match(
        r"2 ranks, each with its own tasks: each holds 51,200 of 102,400 parameters", lines[-2]
    ), out
    assert lines[-1].startswith("RESULT PASS"), out  # the adapted query loss fell
