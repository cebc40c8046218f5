"""Task-parallel meta-training over plain collectives: the implementation of
:mod:`funcmeta.distributed`."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.sharding import DEFAULT_TIMEOUT, ShardingError, is_sharded
from funcmeta._src.distributed import comm

__all__ = [
    "MismatchError",
    "average_gradients",
    "check_same_everywhere",
    "shard",
    "world",
]


@exposed_in("funcmeta.distributed")
class MismatchError(ValueError):
    """The ranks disagree on what they average (names, shapes, dtypes, count); raised on
    every rank, with the same message naming the first difference."""


def _named(tensors: Iterable[Tensor] | Mapping[str, Tensor]) -> list[tuple[str, Tensor]]:
    if isinstance(tensors, Mapping):
        return [(str(k), v) for k, v in tensors.items()]
    return [(f"tensor {i}", t) for i, t in enumerate(tensors)]


def _signature(named: list[tuple[str, Tensor]]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(_local(t).shape), str(t.dtype).replace("torch.", "")) for name, t in named]


def _digest(signature: list[tuple[str, tuple[int, ...], str]]) -> int:
    text = repr(signature).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


def _first_difference(signatures: list[Any]) -> str:
    """The first entry in which some rank differs from rank 0, as a sentence."""
    base = signatures[0]
    for r, other in enumerate(signatures[1:], start=1):
        if other == base:
            continue
        for i, (a, b) in enumerate(itertools.zip_longest(base, other)):
            if a == b:
                continue
            if a is None or b is None:
                extra, owner = (b, r) if a is None else (a, 0)
                return (
                    f"rank 0 averages {len(base)} tensors and rank {r} {len(other)}; "
                    f"the first one only rank {owner} has is {extra[0]!r} "
                    f"(shape {extra[1]}, {extra[2]})"
                )
            return (
                f"entry {i}: rank 0 has {a[0]!r} (shape {a[1]}, {a[2]}), "
                f"rank {r} has {b[0]!r} (shape {b[1]}, {b[2]})"
            )
    return "the ranks' signatures differ"  # pragma: no cover - digests collide only if they differ


@exposed_in("funcmeta.distributed")
def world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``, or ``(0, 1)`` without an initialised process group."""
    if not comm.initialized():
        return 0, 1
    return comm.rank(group), comm.size(group)


@exposed_in("funcmeta.distributed")
def shard(batch: Any, *, group: Any = None) -> tuple[Any, int]:
    """This rank's contiguous share of the leading task axis of every tensor in ``batch``.

    Returns ``(share, count)``, where ``count`` is the number of tasks in the share. Shares
    differ by at most one task. A rank may get none when there are fewer tasks than ranks;
    its ``count`` is then 0. Raises ``ValueError`` when the tensors disagree on the number of
    tasks.
    """
    leaves = [x for x in tree.leaves(batch) if isinstance(x, Tensor)]
    if not leaves:
        raise ValueError("the batch holds no tensors to shard")
    tasks = leaves[0].shape[0]
    if any(x.dim() == 0 or x.shape[0] != tasks for x in leaves):
        raise ValueError(
            f"every batch tensor needs the same leading task axis ({tasks} tasks expected); "
            f"got leading sizes {[tuple(x.shape)[:1] for x in leaves]}"
        )
    rank, size = world(group)
    base, extra = divmod(tasks, size)
    start = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    share = tree.tree_map(lambda x: x[start : start + count] if isinstance(x, Tensor) else x, batch)
    return share, count


@exposed_in("funcmeta.distributed")
def average_gradients(
    tensors: Iterable[Tensor] | Mapping[str, Tensor],
    count: int | float = 1,
    *,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """Replace each tensor's ``.grad`` by the task-weighted mean over the ranks, in place.

    Call it on every rank, with the same tensors in the same order (the model's parameters,
    then the hyperparameters' parameters), after ``.backward()`` on the mean loss over this
    rank's ``count`` tasks. The result is ``sum_r count_r * grad_r / sum_r count_r``: the
    gradient of the mean over all tasks. A missing ``.grad`` counts as zeros (and is set). A
    rank whose share is empty skips ``.backward()`` and passes ``count=0``. Without an
    initialised process group it does nothing.

    ``tensors`` may be a dict ``name -> tensor`` (``dict(net.named_parameters())``): errors
    then name the tensors. The ranks first check that they average the same thing
    (:class:`MismatchError` on every rank if not); each collective waits at most
    ``timeout`` seconds (:class:`PeerError` if a peer is gone or stalled).
    """
    named = _named(tensors)
    check_real(count, "count (the number of tasks this rank's loss is the mean over)", low=0.0)
    check_real(timeout, "timeout (seconds)", low=0.0, low_open=True)
    if world(group)[1] == 1:
        return
    _refuse_different_shards(named, group)
    device = comm.world_device(named[0][1].device if named else torch.device("cpu"), group)
    _check_signature(_signature(named), device, group, timeout)
    if not named:
        return
    # a sharded parameter (fm.distributed.shard_model) averages its own shard: the group is
    # then the mesh axis along which the parameters are replicated
    grads = [_local(torch.zeros_like(t) if t.grad is None else t.grad) for _, t in named]
    flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_ones(1)]) * float(count)
    comm.all_reduce(flat, group, timeout, "averaging the gradients")
    total = flat[-1]
    if float(total) == 0:
        raise ValueError("no rank had any task: nothing to average")
    flat = flat[:-1] / total
    offset = 0
    for (_, t), g in zip(named, grads, strict=True):
        n = g.numel()
        mean = flat[offset : offset + n].reshape(g.shape).to(g.dtype).clone()
        t.grad = _like(t, mean)
        offset += n


def _refuse_different_shards(named: list[tuple[str, Tensor]], group: Any) -> None:
    """Raise :class:`ShardingError` when ``group`` holds two ranks of a sharded parameter's
    mesh with different shards of it: averaging them would mix different rows of it,
    silently when the shards have the same shape. (A rank of ``group`` outside this rank's
    mesh, a model sharded over a sub-mesh, is not judged here.)"""
    if not any(is_sharded(t) for _, t in named):
        return  # plain tensors: nothing to judge, no lookup of the group's ranks
    ranks = comm.group_ranks(group)
    for name, t in named:
        if not is_sharded(t):
            continue
        sharded = cast(Any, t)
        mesh = sharded.device_mesh
        grid = mesh.mesh
        where = [(grid == r).nonzero()[0].tolist() for r in ranks if bool((grid == r).any())]
        for axis, placement in enumerate(sharded.placements):
            if not placement.is_shard() or len({w[axis] for w in where}) < 2:
                continue
            names = comm.axis_names(mesh)
            others = [repr(names[i]) if names else str(i) for i in range(mesh.ndim) if i != axis]
            fix = (
                f"pass the group of the axis that splits the tasks "
                f"(group=mesh.get_group({others[0]}))"
                if others
                else "on a 1-D mesh there is nothing to average"
            )
            raise ShardingError(
                f"average_gradients would average different shards of {name!r}: its group "
                f"holds ranks {ranks[:8]}, which split that parameter along mesh axis "
                f"{names[axis] if names else axis!r}; {fix}. With the same tasks on every "
                "rank of the shard axis, the shards' .grad is complete after the backward; "
                "with fm.distributed.gather_params, its backward averaged them"
            )


def _local(tensor: Tensor) -> Tensor:
    """A ``DTensor``'s shard on this rank, or the tensor itself."""
    return cast(Any, tensor).to_local() if is_sharded(tensor) else tensor


def _like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` as ``param``'s gradient: a ``DTensor`` placed as ``param`` for a sharded
    parameter."""
    if not is_sharded(param):
        return local
    from torch.distributed.tensor import DTensor

    sharded = cast(DTensor, param)
    return DTensor.from_local(
        local, sharded.device_mesh, sharded.placements, shape=param.shape, stride=param.stride()
    )


def _check_signature(
    signature: list[Any],
    device: torch.device,
    group: Any,
    timeout: float,
    needs: str = (
        "the ranks disagree on the tensors they average (fm.distributed.average_gradients "
        "needs the same names, shapes and dtypes in the same order on every rank)"
    ),
) -> None:
    """Raise :class:`MismatchError` on every rank unless all ranks have ``signature``
    (``needs``: the message's start, saying what must agree)."""
    mine = torch.tensor([_digest(signature)], dtype=torch.int64, device=device)
    digests = comm.all_gather(mine, group, timeout, "comparing what the ranks average")
    if bool((digests == digests[0]).all()):
        return
    # every rank saw the same digests and gets here: gather the signatures to name the difference
    signatures = _gather_signatures(signature, device, group, timeout)
    raise MismatchError(f"{needs}: {_first_difference(signatures)}")


def _gather_signatures(
    signature: list[Any], device: torch.device, group: Any, timeout: float
) -> list[Any]:
    """Every rank's signature, gathered as JSON bytes in two tensor collectives that each
    wait at most ``timeout`` (``all_gather_object`` has no timeout, and unpickles what the
    peers send)."""
    data = torch.tensor(list(json.dumps(signature).encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    what = "naming the difference in what the ranks average"
    lengths = comm.all_gather(length, group, timeout, what)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = comm.all_gather(padded, group, timeout, what)
    return [
        [(e[0], tuple(e[1]), e[2]) for e in json.loads(bytes(g[: int(n)].tolist()).decode())]
        for g, n in zip(gathered, lengths, strict=True)
    ]


def check_same_everywhere(
    named: list[tuple[str, Tensor]], group: Any, timeout: float, needs: str
) -> None:
    """Raise :class:`MismatchError` on every rank of ``group`` unless all ranks hold tensors
    of the same names, shapes and dtypes (``needs`` opens the message); :class:`PeerError`
    when a rank does not answer within ``timeout`` seconds."""
    first = named[0][1].device if named else torch.device("cpu")
    device = comm.world_device(torch.device("cpu") if first.type == "meta" else first, group)
    _check_signature(_signature(named), device, group, timeout, needs)
