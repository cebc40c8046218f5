"""The recomputation schedule of per-layer checkpointing, counted.

Each checkpointed block counts its forward runs, attributed to the part of the engine that ran
it (the test wraps the engine's autograd Functions; nothing is counted in the package):

- ``first``: the forward itself (``_Checkpoint.forward``);
- ``inner-vjp``: the recomputation that takes a recorded VJP (``_CheckpointVJP.forward``),
  where the first run's graph was not kept for it;
- ``plain-vjp``: the recomputation of a backward that is not recorded (``_Checkpoint.backward``
  without grad mode): a first-order inner gradient, the query pass and the inner forward in the
  outer backward;
- ``second-order``: the recomputation in the outer backward through a recorded VJP (its
  VJP with a graph, and the derivative of that: ``_CheckpointVJP.backward``);
- ``step``: a first run inside the recomputation of a whole step (``checkpoint_steps``).

The counts are per block and phase (``inner``: the call of ``fm.adapt``/``fm.adapt_tasks``;
``query``: the query pass; ``outer``: the outer backward), the same for every block, for
``checkpoint_layers`` and for a model's own ``torch.utils.checkpoint`` calls (taken over), for
one task and for a batch of tasks, first and second order, with and without step
checkpoints. They pin the schedule ``docs/memory.md`` describes: per second-order inner step
each block runs once in the inner forward, whose graph the inner gradient then uses and
drops, and twice in the outer backward (the two uses of its activations there lie a whole
step's sweep apart); a change that adds a recomputation, or that keeps activations to drop
one, shows here."""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE
from torch import nn
from torch.utils.checkpoint import checkpoint

import funcmeta as fm
from funcmeta._src.checkpoint import engine

W, BLOCKS, STEPS, TASKS = 5, 3, 2, 3

_phase: list[str] = []  # the engine part running now (innermost last)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.runs: collections.Counter[str] = collections.Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        what = _phase[-1] if _phase else "unchecked"
        if what == "first" and fm.recomputing():
            what = "step"
        self.runs[what] += 1
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, own: bool) -> None:
        super().__init__()
        self.own = own
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(W, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.own else b(x)
        return self.head(x)


@contextlib.contextmanager
def _attributed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The engine's Functions wrapped so that a block knows which of them runs it."""

    def wrap(cls: Any, name: str, label: Any) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapped(ctx: Any, *args: Any) -> Any:
            _phase.append(label() if callable(label) else label)
            try:
                return original(ctx, *args)
            finally:
                _phase.pop()

        monkeypatch.setattr(cls, name, staticmethod(wrapped))

    wrap(engine._Checkpoint, "forward", "first")
    wrap(
        engine._Checkpoint,
        "backward",
        lambda: "recording" if torch.is_grad_enabled() else "plain-vjp",
    )
    wrap(engine._CheckpointVJP, "forward", "inner-vjp")
    wrap(engine._CheckpointVJP, "backward", "second-order")
    yield


def schedule(
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    tasks: bool,
    first_order: bool,
    steps: bool,
) -> dict[str, dict[str, int]]:
    """Per phase, how often each block ran and in which part of the engine (all blocks alike)."""
    torch.manual_seed(0)
    net = Net(own=how == "takeover").to(DTYPE)
    layers = [f"blocks.{i}" for i in range(BLOCKS)] if how == "layers" else None
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    g = torch.Generator().manual_seed(1)
    shape = (TASKS, 8, W) if tasks else (8, W)
    x = torch.randn(*shape, generator=g, dtype=DTYPE)
    y = torch.randn(*shape[:-1], 1, generator=g, dtype=DTYPE)
    opt = fm.optim.sgd(lr=0.1)
    options = dict(steps=STEPS, first_order=first_order, checkpoint_steps=steps)

    def inner() -> Any:
        if tasks:
            return fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x, y), opt, **options)
        return fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, **options)

    def query(result: Any) -> torch.Tensor:
        if tasks:
            return fm.task_losses(fmodel, result.params, F.mse_loss, (x, y))[0].sum()
        return F.mse_loss(fmodel(result.params, x), y)

    query(inner()).backward()  # warm-up: the first task-batched call probes the model
    phases: dict[str, dict[str, int]] = {}

    def take(phase: str) -> None:
        counts = [dict(b.runs) for b in net.blocks]
        assert all(c == counts[0] for c in counts), counts  # every block alike
        phases[phase] = counts[0]
        for b in net.blocks:
            b.runs.clear()

    for b in net.blocks:
        b.runs.clear()
    with _attributed(monkeypatch):
        result = inner()
        take("inner")
        loss = query(result)
        take("query")
        loss.backward()
        take("outer")
    return phases


K = STEPS
SECOND = {
    "inner": {"first": K},
    "query": {"first": 1},
    "outer": {"second-order": K, "plain-vjp": K + 1},
}
FIRST = {
    "inner": {"first": K, "plain-vjp": K},
    "query": {"first": 1},
    "outer": {"plain-vjp": 1},
}
# checkpoint_steps: torch's step checkpoint recomputes each step's forward once inside the
# step's own inner gradient (its saved tensors are dropped as the forward packs them), and
# once more in the outer backward, where the recomputed step takes its inner gradient again.
# No graph is kept for the inner gradient here: it would be held twice, the first run's and
# the step checkpoint's run's.
SECOND_STEPS = {
    "inner": {"first": K, "step": K, "inner-vjp": K},
    "query": {"first": 1},
    "outer": {"step": K, "inner-vjp": K, "second-order": K, "plain-vjp": K + 1},
}
FIRST_STEPS = {
    "inner": {"first": K, "step": K, "plain-vjp": K},
    "query": {"first": 1},
    "outer": {"plain-vjp": 1},
}


@pytest.mark.parametrize("steps", [False, True], ids=["", "checkpoint_steps"])
@pytest.mark.parametrize("first_order", [False, True], ids=["second-order", "first-order"])
@pytest.mark.parametrize("tasks", [False, True], ids=["adapt", "adapt_tasks"])
@pytest.mark.parametrize("how", ["layers", "takeover"])
def test_recomputation_schedule(monkeypatch, how, tasks, first_order, steps):
    expected = {
        (False, False): SECOND,
        (True, False): FIRST,
        (False, True): SECOND_STEPS,
        (True, True): FIRST_STEPS,
    }[first_order, steps]
    assert schedule(monkeypatch, how, tasks, first_order, steps) == expected


def test_the_unchecked_model_runs_once_per_pass(monkeypatch):
    """The reference: without checkpointing each block runs once per inner step and once in
    the query pass, never in a backward."""
    torch.manual_seed(0)
    net = Net(own=False).to(DTYPE)
    fmodel = fm.functional_model(net)
    x, y = torch.randn(8, W, dtype=DTYPE), torch.randn(8, 1, dtype=DTYPE)
    with _attributed(monkeypatch):
        r = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=K)
        F.mse_loss(fmodel(r.params, x), y).backward()
    assert [dict(b.runs) for b in net.blocks] == [{"unchecked": K + 1}] * BLOCKS
