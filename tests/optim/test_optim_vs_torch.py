"""Every optimizer gives the numbers of its torch.optim namesake, step for step (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import batches, detached, mlp, trajectory

import funcmeta as fm

STEPS = 25


def sgd_cases():
    for momentum, dampening, nesterov, wd in itertools.product(
        (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.01)
    ):
        if nesterov and (momentum == 0 or dampening != 0):
            continue
        yield dict(
            lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd
        )


def adam_cases(decay: tuple[float, ...]):
    for betas, wd, amsgrad in itertools.product(((0.9, 0.999), (0.8, 0.95)), decay, (False, True)):
        yield dict(lr=0.01, betas=betas, eps=1e-8, weight_decay=wd, amsgrad=amsgrad)


def rmsprop_cases():
    for alpha, momentum, centered, wd in itertools.product(
        (0.99, 0.9), (0.0, 0.8), (False, True), (0.0, 0.02)
    ):
        yield dict(
            lr=0.005, alpha=alpha, eps=1e-8, momentum=momentum, centered=centered, weight_decay=wd
        )


def adagrad_cases():
    for lr_decay, wd, init in itertools.product((0.0, 0.01), (0.0, 0.02), (0.0, 0.1)):
        yield dict(
            lr=0.05, lr_decay=lr_decay, weight_decay=wd, initial_accumulator_value=init, eps=1e-10
        )


CASES = (
    [("sgd", torch.optim.SGD, fm.optim.sgd, kw) for kw in sgd_cases()]
    + [("adam", torch.optim.Adam, fm.optim.adam, kw) for kw in adam_cases((0.0, 0.05))]
    + [("adamw", torch.optim.AdamW, fm.optim.adamw, kw) for kw in adam_cases((0.0, 0.05))]
    + [("rmsprop", torch.optim.RMSprop, fm.optim.rmsprop, kw) for kw in rmsprop_cases()]
    + [("adagrad", torch.optim.Adagrad, fm.optim.adagrad, kw) for kw in adagrad_cases()]
)


def torch_trajectory(torch_cls, kwargs, data):
    model = mlp()
    opt = torch_cls(model.parameters(), **kwargs)
    out = []
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out


def our_trajectory(make, kwargs, data, wrap=lambda kw, params: kw):
    fmodel = fm.functional_model(mlp())
    return trajectory(fmodel, make(**wrap(kwargs, detached(fmodel.params))), data)


def assert_same(ours, theirs):
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-12, msg=f"step {step} {k}")


def case_id(case):
    name, _, _, kw = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in kw.items() if k != "lr")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_torch_optim(case):
    _, torch_cls, make, kwargs = case
    data = batches(STEPS)
    assert_same(our_trajectory(make, kwargs, data), torch_trajectory(torch_cls, kwargs, data))


def as_tensors(kwargs, params):
    """Every hyperparameter as a 0-d tensor requiring grad (betas element-wise)."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, bool):
            out[k] = v
        elif isinstance(v, tuple):
            out[k] = tuple(torch.tensor(b, dtype=torch.float64, requires_grad=True) for b in v)
        else:
            out[k] = torch.tensor(v, dtype=torch.float64, requires_grad=True)
    return out


def as_per_tensor_trees(kwargs, params):
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, bool):
            out[k] = v
        elif isinstance(v, tuple):
            out[k] = tuple({n: torch.tensor(b, dtype=torch.float64) for n in params} for b in v)
        else:
            out[k] = {n: torch.tensor(v, dtype=torch.float64) for n in params}
    return out


def as_per_element_trees(kwargs, params):
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, bool):
            out[k] = v
        elif isinstance(v, tuple):
            out[k] = tuple({n: torch.full_like(p, b) for n, p in params.items()} for b in v)
        else:
            out[k] = {n: torch.full_like(p, v) for n, p in params.items()}
    return out


TENSOR_CASES = [
    (
        "sgd",
        torch.optim.SGD,
        fm.optim.sgd,
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    ),
    (
        "sgd",
        torch.optim.SGD,
        fm.optim.sgd,
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    (
        "adam",
        torch.optim.Adam,
        fm.optim.adam,
        dict(lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.05, amsgrad=True),
    ),
    (
        "adamw",
        torch.optim.AdamW,
        fm.optim.adamw,
        dict(lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.05),
    ),
    (
        "rmsprop",
        torch.optim.RMSprop,
        fm.optim.rmsprop,
        dict(lr=0.005, alpha=0.9, eps=1e-8, momentum=0.8, centered=True, weight_decay=0.02),
    ),
    (
        "adagrad",
        torch.optim.Adagrad,
        fm.optim.adagrad,
        dict(lr=0.05, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-10),
    ),
]


@pytest.mark.parametrize("wrap", [as_tensors, as_per_tensor_trees, as_per_element_trees])
@pytest.mark.parametrize("case", TENSOR_CASES, ids=case_id)
def test_tensor_hyperparameters_match_torch_optim(case, wrap):
    _, torch_cls, make, kwargs = case
    data = batches(STEPS)
    assert_same(our_trajectory(make, kwargs, data, wrap), torch_trajectory(torch_cls, kwargs, data))


def test_invalid_nesterov_raises_like_torch():
    with pytest.raises(ValueError, match="Nesterov"):
        fm.optim.sgd(lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="Nesterov"):
        fm.optim.sgd(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (fm.optim.sgd, dict(lr=-0.1), "learning rate"),
        (fm.optim.adam, dict(betas=(1.0, 0.999)), "beta1"),
        (fm.optim.adam, dict(betas=(0.9, -0.1)), "beta2"),
        (fm.optim.adamw, dict(eps=-1.0), "eps"),
        (fm.optim.rmsprop, dict(alpha=1.5), "alpha"),
        (fm.optim.adagrad, dict(lr_decay=-1.0), "lr_decay"),
        (fm.optim.sgd, dict(momentum=-0.5), "momentum"),
    ],
)
def test_out_of_range_numbers_raise(make, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)
