"""A tensor that funcmeta's saved-tensor hooks keep as it is, checked for in-place writes.

autograd checks each tensor it saved for backward: one changed in place after the save (a
model's forward that does ``out = layer(h); h.mul_(3)``) raises at the backward, since the
backward would read the new values. Where saved-tensor hooks are in force, torch leaves
that check to the hooks. funcmeta's hooks keep some tensors as they are (a checkpointed
layer's recomputation, a sharded model's tensors too small to split); they go through
:func:`keep` and :func:`kept`, which make the same check and raise the same error, so a
checkpointed or sharded model refuses what the plain run refuses, never computing with the
changed values. ``torch.utils.checkpoint`` keeps what its recomputation saves as it is and
checks nothing either: a step checkpoint runs its step under :func:`checked_under`, which
makes the check on what the checkpoint gives back. (Hooks that copy a tensor, a slice kept
for a sharded model or ``save_on_cpu``, keep the values of the save: the gradient of what
ran.)

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

import contextlib
from typing import Any

import torch
from torch import Tensor

from funcmeta._src.core.fence import saved_hooks_in_force, tensor_version

__all__ = ["checked_under", "keep", "kept"]


class _Kept:
    """A saved tensor kept as it is (:func:`keep`), and its version at the save."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version


class _Handed:
    """What the hooks under :func:`checked_under`'s made of a saved tensor, and the tensor's
    version at the save (``None``: it has no version counter)."""

    __slots__ = ("packed", "version")

    def __init__(self, packed: Any, version: int | None) -> None:
        self.packed, self.version = packed, version


def _version(t: Tensor) -> int | None:
    """``t``'s version counter, or ``None`` where it has none (an inference tensor, which
    autograd never saves)."""
    try:
        return tensor_version(t)
    except RuntimeError:
        return None


def keep(t: Tensor) -> Any:
    """``t`` with its version now, for :func:`kept` (``t`` itself where it has no version)."""
    version = _version(t)
    return t if version is None else _Kept(t, version)


def kept(x: Any) -> Any:
    """The tensor :func:`keep` kept (anything else as it is), after checking that it was not
    changed in place since: raises autograd's own ``RuntimeError`` where it was."""
    return _checked(x.tensor, x.version) if isinstance(x, _Kept) else x


def _checked(t: Tensor, version: int | None) -> Tensor:
    """``t``, where it is still at ``version``; autograd's own error where it is not."""
    now = _version(t)
    if version is not None and now != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {now}; expected "
            f"version {version} instead. The model's forward changed a tensor in place after "
            "an operation saved it for the backward (autograd refuses this in the plain run "
            "too; per-layer and step checkpointing and a sharded model keep it through "
            "saved-tensor hooks, which autograd leaves the check to). Change a copy "
            "(h = h.clone()) or use the out-of-place operation (h = h * 3 for h.mul_(3))."
        )
    return t


def checked_under() -> contextlib.AbstractContextManager[Any]:
    """Saved-tensor hooks that hand each saved tensor to the hooks in force now (a step's
    ``torch.utils.checkpoint``) and check that the tensor those give back at the unpack is at
    the version the saved one had: a checkpoint's recomputation keeps the tensors it saves as
    they are, so a forward that changes one in place after saving it would otherwise reach
    the backward with the changed values (``torch.utils.checkpoint`` makes no such check,
    torch 2.13). A nullcontext where no hooks are in force (autograd checks itself)."""
    outer = saved_hooks_in_force()
    if outer is None:
        return contextlib.nullcontext()
    pack_below, unpack_below = outer

    def pack(t: Tensor) -> _Handed:
        return _Handed(pack_below(t), _version(t))

    def unpack(x: _Handed) -> Tensor:
        return _checked(unpack_below(x.packed), x.version)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
