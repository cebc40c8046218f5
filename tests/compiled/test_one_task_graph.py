"""The traced step's call of one task: the function on the task's slices, no ``vmap``
(``funcmeta._src.runtime.traced.one_task_slices``), against ``vmap`` itself and against the
plain path in float64, compiled for real."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.nn.functional as F
from helpers import graph_or_reason
from torch import nn

import funcmeta as fm
from funcmeta._src.inner.inputs import split_batch
from funcmeta._src.runtime import TRACED
from funcmeta._src.runtime.traced import one_task_slices

Pair = namedtuple("Pair", ["x", "y"])


def _vmapped(fn, trees, dims):  # type: ignore[no-untyped-def]
    return torch.func.vmap(fn, in_dims=dims, randomness="different")(*trees)


def _structures() -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 2, generator=g, dtype=torch.float64)
    w = torch.randn(2, 2, generator=g, dtype=torch.float64)
    b = torch.randn(1, 2, generator=g, dtype=torch.float64)
    return [
        ((x, w), (0, None)),  # a batched input, a shared weight
        (({"w": w, "b": b},), ({"w": None, "b": 0},)),  # a dict of mixed in-dims
        (((x, None, 3), {"w": w}), ((0, None, None), None)),  # None and a number passed whole
        ((Pair(x, b), OrderedDict(w=w)), (Pair(0, 0), OrderedDict(w=None))),  # other nodes
        ((x.transpose(0, 1).contiguous(), w), (1, None)),  # the task axis not first
    ]


def _fn(*trees):  # type: ignore[no-untyped-def]
    leaves = [t for t in fm.tree.leaves(trees) if isinstance(t, torch.Tensor)]
    total = sum(t.sum() for t in leaves)
    return {"total": total, "first": leaves[0] * 2.0, "pair": (total.exp(), leaves[-1].tanh())}


@pytest.mark.parametrize("case", range(5))
def test_one_tasks_slices_give_what_vmap_gives(case):
    trees, dims = _structures()[case]
    sliced = one_task_slices(trees, dims)
    assert sliced is not None
    ours = TRACED.over_tasks(_fn, trees, dims, None)
    theirs = _vmapped(_fn, trees, dims)
    for a, b in zip(fm.tree.leaves(ours), fm.tree.leaves(theirs), strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_more_than_one_task_or_nothing_batched_goes_to_vmap():
    two = torch.ones(2, 3)
    assert one_task_slices((two,), (0,)) is None
    assert one_task_slices((torch.ones(1, 3), two), (0, 0)) is None  # one batched axis of 2
    assert one_task_slices((torch.ones(1, 3),), (None,)) is None  # nothing batched
    assert one_task_slices(((1.5,),), (0,)) is None  # a batched leaf that is no tensor
    out = TRACED.over_tasks(lambda t: t * 2, (two,), (0,), None)
    assert torch.equal(out, two * 2)


class Out:
    """An output type registered with torch's pytree registry alone (as HuggingFace registers
    ``ModelOutput``): ``vmap`` opens it."""

    def __init__(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.logits, self.hidden = logits, hidden


torch.utils._pytree.register_pytree_node(
    Out, lambda o: ([o.logits, o.hidden], None), lambda xs, _: Out(*xs)
)


def test_a_registered_output_type_is_opened_as_vmap_opens_it():
    x = torch.randn(1, 3, 2, dtype=torch.float64)
    fn = lambda t: Out(t * 2, t.sum(0))  # noqa: E731
    ours, theirs = TRACED.over_tasks(fn, (x,), (0,), None), _vmapped(fn, (x,), (0,))
    assert isinstance(ours, Out) and isinstance(theirs, Out)
    for a, b in [(ours.logits, theirs.logits), (ours.hidden, theirs.hidden)]:
        assert a.shape == b.shape and torch.equal(a, b)


def test_a_non_tensor_output_is_refused_as_vmap_refuses_it():
    with pytest.raises(ValueError, match="must only return Tensors"):
        TRACED.over_tasks(lambda t: (t, None), (torch.ones(1, 2),), (0,), None)
    with pytest.raises(ValueError, match="must only return Tensors"):
        _vmapped(lambda t: (t, None), (torch.ones(1, 2),), (0,))


def _problem() -> tuple[nn.Module, tuple, tuple]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    support = (torch.randn(3, 5, 3, generator=g), torch.randn(3, 5, 1, generator=g))
    query = (torch.randn(3, 6, 3, generator=g), torch.randn(3, 6, 1, generator=g))
    as64 = lambda pair: tuple(t.double() for t in pair)  # noqa: E731
    return net.double(), as64(support), as64(query)


def _grads(net: nn.Module, run) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    net.zero_grad(set_to_none=True)
    run()
    return [p.grad.clone() for p in net.parameters()]


def _compiled_and_plain(net: nn.Module, fmodel, loss_fn, support, query):  # type: ignore[no-untyped-def]
    """The meta-gradients of a step compiled one task a graph call and of the plain path (two
    SGD steps), and the compiled step; it must have run compiled."""
    opt = fm.optim.sgd(lr=0.1)
    plain = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, compile=False)
    expected = _grads(net, lambda: plain(support, query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, task_chunk=1)
    ours = _grads(net, lambda: step(support, query))
    graph_or_reason(step)  # a graph from torch 2.13 on; the same meta-gradients on any torch
    return ours, expected, step


def test_a_graph_of_one_task_calls_no_vmap(monkeypatch: pytest.MonkeyPatch):
    """A step of one task a graph call runs its computation without ``torch.func.vmap``; a
    step of all tasks in one graph runs it under ``vmap``. Both give the plain path's
    meta-gradients in float64."""
    net, support, query = _problem()
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.1)
    grads = lambda run: _grads(net, run)  # noqa: E731
    plain = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, compile=False)
    expected = grads(lambda: plain(support, query))
    calls = []
    vmap = torch.func.vmap

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return vmap(*args, **kwargs)

    monkeypatch.setattr(torch.func, "vmap", counted)
    for chunk, vmapped in [(1, False), (None, True)]:
        calls.clear()
        step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, task_chunk=chunk)
        s, q = split_batch(support), split_batch(query)
        params = fmodel.params
        (gp, _), _ = step.run_graph(step._uncompiled, params, [], s, q, 3)
        ours = [gp[k] for k, _ in net.named_parameters()]
        assert bool(calls) is vmapped
        worst = max((a - b).abs().max().item() for a, b in zip(ours, expected, strict=True))
        assert worst < 1e-12


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_compiled_step_of_one_task_a_call_gives_the_plain_paths_meta_gradients(
    aot_eager: None, checkpointed: bool
):
    """Compiled for real (``aot_eager``: dynamo and AOTAutograd, the graph as traced), one
    task a graph call, with and without checkpointed layers: the plain path's meta-gradients
    in float64, second order."""
    net, support, query = _problem()
    fmodel = fm.functional_model(net, checkpoint_layers=["0", "2"] if checkpointed else None)
    ours, expected, step = _compiled_and_plain(net, fmodel, F.mse_loss, support, query)
    if step.eager_reason is None:
        assert len(step.compile_seconds) == 1  # one kind of graph call: one task
    worst = max((a - b).abs().max().item() for a, b in zip(ours, expected, strict=True))
    assert worst < 1e-10


class _SelfCheckpointed(nn.Module):
    """A model that checkpoints part of its own forward (non-reentrant)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.a(t)), x, use_reentrant=False
        )
        return self.b(h)


def _real_model(name: str):  # type: ignore[no-untyped-def]
    """``(net, loss_fn, batch)``: a float64 model and a maker of batches of 3 tasks."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "self-checkpointed":

        def regression() -> tuple:
            return torch.randn(3, 5, 3, generator=g), torch.randn(3, 5, 1, generator=g)

        return _SelfCheckpointed().double(), F.mse_loss, regression
    if name == "batchnorm-conv":

        def images() -> tuple:
            labels = torch.randint(0, 3, (3, 6), generator=g)
            return torch.randn(3, 6, 1, 8, 8, generator=g), labels

        layers = [nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)]
        return nn.Sequential(*layers).double(), F.cross_entropy, images
    raise AssertionError(name)


def _as64(batch: tuple) -> tuple:
    return tuple(t.double() if t.is_floating_point() else t for t in batch)


@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("name", ["self-checkpointed", "batchnorm-conv"])
def test_real_models_compiled_one_task_a_call_give_the_plain_paths_meta_gradients(
    aot_eager: None, name: str, nan: bool
):
    """A model that checkpoints itself and a conv net with BatchNorm's batch statistics,
    compiled for real (``aot_eager``) one task a graph call: the plain path's float64
    meta-gradients; a NaN in one task's inputs gives NaN where the plain path gives it, and
    nothing else differs."""
    net, loss_fn, batch = _real_model(name)
    support, query = _as64(batch()), _as64(batch())
    if nan:
        support[0][0, 0].fill_(float("nan"))
    fmodel = fm.functional_model(net)
    ours, expected, _ = _compiled_and_plain(net, fmodel, loss_fn, support, query)
    for a, b in zip(ours, expected, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        assert (a - b).nan_to_num(nan=0.0).abs().max().item() < 1e-10
    assert any(a.isnan().any() for a in ours) is nan


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_llama_decoder_compiled_one_task_a_call_gives_the_plain_paths_meta_gradients(
    aot_eager: None, monkeypatch: pytest.MonkeyPatch, checkpointed: bool
):
    """A transformers Llama from a config, compiled for real (``aot_eager``) one task a
    graph call, with and without its decoder layers checkpointed: the plain path's float64
    meta-gradients. transformers' RMSNorm computes in float32 whatever the dtype (the
    per-task graph and the batched plain path round it differently, 2e-8 apart): the check
    computes it in float64."""
    from helpers import tiny_llama

    net = tiny_llama(2)

    def rms_norm(self, hidden):  # type: ignore[no-untyped-def]
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden * torch.rsqrt(variance + self.variance_epsilon)

    monkeypatch.setattr(type(net.model.norm), "forward", rms_norm)

    def next_token(out, ids):  # type: ignore[no-untyped-def]
        logits = out.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    layers = ["model.layers.0", "model.layers.1"] if checkpointed else None
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 32, (3, 2, 8), generator=g) for _ in range(2)]
    support, query = ({"input_ids": ids[0]}, ids[0]), ({"input_ids": ids[1]}, ids[1])
    ours, expected, _ = _compiled_and_plain(net, fmodel, next_token, support, query)
    worst = max((a - b).abs().max().item() for a, b in zip(ours, expected, strict=True))
    assert worst < 1e-10
