"""Per-layer checkpointing in second order: how often layers are recomputed (so that the
second-order checkpointing cannot silently turn off), what the graph keeps between the
inner loop and the outer backward, and the function underneath on its own."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE
from torch import nn

import funcmeta as fm
from funcmeta._src.checkpoint.engine import checkpoint


class Counting(nn.Module):
    """Linear + tanh that counts its forward calls (first runs and recomputations)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.lin = nn.Linear(a, b)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


def counting_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Counting(3, 8), Counting(8, 8), nn.Linear(8, 1)).to(DTYPE)


@pytest.mark.parametrize("first_order", [False, True], ids=["second-order", "first-order"])
def test_recomputations_per_phase(first_order):
    """One inner step, then the query pass and the outer backward. Each checkpointed layer
    runs: once in the inner forward; in first order once more in the inner backward
    (recompute and VJP; a second-order step takes it on its forward's graph, then drops it);
    once in the query forward. The outer backward recomputes each layer for the query pass
    and for the inner forward and, in second order only, recomputes the recorded VJP
    once more: 3 recomputations there (a checkpoint that kept the recomputed activations of
    the inner backward would show 2)."""
    net = counting_net()
    fmodel = fm.functional_model(net, checkpoint_layers=["0", "1"])
    x, y = torch.randn(16, 3, dtype=DTYPE), torch.randn(16, 1, dtype=DTYPE)
    result = fm.adapt(
        fmodel,
        fmodel.params,
        F.mse_loss,
        (x, y),
        fm.optim.sgd(lr=0.1),
        steps=1,
        first_order=first_order,
    )
    inner = 2 if first_order else 1
    assert [net[0].calls, net[1].calls] == [inner, inner]
    loss = F.mse_loss(fmodel(result.params, x), y)
    assert [net[0].calls, net[1].calls] == [inner + 1, inner + 1]
    loss.backward()
    outer = 1 if first_order else 3
    assert [net[0].calls, net[1].calls] == [inner + 1 + outer] * 2


def test_without_an_outer_graph_one_recomputation_per_step():
    net = counting_net()
    fmodel = fm.functional_model(net, checkpoint_layers=["0", "1"])
    x, y = torch.randn(16, 3, dtype=DTYPE), torch.randn(16, 1, dtype=DTYPE)
    with torch.no_grad():
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=2)
    assert [net[0].calls, net[1].calls] == [4, 4]  # a forward and its recomputation, twice


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def kept_bytes(checkpoint: str | None, steps: int = 3) -> tuple[int, list[torch.Tensor]]:
    """The bytes of the distinct tensors that the graph saves, outside checkpoints, during a
    second-order inner loop and the query pass and still holds when the outer backward
    starts (parameters aside); and the meta-gradients."""
    torch.manual_seed(0)
    width = 16
    net = nn.Sequential(*[Residual(width) for _ in range(4)], nn.Linear(width, 1)).to(DTYPE)
    params = {id(p) for p in net.parameters()}
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint)
    rates = fm.hyper.per_layer(fmodel.params, 0.05, parameterization="softplus")
    g = torch.Generator().manual_seed(1)
    x, y, xq, yq = (torch.randn(256, n, generator=g, dtype=DTYPE) for n in (width, 1, width, 1))
    saved: list[tuple[weakref.ref, tuple[int, int]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            storage = t.untyped_storage()
            saved.append((weakref.ref(t), (storage.data_ptr(), storage.nbytes())))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=rates), steps=steps
        )
        loss = F.mse_loss(fmodel(result.params, xq), yq)
    del result
    gc.collect()
    alive = {key for ref, key in saved if ref() is not None}
    kept = sum(nbytes for _, nbytes in alive)
    grads = torch.autograd.grad(loss, [*net.parameters(), *rates.parameters()])
    return kept, list(grads)


def test_second_order_graph_keeps_layer_inputs_not_activations():
    """Residual MLP blocks, three second-order steps: the graph saved between the inner loop
    and the outer backward shrinks to the layers' inputs, gradients and adapted parameters,
    with the same meta-gradients (float64)."""
    plain, reference = kept_bytes(None)
    ours, grads = kept_bytes("sequential")
    for a, b in zip(grads, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert ours < 0.25 * plain, (ours, plain)


# --- the engine on its own -----------------------------------------------------------------


def test_engine_gradcheck_and_gradgradcheck():
    def f(x, pair, scale):
        w, b = pair["w"], pair["b"]
        h = torch.tanh(x @ w + b) * scale
        return {"h": h, "n": 3, "s": h.sum(-1)}

    x = torch.randn(4, 3, dtype=DTYPE, requires_grad=True)
    w = torch.randn(3, 2, dtype=DTYPE, requires_grad=True)
    b = torch.randn(2, dtype=DTYPE, requires_grad=True)

    def run(x, w, b):
        out = checkpoint(f, x, {"w": w, "b": b}, scale=2.0)
        assert out["n"] == 3
        return out["h"], out["s"]

    torch.autograd.gradcheck(run, (x, w, b))
    torch.autograd.gradgradcheck(run, (x, w, b))


def test_engine_replays_dropout_and_handles_integer_outputs_and_unused_outputs():
    def f(x):
        return F.dropout(x, 0.5, training=True), x.argmax(-1), x * 2

    x = torch.randn(6, 5, dtype=DTYPE, requires_grad=True)
    torch.manual_seed(0)
    d, idx, _ = checkpoint(f, x)
    assert idx.dtype == torch.int64 and not idx.requires_grad
    (g,) = torch.autograd.grad(d.sum(), x, create_graph=True)
    torch.manual_seed(0)
    d2, _, _ = f(x)
    (g2,) = torch.autograd.grad(d2.sum(), x, create_graph=True)
    torch.testing.assert_close(g, g2, rtol=0, atol=0)  # the same mask in the recomputation


def test_engine_input_written_in_place_raises():
    def f(x):
        x.mul_(2)
        return x.sin()

    x = torch.randn(3, dtype=DTYPE, requires_grad=True) * 1
    with pytest.raises(RuntimeError, match="in-place"):
        checkpoint(f, x)


class WritesAfterSaving(nn.Module):
    """Two linear layers; the forward changes the first one's output in place after the
    second read it (and saved it for its backward), then reads it again (``writing`` off:
    the same function, written out of place)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.writing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * 2
        out = torch.tanh(h) * h  # saves h
        if self.writing:
            h.mul_(3)
            return out + self.b(h)
        return out + self.b(3 * h)


def _writes_after_saving_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), WritesAfterSaving(), nn.Linear(4, 1)).to(DTYPE)


def _two_steps_and_the_query(fmodel, x, y, between=None, **options) -> None:
    """Two SGD steps of fm.adapt on (x, y) with ``options``, ``between()`` if given, then the
    query loss's backward on the same data."""
    result = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=2, **options
    )
    if between is not None:
        between()
    F.mse_loss(fmodel(result.params, x), y).backward()


@pytest.mark.parametrize(
    "how",
    ["plain", "layers", "layers, second order", "layers and steps", "layers, first order"],
)
def test_a_tensor_changed_in_place_after_its_save_is_refused_as_in_the_plain_run(how):
    """autograd leaves the check of a saved tensor changed in place to the saved-tensor
    hooks in force; a checkpointed layer's recomputation keeps its tensors as they are, and
    must refuse such a forward as the plain run does, not compute with the changed values."""
    net = _writes_after_saving_net()
    fmodel = fm.functional_model(net, checkpoint_layers=None if how == "plain" else ["1"])
    x, y = torch.randn(6, 3, dtype=DTYPE), torch.randn(6, 1, dtype=DTYPE)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        if how in ("plain", "layers"):  # one forward and its backward
            F.mse_loss(fmodel(fmodel.params, x), y).backward()
        else:
            _two_steps_and_the_query(
                fmodel,
                x,
                y,
                first_order=how.endswith("first order"),
                checkpoint_steps=how.endswith("steps"),
            )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"checkpoint_steps": True},
        {"checkpoint_steps": True, "first_order": True},
        {"checkpoint_layers": ["1"]},
        {"checkpoint_layers": ["1"], "checkpoint_steps": True},
    ],
    ids=["plain", "steps", "steps, first order", "layers", "layers and steps"],
)
def test_a_tensor_changed_in_place_in_the_inner_steps_alone_is_refused(options):
    """The write in the inner steps' forwards only (the query pass computes the same function
    out of place): a step checkpoint's recomputation (``torch.utils.checkpoint``, which keeps
    what it recomputes as it is and checks no version) must refuse it too, not give the outer
    backward the changed values (it gave meta-gradients off by 40 without a word)."""
    net = _writes_after_saving_net()
    layers = options.pop("checkpoint_layers", None)
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    x, y = torch.randn(6, 3, dtype=DTYPE), torch.randn(6, 1, dtype=DTYPE)
    net[1].writing = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _two_steps_and_the_query(
            fmodel, x, y, between=lambda: setattr(net[1], "writing", False), **options
        )


def test_the_model_without_the_write_runs_in_every_mode():
    """The out-of-place model of the tests above: every mode gives the plain run's
    meta-gradients (the refusals above are the write's, not the modes')."""

    def grads(layers, **options):
        net = _writes_after_saving_net()
        net[1].writing = False
        fmodel = fm.functional_model(net, checkpoint_layers=layers)
        x, y = torch.randn(6, 3, dtype=DTYPE), torch.randn(6, 1, dtype=DTYPE)
        _two_steps_and_the_query(fmodel, x, y, **options)
        return [p.grad for p in net.parameters()]

    torch.manual_seed(3)
    plain = grads(None)
    for layers, options in (
        (None, {"checkpoint_steps": True}),
        (["1"], {}),
        (["1"], {"checkpoint_steps": True}),
    ):
        torch.manual_seed(3)
        for a, b in zip(grads(layers, **options), plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_engine_refuses_a_saved_tensor_changed_in_place_in_its_recomputation():
    def f(x, w):
        h = x * w
        out = h.sin()  # saves h
        h.mul_(3)
        return out

    x = torch.randn(5, dtype=DTYPE, requires_grad=True)
    w = torch.tensor(0.7, dtype=DTYPE, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (g,) = torch.autograd.grad(checkpoint(f, x, w).sum(), x, create_graph=True)
        g.sum().backward()


def test_engine_third_derivative_equals_the_plain_function():
    """A backward through the recorded VJP that is itself recorded (third order) keeps its
    graph and stays exact."""

    def f(x, w):
        return torch.sin(x * w).sum() + (x**3 * w).sum()

    def third(fn):
        x = torch.linspace(-1, 2, 5, dtype=DTYPE, requires_grad=True)
        w = torch.tensor(0.7, dtype=DTYPE, requires_grad=True)
        (g1,) = torch.autograd.grad(fn(x, w), x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), x, create_graph=True)
        return torch.autograd.grad(g2.sum(), [x, w])

    ours = third(lambda x, w: checkpoint(f, x, w))
    plain = third(f)
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert plain[1].abs() > 0
