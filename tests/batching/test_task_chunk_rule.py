"""task_chunk="auto", the default: the chunk is a rule of the shapes, the model's size and the
device (docs/tasks.md), never a timing, so float32 runs repeat bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm
from funcmeta._src.batching.chunks import CPU_BUDGET, rule_chunk

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "workload, parameters, inputs, tasks, want",
    [
        # the rows of docs/tasks.md: benchmarks/speed/tasks.py's workloads and the Omniglot one
        *[("sinusoid MLP", 1_761, 10, t, None) for t in (4, 16, 32, 64)],
        ("conv4 5-way 1-shot", 112_261, 5 * 28 * 28, 4, None),
        *[("conv4 5-way 1-shot", 112_261, 5 * 28 * 28, t, 4) for t in (16, 32, 64)],
        ("conv4 20-way 1-shot", 113_236, 20 * 28 * 28, 16, 1),
        ("one task", 10**9, 10**6, 1, None),
    ],
)
def test_the_rule_takes_the_chunks_the_docs_give(workload, parameters, inputs, tasks, want):
    chunk = rule_chunk(tasks, inputs_per_task=inputs, parameters=parameters, device="cpu")
    assert chunk == want, workload


def test_the_rule_is_the_largest_power_of_two_within_the_budget():
    work = 1_000_000
    for tasks in (3, 100, 5000):
        chunk = rule_chunk(tasks, inputs_per_task=1000, parameters=1000, device="cpu")
        assert chunk == (2048 if tasks > 2048 else None)
        assert 2048 * work <= CPU_BUDGET < 4096 * work
    huge = rule_chunk(8, inputs_per_task=10**6, parameters=10**6, device="cpu")
    assert huge == 1  # over the budget alone: one task at a time, never 0
    for device in ("cuda", torch.device("cuda", 1), "meta"):
        assert rule_chunk(64, inputs_per_task=10**6, parameters=10**6, device=device) is None


def test_a_model_takes_the_rules_chunk_and_reports_it(monkeypatch):
    """conv4 5-way 1-shot at 16 tasks: chunks of 4, for the inner loop and the query pass
    given its chunk (``task_chunk=result.chunk``), as docs/tasks.md says; the choice names
    what the rule read, and a pinned call chooses nothing."""
    from helpers import chunks_run  # here: the subprocesses below import this module alone

    net = fm.models.conv4(5)
    fmodel = fm.functional_model(net)
    assert fmodel.task_chunk_choices == {}  # nothing chosen before the first call
    support = (torch.randn(16, 5, 1, 28, 28), torch.arange(5).repeat(16, 1))
    query = (torch.randn(16, 5, 1, 28, 28), torch.arange(5).repeat(16, 1))
    seen = chunks_run(monkeypatch)
    opt = fm.optim.sgd(lr=0.1)
    with torch.no_grad():
        result = fm.adapt_tasks(fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1)
        assert result.chunk.chunk == 4 and repr(result.chunk) == "TaskChunk(4)"
        fm.task_losses(fmodel, result.params, F.cross_entropy, query, task_chunk=result.chunk)
    assert seen == [4, 4]  # the inner step, then the query pass on the inner loop's chunk
    (label,) = fmodel.task_chunk_choices
    assert label == "16 tasks, inputs (16, 5, 1, 28, 28), cpu"
    chosen = {"chunk": 4, "parameters": 112_261, "inputs_per_task": 3920}
    assert fmodel.task_chunk_choices[label] == chosen
    assert result.losses.shape == (1, 16)
    seen.clear()
    with torch.no_grad():  # a pinned chunk: nothing chosen, the report stays as it was
        pinned = fm.adapt_tasks(
            fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1, task_chunk=None
        )
    assert pinned.chunk.chunk is None and seen == [None]
    assert fmodel.task_chunk_choices == {label: chosen}


def _mlp_problem(dtype: torch.dtype = torch.float32) -> tuple[fm.FunctionalModel, tuple, tuple]:
    """An MLP the rule runs in chunks of 4 of its 8 tasks (75,268 parameters, 6,400 input
    elements per task), seeded."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)
    ).to(dtype)
    g = torch.Generator().manual_seed(1)

    def data(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    support = (data(8, 200, 32), data(8, 200, 4))
    query = (data(8, 100, 32), data(8, 100, 4))
    return fm.functional_model(net), support, query


def _meta_gradients(
    fmodel: fm.FunctionalModel, support: tuple, query: tuple, task_chunk: object = "auto"
) -> tuple[list, int | None]:
    """Second-order MAML, 2 steps, the defaults otherwise (the query pass on the inner loop's
    chunk, as the recipes run it): the meta-gradients, and the chunk the inner loop took."""
    result = fm.adapt_tasks(
        fmodel,
        fmodel.params,
        F.mse_loss,
        support,
        fm.optim.sgd(lr=0.1),
        steps=2,
        task_chunk=task_chunk,
    )
    losses = fm.task_losses(
        fmodel, result.params, F.mse_loss, query, buffers=result.buffers, task_chunk=result.chunk
    ).losses
    grads = list(torch.autograd.grad(losses.mean(), list(fmodel.params.values())))
    return grads, result.chunk.chunk


_RUN = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from test_task_chunk_rule import _meta_gradients, _mlp_problem

fmodel, support, query = _mlp_problem()
runs = [_meta_gradients(fmodel, support, query) for _ in range(9)]
grads, chunks = [g for g, _ in runs], {c for _, c in runs}
(chunk,) = chunks
torch.save({"grads": grads, "chunk": chunk}, sys.argv[2])
"""


def test_two_processes_give_bit_identical_float32_meta_gradients(tmp_path):
    """Two fresh processes, the defaults, the same seeded float32 problem: nine meta-iterations
    each (as many as the measuring default took to choose), every meta-gradient equal bit
    for bit."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    outs = [tmp_path / f"run{i}.pt" for i in range(2)]
    # both at once: two processes, whatever else runs beside each
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _RUN, str(Path(__file__).parent), str(out)],
            env=env,
            cwd=tmp_path,
        )
        for out in outs
    ]
    assert [run.wait(timeout=600) for run in runs] == [0, 0]
    first, second = (torch.load(out) for out in outs)
    assert first["chunk"] == second["chunk"] == 4  # chunked: the case where the chunk matters
    for a_iter, b_iter in zip(first["grads"], second["grads"], strict=True):
        for a, b in zip(a_iter, b_iter, strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_the_default_never_reads_a_clock(monkeypatch):
    """adapt_tasks, the query pass and the meta-backward with the defaults, time.perf_counter
    made to raise: the default chunk is chosen without a timing."""
    import funcmeta._src.batching.chunks as chunks

    fmodel, support, query = _mlp_problem()

    def no_clock() -> float:
        raise AssertionError("the default task chunk read the clock")

    with monkeypatch.context() as m:
        m.setattr(chunks.time, "perf_counter", no_clock)
        assert time.perf_counter is no_clock  # the module the tuner times with
        runs = [_meta_gradients(fmodel, support, query) for _ in range(9)]
    assert [chunk for _, chunk in runs] == [4] * 9
    # the measuring mode does read it, so the patch would have caught it
    with monkeypatch.context() as m:
        m.setattr(chunks.time, "perf_counter", no_clock)
        with pytest.raises(AssertionError, match="read the clock"):
            for _ in range(3):
                _meta_gradients(fmodel, support, query, task_chunk="tune")


def test_the_rule_and_a_pinned_chunk_give_the_same_results():
    """float64: the rule's chunks of 4 against all tasks at once."""
    fmodel, support, query = _mlp_problem(torch.float64)
    ours, chunk = _meta_gradients(fmodel, support, query)
    theirs, pinned_chunk = _meta_gradients(fmodel, support, query, task_chunk=None)
    assert chunk == 4 and pinned_chunk is None
    for g, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
