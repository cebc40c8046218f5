"""``benchmarks/memory/llm_scale.py --small`` (2 layers, hidden 64, float64) runs the 1.1 B
benchmark's code in one process and on 4 (``shard_model`` of a meta-device build) and 2
(``gather_params``) gloo ranks, and every mode's meta-gradients equal one process's unsharded
run to 1e-10; a difference would print ``RESULT FAIL`` naming the run and mode."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from bench_scripts import script
from helpers import NEEDS_SHARDED

pytestmark = NEEDS_SHARDED

pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[dev]'")
pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
SCRIPT = script("memory/llm_scale.py")


def _small(*args: str) -> list[str]:
    """The lines ``llm_scale.py --small`` printed with ``args``, after checking it passed."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = run.stdout.splitlines()
    assert lines and lines[-1] == "RESULT PASS", run.stdout + run.stderr[-3000:]
    assert run.returncode == 0
    return lines


# seven processes import transformers: minutes on a 2-core machine, so in make test-slow
@pytest.mark.slow
def test_the_small_decoder_equals_one_unsharded_process_in_every_way():
    lines = _small(
        *("--steps", "2", "--modes", "plain", "layers", "steps", "both", "--shard-modes", "both")
    )
    (summary,) = [s for s in lines if s.startswith("--small:")]
    rows = int(re.search(r"--small: (\d+) rows", summary).group(1))
    assert rows == 4 + 2 * 4 + 2 * 2  # one process: 4 modes; 4 and 2 ranks: plain and both
    worst = float(re.search(r"meta-gradients ([0-9.e+-]+) of", summary).group(1))
    assert worst <= 1e-10


def test_the_extended_table_in_the_docs_is_the_formulas():
    """docs/memory.md's 1 B / 8 B table is what ``--extended`` computes from the formula."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--extended"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    table = [line for line in run.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 6  # the header, its rule, 2 decoders x 2 dtypes
    docs = (SCRIPT.parents[2] / "docs" / "memory.md").read_text()
    for line in table:
        assert line in docs, line


@pytest.mark.slow
def test_the_tensor_breakdown_names_what_is_alive_at_a_steps_peak():
    """``--tensors`` follows the tensors of one more meta-step and prints its peak's largest
    groups, each named by its pass (a backward's among them under ``checkpoint_steps``),
    their bytes at most the peak's."""
    lines = _small("--steps", "1", "--runs", "one", "--modes", "steps", "--tensors")
    heads = [s for s in lines if s.startswith("tensors made in a meta-step (one, steps, K=1")]
    assert len(heads) == 1, lines
    peak, shown, snapshot = (
        int(v) for v in re.search(r": (\d+) MiB alive .*\((\d+) MiB of (\d+)\)", heads[0]).groups()
    )
    assert shown <= snapshot <= peak
    groups = lines[lines.index(heads[0]) + 1 :][:15]
    assert all(re.match(r"\s+[0-9.]+ MiB  x\d+ +(forward|backward) \w+ \(", g) for g in groups)
    assert any(" backward " in g for g in groups)
