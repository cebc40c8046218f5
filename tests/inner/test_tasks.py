"""Task batching: adapt_tasks equals a Python loop over the tasks (float64, to round-off)
for an MLP, the conv4 network with BatchNorm and a transformer block, with SGD and Adam,
with and without checkpointing; and the features of adapt, per task."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICES
from torch import nn

import funcmeta as fm

DTYPE = torch.float64
T = 3


# --- models ----------------------------------------------------------------------------


def mlp():
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def conv4(ways=5, channels=64):
    def block(cin):
        return nn.Sequential(
            nn.Conv2d(cin, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )

    return nn.Sequential(
        block(1),
        block(channels),
        block(channels),
        block(channels),
        nn.Flatten(),
        nn.Linear(channels, ways),
    )


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        n, s, d = x.shape
        q, k, v = self.qkv(x).reshape(n, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(n, s, d))


class Block(nn.Module):
    def __init__(self, dim=16, heads=2, hidden=32):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, dim=16, classes=3):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.Sequential(Block(dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


def sinusoid_tasks(shots=10):
    b = fm.data.Sinusoid().sample(
        T, shots, shots, generator=torch.Generator().manual_seed(0), dtype=DTYPE
    )
    return (b.x_support, b.y_support), (b.x_query, b.y_query), F.mse_loss


def image_tasks(ways=5):
    g = torch.Generator().manual_seed(0)
    xs, xq = (torch.randn(T, ways, 1, 28, 28, generator=g, dtype=DTYPE) for _ in range(2))
    ys = torch.arange(ways).repeat(T, 1)
    return (xs, ys), (xq, ys.clone()), F.cross_entropy


def sequence_tasks():
    g = torch.Generator().manual_seed(0)
    xs, xq = (torch.randn(T, 6, 5, 4, generator=g, dtype=DTYPE) for _ in range(2))
    ys, yq = (torch.randint(0, 3, (T, 6), generator=g) for _ in range(2))
    return (xs, ys), (xq, yq), F.cross_entropy


MODELS = {
    "mlp": (mlp, sinusoid_tasks),
    "conv4": (conv4, image_tasks),
    "transformer": (Transformer, sequence_tasks),
}


def make(model_name, seed=0):
    build, data = MODELS[model_name]
    torch.manual_seed(seed)
    return build().to(DTYPE), *data()


def optimizer(name, rates):
    # Adam with eps 1e-4: the conv biases in front of BatchNorm have exactly-zero true
    # gradients (round-off, ~1e-17), and Adam's step m / (sqrt(v) + eps) has derivative
    # ~1/eps there, which amplifies round-off by 1/eps. With eps 1e-8 the batched and loop
    # conv4 meta-gradients (|g| ~ 3e3) differ by 1.2e-8 relative; with 1e-4, by 4e-12.
    if name == "sgd":
        return fm.optim.sgd(lr=rates, momentum=0.5)
    return fm.optim.adam(lr=rates, eps=1e-4)


# --- reference and batched runs --------------------------------------------------------


def loop(net, support, query, loss_fn, opt_name, steps=2, checkpoint=None, **kwargs):
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint)
    rates = fm.hyper.per_layer(fmodel.params, 0.05, parameterization="softplus")
    opt = optimizer(opt_name, rates)
    losses, buffers = [], []
    for t in range(T):
        s = (support[0][t], support[1][t])
        result = fm.adapt(fmodel, fmodel.params, loss_fn, s, opt, steps=steps, **kwargs)
        out, bufs = fmodel.run(result.params, result.buffers, query[0][t])
        losses.append(loss_fn(out, query[1][t]))
        buffers.append(bufs)
    outer = torch.stack(losses).mean()
    inputs = [*net.parameters(), *rates.parameters()]
    grads = torch.autograd.grad(outer, inputs)
    stacked = {k: torch.stack([b[k] for b in buffers]) for k in fmodel.buffers}
    return outer.detach(), grads, stacked


def batched(net, support, query, loss_fn, opt_name, steps=2, checkpoint=None, **kwargs):
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint)
    rates = fm.hyper.per_layer(fmodel.params, 0.05, parameterization="softplus")
    opt = optimizer(opt_name, rates)
    result = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, opt, steps=steps, **kwargs)
    assert result.losses.shape == (steps, T)
    out, buffers = fm.apply_tasks(fmodel, result.params, query[0], buffers=result.buffers)
    per_task = torch.stack([loss_fn(out[t], query[1][t]) for t in range(T)])
    outer = per_task.mean()
    inputs = [*net.parameters(), *rates.parameters()]
    return outer.detach(), torch.autograd.grad(outer, inputs), buffers


def assert_same(a, b, rtol=1e-9, atol=1e-11):
    """Equal to round-off: element-wise rtol, and an atol that scales with each tensor's
    largest entry (an entry near zero in a tensor of magnitude 50 carries 50x the rounding)."""
    (la, ga, ba), (lb, gb, bb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    assert all(g.abs().sum() > 0 for g in gb[-1:])  # the rates receive gradients
    for x, y in zip(ga, gb, strict=True):
        scale = float(y.abs().max())
        torch.testing.assert_close(x, y, rtol=rtol, atol=max(atol, 1e-10 * scale))
    assert ba.keys() == bb.keys()
    for k in ba:
        torch.testing.assert_close(ba[k], bb[k], rtol=rtol, atol=atol)


CHECKPOINTS = {
    "none": {},
    "per-layer": dict(checkpoint="sequential"),
    "per-step": dict(checkpoint_steps=True),
    "both": dict(checkpoint="sequential", checkpoint_steps=True),
}


@pytest.mark.parametrize("ck", list(CHECKPOINTS))
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_batched_equals_loop(model_name, opt_name, ck):
    net, support, query, loss_fn = make(model_name)
    reference = loop(net, support, query, loss_fn, opt_name)
    ours = batched(net, support, query, loss_fn, opt_name, **CHECKPOINTS[ck])
    assert_same(ours, reference)
    for p in net.parameters():
        assert p.grad is None  # nothing was accumulated into the module


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(first_order=True),
        dict(trainable=["4"]),
        dict(clip_grad_norm=0.3),
        dict(truncate=1),
        dict(loss_scale=64.0),
        dict(offload_activations=True),
    ],
    ids=["first-order", "anil", "clip", "truncate", "loss-scale", "offload"],
)
def test_features_per_task(kwargs):
    net, support, query, loss_fn = make("mlp")
    reference = loop(net, support, query, loss_fn, "adam", **kwargs)
    ours = batched(net, support, query, loss_fn, "adam", **kwargs)
    assert_same(ours, reference)


def test_clipping_is_per_task():
    """One task with huge targets: clipping by a norm across tasks would shrink the others'
    steps; clipping per task leaves them as in the loop."""
    net, (xs, ys), query, loss_fn = make("mlp")
    ys = ys.clone()
    ys[0] *= 1000
    reference = loop(net, (xs, ys), query, loss_fn, "sgd", clip_grad_norm=1.0)
    ours = batched(net, (xs, ys), query, loss_fn, "sgd", clip_grad_norm=1.0)
    assert_same(ours, reference)


def test_per_task_initial_parameters_and_rates():
    net, support, query, loss_fn = make("mlp")
    fmodel = fm.functional_model(net)
    g = torch.Generator().manual_seed(5)
    init = {
        k: v.detach() + 0.01 * torch.randn(T, *v.shape, generator=g, dtype=DTYPE)
        for k, v in fmodel.params.items()
    }
    init = {k: v.requires_grad_() for k, v in init.items()}
    rates = {
        k: (0.01 * (1 + torch.arange(T, dtype=DTYPE))).reshape(T, *([1] * v.dim())).requires_grad_()
        for k, v in fmodel.params.items()
    }
    opt = fm.optim.sgd(lr=rates)
    result = fm.adapt_tasks(fmodel, init, loss_fn, support, opt, steps=2)
    out, _ = fm.apply_tasks(fmodel, result.params, query[0])
    outer = torch.stack([loss_fn(out[t], query[1][t]) for t in range(T)]).sum()
    ours = torch.autograd.grad(outer, [*init.values(), *rates.values()])
    # loop: task t starts from init[..][t] with rate rates[..][t]
    p0 = {k: v for k, v in init.items()}
    total = 0
    for t in range(T):
        params = {k: v[t] for k, v in p0.items()}
        lr_t = {k: v[t] for k, v in rates.items()}
        r = fm.adapt(
            fmodel, params, loss_fn, (support[0][t], support[1][t]), fm.optim.sgd(lr=lr_t), steps=2
        )
        total = total + loss_fn(fmodel(r.params, query[0][t]), query[1][t])
    ref = torch.autograd.grad(total, [*init.values(), *rates.values()])
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_autocast_bf16_batching_adds_no_error_beyond_bf16():
    """bf16 rounds batched matmuls differently from per-task ones, so equality is not the
    test. Against the fp32 loop, the batched bf16 meta-gradient is no further off than the
    bf16 loop's."""
    torch.manual_seed(0)
    net = mlp()
    (xs, ys), (xq, yq), _ = sinusoid_tasks()
    support, query = (xs.float(), ys.float()), (xq.float(), yq.float())

    def loss_fn(o, y):
        return F.mse_loss(o.float(), y)

    exact = loop(net, support, query, loss_fn, "sgd")[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = batched(net, support, query, loss_fn, "sgd")[1]
        looped = loop(net, support, query, loss_fn, "sgd")[1]

    def error(grads):
        num = sum(float((a - b).pow(2).sum()) for a, b in zip(grads, exact, strict=True))
        return math.sqrt(num / sum(float(b.pow(2).sum()) for b in exact))

    assert all(torch.isfinite(g).all() for g in ours)
    assert error(ours) < 0.1
    assert error(ours) < 2 * error(looped) + 1e-3


def test_nonfinite_names_the_tasks_and_skip_is_refused():
    net, (xs, ys), _, loss_fn = make("mlp")
    fmodel = fm.functional_model(net)
    bad = xs.clone()
    bad[1, 0, 0] = float("nan")
    with pytest.raises(fm.NonFiniteError, match=r"inner step 0: non-finite loss in tasks \[1\]"):
        fm.adapt_tasks(
            fmodel,
            fmodel.params,
            loss_fn,
            (bad, ys),
            fm.optim.sgd(lr=0.1),
            steps=1,
            on_nonfinite="raise",
        )
    with pytest.raises(ValueError, match=r"skip.*not available with task batching"):
        fm.adapt_tasks(
            fmodel,
            fmodel.params,
            loss_fn,
            (xs, ys),
            fm.optim.sgd(lr=0.1),
            steps=1,
            on_nonfinite="skip",
        )


def test_shape_errors_name_the_task_axis():
    net, (xs, ys), _, loss_fn = make("mlp")
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.1)
    with pytest.raises(ValueError, match=r"expected 3 tasks.*'1': \(2, 10, 1\)"):
        fm.adapt_tasks(fmodel, fmodel.params, loss_fn, (xs, ys[:2]), opt, steps=1)
    wrong = {**fmodel.params, "0.bias": torch.zeros(5, 40, dtype=DTYPE)}
    with pytest.raises(
        ValueError, match=r"params\['0\.bias'\] has shape \(5, 40\); expected \(40,\).*\(3, 40\)"
    ):
        fm.adapt_tasks(fmodel, wrong, loss_fn, (xs, ys), opt, steps=1)
    with pytest.raises(ValueError, match="scalars"):
        fm.apply_tasks(fmodel, fmodel.params, torch.tensor(1.0, dtype=DTYPE))


def test_module_unchanged_and_batchnorm_buffers_per_task():
    net, support, _query, loss_fn = make("conv4")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fmodel = fm.functional_model(net)
    result = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, fm.optim.sgd(lr=0.1), steps=2)
    assert result.buffers["0.1.running_mean"].shape == (T, 64)
    assert torch.equal(result.buffers["0.1.num_batches_tracked"], torch.full((T,), 2))
    means = result.buffers["0.1.running_mean"]
    assert not torch.allclose(means[0], means[1])  # each task its own statistics
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ck", list(CHECKPOINTS))
def test_batched_equals_loop_on_the_device(ck, device):
    torch.manual_seed(0)
    net = conv4(channels=16).to(DTYPE).to(device)
    (xs, ys), (xq, yq), loss_fn = image_tasks()
    support, query = (xs.to(device), ys.to(device)), (xq.to(device), yq.to(device))
    reference = loop(net, support, query, loss_fn, "adam")
    ours = batched(net, support, query, loss_fn, "adam", **CHECKPOINTS[ck])
    assert_same(ours, reference, rtol=1e-8, atol=1e-10)


def test_the_torch_func_vmap_fallback_gives_the_same_results(monkeypatch):
    """Without functorch's batching primitives, task batching runs on torch.func.vmap."""
    import funcmeta._src.core.vmap as functorch_glue

    monkeypatch.setattr(functorch_glue, "USE_PRIMITIVES", False)
    net, support, query, loss_fn = make("mlp")
    reference = loop(net, support, query, loss_fn, "adam")
    ours = batched(net, support, query, loss_fn, "adam", checkpoint="sequential")
    assert_same(ours, reference)


@pytest.mark.parametrize("first_order", [False, True])
def test_under_no_grad_for_evaluation(first_order):
    net, support, _, loss_fn = make("mlp")
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.05)
    with torch.no_grad():
        evaluated = fm.adapt_tasks(
            fmodel, fmodel.params, loss_fn, support, opt, steps=2, first_order=first_order
        )
    trained = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, opt, steps=2)
    for k, v in trained.params.items():
        assert not evaluated.params[k].requires_grad
        torch.testing.assert_close(evaluated.params[k], v.detach(), rtol=1e-12, atol=1e-14)


def test_task_losses_return_the_outputs_of_the_same_forward():
    net, support, query, loss_fn = make("conv4")
    fmodel = fm.functional_model(net)
    adapted = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, fm.optim.sgd(lr=0.1), steps=1)
    result = fm.task_losses(fmodel, adapted.params, loss_fn, query, buffers=adapted.buffers)
    # one result type, with or without the outputs
    assert isinstance(result, fm.TaskLosses) and result.outputs is None
    plain, plain_buffers = result.losses, result.buffers
    with_outputs = fm.task_losses(
        fmodel, adapted.params, loss_fn, query, buffers=adapted.buffers, return_outputs=True
    )
    assert isinstance(with_outputs, fm.TaskLosses)
    losses, new_buffers, outputs = with_outputs
    expected, _ = fm.apply_tasks(fmodel, adapted.params, query[0], buffers=adapted.buffers)
    torch.testing.assert_close(outputs, expected, rtol=0, atol=0)
    torch.testing.assert_close(losses, plain, rtol=0, atol=0)
    per_task = torch.stack([loss_fn(outputs[t], query[1][t]) for t in range(T)])
    torch.testing.assert_close(losses, per_task)
    for k, v in plain_buffers.items():
        torch.testing.assert_close(new_buffers[k], v, rtol=0, atol=0)
    # the outputs carry the graph back to the initial parameters
    (grad,) = torch.autograd.grad(outputs.sum(), [fmodel.params["0.0.weight"]])
    assert grad.abs().sum() > 0
    with pytest.raises(TypeError, match="return_outputs must be True or False"):
        fm.task_losses(fmodel, fmodel.params, loss_fn, query, return_outputs=1)
