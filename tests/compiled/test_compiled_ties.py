"""The compiled step on models whose tensors sit in two places (tied weights): the traced
call asks ``torch.func.functional_call`` to tie (``tie_weights=True``) only where the model
has ties (``FunctionalModel.tied``, worked out once), since dynamo traces tie_weights' walk
of the module on every call. Tied and untied models, on both graphs, give
``fm.adapt_tasks``' float64 meta-gradients; a model tied after its functional model was
built is not what this covers (its layout is read once, as the eager swap's is)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import graph_or_reason
from torch import nn

import funcmeta as fm
from funcmeta._src.compiled.eager_reasons import autograd_untraceable
from funcmeta._src.module.functional import shares_tensors

DTYPE = torch.float64


class TiedPair(nn.Module):
    """Two linear layers with one weight (the second reads the first's), different biases."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.second.weight = self.first.weight
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.second(torch.tanh(self.first(x)))))


class Twice(nn.Module):
    """One submodule registered under two names: one place, not a tie."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.again = self.layer
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.again(torch.tanh(self.layer(x)))))


def untied() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def tasks() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    make = lambda n: (  # noqa: E731
        torch.randn(3, n, 4, generator=g, dtype=DTYPE),
        torch.randn(3, n, 1, generator=g, dtype=DTYPE),
    )
    return make(5), make(6)


def meta_grads(net: nn.Module, run) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    for p in net.parameters():
        p.grad = None
    run()
    return [p.grad.clone() for p in net.parameters()]


def test_shares_tensors_tells_a_tie_from_a_module_registered_twice() -> None:
    assert shares_tensors(TiedPair())
    assert not shares_tensors(Twice())
    assert not shares_tensors(untied())
    buffered = untied()
    buffered.register_buffer("scale", buffered[0].weight.detach())
    assert not shares_tensors(buffered)  # a buffer of its own tensor
    buffered.register_buffer("alias", buffered.scale)
    assert shares_tensors(buffered)  # one buffer tensor in two places
    assert fm.functional_model(TiedPair()).tied
    assert not fm.functional_model(Twice()).tied


GRAPHS = ["torch.func"] + ([] if autograd_untraceable() is not None else ["autograd"])


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("make", [TiedPair, Twice, untied], ids=["tied", "twice", "untied"])
def test_the_compiled_step_equals_adapt_tasks_with_and_without_ties(
    aot_eager: None, make, graph: str
) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = make().to(DTYPE)
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.3)
    support, query = tasks()

    def eager() -> None:
        result = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, opt, steps=2)
        fm.task_losses(fmodel, result.params, F.mse_loss, query).losses.mean().backward()

    want = meta_grads(net, eager)
    step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, graph=graph)
    got = meta_grads(net, lambda: step(support, query))
    graph_or_reason(step)  # a graph from torch 2.13 on; the same meta-gradients on any torch
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_the_traced_runtime_gives_vmap_one_in_dim_for_a_dict_of_one_in_dim() -> None:
    """The traced runtime hands vmap a dict of in-dims that are all 0 (or all None) as one 0
    (None) for the whole dict, a prefix vmap reads the same way: the same per-task results
    as the dicts themselves; a mixed dict is passed as it is."""
    from funcmeta._src.runtime.traced import TRACED, _uniform

    assert _uniform({"a": 0, "b": 0}) == 0 and _uniform({"a": None}) is None
    assert _uniform({"a": 0, "b": None}) == {"a": 0, "b": None}
    assert _uniform({}) == {} and _uniform(0) == 0 and _uniform({"a": 1}) == {"a": 1}
    g = torch.Generator().manual_seed(0)
    shared = {"w": torch.randn(3, 3, generator=g, dtype=DTYPE), "b": torch.randn(3, dtype=DTYPE)}
    per_task = {k: torch.stack([v, 2 * v]) for k, v in shared.items()}
    x = torch.randn(2, 4, 3, generator=g, dtype=DTYPE)

    def one(x: torch.Tensor, p: dict, q: dict) -> torch.Tensor:  # type: ignore[type-arg]
        return (x @ p["w"] + p["b"]) * (x @ q["w"]).sum() + q["b"].sum()

    for dims in (
        (0, {"w": None, "b": None}, {"w": 0, "b": 0}),
        (0, {"w": 0, "b": None}, {"w": 0, "b": 0}),
    ):
        first = {k: (shared if d is None else per_task)[k] for k, d in dims[1].items()}
        trees = (x, first, per_task)
        got = TRACED.over_tasks(one, trees, dims, None)
        want = torch.func.vmap(one, in_dims=dims)(*trees)
        assert torch.equal(got, want)
