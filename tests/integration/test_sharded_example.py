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
from helpers import NEEDS_SHARDED

pytestmark = NEEDS_SHARDED

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharded_maml.py"


def _ranks_errors(stderr: str) -> str:
    """What the ranks wrote to stderr, without torchrun's own log lines and its closing
    traceback (which end the text and named no cause when a rank failed)."""
    own = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d")
    kept = []
    for line in stderr.splitlines():
        if "torch/distributed/run.py" in line or line.startswith("torch.distributed.elastic"):
            break  # torchrun's traceback: the rest is its summary
        if not own.match(line):
            kept.append(line)
    return "\n".join(kept)[-8000:] or stderr[-8000:]


def _torchrun(ranks: int, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(EXAMPLE), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        # torchrun --standalone picks a free port and binds it later: another job may take it
        if done.returncode == 0 or "address already in use" not in done.stderr.lower():
            break
    assert done.returncode == 0, done.stdout[-2000:] + _ranks_errors(done.stderr)
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
