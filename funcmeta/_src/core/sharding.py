"""Parameters sharded across processes (``DTensor``), as the engine meets them: the error
for a call that cannot take them, and torch's own error rewritten where a layer read a shard.
:func:`funcmeta.distributed.shard_model` (``funcmeta._src.distributed.sharded``) makes them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from funcmeta._src.core.exposed import exposed_in

__all__ = ["ShardingError", "is_sharded", "refuse_sharded", "rewrite_mixed"]

_DISPATCH_MIX = "got mixed torch.Tensor and DTensor"


@exposed_in("funcmeta.distributed")
class ShardingError(ValueError):
    """A model cannot be sharded as asked, or a sharded model met a call that cannot take it;
    the message names the parameter or the entry point, and what to do."""


def _dtensor_class() -> type:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: nothing is a DTensor
        return type("NoDTensor", (), {})
    return DTensor


_DTENSOR: list[type] = []  # the class, looked up at the first check (the inner loop asks)


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a shard of ``shard_model``'s, or any other)."""
    if not _DTENSOR:
        _DTENSOR.append(_dtensor_class())
    return isinstance(tensor, _DTENSOR[0])


def refuse_sharded(params: Mapping[str, Any], entry: str, why: str) -> None:
    """Raise :class:`ShardingError` naming ``entry`` and the first ``DTensor`` in ``params``."""
    for name, value in params.items():
        if is_sharded(value):
            raise ShardingError(
                f"{entry} cannot take a sharded model (parameter {name!r} is a DTensor): {why}"
            )


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
