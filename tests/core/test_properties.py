"""Property-based tests over random tree shapes: the pytree helpers and the optimizers."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcmeta as fm

SHAPES = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


def leaf():
    return SHAPES.map(lambda s: torch.randn(s, dtype=torch.float64))


KEYS = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
TREES = st.recursive(
    leaf(),
    lambda children: st.one_of(
        st.dictionaries(KEYS, children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple),
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(TREES, st.data())
def test_partition_then_combine_is_the_identity(tree, data):
    paths = fm.tree.paths(tree)
    chosen = set(data.draw(st.lists(st.sampled_from(paths), unique=True)))
    selected, rest = fm.tree.partition(tree, lambda path, x: path in chosen)
    assert sorted(fm.tree.paths(selected)) == sorted(chosen)
    assert sorted(fm.tree.paths(rest)) == sorted(set(paths) - chosen)
    merged = fm.tree.combine(selected, rest)
    assert all(a is b for a, b in zip(fm.tree.leaves(merged), fm.tree.leaves(tree), strict=True))
    assert fm.tree.paths(merged) == paths


def prefix_of(tree, draw, depth=0):
    """A prefix of ``tree``: some subtrees replaced by a number (their own marker)."""
    if isinstance(tree, torch.Tensor) or draw(st.booleans()):
        return float(draw(st.integers(0, 1000)))
    if isinstance(tree, dict):
        return {k: prefix_of(v, draw, depth + 1) for k, v in tree.items()}
    children = [prefix_of(v, draw, depth + 1) for v in tree]
    return tuple(children) if isinstance(tree, tuple) else children


@settings(max_examples=60, deadline=None)
@given(TREES, st.data())
def test_broadcast_prefix_gives_each_leaf_its_covering_value(tree, data):
    prefix = prefix_of(tree, data.draw)
    values = fm.tree.broadcast_prefix(prefix, tree)
    prefix_paths = dict(zip(fm.tree.paths(prefix), fm.tree.leaves(prefix), strict=True))
    for path, value in zip(fm.tree.paths(tree), values, strict=True):
        covering = [p for p in prefix_paths if p == "" or path == p or path.startswith(p + ".")]
        assert len(covering) == 1 and prefix_paths[covering[0]] == value


OPTIMIZERS = {
    "sgd": (fm.optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adam": (fm.optim.adam, torch.optim.Adam, dict(lr=0.05, betas=(0.8, 0.9), amsgrad=True)),
    "adamw": (fm.optim.adamw, torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
    "rmsprop": (fm.optim.rmsprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    "adagrad": (fm.optim.adagrad, torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
}


@settings(max_examples=40, deadline=None)
@given(TREES, st.sampled_from(sorted(OPTIMIZERS)), st.integers(0, 2**31 - 1))
def test_optimizers_on_any_tree_match_torch_optim_on_its_leaves(tree, name, seed):
    ours_make, torch_cls, kwargs = OPTIMIZERS[name]
    g = torch.Generator().manual_seed(seed)
    grads = [
        [torch.randn(x.shape, generator=g, dtype=x.dtype) for x in fm.tree.leaves(tree)]
        for _ in range(4)
    ]
    opt = ours_make(**kwargs)
    params, state = tree, opt.init(tree)
    spec = fm.tree.flatten(tree)[1]
    for step in grads:
        updates, state = opt.update(fm.tree.unflatten(spec, step), state, params)
        params = fm.apply_updates(params, updates)
    leaves = [torch.nn.Parameter(x.clone()) for x in fm.tree.leaves(tree)]
    reference = torch_cls(leaves, **kwargs)
    for step in grads:
        for p, gr in zip(leaves, step, strict=True):
            p.grad = gr.clone()
        reference.step()
    for a, b in zip(fm.tree.leaves(params), leaves, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-12)
