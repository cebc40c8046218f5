"""``examples/sharded_maml.py`` under torchrun: two gloo ranks each hold half the parameters
and gather at most one block's at once; the run saved there resumes on one rank."""

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
    out = _torchrun(2, "--iterations", "5", "--save", str(tmp_path / "run"))
    last = out.strip().splitlines()[-1]
    found = re.search(
        r"2 ranks: each holds ([\d,]+) of ([\d,]+) parameters; gathered at most ([\d,]+) bytes "
        r"at once \(one block: ([\d,]+)\)",
        last,
    )
    assert found, out
    held, whole, most, block = (int(g.replace(",", "")) for g in found.groups())
    assert held <= whole // 2 + 64  # a 1-row head and odd sizes split unevenly
    assert 0 < most <= block
    resumed = _torchrun(1, "--iterations", "5", "--resume", str(tmp_path / "run"))
    assert "iteration 10: query MSE" in resumed  # it went on from iteration 5
    assert "1 ranks: each holds" in resumed
