"""Differentiable global-norm gradient clipping (``torch.nn.utils.clip_grad_norm_``).

Example:
    >>> import torch, funcmeta as fm
    >>> grads = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    >>> clip = fm.optim.clip_by_global_norm(1.0)
    >>> clipped, _ = clip.update(grads, clip.init(grads))
    >>> round(fm.optim.global_norm(clipped).item(), 4)
    1.0
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_max_norm
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.optim.base import GradientTransformation, safe_sqrt

__all__ = ["ClipState", "clip_by_global_norm", "clip_grads_by_global_norm", "global_norm"]


@exposed_in("funcmeta.optim")
def global_norm(grads: Tree, *, task_axis: bool = False) -> Tensor:
    """The 2-norm of all leaves together; its derivatives stay finite when all are zero.

    With ``task_axis``, every leaf has a leading task axis and the result is one norm per
    task, shape ``(T,)``.
    """
    g = tree.leaves(grads)
    if not g:
        raise ValueError("global_norm of a tree with no tensors")
    if task_axis:
        total = torch.stack([x.pow(2).flatten(1).sum(1) for x in g]).sum(0)
    else:
        total = torch.stack([x.pow(2).sum() for x in g]).sum()
    return safe_sqrt(total)


def clip_grads_by_global_norm(
    grads: Tree, max_norm: float | Tensor, *, task_axis: bool = False
) -> Tree:
    """Scale ``grads`` by ``min(1, max_norm / (global_norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does; differentiable in ``grads`` and ``max_norm``.

    With ``task_axis``, every leaf has a leading task axis and each task is clipped by its
    own norm.
    """
    coef = torch.clamp(max_norm / (global_norm(grads, task_axis=task_axis) + 1e-6), max=1.0)
    if not task_axis:
        return tree.tree_map(lambda x: x * coef, grads)
    return tree.tree_map(lambda x: x * coef.reshape(-1, *([1] * (x.dim() - 1))), grads)


@exposed_in("funcmeta.optim")
class ClipState(NamedTuple):
    """:func:`clip_by_global_norm` keeps no state."""


@exposed_in("funcmeta.optim")
def clip_by_global_norm(max_norm: float | Tensor) -> GradientTransformation:
    """Clip the updates to a global 2-norm of at most ``max_norm`` (number or 0-d tensor).

    In the inner loop of :func:`funcmeta.adapt_tasks` (updates with a task axis) its
    ``update_tasks`` clips each task by its own norm, as in the per-task loop.
    """
    check_max_norm(max_norm)

    def init(params: Tree) -> ClipState:
        return ClipState()

    def update(updates: Tree, state: ClipState, params: Tree | None = None) -> tuple[Tree, Any]:
        return clip_grads_by_global_norm(updates, max_norm), state

    def update_tasks(
        updates: Tree, state: ClipState, params: Tree | None = None
    ) -> tuple[Tree, Any]:
        return clip_grads_by_global_norm(updates, max_norm, task_axis=True), state

    return GradientTransformation(init, update, update_tasks)
