"""``nn.LayerNorm`` with per-task parameters under task batching
(:mod:`funcmeta._src.batching.layer_norm`): the node against ``F.layer_norm`` task by task and
against finite differences (twice), models against a per-task loop of ``fm.adapt`` in first
and second order, the cases where it steps aside, and what it keeps for the backward."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import per_task
from test_task_layers import assert_same, run
from torch import Tensor, nn

import funcmeta as fm
import funcmeta._src.batching.layer_norm as layer_norm
from funcmeta._src.core.kernels import twice_differentiable

DTYPE = torch.float64
T, N = 3, 5


@pytest.fixture
def calls(monkeypatch):
    """The shapes of the input and bias of each call that took the per-task node."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...] | None]] = []
    real = layer_norm.per_task_layer_norm

    def counted(x, w, b, *args):
        out = real(x, w, b, *args)  # counted once it has run (torch may refuse it under vmap)
        seen.append((tuple(x.shape), None if b is None else tuple(b.shape)))
        return out

    monkeypatch.setattr(layer_norm, "per_task_layer_norm", counted)
    return seen


# (input shape per task, normalized shape, bias: "task", "shared" or None)
CASES = {
    "rows": ((N, 4), (4,), "task"),
    "two-axes": ((N, 2, 4), (2, 4), "task"),
    "one-sample": ((4,), (4,), "task"),
    "sequence-no-bias": ((2, N, 4), (4,), None),
    "shared-bias": ((N, 4), (4,), "shared"),
}


def _node_inputs(case: str, seed: int = 0) -> tuple[Tensor, Tensor, Tensor | None, int]:
    shape, normalized, bias = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, *shape, generator=g, dtype=DTYPE).requires_grad_()
    w = (1 + torch.randn(T, *normalized, generator=g, dtype=DTYPE)).requires_grad_()
    b = None
    if bias is not None:
        b_shape = (T, *normalized) if bias == "task" else normalized
        b = torch.randn(*b_shape, generator=g, dtype=DTYPE).requires_grad_()
    return x, w, b, len(normalized)


@pytest.mark.parametrize("case", list(CASES))
def test_the_node_equals_layer_norm_task_by_task_to_second_order(case):
    x, w, b, dims = _node_inputs(case)
    normalized = x.shape[x.dim() - dims :]
    out = layer_norm.per_task_layer_norm(x, w, b, dims, 1e-5)

    def bias_of(t):
        return None if b is None else (b[t] if b.dim() > dims else b)

    loop = torch.stack([F.layer_norm(x[t], normalized, w[t], bias_of(t)) for t in range(T)])
    torch.testing.assert_close(out, loop, rtol=1e-13, atol=1e-14)
    leaves = [v for v in (x, w, b) if v is not None]
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    # first derivatives, and second ones (of the first's squared norm), against the loop's
    got = torch.autograd.grad((out * probe).sum(), leaves, create_graph=True)
    want = torch.autograd.grad((loop * probe).sum(), leaves, create_graph=True)
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-11, atol=1e-12)
    second = torch.autograd.grad(sum((g**2).sum() for g in got), leaves, allow_unused=True)
    second_want = torch.autograd.grad(sum((g**2).sum() for g in want), leaves, allow_unused=True)
    for a, c in zip(second, second_want, strict=True):
        assert (a is None) == (c is None)  # the bias's: the first derivatives do not use it
        if c is not None:
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("case", ["rows", "two-axes", "shared-bias", "sequence-no-bias"])
def test_the_node_passes_gradcheck_twice(case):
    x, w, b, dims = _node_inputs(case, seed=2)
    leaves = tuple(v for v in (x, w, b) if v is not None)

    def f(*args):
        return layer_norm.per_task_layer_norm(
            *args[:2], args[2] if b is not None else None, dims, 1e-5
        )

    assert torch.autograd.gradcheck(f, leaves)
    assert torch.autograd.gradgradcheck(f, leaves)


class Normed(nn.Module):
    """Linear, LayerNorm, ReLU, linear head: features of ``(N, *shape)``."""

    def __init__(self, shape: tuple[int, ...] = (4,), bias: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(shape[-1], shape[-1])
        self.norm = nn.LayerNorm(shape, bias=bias)
        self.head = nn.Linear(int(torch.Size(shape).numel()), 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        return self.head(h.flatten(1))


def _net_and_data(shape=(4,), bias=True, seed=0):
    torch.manual_seed(seed)
    net = Normed(shape, bias).to(DTYPE)
    with torch.no_grad():  # away from the initial ones and zeros
        net.norm.weight.add_(0.3 * torch.randn_like(net.norm.weight))
        if bias:
            net.norm.bias.add_(0.3 * torch.randn_like(net.norm.bias))
    g = torch.Generator().manual_seed(seed)
    xs, xq = (torch.randn(T, 6, *shape, generator=g, dtype=DTYPE) for _ in range(2))
    ys, yq = (torch.randint(0, 3, (T, 6), generator=g) for _ in range(2))
    return net, (xs, ys), (xq, yq)


@pytest.mark.parametrize("order", ["first", "second"])
@pytest.mark.parametrize(
    "shape,bias", [((4,), True), ((2, 4), True), ((4,), False)], ids=["1d", "2d", "no-bias"]
)
def test_task_batched_layer_norm_equals_the_per_task_loop(shape, bias, order, calls):
    net, support, query = _net_and_data(shape, bias)
    first_order = order == "first"
    reference = run(net, support, query, tasks=False, first_order=first_order)
    assert not calls
    ours = run(net, support, query, tasks=True, first_order=first_order)
    assert_same(ours, reference)
    # the query pass at least, and in first order the two inner steps too
    assert len(calls) >= (3 if first_order else 1)


def test_a_second_order_step_keeps_torchs_double_backward(calls):
    net, _, query = _net_and_data()
    fmodel = fm.functional_model(net)
    params = _per_task_params(fmodel, 7)
    with twice_differentiable():
        inside = fm.apply_tasks(fmodel, params, query[0])[0]
    assert not calls
    outside = fm.apply_tasks(fmodel, params, query[0])[0]
    assert calls
    torch.testing.assert_close(inside, outside, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("first_order", [True, False], ids=["first", "second"])
def test_the_model_stays_batched(first_order, calls):
    """The node runs under vmap (it has a vmap rule): no fallback to a per-task loop, and
    no warning."""
    net, support, query = _net_and_data()
    fmodel = fm.functional_model(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            support,
            fm.optim.sgd(lr=0.1),
            steps=2,
            first_order=first_order,
        )
        fm.task_losses(fmodel, result.params, F.cross_entropy, query)
    assert fmodel.per_task is False and fmodel.per_task_layers == {}
    assert calls


def test_a_shared_bias_with_adapted_weights(calls):
    """Only the weight adapted: the bias stays one tensor for all tasks, its meta-gradient
    the sum of the tasks'."""
    net, support, query = _net_and_data()
    adapted = lambda name, _: name != "norm.bias"  # noqa: E731
    reference = run(net, support, query, tasks=False, first_order=True, trainable=adapted)
    ours = run(net, support, query, tasks=True, first_order=True, trainable=adapted)
    assert_same(ours, reference)
    assert len(calls) >= 3 and all(bias == (4,) for _, bias in calls)


def _per_task_params(fmodel: fm.FunctionalModel, seed: int) -> dict[str, Tensor]:
    return {k: v.requires_grad_() for k, v in per_task(fmodel.params, T, seed, 0.3).items()}


def test_a_hooked_layer_runs_as_it_is(calls):
    net, support, query = _net_and_data()
    seen = []
    net.norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    reference = run(net, support, query, tasks=False, first_order=True)
    count = len(seen)
    ours = run(net, support, query, tasks=True, first_order=True)
    assert_same(ours, reference)
    assert not calls and len(seen) > count


def test_under_autocast_the_layer_runs_as_it_is(calls):
    """autocast has a rule of its own for layer_norm; the node would bypass it."""
    net, _, query = _net_and_data()
    net = net.float()
    fmodel = fm.functional_model(net)
    params = {k: v.float() for k, v in _per_task_params(fmodel, 3).items()}
    x = query[0].float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fm.apply_tasks(fmodel, params, x)[0]
        loop = torch.stack([fmodel({k: v[t] for k, v in params.items()}, x[t]) for t in range(T)])
    assert not calls
    assert out.dtype == loop.dtype
    torch.testing.assert_close(out, loop, rtol=2e-2, atol=2e-2)


class CastThenNorm(nn.Module):
    """A LayerNorm (float32 parameters) given its input in another dtype, cast inside."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.norm = nn.LayerNorm(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.to(self.dtype))


def test_a_bfloat16_input_with_float32_parameters_keeps_its_dtype(calls):
    """layer_norm's mixed precision: the output has the input's dtype, computed in float32
    (vmap's rule gave float32 here); values and gradients equal the loop's to bfloat16
    rounding."""
    torch.manual_seed(8)
    net = CastThenNorm(torch.bfloat16)
    fmodel = fm.functional_model(net)
    params = _per_task_params(fmodel, 8)
    x = torch.randn(T, N, 4)
    out = fm.apply_tasks(fmodel, params, x)[0]
    assert calls
    loop = torch.stack([fmodel({k: v[t] for k, v in params.items()}, x[t]) for t in range(T)])
    assert out.dtype == loop.dtype == torch.bfloat16
    torch.testing.assert_close(out, loop, rtol=1e-2, atol=1e-2)
    probe = torch.randn(out.shape).to(torch.bfloat16)
    got = torch.autograd.grad((out * probe).float().sum(), list(params.values()))
    want = torch.autograd.grad((loop * probe).float().sum(), list(params.values()))
    for a, c in zip(got, want, strict=True):
        assert a.dtype == c.dtype == torch.float32
        torch.testing.assert_close(a, c, rtol=2e-2, atol=2e-2)


def test_a_float64_input_with_float32_parameters_is_refused_as_the_loop_refuses_it(calls):
    """vmap's rule would promote and run; layer_norm (the loop) refuses."""
    net = CastThenNorm(DTYPE)
    fmodel = fm.functional_model(net)
    params = _per_task_params(fmodel, 9)
    x = torch.randn(T, N, 4)
    with pytest.raises(RuntimeError) as loop:
        fmodel({k: v[0] for k, v in params.items()}, x[0])
    with pytest.raises(RuntimeError, match=re.escape(str(loop.value))):
        fm.apply_tasks(fmodel, params, x)
    assert not calls


def test_two_task_axes_step_aside_exactly(calls):
    """Parameters per task at the inner vmap level, inputs batched at both: the node would
    see an outer task axis, so the layer runs by vmap's rule."""
    net, _, query = _net_and_data()
    fmodel = fm.functional_model(net)
    params = _per_task_params(fmodel, 4)
    x = torch.stack([query[0], query[0].flip(0)])  # (2, T, 6, 4)
    out = torch.func.vmap(torch.func.vmap(fmodel), in_dims=(None, 0))(params, x)
    assert not calls
    for i in range(2):
        for t in range(T):
            want = fmodel({k: v[t] for k, v in params.items()}, x[i, t])
            torch.testing.assert_close(out[i, t], want, rtol=1e-12, atol=1e-13)


def test_a_non_finite_task_leaves_the_others_alone(calls):
    net, _, query = _net_and_data()
    fmodel = fm.functional_model(net)
    params = _per_task_params(fmodel, 5)
    x = query[0].clone()
    x[1, 2, 0] = float("nan")
    x[2, 0, 1] = float("inf")
    out = fm.apply_tasks(fmodel, params, x)[0]
    assert calls
    grads = torch.autograd.grad(out.sum(), list(params.values()))
    assert bool(out[0].isfinite().all()) and bool(out[1].isnan().any())
    for t in range(T):  # outputs and gradients task by task: the layer's own, NaN included
        one = {k: v[t] for k, v in params.items()}
        own = fmodel(one, x[t])
        torch.testing.assert_close(out[t], own, rtol=1e-12, atol=1e-13, equal_nan=True)
        want = torch.autograd.grad(own.sum(), list(one.values()))
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g[t], w, rtol=1e-12, atol=1e-13, equal_nan=True)
    assert all(bool(g[0].isfinite().all()) for g in grads)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves while ``fn`` runs."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("standin", [True, False], ids=["node", "control"])
def test_it_keeps_what_the_loop_keeps(standin, calls, monkeypatch):
    """The activations saved for the backward of a task-batched forward: the node saves no
    normalised activation, so the batched forward keeps what the loop keeps. The control,
    vmap's rule, keeps one more activation-sized tensor per task."""
    if not standin:
        monkeypatch.setattr(layer_norm.TaskLayerNorm, "forward", lambda self, x: self.original(x))
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)).to(DTYPE)
    fmodel = fm.functional_model(net)
    params = _per_task_params(fmodel, 6)
    x = torch.randn(T, 256, 64, dtype=DTYPE)
    batched = _saved_bytes(lambda: fm.apply_tasks(fmodel, params, x))
    loop = _saved_bytes(
        lambda: [fmodel({k: v[t] for k, v in params.items()}, x[t]) for t in range(T)]
    )
    activation = 256 * 64 * 8
    assert bool(calls) == standin
    if standin:
        assert batched <= loop, (batched, loop)  # the loop keeps each task's weight too
    else:
        assert batched > loop + 0.9 * T * activation, (batched, loop)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_is_computed_in_float32_and_rounded_once(param_dtype):
    """As layer_norm's kernels do: the output equals the layer's but for float32 rounding
    (normalising, scaling and shifting in bfloat16 rounded three times, and a third of the
    results differed from the layer's by an ulp), and the gradients are at least as close to
    float64's as the layer's."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(T, 64, 256, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.3 * torch.randn(T, 256, generator=g)).to(param_dtype).requires_grad_()
    b = (0.3 * torch.randn(T, 256, generator=g)).to(param_dtype).requires_grad_()
    out = layer_norm.per_task_layer_norm(x, w, b, 1, 1e-5)
    loop = torch.stack([F.layer_norm(x[t], (256,), w[t], b[t]) for t in range(T)])
    assert out.dtype == loop.dtype == torch.bfloat16
    differ = out != loop
    assert float(differ.float().mean()) < 1e-3  # 0 to 0.04% with torch 2.13
    ulp = 2.0 ** (torch.frexp(loop[differ].float()).exponent.double() - 8)
    assert bool(((out[differ].double() - loop[differ].double()).abs() <= ulp).all())
    probe = torch.randn(out.shape, generator=g).bfloat16()
    ours = torch.autograd.grad((out * probe).float().sum(), (x, w, b))
    theirs = torch.autograd.grad((loop * probe).float().sum(), (x, w, b))
    exact = [v.detach().double().requires_grad_() for v in (x, w, b)]
    ref = torch.stack(
        [F.layer_norm(exact[0][t], (256,), exact[1][t], exact[2][t]) for t in range(T)]
    )
    truth = torch.autograd.grad((ref * probe.double()).sum(), exact)
    for a, c, r in zip(ours, theirs, truth, strict=True):
        assert a.dtype == c.dtype
        assert float((a.double() - r).abs().max()) <= float((c.double() - r).abs().max())
