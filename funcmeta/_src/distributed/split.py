"""Tasks split across the ranks that shard a model: the whole parameters gathered once per
meta-step, their meta-gradient averaged over the ranks into the shards. The implementation
of :func:`funcmeta.distributed.gather_params`.

With ``keep_frozen=True`` the whole tensors of frozen shards (``requires_grad=False``) are
kept from one call to the next (:class:`_Kept`, weakly keyed by the shard) and gathered
again only where some rank's shard was written since: each rank marks the parameters it
must gather (learnt, never kept, or stale by their version counters), and the marks travel
in the all-reduce that sums the task counts, so every rank gathers the same ones.

Each shard is gathered with ``DTensor.full_tensor()`` (an all-gather); an autograd function
around it declares the whole tensor's gradient a partial sum, weighted by this rank's share
of the tasks, and redistributes it to the shard's placements in the backward: a
reduce-scatter of the ranks' gradients into the shards instead of ``full_tensor()``'s own
backward, which keeps each rank's slice (docs/decisions/sharded-parameters.md). The shards'
``.grad`` is then the gradient of the mean over every rank's tasks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from funcmeta._src.core.checks import check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import tensor_version
from funcmeta._src.core.sharding import DEFAULT_TIMEOUT, ShardingError, is_sharded
from funcmeta._src.distributed import comm

__all__ = ["gather_params"]


class _Gathered(torch.autograd.Function):
    """Shards' whole tensors (gathered before, without a graph), as one autograd node: its
    backward runs on every rank whose loss reached any of them, with zeros for those it did
    not reach, so every rank runs the same collectives in the same order. For each shard it
    weights the gradient of the whole tensor and reduces it over the mesh into the shard's
    placements (a partial sum redistributed: a reduce-scatter along a ``Shard`` axis, an
    all-reduce along a ``Replicate`` one), naming the parameter when a peer is gone."""

    @staticmethod
    def forward(ctx: Any, weight: float, names: list[str], *tensors: Any) -> tuple[Tensor, ...]:
        half = len(tensors) // 2
        shards, wholes = tensors[:half], tensors[half:]
        ctx.specs = [(s.device_mesh, s.placements, s.shape, s.stride()) for s in shards]
        ctx.weight, ctx.names = weight, names
        ctx.set_materialize_grads(True)  # zeros for a whole tensor this rank's loss left out
        return tuple(w.view_as(w) for w in wholes)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor, Partial

        reduced = []
        for (mesh, placements, shape, stride), name, grad in zip(
            ctx.specs, ctx.names, grads, strict=True
        ):
            partial = DTensor.from_local(
                grad * ctx.weight, mesh, [Partial()] * mesh.ndim, shape=shape, stride=stride
            )
            what = f"reducing the meta-gradient of parameter {name!r} across the mesh"
            reduced.append(comm.redistribute(partial, mesh, placements, what))
        return (None, None, *reduced, *([None] * len(reduced)))


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A frozen shard's whole tensor, kept by ``gather_params(keep_frozen=True)``, with what
    it was gathered from: the shard's version counters (the ``DTensor``'s, bumped by an
    in-place write through it, and its local tensor's, bumped by one to the local tensor or
    by ``torch.distributed.checkpoint.load``), the local tensor's storage and layout, the
    placements and mesh, and the whole tensor's own version (a write to it makes it stale)."""

    whole: Tensor
    key: tuple[Any, ...]
    whole_version: int

    @staticmethod
    def key_of(shard: Any) -> tuple[Any, ...]:
        local = shard.to_local()
        return (
            tensor_version(shard),
            tensor_version(local),
            local.data_ptr(),
            tuple(local.shape),
            local.stride(),
            local.dtype,
            tuple(shard.placements),
            id(shard.device_mesh),
        )

    def fresh(self, shard: Any) -> bool:
        """Whether the whole tensor is still the gather of ``shard`` as it is now."""
        return tensor_version(self.whole) == self.whole_version and self.key == _Kept.key_of(shard)


# the frozen shards' whole tensors that gather_params(keep_frozen=True) keeps, by shard
# (keyed by identity: a tensor's == is elementwise, which a weakref's == would call)
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _must_gather(shard: Any, keep_frozen: bool) -> bool:
    """Whether this rank must gather ``shard`` now: it is learnt, nothing is kept for it, or
    what is kept went stale."""
    if not keep_frozen or shard.requires_grad:
        return True
    kept = _KEPT.get(shard)
    return kept is None or not kept.fresh(shard)


def _totals(
    count: float, mesh: Any, timeout: float, marks: list[float]
) -> tuple[float, int, list[bool]]:
    """The sum of ``count`` over every rank of ``mesh``, how many ranks have none, and for
    each of ``marks`` (1 where this rank must gather a parameter, else 0) whether any rank
    marked it (one small all-reduce per axis)."""
    device = comm.world_device(torch.device(mesh.device_type), mesh.get_group(0))
    totals = torch.tensor(
        [float(count), float(count == 0), *marks], dtype=torch.float64, device=device
    )
    for axis in range(mesh.ndim):
        comm.all_reduce(totals, mesh.get_group(axis), timeout, "summing the task counts")
    found = totals.tolist()
    return found[0], int(found[1]), [m > 0 for m in found[2:]]


@exposed_in("funcmeta.distributed")
def gather_params(
    params: Mapping[str, Tensor],
    count: int | float,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    keep_frozen: bool = False,
) -> dict[str, Tensor]:
    """The whole parameters of a model sharded by :func:`shard_model`, for a rank that runs
    its own ``count`` tasks: one all-gather per parameter now, and in the outer backward one
    reduce-scatter per parameter that leaves in each shard's ``.grad`` the task-weighted mean
    of every rank's meta-gradient.

    This is the other way to use a sharded model. :func:`shard_model` alone keeps the
    parameters sharded in the inner loop too, and every rank of its shard axis runs the same
    tasks: the ranks split the memory, not the work. With ``gather_params`` each rank of the
    mesh (both axes of a 2-D one) adapts its own share of the meta-batch (split it with
    :func:`shard`) on whole tensors, so the ranks split the work: the inner loop is the
    unsharded one (:func:`funcmeta.adapt`, :func:`funcmeta.adapt_tasks` with its tasks
    batched by ``vmap``, the recipes; not :func:`funcmeta.compile_meta_step`, which reads
    the model's own parameters), and a rank holds the whole initial parameters and its
    tasks' adapted ones during the step, while the parameters between steps, their gradients
    and the outer optimizer's state stay sharded.

    ``count`` is the number of tasks this rank's loss is the mean over (as returned by
    :func:`shard`); the shards then get ``sum_r count_r * grad_r / sum_r count_r``, the
    gradient of the mean over all tasks. Every rank runs the outer backward once per gather
    (the reduce-scatters are collectives; a rank whose loss leaves out some parameters sends
    zeros for them), so every rank needs a task: a ``count`` of 0 on any rank raises
    ``ValueError`` on all of them. Do not also call :func:`average_gradients` on the sharded
    parameters; call it on anything else learnable (plain, unsharded inner rates: ``fm.hyper``
    trees not placed by :func:`shard_hyper`), with the same ``count``. A model without
    shards (one process, or an unsharded run of the same script) gets its ``params`` back as
    they are.

    ``keep_frozen=True`` keeps the whole tensors of the shards that do not require grad (the
    frozen base of a LoRA model) from one call to the next, and gathers one again only where
    a rank's shard was written in place since (through the parameter, its local tensor, or
    ``torch.distributed.checkpoint.load``) or the kept whole tensor was: every rank checks
    its own at each call, and the all-reduce that sums the counts carries the checks, so
    the ranks gather the same parameters and no collective is added. A frozen base is then
    gathered once instead of at every meta-step, and the rank holds its whole frozen
    weights between the steps too (it holds them during each step anyway). Without it,
    each call gathers everything and drops what an earlier call kept.

    Raises :class:`ShardingError` when ``params`` mixes shards with plain tensors that
    require grad (their gradients would not be averaged), or holds shards of different
    meshes; :class:`PeerError` when the sum of the counts fails or waits past ``timeout``
    seconds, and when a gather or a reduce-scatter fails. Those two wait as long as the
    mesh's process groups allow: :func:`shard_model`'s ``timeout``.

    Example (one process; under ``torchrun`` every rank runs the same code on its own tasks):
        >>> import tempfile, torch, torch.distributed as dist
        >>> import funcmeta as fm
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> rendezvous = tempfile.mktemp()
        >>> dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
        >>> net = fm.distributed.shard_model(torch.nn.Linear(4, 2), init_device_mesh("cpu", (1,)))
        >>> fmodel = fm.functional_model(net)
        >>> whole = fm.distributed.gather_params(fmodel.params, count=3)
        >>> [type(t).__name__ for t in whole.values()]
        ['Tensor', 'Tensor']
        >>> fmodel(whole, torch.ones(3, 4)).sum().backward()
        >>> type(net.weight.grad).__name__
        'DTensor'
        >>> dist.destroy_process_group()
    """
    if not isinstance(params, Mapping):
        raise TypeError(
            "gather_params takes the model's parameters as a dict of name -> tensor "
            f"(fmodel.params), got {type(params).__name__}"
        )
    check_real(timeout, "timeout (seconds)", low=0.0, low_open=True)
    check_real(count, "count (the number of tasks this rank's loss is the mean over)", low=0.0)
    if not isinstance(keep_frozen, bool):
        raise TypeError(f"keep_frozen must be True or False, got {type(keep_frozen).__name__}")
    shards = {n: v for n, v in params.items() if is_sharded(v)}
    if not shards:
        return dict(params)
    plain = [n for n, v in params.items() if not is_sharded(v) and v.requires_grad]
    if plain:
        raise ShardingError(
            f"gather_params got shards beside plain tensors that require grad ({plain[:4]}): "
            "their gradients would stay this rank's own. Shard the whole model "
            "(fm.distributed.shard_model), or pass only its parameters and average the "
            "others' gradients with fm.distributed.average_gradients"
        )
    meshes = {id(cast(Any, v).device_mesh): cast(Any, v).device_mesh for v in shards.values()}
    if len(meshes) > 1:
        raise ShardingError(
            f"gather_params got shards of {len(meshes)} different meshes: shard the model once "
            "(fm.distributed.shard_model) and pass its parameters"
        )
    mesh = next(iter(meshes.values()))
    marks = [float(_must_gather(v, keep_frozen)) for v in shards.values()]
    total, empty, gather = _totals(count, mesh, timeout, marks)
    if empty:
        raise ValueError(
            f"{empty} of {mesh.size()} ranks have no task (count=0): with gather_params "
            "every rank runs the outer backward (its reduce-scatter is a collective), so "
            "give every rank at least one task (as many tasks as ranks or more)"
        )
    whole: dict[str, Tensor] = {}
    learnt: list[str] = []
    must = dict(zip(shards, gather, strict=True))
    for name, value in params.items():
        if not is_sharded(value):
            whole[name] = value
            continue
        if not must[name]:  # kept, and no rank's shard changed
            whole[name] = _KEPT[value].whole
            continue
        with torch.no_grad():
            whole[name] = comm.gather_whole(value, f"gathering parameter {name!r} across the mesh")
        if value.requires_grad:
            learnt.append(name)
        if keep_frozen and not value.requires_grad:
            tensor = whole[name]
            _KEPT[value] = _Kept(tensor, _Kept.key_of(value), tensor_version(tensor))
        else:
            _KEPT.pop(value, None)
    if learnt:  # one node for all: its backward reduces every gradient, used or not
        weight = float(count) / total
        mine = [params[n] for n in learnt]
        tied = _Gathered.apply(weight, learnt, *mine, *(whole[n] for n in learnt))
        whole.update(zip(learnt, tied, strict=True))
    return whole
