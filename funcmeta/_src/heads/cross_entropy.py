"""A language model's loss from its last hidden states and its linear head, without a whole
logit tensor on any rank where the head computes on its shards."""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.core.checks import check_choice
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.sharding import is_sharded
from funcmeta._src.distributed.loss import cross_entropy_on_shards
from funcmeta._src.distributed.parallel import on_shards
from funcmeta._src.module.shadow import Standin

__all__ = ["linear_cross_entropy"]

Reduction = Literal["mean", "sum", "none"]


@exposed_in("funcmeta.heads")
def linear_cross_entropy(
    hidden: Tensor,
    head: nn.Linear,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> Tensor:
    """``F.cross_entropy`` of ``head(hidden)``'s logits against ``targets``, at every position.

    ``hidden`` is ``(..., in_features)`` (a decoder's last hidden states), ``head`` the
    ``nn.Linear`` onto the vocabulary, ``targets`` ``(...)`` integer ids (the next tokens),
    ``ignore_index`` a target that counts for nothing. ``reduction`` is ``F.cross_entropy``'s:
    ``"mean"`` over the targets not ignored, ``"sum"``, or ``"none"`` (one loss a position,
    0 where ignored). Returns what ``F.cross_entropy(head(hidden).flatten(0, -2),
    targets.flatten(), ...)`` returns, reshaped to ``targets``' shape for ``"none"``.

    Where ``head`` computes on its shards (``fm.distributed.shard_model(...,
    compute_on_shards=[head's name])``), each rank computes its columns of the logits and
    the ranks combine per-token sums (vocabulary-parallel: one all-gather and two
    all-reduces of ``(tokens,)`` values): no rank makes a whole ``tokens x vocabulary``
    tensor, in the forward or in the backward, and the second-order meta-gradients are
    exact (docs/distributed.md, "Layers computed on their shards"). Anywhere else (one
    process, ``gather_params``, a head gathered whole) it is ``F.cross_entropy`` of the
    head's own forward (checkpointed where ``checkpoint_layers`` names the head; on its
    shards the loss saves only its input, the shard and the targets, and recomputes the
    columns in its backward). Call it inside the model's ``forward`` (the head's
    parameters are then the ones ``functional_call`` passes in).

    Raises ``TypeError`` for a head that is no ``nn.Linear`` or targets that are no integer
    tensor, ``ValueError`` for shapes that do not match, and ``IndexError`` for a target
    outside the head's rows that is not ``ignore_index``.

    Example:
        >>> import torch, torch.nn.functional as F, funcmeta as fm
        >>> head = torch.nn.Linear(8, 50)
        >>> hidden, ids = torch.randn(2, 5, 8), torch.randint(0, 50, (2, 5))
        >>> loss = fm.heads.linear_cross_entropy(hidden, head, ids)
        >>> torch.allclose(loss, F.cross_entropy(head(hidden).flatten(0, 1), ids.flatten()))
        True
    """
    layer: nn.Module = head
    while isinstance(layer, Standin):  # a layer checkpointed or batched over tasks
        layer = layer.original
    if not isinstance(layer, nn.Linear):
        raise TypeError(
            f"head must be the nn.Linear onto the vocabulary, got {type(layer).__name__}"
        )
    if not (isinstance(hidden, Tensor) and hidden.is_floating_point() and hidden.dim() >= 1):
        kind = type(hidden).__name__ if not isinstance(hidden, Tensor) else hidden.dtype
        raise TypeError(f"hidden must be a floating-point tensor (..., in_features), got {kind}")
    if hidden.shape[-1] != layer.in_features:
        raise ValueError(
            f"hidden's last axis must be the head's in_features ({layer.in_features}), "
            f"got hidden {tuple(hidden.shape)}"
        )
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.is_complex():
        got = targets.dtype if isinstance(targets, Tensor) else type(targets).__name__
        raise TypeError(f"targets must be an integer tensor of ids, got {got}")
    if targets.dtype == torch.bool or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must be integer ids of shape {tuple(hidden.shape[:-1])} (hidden's "
            f"without its last axis), got {targets.dtype} {tuple(targets.shape)}"
        )
    check_choice(reduction, "reduction", ("mean", "sum", "none"))
    ids = targets.reshape(-1).long()
    found = on_shards(layer)
    if found is None or not is_sharded(layer.weight):
        logits = head(hidden).reshape(-1, layer.out_features)
        out = F.cross_entropy(logits, ids, ignore_index=ignore_index, reduction=reduction)
        return out.reshape(targets.shape) if reduction == "none" else out
    runtime, what = found
    _check_targets(ids, layer.out_features, ignore_index)
    rows = hidden.reshape(-1, layer.in_features)
    losses = cross_entropy_on_shards(runtime, what, layer, rows, ids, ignore_index)
    if reduction == "none":
        return losses.reshape(targets.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (ids != ignore_index).sum().to(total.dtype)


def _check_targets(ids: Tensor, rows: int, ignore_index: int) -> None:
    """An ``IndexError`` for the first target outside ``[0, rows)`` that is not ignored (on
    its shards no rank would hold it, and its logit would read as 0)."""
    bad = (ids != ignore_index) & ((ids < 0) | (ids >= rows))
    if bool(bad.any()):
        first = int(cast(Any, ids[bad][0]))
        raise IndexError(
            f"target {first} is out of range for a head of {rows} rows (and is not "
            f"ignore_index={ignore_index})"
        )
