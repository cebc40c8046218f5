"""Learnable hyperparameter trees: kinds, parameterisations, per-step values, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, mlp
from torch import nn

import funcmeta as fm


@pytest.fixture
def params():
    return fm.functional_model(mlp()).params


@pytest.mark.parametrize("parameterization", ["raw", "softplus", "exp"])
@pytest.mark.parametrize("init", [0.01, 0.5, 3.0, 40.0])
def test_init_is_the_value(params, parameterization, init):
    for hyper in (
        fm.hyper.scalar(init, parameterization=parameterization, dtype=DTYPE),
        fm.hyper.per_layer(params, init, parameterization=parameterization),
        fm.hyper.per_tensor(params, init, parameterization=parameterization),
        fm.hyper.per_element(params, init, parameterization=parameterization),
    ):
        for value in fm.tree.leaves(hyper()):
            torch.testing.assert_close(value, torch.full_like(value, init), rtol=1e-12, atol=0)


def test_shapes_and_groups(params):
    assert fm.hyper.scalar(0.1)().shape == ()
    per_layer = fm.hyper.per_layer(params, 0.1)
    assert per_layer.groups == ["0", "2", "4"]
    assert sum(p.numel() for p in per_layer.parameters()) == 3
    values = per_layer()
    assert values.keys() == params.keys() and all(v.shape == () for v in values.values())
    per_tensor = fm.hyper.per_tensor(params, 0.1)
    assert sum(p.numel() for p in per_tensor.parameters()) == len(params)
    per_element = fm.hyper.per_element(params, 0.1)
    assert {k: v.shape for k, v in per_element().items()} == {k: v.shape for k, v in params.items()}
    assert sum(p.numel() for p in per_element.parameters()) == sum(
        p.numel() for p in params.values()
    )


def test_per_layer_shares_one_value_within_a_layer(params):
    lrs = fm.hyper.per_layer(params, 0.1)
    with torch.no_grad():
        lrs.raw.copy_(torch.tensor([1.0, 2.0, 3.0]))
    values = lrs()
    assert values["0.weight"].item() == values["0.bias"].item() == 1.0
    assert values["4.weight"].item() == 3.0


def test_positive_parameterisations_stay_positive(params):
    for parameterization in ("softplus", "exp"):
        lrs = fm.hyper.per_element(params, 0.1, parameterization=parameterization)
        with torch.no_grad():
            for r in lrs.raw:
                r.fill_(-50.0)
        assert all((v > 0).all() for v in lrs().values())
    with pytest.raises(ValueError, match="positive init"):
        fm.hyper.scalar(0.0, parameterization="softplus")
    with pytest.raises(ValueError, match="parameterization"):
        fm.hyper.scalar(0.1, parameterization="sigmoid")


def test_per_step_values_and_errors(params):
    lrs = fm.hyper.per_tensor(params, 0.1, steps=3)
    assert lrs.raw.shape == (3, len(params))
    with torch.no_grad():
        lrs.raw[2].fill_(0.7)
    assert lrs(2)["0.bias"].item() == pytest.approx(0.7)
    assert lrs(0)["0.bias"].item() == pytest.approx(0.1)
    with pytest.raises(IndexError, match="step 3 is out of range"):
        lrs(3)
    with pytest.raises(ValueError, match="pass the step"):
        lrs()
    with pytest.raises(
        ValueError, match=r"steps \(None, or the number of per-step values\) must be an int >= 1"
    ):
        fm.hyper.scalar(0.1, steps=0)
    element = fm.hyper.per_element(params, 0.1, steps=2)
    assert element(1)["0.weight"].shape == params["0.weight"].shape


def test_gradients_reach_the_raw_parameters(params):
    fmodel = fm.functional_model(mlp())
    lrs = fm.hyper.per_layer(fmodel.params, 0.05, steps=2, parameterization="softplus")
    x, y = torch.randn(6, 3, dtype=DTYPE), torch.randn(6, 2, dtype=DTYPE)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=lrs), steps=2)
    F.mse_loss(fmodel(result.params, x), y).backward()
    assert lrs.raw.grad is not None and lrs.raw.grad.shape == (2, 3)
    assert torch.all(lrs.raw.grad != 0)


def test_inverse_softplus_is_exact_for_large_values():
    lr = fm.hyper.scalar(40.0, parameterization="softplus", dtype=DTYPE)
    assert math.isfinite(lr.raw.item())
    torch.testing.assert_close(lr(), torch.tensor(40.0, dtype=DTYPE))


def test_groups_are_addressable_by_name_and_in_module_order():
    """Rates are kept in the tree's (sorted) path order; ports that index learn2learn's
    MetaSGD.lrs by position get the module order by name."""
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    fmodel = fm.functional_model(net)
    rates = fm.hyper.per_element(fmodel.params, 0.5)
    assert rates.groups == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert rates.in_module_order(net) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    with torch.no_grad():
        rates.raw_for("2.weight").fill_(0.25)
    assert torch.equal(rates()["2.weight"], torch.full((1, 3), 0.25))
    layers = fm.hyper.per_layer(fmodel.params, 0.1, steps=2, parameterization="softplus")
    assert layers.in_module_order(net) == ["0", "2"]
    torch.testing.assert_close(layers.value_for("2", step=1), torch.tensor(0.1))
    with pytest.raises(KeyError, match=r"no group '1'.*\['0', '2'\]"):
        layers.raw_for("1")
