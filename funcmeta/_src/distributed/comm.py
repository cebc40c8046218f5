"""Every collective funcmeta starts, in one place: each waits at most a timeout (or the
process group's own, for ``DTensor``'s), raises :class:`~funcmeta.distributed.PeerError`
naming what it was for when a peer is gone or stalled, and runs under a
``torch.profiler.record_function`` label (``funcmeta::all_gather``, ``funcmeta::gather``,
...), as FSDP labels its own, so that a profile shows each one and what it was for.

The rest of ``funcmeta._src.distributed`` asks this module; nothing outside that package
talks to other processes (``tests/core/test_architecture.py``).

Example (one process):
    >>> import tempfile, torch, torch.distributed as dist
    >>> from funcmeta._src.distributed import comm
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    >>> comm.all_gather(torch.tensor([7]), None, 5.0, "an example").tolist()
    [[7]]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from funcmeta._src.core.sharding import PeerError

__all__ = [
    "all_gather",
    "all_gather_into",
    "axis_names",
    "all_reduce",
    "collective",
    "distribute",
    "gather_whole",
    "group_ranks",
    "initialized",
    "new_group",
    "own_axis_names",
    "rank",
    "redistribute",
    "size",
    "world_device",
]

_RESUME = "Exit and resume every rank from its last torch.distributed.checkpoint save"


def initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the default group for ``None``)."""
    return dist.get_rank(group)


def size(group: Any = None) -> int:
    """How many ranks ``group`` has."""
    return dist.get_world_size(group)


def group_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group``, in its order."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def world_device(device: torch.device, group: Any = None) -> torch.device:
    """Where a collective's own small tensors live: ``device``, or this process's CUDA device
    for a CPU tensor on NCCL."""
    if device.type == "cpu" and dist.get_backend(group) == "nccl":  # pragma: no cover - GPU
        return torch.device("cuda", torch.cuda.current_device())
    return device


#: What ``own_axis_names`` appends to a mesh's axis names (``axis_names`` strips it).
_OWN = "@funcmeta"


def own_axis_names(names: Sequence[str], tag: int) -> tuple[str, ...]:
    """Axis names apart from every other mesh's: ``name@funcmeta<tag>``."""
    return tuple(f"{n}{_OWN}{tag}" for n in names)


def axis_names(mesh: Any) -> list[str]:
    """The names of ``mesh``'s axes as the user gave them (without ``own_axis_names``' tag)."""
    return [n.split(_OWN)[0] for n in mesh.mesh_dim_names or ()]


def new_group(ranks: Sequence[int], timeout: float) -> Any:
    """A process group of ``ranks`` whose collectives wait at most ``timeout`` seconds; only
    its members call this (``use_local_synchronization``)."""
    with record_function("funcmeta::new_group"):
        return dist.new_group(
            list(ranks), timeout=timedelta(seconds=timeout), use_local_synchronization=True
        )


@contextlib.contextmanager
def collective(label: str, what: str, timeout: float | None = None) -> Iterator[None]:
    """Around one collective: its profiler label, and a failure (a peer gone, stalled past
    ``timeout`` or the group's timeout, or running another collective) raised as
    :class:`PeerError` naming ``what``."""
    with record_function(f"funcmeta::{label}"):
        try:
            yield
        except RuntimeError as error:
            if isinstance(error, PeerError):
                raise
            within = f" or did not finish within {timeout:g} s" if timeout is not None else ""
            first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise PeerError(
                f"rank {dist.get_rank()}: {what} failed{within}: a peer process is gone or "
                f"stalled, or the ranks ran different collectives ({first}). {_RESUME}."
            ) from error


def _wait(work: Any, timeout: float) -> None:
    work.wait(timeout=timedelta(seconds=timeout))


def all_gather(mine: Tensor, group: Any, timeout: float, what: str) -> Tensor:
    """Every rank's ``mine`` (same shape on every rank), stacked in rank order."""
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with collective("all_gather", what, timeout):
        _wait(dist.all_gather(every, mine, group=group, async_op=True), timeout)
    return torch.stack(every)


def all_reduce(tensor: Tensor, group: Any, timeout: float, what: str) -> Tensor:
    """``tensor`` summed over the ranks of ``group``, in place; returns it."""
    with collective("all_reduce", what, timeout):
        _wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True), timeout)
    return tensor


#: torch's all-gather into one tensor: ``all_gather_single`` where torch has it (the older
#: name, ``all_gather_into_tensor``, warns that it is deprecated there).
_ALL_GATHER_ONE: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(out: Tensor, piece: Tensor, group: Any, timeout: float, what: str) -> Tensor:
    """Every rank's ``piece`` of ``group``, concatenated into ``out``; returns ``out``."""
    with collective("all_gather_into_tensor", what, timeout):
        _wait(_ALL_GATHER_ONE(out, piece, group=group, async_op=True), timeout)
    return out


def gather_whole(shard: Any, what: str) -> Tensor:
    """A ``DTensor``'s whole tensor (``full_tensor()``: an all-gather along its ``Shard``
    axes, differentiable twice), waiting as long as its mesh's process groups allow."""
    with collective("gather", what):
        return shard.full_tensor()


def redistribute(tensor: Any, mesh: Any, placements: Sequence[Any], what: str) -> Any:
    """``tensor`` (a ``DTensor``) redistributed to ``placements`` on ``mesh`` (a partial sum
    reduced: a reduce-scatter along a ``Shard`` axis, an all-reduce along a ``Replicate``
    one)."""
    with collective("redistribute", what):
        return tensor.redistribute(mesh, list(placements))


def distribute(tensor: Tensor, mesh: Any, placements: Sequence[Any], local: bool = False) -> Any:
    """``tensor`` (the same on every rank) as a ``DTensor`` placed on ``mesh``: rank 0's
    values scattered, or with ``local`` this rank's own slice of its own ``tensor`` (no
    communication; where torch cannot, rank 0's scattered). With ``local`` the shard is a
    copy: nothing of ``tensor`` stays alive through it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with collective("distribute", "placing a parameter on the mesh"):
        if not local:
            return distribute_tensor(tensor, mesh, list(placements))
        try:
            placed = distribute_tensor(tensor, mesh, list(placements), src_data_rank=None)
        except TypeError:  # torch < 2.6: no src_data_rank, rank 0's values scattered
            placed = distribute_tensor(tensor, mesh, list(placements))
        mine = placed.to_local()
        if mine.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            mine = mine.clone()  # a view keeps the whole tensor alive
        return DTensor.from_local(
            mine,
            mesh,
            list(placements),
            run_check=False,
            shape=placed.shape,
            stride=placed.stride(),
        )
