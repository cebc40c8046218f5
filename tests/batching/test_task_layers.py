"""The task-batched fast paths of conv-net layers (convolution, BatchNorm, GroupNorm,
InstanceNorm, pooling) against a per-task loop of ``fm.adapt`` and against vmap's generic
batching: float64, second order, train and eval mode, per-task and shared parameters,
hooks, dtypes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import per_task
from torch import nn

import funcmeta as fm
import funcmeta._src.batching.executor as executor
import funcmeta._src.batching.layers as task_layers
import funcmeta._src.inner.tune as tune_module

DTYPE = torch.float64
T = 3


def conv2d_net():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False),
        nn.BatchNorm2d(6, affine=False),
        nn.Tanh(),
        nn.AvgPool2d(2, padding=1, count_include_pad=False),
        nn.Conv2d(6, 6, 3, padding="same", padding_mode="circular", dilation=2),
        nn.BatchNorm2d(6, momentum=0.3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def conv1d_net():
    return nn.Sequential(
        nn.Conv1d(2, 4, 5, padding=2),
        nn.BatchNorm1d(4),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(4, 4, 3, padding_mode="replicate", padding=1),
        nn.AvgPool1d(3, stride=2),
        nn.AdaptiveAvgPool1d(2),
        nn.Flatten(),
        nn.Linear(8, 5),
        nn.BatchNorm1d(5),
        nn.Tanh(),
        nn.Linear(5, 3),
    )


def conv3d_net():
    return nn.Sequential(
        nn.Conv3d(1, 3, 3, padding=1),
        nn.BatchNorm3d(3, track_running_stats=False),
        nn.ReLU(),
        nn.MaxPool3d(2),
        nn.Conv3d(3, 4, 2),
        nn.BatchNorm3d(4),
        nn.AvgPool3d(1),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def groupnorm_net():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.GroupNorm(3, 6, eps=1e-3),
        nn.Tanh(),
        nn.Conv2d(6, 6, 3, padding=1),
        nn.GroupNorm(1, 6, affine=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def instancenorm_net():
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1),
        nn.InstanceNorm1d(4, affine=True),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(4, 4, 3, padding=1),
        nn.InstanceNorm1d(4, affine=True, track_running_stats=True, momentum=0.2),
        nn.Tanh(),
        nn.AvgPool1d(2),
        nn.Conv1d(4, 4, 3, padding=1),
        nn.InstanceNorm1d(4),
        nn.AdaptiveAvgPool1d(2),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


NETS = {
    "conv2d": (conv2d_net, (2, 12, 12)),
    "groupnorm": (groupnorm_net, (2, 8, 8)),
    "instancenorm": (instancenorm_net, (2, 16)),
    "conv1d": (conv1d_net, (2, 20)),
    "conv3d": (conv3d_net, (1, 6, 6, 6)),
}


def make(name, seed=0):
    build, shape = NETS[name]
    torch.manual_seed(seed)
    net = build().to(DTYPE)
    g = torch.Generator().manual_seed(seed)
    xs, xq = (torch.randn(T, 6, *shape, generator=g, dtype=DTYPE) for _ in range(2))
    ys, yq = (torch.randint(0, 3, (T, 6), generator=g) for _ in range(2))
    return net, (xs, ys), (xq, yq)


def run(net, support, query, *, tasks, steps=2, params=None, task_chunk="auto", **options):
    """Outer loss, meta-gradients (to the module and the learned rates) and buffers, of
    ``adapt_tasks`` (``tasks=True``, ``task_chunk`` tasks at a time, the query pass on the
    inner loop's chunk) or of a per-task loop of ``adapt``."""
    fmodel = fm.functional_model(net)
    params = fmodel.params if params is None else params
    rates = fm.hyper.per_layer(fmodel.params, 0.05, parameterization="softplus")
    opt = fm.optim.sgd(lr=rates, momentum=0.5)
    if tasks:
        result = fm.adapt_tasks(
            fmodel,
            params,
            F.cross_entropy,
            support,
            opt,
            steps=steps,
            task_chunk=task_chunk,
            **options,
        )
        if task_chunk != "auto":
            assert result.chunk.chunk == task_chunk
        out, buffers = fm.apply_tasks(
            fmodel, result.params, query[0], buffers=result.buffers, task_chunk=result.chunk
        )
        losses = [F.cross_entropy(out[t], query[1][t]) for t in range(T)]
    else:
        losses, per_task = [], []
        for t in range(T):
            p = {
                k: v[t] if v.dim() > fmodel.param_shapes[k].__len__() else v
                for k, v in params.items()
            }
            result = fm.adapt(
                fmodel,
                p,
                F.cross_entropy,
                (support[0][t], support[1][t]),
                opt,
                steps=steps,
                **options,
            )
            out, bufs = fmodel.run(result.params, result.buffers, query[0][t])
            losses.append(F.cross_entropy(out, query[1][t]))
            per_task.append(bufs)
        buffers = {k: torch.stack([b[k] for b in per_task]) for k in fmodel.buffers}
    outer = torch.stack(losses).mean()
    leaves = [v for v in params.values() if v.requires_grad] + list(rates.parameters())
    return outer.detach(), torch.autograd.grad(outer, leaves), buffers


def assert_same(a, b):
    (la, ga, ba), (lb, gb, bb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-10, atol=1e-12)
    assert any(float(g.abs().max()) > 0 for g in gb)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11 * max(1.0, float(y.abs().max())))
    assert ba.keys() == bb.keys()
    for k in ba:
        torch.testing.assert_close(ba[k], bb[k], rtol=1e-10, atol=1e-12)


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts the layer calls that took a fast path (the grouped layout's exit)."""
    calls = []
    ungrouped = task_layers._ungrouped

    def counting(out, tasks, level):
        calls.append(tuple(out.shape))
        return ungrouped(out, tasks, level)

    monkeypatch.setattr(task_layers, "_ungrouped", counting)
    return calls


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(NETS))
def test_fast_paths_equal_the_per_task_loop(name, mode, fast_calls):
    net, support, query = make(name)
    net.train(mode == "train")
    reference = run(net, support, query, tasks=False)
    assert not fast_calls
    ours = run(net, support, query, tasks=True)
    assert_same(ours, reference)
    assert len(fast_calls) >= 3 * 6  # 3 steps' forwards (2 inner, 1 query), every fast layer


@pytest.mark.parametrize("name", list(NETS))
def test_per_task_initial_parameters(name):
    net, support, query = make(name)
    g = torch.Generator().manual_seed(3)
    params = {
        k: (v + 0.1 * torch.randn(T, *v.shape, generator=g, dtype=DTYPE)).requires_grad_()
        if i % 2 == 0
        else v
        for i, (k, v) in enumerate(net.named_parameters())
    }
    reference = run(net, support, query, tasks=False, params=params)
    ours = run(net, support, query, tasks=True, params=params)
    assert_same(ours, reference)


def test_shared_fixed_body_and_adapted_head():
    """ANIL's shape: the convolutions and BatchNorm affine parameters held fixed (shared by
    the tasks, so unbatched), only the last layer adapted."""
    net, support, query = make("conv2d")
    head = ["12.weight", "12.bias"]
    reference = run(net, support, query, tasks=False, trainable=head)
    ours = run(net, support, query, tasks=True, trainable=head)
    assert_same(ours, reference)


def test_shared_batchnorm_affine_parameters_with_adapted_convolutions():
    net, support, query = make("conv2d")
    adapted = [k for k, _ in net.named_parameters() if not k.startswith(("1.", "9."))]
    reference = run(net, support, query, tasks=False, trainable=adapted)
    ours = run(net, support, query, tasks=True, trainable=adapted)
    assert_same(ours, reference)


@pytest.mark.parametrize("name", list(NETS))
def test_fast_paths_equal_vmaps_generic_batching(name, monkeypatch):
    net, support, query = make(name)
    ours = run(net, support, query, tasks=True)
    monkeypatch.setattr(executor, "task_standins", lambda module: {})
    plain = run(net, support, query, tasks=True)
    assert_same(ours, plain)


def test_a_hooked_layer_runs_as_it_is(fast_calls):
    """A layer with a hook is not replaced: the hook sees one task's tensors, as in a loop."""
    net, support, query = make("conv2d")
    run(net, support, query, tasks=True)
    unhooked = len(fast_calls)
    fast_calls.clear()
    seen = []
    net[4].register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    reference = run(net, support, query, tasks=False)
    looped = list(seen)
    seen.clear()
    ours = run(net, support, query, tasks=True)
    assert_same(ours, reference)
    assert set(seen) == set(looped) == {(6, 6, 3, 3)}
    assert len(fast_calls) == unhooked - len(seen)  # only the hooked layer left its fast path


def test_momentum_none_takes_the_fast_path_when_the_tasks_counts_agree(fast_calls):
    """A cumulative moving average: the factor is one over the count of batches, the same
    for tasks adapted together (the module's count, then each task's)."""
    net, support, query = make("conv2d")
    net[1].momentum = None
    net[1].num_batches_tracked.fill_(4)
    reference = run(net, support, query, tasks=False)
    ours = run(net, support, query, tasks=True)
    assert_same(ours, reference)
    assert len(fast_calls) >= 3 * 6
    assert ours[2]["1.num_batches_tracked"].tolist() == [7] * T  # 4, two steps, the query


def test_momentum_none_with_different_counts_runs_the_layer():
    """Each task's own count, different ones: one factor cannot serve them, so the layer
    runs by vmap's rule, each task with its own factor (as a loop gives it)."""
    net, support, _ = make("conv2d")
    net[1].momentum = None
    fmodel = fm.functional_model(net)
    buffers = {k: torch.stack([v.clone() for _ in range(T)]) for k, v in fmodel.buffers.items()}
    buffers["1.num_batches_tracked"] = torch.tensor([1, 5, 9])
    opt = fm.optim.sgd(lr=0.1)
    result = fm.adapt_tasks(
        fmodel, fmodel.params, F.cross_entropy, support, opt, steps=2, buffers=buffers
    )
    for t in range(T):
        own = fm.adapt(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            (support[0][t], support[1][t]),
            opt,
            steps=2,
            buffers={k: v[t] for k, v in buffers.items()},
        )
        for k, v in own.buffers.items():
            torch.testing.assert_close(result.buffers[k][t], v, rtol=1e-12, atol=1e-14)
        for k, v in own.params.items():
            torch.testing.assert_close(result.params[k][t], v, rtol=1e-10, atol=1e-12)
    assert result.buffers["1.num_batches_tracked"].tolist() == [3, 7, 11]


def test_running_statistics_are_each_tasks_own():
    net, support, _ = make("conv2d")
    fmodel = fm.functional_model(net)
    result = fm.adapt_tasks(
        fmodel, fmodel.params, F.cross_entropy, support, fm.optim.sgd(lr=0.1), steps=2
    )
    means = result.buffers["1.running_mean"]
    assert means.shape == (T, 4)
    assert not torch.allclose(means[0], means[1])
    assert torch.equal(result.buffers["1.num_batches_tracked"], torch.full((T,), 2))
    assert torch.equal(net[1].running_mean, torch.zeros(4, dtype=DTYPE))  # module untouched


def test_standins_cover_the_conv_net_layers_and_exact_types_only():
    class MyConv(nn.Conv2d):
        pass

    net = nn.Sequential(
        nn.Conv2d(1, 2, 3),
        MyConv(2, 2, 3),
        nn.BatchNorm2d(2),
        nn.MaxPool2d(2),
        nn.MaxPool2d(2, return_indices=False),
        nn.LSTM(2, 2),
        nn.Linear(2, 2),
        nn.GroupNorm(1, 2),
        nn.InstanceNorm2d(2, affine=True),
    )
    nn.utils.parametrizations.weight_norm(net[0])
    kinds = {k: v.__name__ for k, v in task_layers.task_standins(net).items()}
    assert kinds == {
        "2": "TaskBatchNorm",
        "3": "TaskPool",
        "4": "TaskPool",
        "5": "TaskRecurrent",
        "6": "TaskLinear",
        "7": "TaskGroupNorm",
        "8": "TaskInstanceNorm",
    }


class CastThenNorm(nn.Module):
    """A normalisation (float32 parameters) given its input in another dtype, cast inside."""

    def __init__(self, norm: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.norm = norm

    def forward(self, x):
        return self.norm(x.to(self.dtype))


NORMS = {
    "group": lambda: nn.GroupNorm(2, 4),
    "instance": lambda: nn.InstanceNorm2d(4, affine=True),
    "batch-cumulative": lambda: nn.BatchNorm2d(4, momentum=None).eval(),
}


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_normalisations_keep_the_loops_dtypes(norm, dtype, fast_calls):
    """group_norm, instance_norm and batch_norm take a bfloat16 input with float32 parameters
    (bfloat16 out) and refuse float64 with them; vmap's rule gave float32 and ran the second
    (GroupNorm, InstanceNorm), or refused the first (BatchNorm with momentum=None)."""
    torch.manual_seed(9)
    fmodel = fm.functional_model(CastThenNorm(NORMS[norm](), dtype))
    params = per_task(fmodel.params, T, 9, 0.3)
    x = torch.randn(T, 5, 4, 3, 2)

    def one(t):
        return fmodel({k: v[t] for k, v in params.items()}, x[t])

    if dtype == torch.float64:
        with pytest.raises(RuntimeError) as loop:
            one(0)
        with pytest.raises(RuntimeError, match=re.escape(str(loop.value))):
            fm.apply_tasks(fmodel, params, x)
        return
    out = fm.apply_tasks(fmodel, params, x)[0]
    want = torch.stack([one(t) for t in range(T)])
    assert fast_calls
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# --- task chunks ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, T, None])
def test_task_chunks_equal_the_loop(chunk):
    net, support, query = make("conv2d")
    reference = run(net, support, query, tasks=False)
    ours = run(net, support, query, tasks=True, task_chunk=chunk)
    assert_same(ours, reference)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_task_chunk_must_be_a_positive_int(bad):
    fmodel = fm.functional_model(nn.Linear(1, 1))
    batch = (torch.randn(2, 3, 1), torch.randn(2, 3, 1))
    with pytest.raises(
        ValueError, match='task_chunk must be "auto", "tune", None or a positive int'
    ):
        fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, batch, fm.optim.sgd(lr=0.1), steps=1, task_chunk=bad
        )
    with pytest.raises(ValueError, match=r"fm\.task_losses: task_chunk must be"):
        fm.task_losses(fmodel, fmodel.params, F.mse_loss, batch, task_chunk=bad)
    with pytest.raises(ValueError, match=r"fm\.apply_tasks: task_chunk must be"):
        fm.apply_tasks(fmodel, fmodel.params, batch[0], task_chunk=bad)


def test_tune_task_chunk_times_every_candidate_and_returns_the_times(monkeypatch):
    """Each candidate is passed as the calls' task_chunk (nothing is set on the model), and
    the fastest, passed on, gives the loop's results."""
    net, support, query = make("conv1d")
    fmodel = fm.functional_model(net)
    seen, passes = [], []
    adapt_tasks, task_losses = tune_module.adapt_tasks, tune_module.task_losses

    def spy(fmodel, *args, **kwargs):
        seen.append(kwargs["task_chunk"])
        result = adapt_tasks(fmodel, *args, **kwargs)
        assert result.chunk.chunk == kwargs["task_chunk"]
        return result

    def spy_pass(fmodel, *args, **kwargs):
        passes.append(kwargs["task_chunk"])
        return task_losses(fmodel, *args, **kwargs)

    monkeypatch.setattr(tune_module, "adapt_tasks", spy)
    monkeypatch.setattr(tune_module, "task_losses", spy_pass)
    opt = fm.optim.sgd(lr=0.1)
    times = fm.tune_task_chunk(
        fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1, repeats=2
    )
    assert sorted(times) == [1, 3]  # the grid task_chunk="tune" measures: 1, 4, ... below T, and T
    assert all(isinstance(ms, float) and ms > 0 for ms in times.values())
    assert seen == [1, 3, 3, 1, 1, 3]  # a warm-up round, then the repeats, rotated
    # each query pass follows its inner loop's chunk
    assert [p.chunk for p in passes] == seen
    assert fmodel.task_chunk_choices == {}  # pinned calls: nothing chosen on the model
    assert not hasattr(fmodel, "task_chunk")
    best = min(times, key=times.get)
    assert_same(
        run(net, support, query, tasks=True, task_chunk=best),
        run(net, support, query, tasks=False),
    )
    seen.clear()
    again = fm.tune_task_chunk(
        fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1, candidates=[2], repeats=1
    )
    assert list(again) == [2] and seen == [2, 2]


def test_tune_task_chunk_checks_its_arguments():
    net, support, _ = make("conv1d")
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.1)
    with pytest.raises(ValueError, match="candidates"):
        fm.tune_task_chunk(
            fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1, candidates=[0]
        )
    with pytest.raises(ValueError, match="repeats"):
        fm.tune_task_chunk(fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1, repeats=0)
    with pytest.raises(TypeError, match="unknown"):
        fm.tune_task_chunk(fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1, bogus=1)
    assert fmodel.task_chunk_choices == {}


@pytest.mark.parametrize("kind", ["parametrization", "old weight_norm"])
def test_weight_normalised_convolutions_run_as_they_are(kind):
    """A parametrized convolution is a subclass (no stand-in); the old ``weight_norm`` is a
    forward pre-hook (the stand-in runs the layer as it is). Both equal the loop."""
    net, support, query = make("conv2d")
    if kind == "parametrization":
        nn.utils.parametrizations.weight_norm(net[4])
    else:
        nn.utils.weight_norm(net[4])
    reference = run(net, support, query, tasks=False)
    ours = run(net, support, query, tasks=True)
    assert_same(ours, reference)


def test_tune_task_chunk_takes_the_meta_loss_on_the_query(monkeypatch):
    net, support, query = make("conv1d")
    fmodel = fm.functional_model(net)
    scored = []
    task_losses = tune_module.task_losses

    def spy(fmodel, params, loss_fn, batch, **kwargs):
        scored.append(batch[0])
        return task_losses(fmodel, params, loss_fn, batch, **kwargs)

    monkeypatch.setattr(tune_module, "task_losses", spy)
    opt = fm.optim.sgd(lr=0.1)
    fm.tune_task_chunk(
        fmodel, fmodel.params, F.cross_entropy, support, opt, steps=1, query=query, repeats=1
    )
    assert len(scored) == 2 * 2 and all(x is query[0] for x in scored)


@pytest.mark.parametrize("name", ["groupnorm", "instancenorm"])
def test_a_non_finite_task_leaves_the_others_alone(name, fast_calls):
    """NaN and inf in one task's input: the tasks share one normalisation call, but each
    group's and channel's statistics are one task's, so the others' outputs are those of
    the layer per task, and finite."""
    net, _, (xq, _) = make(name)
    fmodel = fm.functional_model(net)
    params = per_task(fmodel.params, T, 11, 0.3)
    x = xq.clone()
    x[1, 0, 0, 0] = float("nan")
    x[2, 3, 1, 2] = float("inf")
    out = fm.apply_tasks(fmodel, params, x)[0]
    assert fast_calls
    for t in range(T):
        own = fmodel({k: v[t] for k, v in params.items()}, x[t])
        torch.testing.assert_close(out[t], own, rtol=1e-12, atol=1e-13, equal_nan=True)
    assert bool(out[0].isfinite().all()) and not bool(out[1].isfinite().all())
