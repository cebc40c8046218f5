"""Meta-gradients w.r.t. every optimizer hyperparameter, in every shape, against finite
differences (torch.autograd.gradcheck, float64); and finiteness of double backward when a
gradient entry is exactly zero."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, batches, mlp

import funcmeta as fm

# Base values, chosen away from kinks; every listed name is checked as a learnable tensor.
OPTIMIZERS = {
    "sgd": (fm.optim.sgd, dict(lr=0.1, momentum=0.7, dampening=0.2, weight_decay=0.05)),
    "sgd-nesterov": (fm.optim.sgd, dict(lr=0.1, momentum=0.7, weight_decay=0.05, nesterov=True)),
    "adam": (fm.optim.adam, dict(lr=0.05, b1=0.85, b2=0.95, eps=1e-3, weight_decay=0.05)),
    "adam-amsgrad": (fm.optim.adam, dict(lr=0.05, b1=0.85, b2=0.95, eps=1e-3, amsgrad=True)),
    "adamw": (fm.optim.adamw, dict(lr=0.05, b1=0.85, b2=0.95, eps=1e-3, weight_decay=0.05)),
    "rmsprop": (
        fm.optim.rmsprop,
        dict(lr=0.01, alpha=0.9, eps=1e-3, weight_decay=0.05, momentum=0.6, centered=True),
    ),
    "adagrad": (
        fm.optim.adagrad,
        dict(lr=0.1, lr_decay=0.05, weight_decay=0.05, initial_accumulator_value=0.2, eps=1e-3),
    ),
}

SHAPES = ("scalar", "per_tensor", "per_element")


def hyper_cases():
    for opt_name, (_, kwargs) in OPTIMIZERS.items():
        for name, value in kwargs.items():
            if isinstance(value, bool):
                continue
            for shape in SHAPES:
                yield opt_name, name, shape


def build(make, kwargs, learn_name, learn_value):
    kw = {k: v for k, v in kwargs.items() if k not in ("b1", "b2")}
    b1, b2 = kwargs.get("b1"), kwargs.get("b2")
    if learn_name == "b1":
        b1 = learn_value
    elif learn_name == "b2":
        b2 = learn_value
    else:
        kw[learn_name] = learn_value
    if b1 is not None:
        kw["betas"] = (b1, b2)
    return make(**kw)


@pytest.mark.parametrize("opt_name, name, shape", list(hyper_cases()))
def test_hyperparameter_gradient_matches_finite_differences(opt_name, name, shape):
    make, kwargs = OPTIMIZERS[opt_name]
    fmodel = fm.functional_model(mlp((2, 3, 1)))
    params = {k: v.detach() for k, v in fmodel.params.items()}
    (xs, ys), (xq, yq) = batches(2, inputs=2, outputs=1, size=6)
    base = kwargs[name]
    keys = list(params)
    if shape == "scalar":
        inputs = (torch.tensor(base, dtype=DTYPE, requires_grad=True),)
    elif shape == "per_tensor":
        inputs = tuple(
            torch.tensor(base * (1 - 0.05 * i), dtype=DTYPE, requires_grad=True)
            for i in range(len(keys))
        )
    else:
        g = torch.Generator().manual_seed(3)
        inputs = tuple(
            (
                base * (1 - 0.1 * torch.rand(params[k].shape, generator=g, dtype=DTYPE))
            ).requires_grad_()
            for k in keys
        )

    def meta_loss(*leaves):
        value = leaves[0] if shape == "scalar" else dict(zip(keys, leaves, strict=True))
        opt = build(make, kwargs, name, value)
        result = fm.adapt(fmodel, params, F.mse_loss, (xs, ys), opt, steps=3)
        return F.mse_loss(fmodel(result.params, xq), yq)

    assert torch.autograd.gradcheck(meta_loss, inputs, eps=1e-6, atol=1e-7, rtol=1e-4)


ZERO_GRAD_OPTIMIZERS = {
    "adam": fm.optim.adam(lr=0.05),
    "adam-amsgrad": fm.optim.adam(lr=0.05, amsgrad=True),
    "adamw": fm.optim.adamw(lr=0.05),
    "rmsprop": fm.optim.rmsprop(lr=0.01),
    "rmsprop-centered": fm.optim.rmsprop(lr=0.01, centered=True, momentum=0.5),
    "adagrad": fm.optim.adagrad(lr=0.1),
}


@pytest.mark.parametrize("opt_name", list(ZERO_GRAD_OPTIMIZERS))
def test_double_backward_finite_when_a_gradient_entry_is_zero(opt_name):
    """Input feature 0 is always zero, so column 0 of the first weight has exactly zero
    gradients: sqrt of a zero second moment must not turn the meta-gradient into NaN."""
    fmodel = fm.functional_model(mlp((3, 4, 1)))
    (xs, ys), (xq, yq) = batches(2, inputs=3, outputs=1)
    xs = xs.clone()
    xs[:, 0] = 0
    opt = ZERO_GRAD_OPTIMIZERS[opt_name]
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=3)
    loss = F.mse_loss(fmodel(result.params, xq), yq)
    grads = torch.autograd.grad(loss, list(fmodel.params.values()))
    assert all(torch.isfinite(g).all() for g in grads)


def test_plain_sqrt_would_give_nan_in_that_setting():
    """The setting above really hits the hazard: a hand-written Adam step with torch.sqrt
    yields NaN meta-gradients there."""
    fmodel = fm.functional_model(mlp((3, 4, 1)))
    (xs, ys), (xq, yq) = batches(2, inputs=3, outputs=1)
    xs = xs.clone()
    xs[:, 0] = 0
    params = fmodel.params
    loss = F.mse_loss(fmodel(params, xs), ys)
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
    new = {}
    for (k, p), g in zip(params.items(), grads, strict=True):
        v = 0.001 * g * g / 0.001
        new[k] = p - 0.05 * (g / (torch.sqrt(v) + 1e-8))
    out = torch.autograd.grad(F.mse_loss(fmodel(new, xq), yq), list(params.values()))
    assert any(torch.isnan(g).any() for g in out)
