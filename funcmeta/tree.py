"""Pytree helpers for parameter and hyperparameter trees, on optree: map, flatten, paths,
prefix broadcast, and partition/combine by a filter (an ANIL-style split of the parameters).

Parameter trees are usually the flat ``dict[str, Tensor]`` of
:func:`funcmeta.functional_model`, but every helper accepts any optree pytree. ``None`` is an
empty subtree, never a leaf. Paths are the path entries joined by ``"."``.

Example:
    >>> import torch, funcmeta as fm
    >>> params = {"body.weight": torch.ones(2, 2), "head.weight": torch.ones(1, 2)}
    >>> head, body = fm.tree.partition(params, ["head"])
    >>> sorted(k for k, v in head.items() if v is not None)
    ['head.weight']
    >>> fm.tree.combine(head, body).keys() == params.keys()
    True
"""

from funcmeta._src.core.tree import Filter as Filter
from funcmeta._src.core.tree import Predicate as Predicate
from funcmeta._src.core.tree import PyTreeSpec as PyTreeSpec
from funcmeta._src.core.tree import Tree as Tree
from funcmeta._src.core.tree import TreeMismatchError as TreeMismatchError
from funcmeta._src.core.tree import broadcast_prefix as broadcast_prefix
from funcmeta._src.core.tree import combine as combine
from funcmeta._src.core.tree import flatten as flatten
from funcmeta._src.core.tree import flatten_with_paths as flatten_with_paths
from funcmeta._src.core.tree import leaves as leaves
from funcmeta._src.core.tree import partition as partition
from funcmeta._src.core.tree import path_str as path_str
from funcmeta._src.core.tree import paths as paths
from funcmeta._src.core.tree import structure as structure
from funcmeta._src.core.tree import tree_map as tree_map
from funcmeta._src.core.tree import unflatten as unflatten

__all__ = [
    "Filter",
    "Predicate",
    "PyTreeSpec",
    "Tree",
    "TreeMismatchError",
    "broadcast_prefix",
    "combine",
    "flatten",
    "flatten_with_paths",
    "leaves",
    "partition",
    "path_str",
    "paths",
    "structure",
    "tree_map",
    "unflatten",
]
