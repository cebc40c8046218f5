"""A second-order inner step's gradient taken on the forward's own graph, not a recomputation.

Within a second-order inner step, a checkpointed layer's first run keeps its graph until the
step's inner gradient takes its VJP there, and drops it then
(:func:`funcmeta._src.checkpoint.engine.kept_for_the_gradient`). That path must give exactly
the numbers of the recomputation it replaces (the plain path, forced here by turning the
keeping off), keep nothing past the step, and keep nothing in passes that are not inner steps.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import funcmeta as fm
from funcmeta._src.checkpoint import engine
from funcmeta._src.runtime import eager

W, BLOCKS = 6, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.a = nn.Linear(W, 2 * W)
        self.b = nn.Linear(2 * W, W)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.drop(torch.tanh(self.a(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, own: bool, unused: bool = False) -> None:
        super().__init__()
        self.own, self.unused = own, unused
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.side = Block() if unused else None
        self.head = nn.Linear(W, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.side is not None:  # a checkpointed layer whose output reaches no loss
            self.side(x) if not self.own else checkpoint(self.side, x, use_reentrant=False)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.own else b(x)
        return self.head(x)


def _fmodel(how: str, dtype: torch.dtype, unused: bool = False, train: bool = True) -> Any:
    torch.manual_seed(0)
    net = Net(own=how == "takeover", unused=unused).to(dtype).train(train)
    names = [f"blocks.{i}" for i in range(BLOCKS)] + (["side"] if unused else [])
    return fm.functional_model(net, checkpoint_layers=names if how == "layers" else None)


def _meta_gradient(fmodel: Any, tasks: bool, steps: bool, dtype: torch.dtype) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    shape = (3, 8, W) if tasks else (8, W)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    y = torch.randn(*shape[:-1], 1, generator=g, dtype=dtype)
    options: dict[str, Any] = dict(steps=3, checkpoint_steps=steps, allow_unused=True)
    opt = fm.optim.sgd(lr=0.1)
    torch.manual_seed(2)  # the dropout masks
    if tasks:
        r = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x, y), opt, **options)
        loss = fm.task_losses(fmodel, r.params, F.mse_loss, (x, y))[0].sum()
    else:
        r = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, **options)
        loss = F.mse_loss(fmodel(r.params, x), y)
    grads = torch.autograd.grad(loss, list(fmodel.params.values()), allow_unused=True)
    return [*grads, r.losses.detach()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("steps", [False, True], ids=["", "checkpoint_steps"])
@pytest.mark.parametrize("tasks", [False, True], ids=["adapt", "adapt_tasks"])
@pytest.mark.parametrize("how", ["layers", "takeover"])
def test_the_kept_graph_gives_the_recomputations_numbers(monkeypatch, how, tasks, steps, dtype):
    kept = _meta_gradient(_fmodel(how, dtype), tasks, steps, dtype)
    monkeypatch.setattr(eager, "kept_for_the_gradient", contextlib.nullcontext)
    recomputed = _meta_gradient(_fmodel(how, dtype), tasks, steps, dtype)
    for a, b in zip(kept, recomputed, strict=True):
        assert a is not None and torch.equal(a, b)


def test_the_kept_graph_matches_the_unchecked_meta_gradient():
    """Independent of the recomputation: the same model unchecked, dropout off, float64."""
    checked = _fmodel("layers", torch.float64, train=False)
    got = _meta_gradient(checked, False, False, torch.float64)
    torch.manual_seed(0)
    net = Net(own=False).double().eval()
    want = _meta_gradient(fm.functional_model(net), False, False, torch.float64)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every checkpointed call from now on."""
    seen: list[Any] = []
    first = engine._Call.first

    def recorded(self: Any, tensors: Any) -> Any:
        seen.append(self)
        return first(self, tensors)

    monkeypatch.setattr(engine._Call, "first", recorded)
    return seen


@pytest.mark.parametrize("how", ["layers", "takeover"])
def test_no_graph_is_kept_past_its_step(monkeypatch, how):
    fmodel = _fmodel(how, torch.float64, unused=True)
    calls = _calls(monkeypatch)
    _meta_gradient(fmodel, False, False, torch.float64)
    assert len(calls) == (BLOCKS + 1) * (3 + 1)  # 3 steps and the query pass
    assert all(c.kept is None for c in calls)


def test_no_graph_is_kept_when_the_step_fails(monkeypatch):
    fmodel = _fmodel("layers", torch.float64)
    calls = _calls(monkeypatch)
    x, y = torch.randn(8, W, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a loss that fails")

    with pytest.raises(RuntimeError, match="a loss that fails"):
        fm.adapt(fmodel, fmodel.params, failing, (x, y), fm.optim.sgd(lr=0.1), steps=1)
    assert len(calls) == BLOCKS and all(c.kept is None for c in calls)


@pytest.mark.parametrize(
    ("first_order", "offload", "steps"),
    [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
    ids=["second-order", "first-order", "offloaded", "checkpoint_steps"],
)
def test_only_second_order_inner_steps_keep_a_graph(monkeypatch, first_order, offload, steps):
    """The query pass keeps nothing (its backward is the outer one, far away), and neither
    does a first-order step (whose peak is its forward's activations: keeping them would
    undo the checkpointing), an offloaded one (the least device memory asked for) or one
    under a step checkpoint (which runs the forward again inside the inner gradient: two
    graphs would be held at once)."""
    fmodel = _fmodel("layers", torch.float64)
    x, y = torch.randn(8, W, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    kept: list[bool] = []
    vjp = engine._Call.first_vjp

    def seen(self: Any, *args: Any) -> Any:
        kept.append(self.kept is not None)
        return vjp(self, *args)

    monkeypatch.setattr(engine._Call, "first_vjp", seen)
    opt = fm.optim.sgd(lr=0.1)
    options = dict(steps=2, first_order=first_order, offload_activations=offload)
    r = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, **options, checkpoint_steps=steps)
    inner = [not (first_order or offload or steps)] * (2 * BLOCKS)
    assert kept[: 2 * BLOCKS] == inner and (steps or len(kept) == 2 * BLOCKS)
    kept.clear()
    F.mse_loss(fmodel(r.params, x), y).backward()
    assert kept and not any(kept)
