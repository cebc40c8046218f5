"""Recipe results are frozen dataclasses, no longer tuples: unpacking or indexing one fails
with a pointer to the fields (and, for an index, the field it used to be)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm


@pytest.fixture(scope="module")
def maml_result():
    torch.manual_seed(0)
    fmodel = fm.functional_model(nn.Linear(2, 1))
    support = (torch.randn(3, 4, 2), torch.randn(3, 4, 1))
    query = (torch.randn(3, 4, 2), torch.randn(3, 4, 1))
    return fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=0.1)


def test_unpacking_a_result_names_its_fields(maml_result):
    with pytest.raises(
        TypeError,
        match=r"no longer a tuple and cannot be unpacked: name its "
        r"fields, out\.loss, out\.query_loss, out\.adapted, out\.logits \(CHANGELOG",
    ):
        _loss, _query_loss, _adapted = maml_result  # the tuple code of before
    with pytest.raises(TypeError, match="cannot be unpacked"):
        list(maml_result)


@pytest.mark.parametrize(
    ("index", "field"), [(0, "loss"), (1, "query_loss"), (6, "logits"), (-1, "logits")]
)
def test_indexing_a_result_says_what_the_index_was(maml_result, index, field):
    with pytest.raises(
        TypeError, match=rf"cannot be indexed \(out\[{index}\] was {field}: write out\.{field}\)"
    ):
        maml_result[index]


def test_a_subclass_names_its_own_fields_too():
    out = fm.recipes.MamlppResult(torch.tensor(1.0), None, None, step_buffers=[])
    with pytest.raises(TypeError, match=r"out\.logits, out\.step_buffers \(CHANGELOG"):
        _, _ = out
    with pytest.raises(TypeError, match=r"cannot be indexed: name its fields"):
        out["loss"]
    assert out.loss == 1.0 and out.step_buffers == []  # the fields themselves still read
