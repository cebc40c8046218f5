"""Parameters sharded across processes (``DTensor``), as the engine meets them: the error
for a call that cannot take them, and torch's own error rewritten where a layer read a shard.
:func:`funcmeta.distributed.shard_model` (``funcmeta._src.distributed.sharded``) makes them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from funcmeta._src.core import tree
from funcmeta._src.core.exposed import exposed_in

__all__ = [
    "DEFAULT_TIMEOUT",
    "PeerError",
    "ShardingError",
    "is_sharded",
    "check_same_batch",
    "learnable_tensors_refused",
    "refuse_sharded_options",
    "refuse_sharded",
    "rewrite_mixed",
    "rewrite_mixed_hyper",
]

_DISPATCH_MIX = "got mixed torch.Tensor and DTensor"

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective of :func:`funcmeta.distributed.average_gradients` (and of a sharded
model's checks) waits for the other ranks by default."""


@exposed_in("funcmeta.distributed")
class PeerError(RuntimeError):
    """A collective with the other ranks failed or timed out: a peer process is gone or stalled.

    The process group cannot be trusted after it: exit, and resume every rank from its last
    snapshot (``fm.snapshot.load``; docs/distributed.md)."""


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


_DIFFERENTIATION = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


class _LearnableMeetsShard(TorchFunctionMode):
    """Refuses a call that mixes a ``DTensor`` with a plain tensor that requires grad: a
    learnable hyperparameter (a rate) applied to a sharded gradient. torch lets a tensor
    without dimensions through as a scalar and differentiates it on this rank's shard alone:
    its gradient would be a partial sum, different on every rank, without an error."""

    def __init__(self, in_model: Callable[[], bool]) -> None:
        super().__init__()
        self.in_model = in_model  # inside the model's forward: torch's own error, said again

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in _DIFFERENTIATION or self.in_model():
            # a plain loss differentiated for sharded leaves is right; in the model's forward
            # a layer meeting a shard is torch's error, said again (rewrite_mixed)
            return func(*args, **(kwargs or {}))
        tensors = [a for a in tree.leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        if len(tensors) > 1 and any(is_sharded(t) for t in tensors):
            plain = [t for t in tensors if not is_sharded(t) and t.requires_grad]
            if plain:
                raise ShardingError(
                    "a learnable tensor (shape "
                    f"{tuple(plain[0].shape)}, requires_grad) meets a sharded parameter's "
                    f"tensor in {getattr(func, '__name__', func)}: its gradient would sum "
                    "this rank's shard alone, a different wrong number on every rank. "
                    "Place learnable hyperparameters (fm.hyper rates) beside the shards "
                    "first: fm.distributed.shard_hyper(rates, model), before building the "
                    "outer optimizer"
                )
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def learnable_tensors_refused(
    params: Mapping[str, Any], in_model: Callable[[], bool]
) -> Iterator[None]:
    """Within the block, outside the model's forward (``in_model()`` False), refuse what
    :class:`_LearnableMeetsShard` refuses when ``params`` holds a ``DTensor``; nothing
    otherwise (no mode, no cost)."""
    if not any(is_sharded(v) for v in params.values()):
        yield
        return
    with _LearnableMeetsShard(in_model):
        yield


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    """An exact checksum of ``tensor``'s values and their order, the same on any device and
    thread count: its bit patterns as integers, weighted by position, summed in int64."""
    x = tensor.detach().contiguous().reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.is_floating_point() or x.is_complex():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        x = x.view(bits[x.element_size()]) if x.element_size() in bits else x.view(torch.uint8)
    weights = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 1021 + 1
    return (x.to(torch.int64) * weights).sum()


def check_same_batch(batch: Any, params: Mapping[str, Any]) -> None:
    """Raise :class:`ShardingError` on every rank of the mesh axis that splits ``params``
    unless all its ranks hold the same ``batch`` (values, shapes, order): ``full_tensor()``'s
    backward sums nothing across ranks, so ranks that share parameters but not data would
    get wrong gradients silently. One 8-byte all-gather per call; nothing for unsharded
    ``params``."""
    sharded = next((v for v in params.values() if is_sharded(v)), None)
    if sharded is None:
        return
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    axes = [i for i, p in enumerate(sharded.placements) if isinstance(p, Shard)]
    if not axes:
        return
    group = sharded.device_mesh.get_group(axes[0])
    if dist.get_world_size(group) == 1:
        return
    leaves = [x for x in tree.leaves(batch) if isinstance(x, torch.Tensor)]
    device = sharded.to_local().device
    total = torch.zeros((), dtype=torch.int64, device=device)
    for i, x in enumerate(leaves):
        shape = torch.tensor(list(x.shape) or [0], dtype=torch.int64, device=device)
        total = total * 31 + _digest(x).to(device) + (i + 1) * _digest(shape)
    mine = total.reshape(1)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        work = dist.all_gather(every, mine, group=group, async_op=True)
        assert work is not None
        work.wait(timeout=timedelta(seconds=DEFAULT_TIMEOUT))
    except RuntimeError as error:
        raise PeerError(
            f"comparing the batches of the ranks that split the parameters failed or did not "
            f"finish within {DEFAULT_TIMEOUT:g} s: a peer process is gone or stalled "
            f"({str(error).splitlines()[0]}). Exit and resume every rank from its last "
            "torch.distributed.checkpoint save"
        ) from error
    if any(not torch.equal(e, every[0]) for e in every):
        raise ShardingError(
            "the ranks that split the parameters hold different batches: a sharded model "
            "needs the same tasks on every rank of its shard axis (a gathered parameter's "
            "backward sums nothing across ranks, so the gradients would be wrong); split "
            "tasks along another mesh axis (shard_model(..., mesh_dim=) on a 2-D mesh) and "
            "average with fm.distributed.average_gradients over it"
        )


#: The inner-loop options a sharded model refuses, and why.
_SHARDED_OPTIONS = (
    "its check of the inner gradients for non-finite values does not run on DTensor shards "
    "yet; leave it out (a non-finite loss then reaches the parameters, as it does without "
    "the option)"
)


def refuse_sharded_options(params: Mapping[str, Any], entry: str, options: Any) -> None:
    """Raise :class:`ShardingError` when ``options`` (an ``AdaptOptions``) sets
    ``on_nonfinite`` or ``loss_scale`` and ``params`` are sharded: their non-finite check
    reduces the gradients with a product, which DTensor refuses ("Replicate to
    Partial(product) conversion is not supported")."""
    for option in ("on_nonfinite", "loss_scale"):
        if getattr(options, option) is not None:
            refuse_sharded(params, f"{entry} with {option}=", _SHARDED_OPTIONS)
