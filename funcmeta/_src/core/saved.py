"""A tensor that funcmeta's saved-tensor hooks keep as it is, checked for in-place writes.

autograd checks each tensor it saved for backward: one changed in place after the save (a
model's forward that does ``out = layer(h); h.mul_(3)``) raises at the backward, since the
backward would read the new values. Where saved-tensor hooks are in force, torch leaves
that check to the hooks. funcmeta's hooks keep some tensors as they are (a checkpointed
layer's recomputation, a sharded model's tensors too small to split); they go through
:func:`keep` and :func:`kept`, which make the same check and raise the same error, so a
checkpointed or sharded model refuses what the plain run refuses, never computing with the
changed values. (Hooks that copy a tensor, a slice kept for a sharded model or
``save_on_cpu``, keep the values of the save: the gradient of what ran.)

Example:
    >>> import torch
    >>> from funcmeta._src.core.saved import keep, kept
    >>> h = torch.ones(2)
    >>> k = keep(h)
    >>> kept(k) is h
    True
    >>> _ = h.mul_(3)
    >>> kept(k)
    Traceback (most recent call last):
    ...
    RuntimeError: one of the variables needed for gradient computation has been modified by an inplace operation: [torch.FloatTensor [2]] is at version 1; expected version 0 instead. ...
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from funcmeta._src.core.fence import tensor_version

__all__ = ["Kept", "keep", "kept"]


class Kept:
    """A saved tensor kept as it is, and its version at the save."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version


def keep(t: Tensor) -> Kept | Tensor:
    """``t`` with its version now, for :func:`kept`; ``t`` itself where it has no version
    counter (an inference tensor, which autograd never saves)."""
    try:
        return Kept(t, tensor_version(t))
    except RuntimeError:
        return t


def kept(x: Any) -> Any:
    """The tensor :func:`keep` kept (anything else as it is), after checking that it was not
    changed in place since: raises autograd's own ``RuntimeError`` where it was."""
    if not isinstance(x, Kept):
        return x
    now = tensor_version(x.tensor)
    if now != x.version:
        t = x.tensor
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {now}; expected "
            f"version {x.version} instead. The model's forward changed a tensor in place "
            "after an operation saved it for the backward (autograd refuses this in the "
            "plain run too; the saved-tensor hooks of per-layer checkpointing or of a "
            "sharded model keep it as it is). Change a copy (h = h.clone()) or use the "
            "out-of-place operation (h = h * 3 for h.mul_(3))."
        )
    return x.tensor
