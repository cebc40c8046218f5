"""The one tree API of funcmeta, on optree: parameter and hyperparameter trees (map, flatten,
prefix broadcast, partition/combine by a filter), and the outputs and arguments of models,
whose registered node types (HuggingFace ``ModelOutput``, torch's own) are walked through
torch's pytree registry.

Parameter trees are usually the flat ``dict[str, Tensor]`` of
:func:`funcmeta.functional_model`, but every helper accepts any optree pytree (nested dicts,
lists, tuples, NamedTuples). ``None`` is an empty subtree, never a leaf: :func:`partition`
uses it as the placeholder for leaves that were not selected.

The ``*_registered`` functions walk a model's outputs and arguments with every node type
registered with torch's pytree registry (``torch.utils._pytree.register_pytree_node``, as
HuggingFace registers ``ModelOutput``), which plain optree walks would treat as leaves.

Paths are strings: the path entries joined by ``"."`` (``"0.weight"`` for the flat dict key
``"0.weight"``, ``"head.1"`` for ``{"head": [a, b]}``'s second leaf).

Example:
    >>> import torch
    >>> from funcmeta._src.core import tree
    >>> params = {"body.weight": torch.ones(2, 2), "head.weight": torch.ones(1, 2)}
    >>> head, body = tree.partition(params, ["head"])
    >>> sorted(k for k, v in head.items() if v is not None)
    ['head.weight']
    >>> tree.combine(head, body).keys() == params.keys()
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optree
from torch import Tensor as _Tensor
from torch.nn import Parameter as _Parameter

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import compiling, torch_pytree

__all__ = [
    "Filter",
    "Predicate",
    "PyTreeSpec",
    "Tree",
    "TreeMismatchError",
    "broadcast_prefix",
    "combine",
    "flatten",
    "flatten_registered",
    "flatten_with_paths",
    "leaves",
    "leaves_registered",
    "partition",
    "path_str",
    "paths",
    "structure",
    "tree_map",
    "unflatten",
    "unflatten_registered",
]

Tree = Any
PyTreeSpec = optree.PyTreeSpec
"""Any optree pytree whose leaves are tensors (or numbers, for hyperparameters)."""

Predicate = Callable[[str, Any], bool]
"""The one shape of every predicate in funcmeta: ``(name, value) -> bool``, where ``name``
is the dotted name (a parameter's path for ``trainable=``, a submodule's name for
``checkpoint_layers=``) and ``value`` the object under it (the tensor, the module)."""

Filter = Predicate | str | Iterable[str]
"""Which leaves to select. A :data:`Predicate` ``(name, leaf) -> bool``, a name prefix (``"head"``
selects ``"head"`` and everything under ``"head."``), or several."""


@exposed_in("funcmeta.tree")
class TreeMismatchError(ValueError):
    """A tree does not fit the structure it must match; the message names the paths."""


@exposed_in("funcmeta.tree")
def path_str(path: Sequence[Any]) -> str:
    """Join optree path entries into the dotted path string used in messages and filters."""
    return ".".join(str(entry) for entry in path)


def _plain_tensor(node: Any) -> bool:
    """A ``torch.Tensor`` or ``nn.Parameter`` itself (never an optree node type)."""
    return type(node) is _Tensor or type(node) is _Parameter


def _leaf_hint() -> Callable[[Any], bool] | None:
    """optree's ``is_leaf`` for a tree dynamo traces: a plain tensor is a leaf without its
    registry lookup, which dynamo traces per node (the same leaves and structure, since a
    tensor is no registered node); ``None`` eagerly, where optree's C++ walk is faster."""
    return _plain_tensor if compiling() else None


@exposed_in("funcmeta.tree")
def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree, none_is_leaf: bool = False) -> Tree:
    """Apply ``fn`` to every leaf of ``tree`` (and the matching leaves of ``rest``); with
    ``none_is_leaf``, ``None`` is a leaf too."""
    return optree.tree_map(fn, tree, *rest, is_leaf=_leaf_hint(), none_is_leaf=none_is_leaf)


@exposed_in("funcmeta.tree")
def leaves(tree: Tree, *, none_is_leaf: bool = False) -> list[Any]:
    """The leaves of ``tree`` in optree's canonical order (dict keys sorted)."""
    return optree.tree_leaves(tree, is_leaf=_leaf_hint(), none_is_leaf=none_is_leaf)


@exposed_in("funcmeta.tree")
def flatten(tree: Tree, *, none_is_leaf: bool = False) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, spec)``; rebuild with :func:`unflatten`."""
    return optree.tree_flatten(tree, is_leaf=_leaf_hint(), none_is_leaf=none_is_leaf)


@exposed_in("funcmeta.tree")
def unflatten(spec: optree.PyTreeSpec, leaf_list: Iterable[Any]) -> Tree:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, list(leaf_list))


@exposed_in("funcmeta.tree")
def structure(tree: Tree, *, none_is_leaf: bool = False) -> optree.PyTreeSpec:
    """The structure of ``tree`` (comparable with ``==``)."""
    return optree.tree_structure(tree, is_leaf=_leaf_hint(), none_is_leaf=none_is_leaf)


@exposed_in("funcmeta.tree")
def flatten_with_paths(tree: Tree) -> tuple[list[str], list[Any]]:
    """``(paths, leaves)``: each leaf with its dotted path."""
    path_list, leaf_list, _ = optree.tree_flatten_with_path(tree)
    return [path_str(p) for p in path_list], leaf_list


def flatten_registered(tree: Tree) -> tuple[list[Any], Any]:
    """``(leaves, spec)`` of a model's outputs or arguments, registered node types opened;
    rebuild with :func:`unflatten_registered`."""
    return torch_pytree.tree_flatten(tree)


def unflatten_registered(leaf_list: Iterable[Any], spec: Any) -> Tree:
    """Inverse of :func:`flatten_registered`."""
    return torch_pytree.tree_unflatten(list(leaf_list), spec)


def leaves_registered(tree: Tree) -> list[Any]:
    """The leaves of a model's outputs or arguments, registered node types opened."""
    return torch_pytree.tree_leaves(tree)


@exposed_in("funcmeta.tree")
def paths(tree: Tree) -> list[str]:
    """Dotted paths of the leaves of ``tree``, aligned with :func:`leaves`."""
    return spec_paths(optree.tree_structure(tree))


_PATHS_CACHE: dict[optree.PyTreeSpec, tuple[str, ...]] = {}


def spec_paths(spec: optree.PyTreeSpec) -> list[str]:
    """Dotted paths of the leaves of a tree with structure ``spec`` (worked out once per
    structure; a graph ``torch.compile`` traces works them out, as it keeps no cache)."""
    if compiling():
        return [path_str(p) for p in spec.paths()]
    found = _PATHS_CACHE.get(spec)
    if found is None:
        found = tuple(path_str(p) for p in spec.paths())
        if len(_PATHS_CACHE) > 4096:
            _PATHS_CACHE.clear()
        _PATHS_CACHE[spec] = found
    return list(found)


def _is_container(node: Any) -> bool:
    return node is not None and not optree.treespec_is_leaf(optree.tree_structure(node))


def _child(node: Any, entry: Any) -> tuple[bool, Any]:
    """``(found, child)`` for one path entry of a container node."""
    try:
        return True, node[entry]
    except (KeyError, IndexError, TypeError):
        return False, None


_PREFIX_CACHE: dict[tuple[optree.PyTreeSpec, optree.PyTreeSpec], tuple[int, ...]] = {}


def _prefix_index(prefix: Tree, full: Tree, name: str) -> tuple[int, ...]:
    """For each leaf of ``full``, the index of the ``prefix`` leaf that covers it."""
    prefix_paths = optree.tree_paths(prefix)
    full_paths = optree.tree_paths(full)
    # Every prefix leaf must sit at a node that exists in ``full`` (a ``None`` placeholder
    # counts): an entry for a parameter that is not there is a typo, not a no-op.
    extra = []
    for ppath in prefix_paths:
        node = full
        for entry in ppath:
            found, node = _child(node, entry) if _is_container(node) else (False, None)
            if not found:
                extra.append(path_str(ppath))
                break
    if extra:
        raise TreeMismatchError(f"{name} has entries at paths that the parameters lack: {extra}")
    where = {tuple(p): i for i, p in enumerate(prefix_paths)}
    index, missing = [], []
    for fpath in full_paths:
        for cut in range(len(fpath) + 1):
            i = where.get(tuple(fpath[:cut]))
            if i is not None:
                index.append(i)
                break
        else:
            missing.append(path_str(fpath))
    if missing:
        raise TreeMismatchError(f"{name} gives no value for the parameters at paths {missing}")
    return tuple(index)


@exposed_in("funcmeta.tree")
def broadcast_prefix(prefix: Tree, full: Tree, *, name: str = "value") -> list[Any]:
    """Leaves of ``prefix`` repeated to line up with ``leaves(full)``.

    ``prefix`` is a tree whose structure is a prefix of ``full``'s: a single leaf covers the
    whole tree (a scalar learning rate), a dict keyed like ``full`` gives one value per
    entry (per tensor), the full structure gives one value per leaf (per element). Entries
    for subtrees that are ``None`` in ``full`` (parameters left out by :func:`partition`)
    are allowed and ignored. Raises :class:`TreeMismatchError` naming the paths that have
    no value or that do not exist in ``full``.

    Example:
        >>> broadcast_prefix({"a": 1.0, "b": 2.0}, {"a": [0, 0], "b": 0})
        [1.0, 1.0, 2.0]
    """
    prefix_leaves, prefix_spec = optree.tree_flatten(prefix)
    if compiling():
        return [prefix_leaves[i] for i in _prefix_index(prefix, full, name)]
    full_spec = optree.tree_structure(full)
    key = (prefix_spec, full_spec)
    index = _PREFIX_CACHE.get(key)
    if index is None:
        index = _prefix_index(prefix, full, name)
        if len(_PREFIX_CACHE) > 4096:
            _PREFIX_CACHE.clear()
        _PREFIX_CACHE[key] = index
    return [prefix_leaves[i] for i in index]


def _selector(where: Filter) -> Callable[[str, Any], bool]:
    if callable(where):
        return where
    names = [where] if isinstance(where, str) else list(where)
    if not all(isinstance(n, str) for n in names):
        raise TypeError("a filter is a predicate (name, leaf) -> bool, a name prefix or several")

    def select(path: str, _leaf: Any) -> bool:
        return any(path == n or path.startswith(n + ".") for n in names)

    select.names = names  # type: ignore[attr-defined]
    return select


@exposed_in("funcmeta.tree")
def partition(tree: Tree, where: Filter) -> tuple[Tree, Tree]:
    """Split ``tree`` into ``(selected, rest)``, each with ``None`` where the other has a leaf.

    ``where`` is a predicate ``(name, leaf) -> bool``, or name prefixes: ``"head"`` selects
    ``"head"`` itself and everything under ``"head."``. A prefix that selects nothing raises
    ``ValueError`` naming it.
    """
    select = _selector(where)
    path_list, leaf_list, spec = optree.tree_flatten_with_path(tree)
    strings = [path_str(p) for p in path_list]
    chosen = [bool(select(s, x)) for s, x in zip(strings, leaf_list, strict=True)]
    names = getattr(select, "names", None)
    if names is not None:
        unmatched = [n for n in names if not any(s == n or s.startswith(n + ".") for s in strings)]
        if unmatched:
            raise ValueError(f"filter names match no parameter: {unmatched}; paths are {strings}")
    selected = [x if c else None for x, c in zip(leaf_list, chosen, strict=True)]
    rest = [None if c else x for x, c in zip(leaf_list, chosen, strict=True)]
    return optree.tree_unflatten(spec, selected), optree.tree_unflatten(spec, rest)


@exposed_in("funcmeta.tree")
def combine(*trees: Tree) -> Tree:
    """Merge trees of one structure, taking at each leaf the first that is not ``None``."""

    def first(*xs: Any) -> Any:
        for x in xs:
            if x is not None:
                return x
        return None

    return optree.tree_map(first, *trees, none_is_leaf=True)
