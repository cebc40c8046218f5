"""Parameters sharded across processes (``DTensor``), as the engine meets them: the errors,
torch's own error rewritten where a layer read a shard, and the record of which modules are
sharded and by which runtime. :func:`funcmeta.distributed.shard_model`
(``funcmeta._src.distributed``) makes them and starts every collective; nothing here talks to
other processes.

Nothing here imports ``torch.distributed.tensor``: :func:`is_sharded` answers ``False`` while
that module is not loaded, since no ``DTensor`` can exist before it is.

Example:
    >>> import torch
    >>> from funcmeta._src.core.sharding import is_sharded, sharding_of
    >>> is_sharded(torch.ones(2)), sharding_of(torch.nn.Linear(1, 1)) is None
    (False, True)
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

from torch import Tensor, nn

from funcmeta._src.core.exposed import exposed_in

__all__ = [
    "DEFAULT_TIMEOUT",
    "PeerError",
    "ShardingError",
    "Sharding",
    "is_sharded",
    "record_sharding",
    "rewrite_mixed",
    "rewrite_mixed_hyper",
    "saving_split",
    "sharding_epoch",
    "sharding_of",
]

_DISPATCH_MIX = "got mixed torch.Tensor and DTensor"

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective of :func:`funcmeta.distributed.average_gradients`, and of a model
sharded by :func:`funcmeta.distributed.shard_model`, waits for the other ranks by default."""


@exposed_in("funcmeta.distributed")
class PeerError(RuntimeError):
    """A collective with the other ranks failed or timed out: a peer process is gone or stalled.

    The process group cannot be trusted after it: exit, and resume every rank from its last
    snapshot (``fm.snapshot.load``; docs/distributed.md)."""


@exposed_in("funcmeta.distributed")
class ShardingError(ValueError):
    """A model cannot be sharded as asked, or a sharded model met a call that cannot take it;
    the message names the parameter or the entry point, and what to do."""


_DTENSOR: list[type] = []  # the class, once torch.distributed.tensor is loaded


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a shard of ``shard_model``'s, or any other).

    Imports nothing: until ``torch.distributed.tensor`` is loaded (by ``shard_model``, or by
    the user) no ``DTensor`` exists, and the answer is ``False`` at the cost of a dict lookup.
    """
    if not _DTENSOR:
        module = sys.modules.get("torch.distributed.tensor")
        found = getattr(module, "DTensor", None) if module is not None else None
        if found is None:
            return False
        _DTENSOR.append(found)
    return isinstance(tensor, _DTENSOR[0])


class Sharding(Protocol):
    """What the layers below ask of a sharded model's runtime (made by
    ``funcmeta._src.distributed``, which starts every collective): the saved-tensor hooks of
    a checkpointed layer, and the checks of a direct call of a module."""

    def split_saving(self, tensors: Iterable[Tensor]) -> contextlib.AbstractContextManager[Any]:
        """The hooks that keep each rank's slice of what a checkpointed call on ``tensors``
        saves (a nullcontext where none apply)."""
        ...

    def watch(self, module: nn.Module) -> None:
        """Check each direct call of ``module`` (its inputs, and the gradient reaching its
        outputs) across the ranks that split the parameters."""
        ...


#: The runtime of each module sharded by ``shard_model`` (every submodule of the module it
#: was given), and of each mesh it built; and how many times a module was sharded here.
_MODULES: weakref.WeakKeyDictionary[nn.Module, Sharding] = weakref.WeakKeyDictionary()
_MESHES: dict[int, tuple[Any, Sharding]] = {}
_EPOCH = [0]


def record_sharding(module: nn.Module, mesh: Any, runtime: Sharding) -> None:
    """Note that ``module`` (and each of its submodules) was sharded on ``mesh`` (built for
    it) and runs on ``runtime``."""
    for m in module.modules():
        _MODULES[m] = runtime
    _MESHES[id(mesh)] = (mesh, runtime)
    _EPOCH[0] += 1


def sharding_epoch() -> int:
    """How many modules were sharded in this process so far (a functional model built
    before the latest one checks that its module was not among them)."""
    return _EPOCH[0]


def sharding_of(module: nn.Module) -> Sharding | None:
    """The runtime of the sharding of ``module`` or of its submodules (``None``: unsharded).
    Raises :class:`ShardingError` when parts of it were sharded by separate ``shard_model``
    calls, or when it holds ``DTensor`` parameters that ``shard_model`` did not make."""
    found: list[Sharding] = []
    if _EPOCH[0]:  # some module was sharded in this process
        for m in module.modules():
            runtime = _MODULES.get(m)
            if runtime is not None and all(runtime is not f for f in found):
                found.append(runtime)
    if len(found) > 1:
        raise ShardingError(
            f"parts of this {type(module).__name__} were sharded by {len(found)} separate "
            "fm.distributed.shard_model calls: shard the model once (the module whose forward "
            "is called), so that one runtime owns its gathers and checks"
        )
    if found:
        return found[0]
    odd = next((n for n, p in module.named_parameters() if is_sharded(p)), None)
    if odd is not None:
        raise ShardingError(
            f"parameter {odd!r} is a DTensor that fm.distributed.shard_model did not make: "
            "shard the model with fm.distributed.shard_model(module, mesh), which owns its "
            "gathers, checks and collectives"
        )
    return None


def saving_split(tensors: Iterable[Tensor]) -> contextlib.AbstractContextManager[Any]:
    """The saved-tensor hooks of the sharded runtime whose shards are among ``tensors`` (a
    checkpointed layer's inputs), or a nullcontext."""
    if _EPOCH[0] == 0:
        return contextlib.nullcontext()
    for t in tensors:
        if is_sharded(t):
            entry = _MESHES.get(id(t.device_mesh))  # type: ignore[attr-defined]
            if entry is not None:
                return entry[1].split_saving(tensors)
    return contextlib.nullcontext()


def rewrite_mixed(error: BaseException) -> ShardingError | None:
    """The named error for torch's "mixed torch.Tensor and DTensor" in a sharded model's run:
    a layer computed with a parameter it does not own, so it met a shard; else ``None``."""
    if _DISPATCH_MIX not in str(error):
        return None
    return ShardingError(
        "a sharded model's layer computed with a parameter it does not own (torch: "
        f"{str(error).splitlines()[0]}): shard_model gathers a layer's parameters only while "
        "that layer runs, so a forward that reads another layer's weight (a shared or tied "
        "weight, self.other.weight) meets a shard; own the weight in the layer that uses it, "
        "or leave the model unsharded"
    )


def rewrite_mixed_hyper(error: BaseException, params: list[Any]) -> ShardingError | None:
    """The named error for torch's "mixed torch.Tensor and DTensor" in an inner optimizer's
    step on whole parameters (``params`` holds no ``DTensor``): a hyperparameter placed by
    ``shard_hyper`` (a ``DTensor``) met them; else ``None``."""
    if _DISPATCH_MIX not in str(error) or any(is_sharded(p) for p in params):
        return None
    return ShardingError(
        "the inner optimizer's step met a DTensor hyperparameter with whole parameters "
        f"(torch: {str(error).splitlines()[0]}): rates placed by "
        "fm.distributed.shard_hyper go with a sharded model's own parameters. With "
        "fm.distributed.gather_params (whole parameters, each rank its own tasks) keep the "
        "rates as fm.hyper built them and average their gradients with "
        "fm.distributed.average_gradients(list(rates.parameters()), count)"
    )
