"""Recurrent layers under task batching (funcmeta._src.batching.recurrent): nn.RNN, nn.LSTM and
nn.GRU with per-task weights computed for all tasks in one pass, exact against a loop of
fm.adapt over the tasks (torch's own recurrent kernels), in float64 and second order; and the
cases it hands to the per-task loop, each said once."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import per_task
from torch import nn

import funcmeta as fm
import funcmeta._src.batching.recurrent as recurrent

DTYPE = torch.float64
T, N, L, IN, HID = 3, 4, 5, 3, 4


class Head(nn.Module):
    """A recurrent layer, then a linear read-out of its last output (and of h_n)."""

    def __init__(self, rnn: nn.RNNBase, hx: bool = False) -> None:
        super().__init__()
        self.rnn = rnn
        width = rnn.proj_size or rnn.hidden_size
        dirs = 2 if rnn.bidirectional else 1
        self.out = nn.Linear(width * dirs * 2, 2)
        self.hx = hx

    def forward(self, x, h0=None):
        out, state = self.rnn(x, h0) if h0 is not None else self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        last = out[..., -1, :] if self.rnn.batch_first or out.dim() == 2 else out[-1]
        if out.dim() == 2:  # one sequence without a batch dimension
            return self.out(torch.cat([last, h[-2:].reshape(-1)[: last.shape[-1]]], -1))
        top = h[-1] if not self.rnn.bidirectional else torch.cat([h[-2], h[-1]], -1)
        return self.out(torch.cat([last, top], -1))


def _data(batch_first: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (T, N, L, IN) if batch_first else (T, L, N, IN)
    return torch.randn(shape, generator=g, dtype=DTYPE), torch.randint(0, 2, (T, N), generator=g)


def _meta_grads(fmodel, x, y, batched, *, first_order=False, extra=()):
    opt = fm.optim.sgd(lr=0.3)
    params = list(fmodel.params.values())
    if batched:
        batch = (fm.Args(x, *extra), y)
        r = fm.adapt_tasks(
            fmodel, fmodel.params, F.cross_entropy, batch, opt, steps=2, first_order=first_order
        )
        out, _ = fm.apply_tasks(fmodel, r.params, fm.Args(x, *extra))
        loss = sum(F.cross_entropy(out[t], y[t]) for t in range(T))
    else:
        loss = 0
        for t in range(T):
            args = fm.Args(x[t], *(fm.tree.tree_map(lambda v, t=t: v[t], e) for e in extra))
            r = fm.adapt(
                fmodel,
                fmodel.params,
                F.cross_entropy,
                (args, y[t]),
                opt,
                steps=2,
                first_order=first_order,
            )
            loss = loss + F.cross_entropy(fmodel(r.params, *args.args), y[t])
    return loss, torch.autograd.grad(loss, params)


def _counting(monkeypatch, name: str) -> list[int]:
    """A list that grows by one at every call of ``funcmeta._src.batching.recurrent.<name>``."""
    calls: list[int] = []
    real = getattr(recurrent, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(recurrent, name, counted)
    return calls


@pytest.fixture
def passes(monkeypatch):
    """Counts the one-pass computations of the recurrent stand-in."""
    return _counting(monkeypatch, "_one_pass")


@pytest.fixture
def merged(monkeypatch):
    """Counts the calls of the layer itself on the tasks joined to its batch (shared weights,
    no graph)."""
    return _counting(monkeypatch, "_merged")


CONFIGS = [
    dict(kind=kind, num_layers=layers, bidirectional=bi, batch_first=bf)
    for kind, layers, bi, bf in itertools.product(
        ["rnn_tanh", "rnn_relu", "lstm", "gru"], [1, 2], [False, True], [False, True]
    )
]


def _layer(kind: str, **kw) -> nn.RNNBase:
    if kind.startswith("rnn"):
        return nn.RNN(IN, HID, nonlinearity=kind[4:], **kw)
    return {"lstm": nn.LSTM, "gru": nn.GRU}[kind](IN, HID, **kw)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_one_pass_equals_the_loop_in_second_order(config, passes):
    config = dict(config)  # the parameter's dict is shared by the tests that use it
    kind = config.pop("kind")
    torch.manual_seed(0)
    fmodel = fm.functional_model(Head(_layer(kind, **config)).to(DTYPE))
    x, y = _data(config["batch_first"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a step-aside nor torch's per-example fallback
        loss_b, grads_b = _meta_grads(fmodel, x, y, batched=True)
    assert passes, "the recurrent layer did not take the one-pass path"
    assert fmodel.per_task is False
    assert fmodel.per_task_layers == {}
    loss_l, grads_l = _meta_grads(fmodel, x, y, batched=False)
    torch.testing.assert_close(loss_b, loss_l, rtol=1e-12, atol=0)
    for b, ref in zip(grads_b, grads_l, strict=True):
        torch.testing.assert_close(b, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("lstm", dict(proj_size=2)),
        ("lstm", dict(proj_size=2, num_layers=2, bidirectional=True)),
        ("gru", dict(bias=False, num_layers=2)),
        ("rnn_tanh", dict(bias=False)),
        ("lstm", dict(num_layers=2, dropout=0.5)),  # eval mode: no dropout, so one pass
    ],
)
def test_projections_no_bias_and_eval_dropout(kind, kw, passes):
    torch.manual_seed(1)
    fmodel = fm.functional_model(Head(_layer(kind, **kw)).to(DTYPE).eval())
    x, y = _data(False, seed=1)
    loss_b, grads_b = _meta_grads(fmodel, x, y, batched=True)
    assert passes
    loss_l, grads_l = _meta_grads(fmodel, x, y, batched=False)
    torch.testing.assert_close(loss_b, loss_l, rtol=1e-12, atol=0)
    for b, ref in zip(grads_b, grads_l, strict=True):
        torch.testing.assert_close(b, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("first_order", [False, True])
def test_initial_state_per_task(kind, first_order, passes):
    torch.manual_seed(2)
    rnn = _layer(kind, num_layers=2, bidirectional=True)
    fmodel = fm.functional_model(Head(rnn).to(DTYPE))
    x, y = _data(False, seed=2)
    h0 = torch.randn(T, 4, N, HID, dtype=DTYPE)
    extra = ((h0, torch.randn(T, 4, N, HID, dtype=DTYPE)),) if kind == "lstm" else (h0,)
    loss_b, grads_b = _meta_grads(fmodel, x, y, True, first_order=first_order, extra=extra)
    assert passes
    loss_l, grads_l = _meta_grads(fmodel, x, y, False, first_order=first_order, extra=extra)
    torch.testing.assert_close(loss_b, loss_l, rtol=1e-12, atol=0)
    for b, ref in zip(grads_b, grads_l, strict=True):
        torch.testing.assert_close(b, ref, rtol=1e-10, atol=1e-12)


def _per_task_params(fmodel: fm.FunctionalModel, seed: int) -> dict[str, torch.Tensor]:
    """Each task's own parameters: the model's, perturbed differently per task."""
    return per_task(fmodel.params, T, seed, 0.1)


@pytest.mark.parametrize("with_hx", [False, True], ids=["no-hx", "hx"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("per_task", [False, True], ids=["shared", "per-task"])
def test_sequences_without_a_batch_dimension(batch_first, per_task, with_hx, passes, merged):
    """One sequence per task (``(L, I)``, whatever ``batch_first`` says), with shared weights
    in evaluation (the tasks become the layer's batch) and with per-task weights (the one
    pass); an initial state ``(layers, H)`` per task or none."""
    torch.manual_seed(3)
    rnn = nn.LSTM(IN, HID, num_layers=2, batch_first=batch_first)
    fmodel = fm.functional_model(rnn.to(DTYPE))
    x = torch.randn(T, L, IN, dtype=DTYPE)  # per task: (L, IN)
    h0 = torch.randn(T, 2, HID, dtype=DTYPE)
    hx = (h0, h0.flip(0))
    params = _per_task_params(fmodel, 3) if per_task else fmodel.params
    args = fm.Args(x, hx) if with_hx else fm.Args(x)
    with torch.no_grad():
        outs, _ = fm.apply_tasks(fmodel, params, args)
    assert (bool(passes), bool(merged)) == (per_task, not per_task)
    for t in range(T):
        one = {k: v[t] for k, v in params.items()} if per_task else fmodel.params
        with torch.no_grad():
            if with_hx:
                out, (h, c) = fmodel(one, x[t], (h0[t], h0.flip(0)[t]))
            else:
                out, (h, c) = fmodel(one, x[t])
        torch.testing.assert_close(outs[0][t], out, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(outs[1][0][t], h, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(outs[1][1][t], c, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("hx", [None, "shared", "per-task"])
def test_shared_weights_without_a_graph_join_the_tasks_to_the_batch(config, hx, passes, merged):
    """A call that builds no graph (evaluation) with weights all tasks share runs the layer
    once, as torch computes it, on the tasks joined to its batch: outputs and states equal
    the layer's own per task. With a graph it takes the one pass (float64: no fused kernel),
    with the same results."""
    config = dict(config)  # the parameter's dict is shared by the tests that use it
    kind = config.pop("kind")
    torch.manual_seed(8)
    rnn = _layer(kind, **config).to(DTYPE)
    fmodel = fm.functional_model(rnn)
    x = _data(config["batch_first"], seed=8)[0]
    dirs = 2 if config["bidirectional"] else 1
    shape = (dirs * config["num_layers"], N, HID)
    h0 = None
    if hx == "shared":
        h0 = torch.randn(shape, dtype=DTYPE)
    elif hx == "per-task":
        h0 = torch.randn((T, *shape), dtype=DTYPE)
    if h0 is not None and kind == "lstm":
        h0 = (h0, 2 * h0)

    def run() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if h0 is None:
            out, state = torch.func.vmap(lambda xt: fmodel(fmodel.params, xt))(x)
        else:  # a shared state is closed over, unbatched
            dims = 0 if hx == "per-task" else None
            out, state = torch.func.vmap(
                lambda xt, ht: fmodel(fmodel.params, xt, ht), in_dims=(0, dims)
            )(x, h0)
        return out, state if isinstance(state, tuple) else (state,)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out, states = run()
        assert merged and not passes
        merged.clear()
        out_g, states_g = run()  # the parameters require grad: a graph
        assert passes and not merged
    for t in range(T):
        if h0 is None:
            h_t = None
        elif hx == "shared":
            h_t = h0
        else:
            h_t = tuple(h[t] for h in h0) if kind == "lstm" else h0[t]
        with torch.no_grad():
            one, one_state = rnn(x[t]) if h_t is None else rnn(x[t], h_t)
        one_states = one_state if isinstance(one_state, tuple) else (one_state,)
        for got in (out, out_g):
            torch.testing.assert_close(got[t], one, rtol=1e-12, atol=1e-14)
        for s, s_g, ref in zip(states, states_g, one_states, strict=True):
            torch.testing.assert_close(s[t], ref, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(s_g[t], ref, rtol=1e-12, atol=1e-14)


def test_shared_recurrent_weights_with_an_adapted_head(passes):
    """trainable= adapts only the head: the recurrent weights stay shared by all tasks."""
    torch.manual_seed(4)
    fmodel = fm.functional_model(Head(nn.GRU(IN, HID, num_layers=2)).to(DTYPE))
    x, y = _data(False, seed=4)
    opt = fm.optim.sgd(lr=0.3)
    r = fm.adapt_tasks(
        fmodel,
        fmodel.params,
        F.cross_entropy,
        (x, y),
        opt,
        steps=2,
        trainable=lambda name, _: name.startswith("out"),
    )
    loss = fm.task_losses(fmodel, r.params, F.cross_entropy, (x, y))[0].sum()
    grads = torch.autograd.grad(loss, list(fmodel.params.values()))
    assert passes
    ref = 0
    for t in range(T):
        one = fm.adapt(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            (x[t], y[t]),
            opt,
            steps=2,
            trainable=lambda name, _: name.startswith("out"),
        )
        ref = ref + F.cross_entropy(fmodel(one.params, x[t]), y[t])
    for g, want in zip(grads, torch.autograd.grad(ref, list(fmodel.params.values())), strict=True):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


def test_dropout_in_training_steps_aside_once_and_says_why(passes):
    torch.manual_seed(5)
    fmodel = fm.functional_model(Head(nn.LSTM(IN, HID, num_layers=2, dropout=0.3)).to(DTYPE))
    x, y = _data(False, seed=5)
    opt = fm.optim.sgd(lr=0.3)
    with pytest.warns(UserWarning, match="LSTM layer 'rnn' once per task: dropout between its"):
        fm.adapt_tasks(fmodel, fmodel.params, F.cross_entropy, (x, y), opt, steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        fm.adapt_tasks(fmodel, fmodel.params, F.cross_entropy, (x, y), opt, steps=1)
    assert not passes
    assert fmodel.per_task is False  # the rest of the model runs batched
    assert list(fmodel.per_task_layers) == ["rnn"]
    assert "dropout" in fmodel.per_task_layers["rnn"]


def test_hooks_step_aside_and_run_once_per_task(passes):
    torch.manual_seed(6)
    net = Head(nn.GRU(IN, HID)).to(DTYPE)
    seen = []
    net.rnn.register_forward_hook(lambda m, i, o: None if fm.recomputing() else seen.append(1))
    fmodel = fm.functional_model(net)
    x, _ = _data(False, seed=6)
    with pytest.warns(UserWarning, match="GRU layer 'rnn' once per task: it has hooks"):
        out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
    assert not passes
    assert fmodel.per_task_layers == {
        "rnn": "GRU: it has hooks, which run once per call of the layer"
    }
    assert len(seen) == T
    for t in range(T):
        torch.testing.assert_close(out[t], fmodel(fmodel.params, x[t]), rtol=1e-12, atol=1e-14)


def test_a_subclass_runs_once_per_task():
    class Scaled(nn.GRU):
        def forward(self, x, hx=None):
            out, h = super().forward(x, hx)
            return 2 * out, h

    from funcmeta._src.batching.layers import task_standins

    kinds = {k: v.__name__ for k, v in task_standins(Head(Scaled(IN, HID))).items()}
    assert kinds["rnn"] == "PerTask"


def _classifier(kind: str, dtype: torch.dtype) -> fm.FunctionalModel:
    torch.manual_seed(7)
    return fm.functional_model(Head(_layer(kind, batch_first=True)).to(dtype))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_float32_kernel_choice_is_exact_both_ways(kind, passes):
    """In float32 on CPU the LSTM's first-order steps keep oneDNN's fused kernel, per task;
    second-order steps (and the GRU always) take the one pass. Both agree with the loop to
    float32 rounding."""
    fmodel = _classifier(kind, torch.float32)
    x, y = _data(True, seed=7)
    x = x.float()
    for first_order in (True, False):
        passes.clear()
        loss_b, grads_b = _meta_grads(fmodel, x, y, True, first_order=first_order)
        one_pass = bool(passes)
        loss_l, grads_l = _meta_grads(fmodel, x, y, False, first_order=first_order)
        torch.testing.assert_close(loss_b, loss_l, rtol=1e-5, atol=1e-6)
        for b, ref in zip(grads_b, grads_l, strict=True):
            torch.testing.assert_close(b, ref, rtol=1e-4, atol=1e-5)
        fused = kind == "lstm" and first_order and torch.backends.mkldnn.is_available()
        assert one_pass != fused, (kind, first_order, one_pass)
    assert fmodel.per_task_layers == {}


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_wrong_hx_is_refused_as_the_layer_refuses_it(kind):
    rnn = _layer(kind, num_layers=2).to(DTYPE)
    fmodel = fm.functional_model(rnn)
    x = torch.randn(T, L, N, IN, dtype=DTYPE)
    h0 = torch.randn(T, 1, N, HID, dtype=DTYPE)  # one layer's state for a two-layer RNN
    hx = (h0, h0) if kind == "lstm" else h0
    with pytest.raises(RuntimeError, match="Expected hidden"):
        fm.apply_tasks(fmodel, fmodel.params, fm.Args(x, hx))
    with pytest.raises(RuntimeError, match=r"input.size\(-1\) must be equal to input_size"):
        fm.apply_tasks(fmodel, fmodel.params, torch.randn(T, L, N, IN + 1, dtype=DTYPE))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_float32_evaluation_with_shared_weights_on_torch_kernels(kind, merged):
    """Evaluation in float32 (oneDNN's fused LSTM on CPU): one call of the layer for all
    tasks, equal to the per-task calls to float32 rounding."""
    fmodel = _classifier(kind, torch.float32)
    x = _data(True, seed=9)[0].float()
    with torch.no_grad():
        out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
        assert merged
        for t in range(T):
            torch.testing.assert_close(out[t], fmodel(fmodel.params, x[t]), rtol=1e-5, atol=1e-6)


def _peak_bytes(fn) -> int:
    """The most tensor bytes allocated at once while ``fn`` runs, above the start (the
    sequence benchmark's count, tested in benchmarks/tests/test_benchmark_memory.py)."""
    from helpers import profiled

    return profiled(fn)


@pytest.mark.parametrize("block", [None, 10**6], ids=["blocks", "all-steps"])
def test_gru_first_order_peak_memory_near_the_loop(block, monkeypatch):
    """The one pass keeps a GRU's first-order peak near the loop's: the input is projected a
    few steps at a time and r, z live in the hidden projection. Projecting all steps at once
    (the control) holds every task's whole projection to the last step."""
    if block is not None:
        monkeypatch.setattr(recurrent, "_BLOCK", block)
    torch.manual_seed(10)
    tasks, n, length = 8, 10, 32
    fmodel = fm.functional_model(Head(nn.GRU(16, 64, batch_first=True)))
    x = torch.randn(tasks, n, length, 16)
    y = torch.randint(0, 2, (tasks, n))
    params = list(fmodel.params.values())
    opt = fm.optim.sgd(lr=0.1)

    def batched():
        r = fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            (x, y),
            opt,
            steps=1,
            first_order=True,
            task_chunk=None,
        )
        loss = fm.task_losses(fmodel, r.params, F.cross_entropy, (x, y), task_chunk=None)
        torch.autograd.grad(loss[0].sum(), params)

    def loop():
        loss = 0
        for t in range(tasks):
            r = fm.adapt(
                fmodel, fmodel.params, F.cross_entropy, (x[t], y[t]), opt, steps=1, first_order=True
            )
            loss = loss + F.cross_entropy(fmodel(r.params, x[t]), y[t])
        torch.autograd.grad(loss, params)

    batched(), loop()  # warm-up
    ratio = _peak_bytes(batched) / _peak_bytes(loop)
    if block is None:
        assert ratio < 1.15, ratio  # 1.10 with torch 2.13
    else:
        assert ratio > 1.15, ratio  # 1.20: the control shows the test can tell them apart


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_two_task_axes_without_a_graph_stay_batched(kind, merged):
    """Shared weights, no graph, the input batched over two vmap levels: the layer cannot be
    handed to torch's kernel with an outer task axis left (it has no batching rule, and the
    whole model would fall back to a loop); the one pass runs instead, exact."""
    torch.manual_seed(15)
    rnn = _layer(kind, num_layers=2, batch_first=True).to(DTYPE)
    fmodel = fm.functional_model(rnn)
    x = torch.randn(2, T, N, L, IN, dtype=DTYPE)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.func.vmap(torch.func.vmap(lambda xt: fmodel(fmodel.params, xt)[0]))(x)
    assert not merged
    assert fmodel.per_task is False and fmodel.per_task_layers == {}
    for i in range(2):
        for t in range(T):
            torch.testing.assert_close(out[i, t], rnn(x[i, t])[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("per_task", [False, True], ids=["shared", "per-task"])
def test_a_non_finite_task_leaves_the_others_alone(kind, per_task, passes, merged):
    """NaN and inf in one task's input: that task's outputs are what the layer gives it, the
    other tasks' outputs and gradients are unchanged and finite (the joined batch and the one
    pass both keep tasks apart)."""
    torch.manual_seed(16)
    rnn = _layer(kind, batch_first=True).to(DTYPE)
    fmodel = fm.functional_model(rnn)
    x = torch.randn(T, N, L, IN, dtype=DTYPE)
    x[1, 2, 3, 0] = float("nan")
    x[2, 0, 0, 1] = float("inf")
    params = _per_task_params(fmodel, 16) if per_task else fmodel.params
    with torch.no_grad():
        out = fm.apply_tasks(fmodel, params, x)[0][0]
    assert bool(merged) != per_task
    for t in range(T):
        one = {k: v[t] for k, v in params.items()} if per_task else fmodel.params
        with torch.no_grad():
            ref = fmodel(one, x[t])[0]
        torch.testing.assert_close(out[t], ref, rtol=1e-12, atol=1e-14, equal_nan=True)
    assert bool(out[1].isnan().any()) and bool(out[[0, 2]].isfinite().all())
    if per_task:  # the one pass with a graph: gradients equal the loop's, task by task
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = fm.apply_tasks(fmodel, leaves, x)[0][0].sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        assert passes
        for t in range(T):
            one = {k: v.detach()[t].requires_grad_() for k, v in params.items()}
            ref = torch.autograd.grad(fmodel(one, x[t])[0].sum(), list(one.values()))
            for g, r in zip(grads, ref, strict=True):
                torch.testing.assert_close(g[t], r, rtol=1e-10, atol=1e-12, equal_nan=True)
        assert all(bool(g[0].isfinite().all()) for g in grads)  # the clean task's
