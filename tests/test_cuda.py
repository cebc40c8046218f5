"""On CUDA, adapt gives the CPU meta-gradients (float64), second and first order, Adam
with per-element learnable rates; skipped where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, batches, mlp

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


@pytest.mark.cuda
@pytest.mark.parametrize("first_order", [False, True])
def test_cuda_matches_cpu(first_order):
    cpu = meta_gradients("cpu", first_order)
    gpu = meta_gradients("cuda", first_order)
    for a, b in zip(cpu, gpu, strict=True):
        assert a.dtype == DTYPE
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.cuda
def test_nonfinite_check_on_cuda():
    fmodel = fm.functional_model(mlp().cuda())
    x, y = (t.cuda() for t in batches(1)[0])
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
