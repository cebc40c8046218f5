"""The renamed public names still work for one release: each warns once with its new name
and gives the same object (or the same result) as the new name."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import funcmeta as fm


@pytest.mark.parametrize(
    ("old", "new", "attribute", "says"),
    [
        ("funcmeta.checkpoint", "funcmeta.remat.layers", "select", "funcmeta.remat"),
        ("funcmeta.tune", "funcmeta.batching.tune", "tune_task_chunk", "batching.tune"),
        ("funcmeta.kernels", "funcmeta.remat.kernels", "twice_differentiable", "remat.kernels"),
        ("funcmeta.replay", "funcmeta.remat.replay", "recomputing", "remat.replay"),
        ("funcmeta.optim.hparams", "funcmeta.optim.values", "per_leaf", "optim.values"),
    ],
)
def test_a_moved_module_warns_and_is_the_new_one(old, new, attribute, says):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=says):
        module = importlib.import_module(old)
    assert getattr(module, attribute) is getattr(importlib.import_module(new), attribute)


@pytest.mark.parametrize("old", ["checkpoint", "tune", "kernels", "replay"])
def test_a_moved_module_is_reached_from_the_package(old):
    sys.modules.pop(f"funcmeta.{old}", None)
    vars(fm).pop(old, None)
    with pytest.warns(DeprecationWarning):
        assert getattr(fm, old).__name__ == f"funcmeta.{old}"


@pytest.mark.parametrize(
    ("owner", "old", "new"),
    [
        (fm.remat, "POLICIES", "PRESETS"),
        (fm.optim, "trace", "momentum_trace"),
        (fm.tree, "map", "tree_map"),
    ],
)
def test_a_renamed_name_warns_and_is_the_new_one(owner, old, new):
    with pytest.warns(DeprecationWarning, match=new):
        value = getattr(owner, old)
    assert value is getattr(owner, new)


@pytest.mark.parametrize("owner", [fm.remat, fm.optim, fm.tree])
def test_an_unknown_name_is_still_an_attribute_error(owner):
    with pytest.raises(AttributeError, match="no_such_name"):
        owner.no_such_name  # noqa: B018


def test_functional_model_apply_warns_and_runs():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fmodel = fm.functional_model(net)
    x = torch.randn(5, 3)
    with pytest.warns(DeprecationWarning, match="FunctionalModel.run"):
        old_out, old_buffers = fmodel.apply(fmodel.params, fmodel.buffers, x)
    new_out, new_buffers = fmodel.run(fmodel.params, fmodel.buffers, x)
    torch.testing.assert_close(old_out, new_out, rtol=0, atol=0)
    for k, v in new_buffers.items():
        torch.testing.assert_close(old_buffers[k], v, rtol=0, atol=0)
