"""The CUDA paths, each run on the CPU too (CI has no GPU): adapt gives the CPU
meta-gradients (float64), second and first order, Adam with per-element learnable rates; the
non-finite check, the GradScaler's skipped step, the motivating example and exact float32
through conv4. What needs CUDA itself (the example's device memory) is asserted only there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICES, DTYPE, batches, mlp

import funcmeta as fm


def meta_gradients(device, first_order):
    net = mlp().to(device)
    fmodel = fm.functional_model(net)
    lrs = fm.hyper.per_element(fmodel.params, 0.05, parameterization="softplus")
    (xs, ys), (xq, yq) = ((x.to(device), y.to(device)) for x, y in batches(2))
    opt = fm.optim.adam(lr=lrs)
    result = fm.adapt(
        fmodel,
        fmodel.params,
        F.mse_loss,
        (xs, ys),
        opt,
        steps=3,
        first_order=first_order,
        clip_grad_norm=1.0,
    )
    loss = F.mse_loss(fmodel(result.params, xq), yq)
    return [g.cpu() for g in torch.autograd.grad(loss, [*net.parameters(), *lrs.parameters()])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("first_order", [False, True])
def test_device_matches_cpu(first_order, device):
    cpu = meta_gradients("cpu", first_order)
    gpu = meta_gradients(device, first_order)
    for a, b in zip(cpu, gpu, strict=True):
        assert a.dtype == DTYPE
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_check(device):
    fmodel = fm.functional_model(mlp().to(device))
    x, y = (t.to(device) for t in batches(1)[0])
    x[0, 0] = float("nan")
    with pytest.raises(fm.NonFiniteError, match="inner step 0"):
        fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (x, y),
            fm.optim.sgd(lr=0.1),
            steps=2,
            loss_scale=128.0,
        )


# --- the motivating scenario on CUDA: self-checkpointing, GradScaler, the example ----------


@pytest.mark.parametrize("device", DEVICES)
def test_inner_overflow_is_a_skipped_step_for_the_devices_scaler(device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    net = net.to(device)
    fmodel = fm.functional_model(net)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**40)
    outer = torch.optim.SGD(net.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = torch.randn(16, 3, device=device), torch.randn(16, 2, device=device)
    with torch.autocast(device, dtype=torch.float16):
        r = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (x, y),
            fm.optim.sgd(lr=0.1),
            steps=3,
            loss_scale=scaler,
        )
        query = F.mse_loss(fmodel(r.params, x).float(), y)
    assert r.overflowed
    scaler.scale(query).backward()
    scaler.step(outer)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**39


@pytest.mark.parametrize("device", DEVICES)
def test_checkpointed_maml_example_on_the_device(capsys, device):
    """The example in fp16 + GradScaler (the CUDA default; GradScaler("cpu") on a CPU) at a
    small width: it trains, and the model's own checkpoints give the unchecked model's fp32
    meta-gradients; on CUDA they keep less peak GPU memory."""
    from test_example import load

    example = load("checkpointed_maml")
    # fp16 matrix products are slow on a CPU: a smaller model there
    width, rows, modules = ("256", "1024", "8") if device == "cuda" else ("32", "64", "4")
    args = example.parser().parse_args(
        [
            "--device",
            device,
            "--precision",
            "fp16",
            "--width",
            width,
            "--rows",
            rows,
            "--modules",
            modules,
            "--iterations",
            "6",
            "--repeats",
            "1",
        ]
    )
    history = example.train(args)
    assert len(history["loss"]) == 6
    args.precision = "fp32"
    results = example.measure(args)
    example.report(results)
    plain, ours = results["unchecked"], results["checkpointed"]
    if device == "cuda":  # device memory: CUDA-only
        assert ours["peak"] < 0.6 * plain["peak"]
    a, b = torch.tensor(plain["grad"]), torch.tensor(ours["grad"])
    assert float((a - b).norm() / a.norm()) < 1e-5


# --- TF32 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_exact_float32_makes_second_order_conv_repeatable(device):
    """conv4-like second-order MAML in float32 on cuDNN: inside exact_float32 the per-task
    loop agrees with the float64 meta-gradients to 1e-3 and the task-batched
    (grouped-convolution) path to 1e-2 (with TF32 an H200 gave 3% and 10% on conv4). On a
    CPU the same code runs on the CPU's kernels."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 5),
    ).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 1, 8, 8, generator=g).to(device)
    y = torch.arange(5).repeat(4, 1).to(device)

    def grads(model, batched):
        fmodel = fm.functional_model(model)
        opt = fm.optim.sgd(lr=0.4)
        xs = x.to(next(model.parameters()).dtype)
        if batched:
            r = fm.adapt_tasks(
                fmodel, fmodel.params, F.cross_entropy, (xs, y), opt, steps=3, task_chunk=None
            )
            loss = fm.task_losses(fmodel, r.params, F.cross_entropy, (xs, y), task_chunk=None)
            loss = loss[0].mean()
        else:
            loss = 0
            for t in range(4):
                r = fm.adapt(fmodel, fmodel.params, F.cross_entropy, (xs[t], y[t]), opt, steps=3)
                loss = loss + F.cross_entropy(fmodel(r.params, xs[t]), y[t]) / 4
        return torch.cat(
            [g.double().flatten() for g in torch.autograd.grad(loss, list(fmodel.params.values()))]
        )

    import copy

    exact = grads(copy.deepcopy(net).double(), batched=False)
    with fm.exact_float32():
        for batched, bound in ((False, 1e-3), (True, 1e-2)):
            ours = grads(net, batched)
            assert float((ours - exact).norm() / exact.norm()) < bound
