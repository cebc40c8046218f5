"""Pytree helpers: partition/combine, prefix broadcasting and its errors, paths."""

from __future__ import annotations

import pytest
import torch
from helpers import GRAPH_TORCH

from funcmeta import tree


def params():
    return {
        "body.0.weight": torch.ones(3, 2),
        "body.0.bias": torch.ones(3),
        "head.weight": torch.ones(1, 3),
        "head.bias": torch.ones(1),
    }


def test_partition_combine_roundtrip_by_prefix():
    p = params()
    head, body = tree.partition(p, "head")
    assert {k for k, v in head.items() if v is not None} == {"head.weight", "head.bias"}
    assert {k for k, v in body.items() if v is not None} == {"body.0.weight", "body.0.bias"}
    merged = tree.combine(head, body)
    assert merged.keys() == p.keys()
    assert all(merged[k] is p[k] for k in p)


def test_partition_by_predicate_and_unmatched_names():
    p = params()
    biases, _ = tree.partition(p, lambda path, x: path.endswith("bias"))
    assert {k for k, v in biases.items() if v is not None} == {"body.0.bias", "head.bias"}
    with pytest.raises(ValueError, match=r"\['haed'\]"):
        tree.partition(p, ["head", "haed"])
    # a prefix must end at a path boundary: "hea" is not "head"
    with pytest.raises(ValueError, match="hea"):
        tree.partition(p, "hea")


def test_broadcast_prefix_scalar_per_tensor_nested():
    p = params()
    assert tree.broadcast_prefix(0.1, p) == [0.1] * 4
    per = {k: float(i) for i, k in enumerate(p)}
    assert tree.broadcast_prefix(per, p) == [per[k] for k in sorted(p)]
    nested = {"a": [torch.zeros(1), torch.zeros(2)], "b": torch.zeros(3)}
    assert tree.broadcast_prefix({"a": 1.0, "b": 2.0}, nested) == [1.0, 1.0, 2.0]
    assert tree.broadcast_prefix({"a": [1.0, 3.0], "b": 2.0}, nested) == [1.0, 3.0, 2.0]


def test_broadcast_prefix_errors_name_paths():
    p = params()
    missing = {k: 1.0 for k in p if k != "head.bias"}
    with pytest.raises(tree.TreeMismatchError, match=r"lr gives no value .*'head\.bias'"):
        tree.broadcast_prefix(missing, p, name="lr")
    extra = {**{k: 1.0 for k in p}, "head.wieght": 1.0}
    with pytest.raises(tree.TreeMismatchError, match=r"lr has entries .*'head\.wieght'"):
        tree.broadcast_prefix(extra, p, name="lr")
    with pytest.raises(tree.TreeMismatchError, match=r"'a\.0\.x'"):
        tree.broadcast_prefix({"a": [{"x": 1.0}, 2.0]}, {"a": [torch.zeros(1), torch.zeros(1)]})


def test_broadcast_prefix_ignores_entries_for_left_out_parameters():
    head, _ = tree.partition(params(), "head")
    full_lr = {k: 0.5 for k in params()}
    assert tree.broadcast_prefix(full_lr, head) == [0.5, 0.5]
    head_only = {"head.weight": 1.0, "head.bias": 2.0}
    assert tree.broadcast_prefix(head_only, head) == [2.0, 1.0]


def test_paths_and_flatten():
    nested = {"a": [torch.zeros(1), torch.zeros(2)], "b": torch.zeros(3)}
    assert tree.paths(nested) == ["a.0", "a.1", "b"]
    leaves, spec = tree.flatten(nested)
    assert tree.unflatten(spec, leaves)["b"] is nested["b"]


@GRAPH_TORCH
def test_a_traced_tree_walk_gives_the_eager_leaves_and_structure() -> None:
    """While dynamo traces, funcmeta's tree functions tell optree that a plain tensor is a
    leaf (skipping a registry lookup per node): the same leaves, in the same order, and the
    same rebuilt trees as eagerly, on a tree of tensors, Parameters, numbers, None and a
    tensor subclass."""
    import torch

    from funcmeta._src.core import tree as t

    class Marked(torch.Tensor):
        pass

    def walk(a: torch.Tensor, b: torch.Tensor) -> tuple:
        mixed = {"z": a, "a": [b, 2.0, None], "m": (a * 2, {"q": b})}
        leaves, spec = t.flatten(mixed)
        with_none, _ = t.flatten(mixed, none_is_leaf=True)
        doubled = t.tree_map(lambda x: x * 2, mixed)
        rebuilt = t.unflatten(spec, [x + 1 if isinstance(x, torch.Tensor) else x for x in leaves])
        return (
            leaves,
            len(with_none),
            t.leaves(doubled),
            t.leaves(rebuilt),
            t.structure(mixed).num_leaves,
        )

    a = torch.nn.Parameter(torch.arange(3.0))
    b = torch.ones(2).as_subclass(Marked)
    eager = walk(a, b)
    traced = torch.compile(walk, backend="eager", fullgraph=True)(a, b)
    assert [type(x) for x in traced[0]] == [type(x) for x in eager[0]]
    assert traced[1] == eager[1] == 6 and traced[4] == eager[4] == 5
    got_all, want_all = traced[0] + traced[2] + traced[3], eager[0] + eager[2] + eager[3]
    for got, want in zip(got_all, want_all, strict=True):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got == want
