"""``nn.LSTMCell`` under task batching (:mod:`funcmeta._src.batching.cells`): models against a
per-task loop of ``fm.adapt`` in float64, first and second order; per-task and shared
weights, one sample per task, no bias; hooks and wrong shapes."""

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
import funcmeta._src.batching.cells as cells

DTYPE = torch.float64
T, N, L = 3, 6, 4


class Unrolled(nn.Module):
    """An LSTM cell over ``L`` steps (no state at the first) and a head on the last state."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(4, 5, bias=bias)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        state = None
        for t in range(x.shape[-2]):
            state = self.cell(x[..., t, :], state)
        return self.head(state[0] + state[1])


@pytest.fixture
def steps(monkeypatch):
    """Counts the cell steps that ran for all tasks at once."""
    seen: list[int] = []
    real = cells.TaskLSTMCell._cell

    def counted(self, *args):
        out = real(self, *args)
        seen.append(1)
        return out

    monkeypatch.setattr(cells.TaskLSTMCell, "_cell", counted)
    return seen


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs, xq = (torch.randn(T, N, L, 4, generator=g, dtype=DTYPE) for _ in range(2))
    ys, yq = (torch.randint(0, 3, (T, N), generator=g) for _ in range(2))
    return (xs, ys), (xq, yq)


@pytest.mark.parametrize("order", ["first", "second"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_lstm_cell_equals_the_per_task_loop(bias, order, steps):
    torch.manual_seed(0)
    net = Unrolled(bias).to(DTYPE)
    support, query = _data()
    first_order = order == "first"
    reference = run(net, support, query, tasks=False, first_order=first_order)
    assert not steps
    ours = run(net, support, query, tasks=True, first_order=first_order)
    assert_same(ours, reference)
    assert len(steps) >= 3 * L  # two inner steps and the query pass, every time step


def test_shared_cell_weights_with_an_adapted_head(steps):
    """The cell held fixed (as in ANIL): its weights shared by all tasks, one matrix product
    for all of them."""
    torch.manual_seed(1)
    net = Unrolled().to(DTYPE)
    support, query = _data(1)
    reference = run(net, support, query, tasks=False, trainable="head")
    ours = run(net, support, query, tasks=True, trainable="head")
    assert_same(ours, reference)
    assert steps


def test_the_model_stays_batched(steps):
    torch.manual_seed(2)
    net = Unrolled().to(DTYPE)
    fmodel = fm.functional_model(net)
    support, query = _data(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fm.adapt_tasks(
            fmodel, fmodel.params, F.cross_entropy, support, fm.optim.sgd(lr=0.1), steps=1
        )
        fm.task_losses(fmodel, result.params, F.cross_entropy, query)
    assert fmodel.per_task is False and fmodel.per_task_layers == {}
    assert steps


def _per_task(fmodel: fm.FunctionalModel, seed: int) -> dict[str, Tensor]:
    return per_task(fmodel.params, T, seed, 0.3)


def cell_call(cell: nn.Module, params: dict[str, Tensor], x: Tensor, hx) -> tuple[Tensor, Tensor]:
    """The layer itself, with ``params``."""
    return torch.func.functional_call(cell, params, (x, hx))


@pytest.mark.parametrize("state", ["none", "shared", "per-task"])
@pytest.mark.parametrize("one", [False, True], ids=["batch", "one-sample"])
def test_one_step_equals_the_cell_task_by_task(state, one, steps):
    """Initial states absent, shared by the tasks or their own; a batch of samples per task,
    or one sample without a batch axis."""
    torch.manual_seed(3)
    cell = nn.LSTMCell(4, 5).to(DTYPE)
    fmodel = fm.functional_model(cell)
    params = _per_task(fmodel, 3)
    g = torch.Generator().manual_seed(4)
    sample = () if one else (N,)
    x = torch.randn(T, *sample, 4, generator=g, dtype=DTYPE)
    hx = None
    if state == "shared":
        hx = tuple(torch.randn(*sample, 5, generator=g, dtype=DTYPE) for _ in range(2))
    elif state == "per-task":
        hx = tuple(torch.randn(T, *sample, 5, generator=g, dtype=DTYPE) for _ in range(2))

    in_dims = (0, 0, None if state != "per-task" else 0)
    h, c = torch.func.vmap(fmodel, in_dims=in_dims)(params, x, hx)
    assert steps
    for t in range(T):
        state_t = hx if state != "per-task" else tuple(s[t] for s in hx)
        want_h, want_c = cell_call(cell, {k: v[t] for k, v in params.items()}, x[t], state_t)
        torch.testing.assert_close(h[t], want_h, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(c[t], want_c, rtol=1e-13, atol=1e-14)


def test_a_hooked_cell_runs_as_it_is(steps):
    torch.manual_seed(5)
    net = Unrolled().to(DTYPE)
    seen = []
    net.cell.register_forward_hook(lambda m, args, out: seen.append(out[0].shape))
    support, query = _data(5)
    reference = run(net, support, query, tasks=False, first_order=True)
    ours = run(net, support, query, tasks=True, first_order=True)
    assert_same(ours, reference)
    assert not steps and seen


def test_a_wrong_state_size_gives_the_layers_error(steps):
    cell = nn.LSTMCell(4, 5).to(DTYPE)
    fmodel = fm.functional_model(cell)
    x = torch.randn(T, N, 4, dtype=DTYPE)
    hx = (torch.zeros(T, N, 6, dtype=DTYPE), torch.zeros(T, N, 6, dtype=DTYPE))
    with pytest.raises(RuntimeError) as own:
        cell(x[0], (hx[0][0], hx[1][0]))
    with pytest.raises(RuntimeError, match=re.escape(str(own.value))):
        fm.apply_tasks(fmodel, _per_task(fmodel, 6), (x, hx))
    assert not steps


def test_under_autocast_the_cell_runs_as_it_is(steps):
    """autocast would run the stand-in's matrix products in bfloat16, not the layer's."""
    torch.manual_seed(7)
    net = Unrolled()
    fmodel = fm.functional_model(net)
    params = _per_task(fmodel, 7)
    x = torch.randn(T, N, L, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-task fallback says so
        out = fm.apply_tasks(fmodel, params, x)[0]
        want = torch.stack([fmodel({k: v[t] for k, v in params.items()}, x[t]) for t in range(T)])
    assert not steps
    assert out.dtype == want.dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("outer", ["inputs", "parameters"])
def test_two_task_axes(outer, steps):
    """Parameters per task at the inner vmap level and the inputs batched at both, or the
    parameters batched at both and the inputs at the inner one: the outer vmap batches the
    stand-in's operations (the layer itself has no batching rule at all)."""
    torch.manual_seed(8)
    cell = nn.LSTMCell(4, 5).to(DTYPE)
    fmodel = fm.functional_model(cell)
    params = _per_task(fmodel, 8)
    g = torch.Generator().manual_seed(8)
    if outer == "inputs":
        x = torch.randn(2, T, N, 4, generator=g, dtype=DTYPE)
        h, c = torch.func.vmap(torch.func.vmap(fmodel), in_dims=(None, 0))(params, x)

        def case(i, t):
            return {k: v[t] for k, v in params.items()}, x[i, t]
    else:
        twice = {k: torch.stack([v, v.flip(0)]) for k, v in params.items()}
        x = torch.randn(T, N, 4, generator=g, dtype=DTYPE)
        h, c = torch.func.vmap(torch.func.vmap(fmodel), in_dims=(0, None))(twice, x)

        def case(i, t):
            return {k: v[i, t] for k, v in twice.items()}, x[t]

    assert steps
    for i in range(2):
        for t in range(T):
            want_h, want_c = cell_call(cell, *case(i, t), None)
            torch.testing.assert_close(h[i, t], want_h, rtol=1e-13, atol=1e-14)
            torch.testing.assert_close(c[i, t], want_c, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("shared", [False, True], ids=["per-task", "shared"])
def test_a_non_finite_task_leaves_the_others_alone(shared, steps):
    torch.manual_seed(9)
    net = Unrolled().to(DTYPE)
    fmodel = fm.functional_model(net)
    params = _per_task(fmodel, 9)
    if shared:  # the cell's weights shared: one matrix product over all tasks' rows
        params = {k: v if k.startswith("head") else fmodel.params[k] for k, v in params.items()}
    x = torch.randn(T, N, L, 4, dtype=DTYPE)
    x[1, 2, 1, 0] = float("nan")
    x[2, 0, 3, 1] = float("inf")
    out = fm.apply_tasks(fmodel, params, x)[0]
    assert steps
    for t in range(T):
        one = {k: (v[t] if v.dim() > fmodel.params[k].dim() else v) for k, v in params.items()}
        torch.testing.assert_close(
            out[t], fmodel(one, x[t]), rtol=1e-12, atol=1e-13, equal_nan=True
        )
    assert bool(out[0].isfinite().all()) and not bool(out[1].isfinite().all())
