"""A model's parameters sharded across processes, gathered a layer at a time: the
implementation of :func:`funcmeta.distributed.shard_model`.

Each parameter becomes a ``DTensor`` sharded along its first dimension over a 1-D
``DeviceMesh`` (``Shard(0)``; a parameter without dimensions is replicated). A layer that
owns parameters gathers them (``DTensor.full_tensor()``, an all-gather, differentiable twice)
when its forward begins and puts the shards back when it ends, so the full tensors exist
while the layer runs and while autograd keeps them for its backward. With per-layer
checkpointing on the same layers (``fm.functional_model(..., checkpoint_layers=...)``) the
graph keeps the shards instead, and a recomputation gathers again: one layer's full
parameters at a time. Gradients reach the shards (``full_tensor``'s backward keeps each rank's
slice), inner-loop updates are ``DTensor`` arithmetic on the shards, and the meta-gradients
land in the shards' ``.grad``.

Every rank computes the same tasks on the same data: the ranks split the parameters' memory,
not the work. ``full_tensor``'s backward sums nothing across ranks, which is exact only then
(docs/decisions/sharded-parameters.md).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torch import Tensor, nn

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import parameter_dict
from funcmeta._src.core.sharding import ShardingError, is_sharded
from funcmeta._src.distributed.collectives import (
    DEFAULT_TIMEOUT,
    PeerError,
    check_same_everywhere,
)
from funcmeta._src.optim.hyper import HyperTree

__all__ = ["gathered_bytes", "shard_hyper", "shard_model", "sharded_names"]


class _Gather:
    """The forward hooks of one layer: its ``DTensor`` parameters gathered for the forward,
    the shards back afterwards (also when the forward raises). Per thread, and nested
    (a layer called again inside its own forward)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _stack(self) -> list[dict[str, Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def before(self, module: nn.Module, args: Any) -> None:
        shards = {n: p for n, p in parameter_dict(module).items() if is_sharded(p)}
        self._stack().append(shards)
        for name, shard in shards.items():
            try:
                full = shard.full_tensor()
            except RuntimeError as error:  # a collective failed: say which gather, and why
                raise PeerError(
                    f"gathering {type(module).__name__} parameter {name!r} across the mesh "
                    f"failed: a peer rank is gone or stalled, or ranks run different layers "
                    f"({str(error).splitlines()[0]}). Exit and resume every rank from its "
                    "last torch.distributed.checkpoint save"
                ) from error
            if full.data_ptr() != shard.to_local().data_ptr():  # one rank: the shard itself
                _count(full)
            parameter_dict(module)[name] = full

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if not stack:
            return
        for name, shard in stack.pop().items():
            parameter_dict(module)[name] = shard


_LIVE: list[Any] = []  # weak references to the gathered tensors' storages (gathered_bytes)


def _count(full: Tensor) -> None:
    _LIVE[:] = [r for r in _LIVE if r() is not None]
    _LIVE.append(weakref.ref(full.untyped_storage()))


@exposed_in("funcmeta.distributed")
def gathered_bytes() -> int:
    """The bytes of gathered parameters alive in this process now (their storages, kept by
    the tensor, a view of it or autograd's saved tensors): a layer's gather lives until its
    backward, or only while it runs when the layer is checkpointed.

    Example:
        >>> import funcmeta as fm
        >>> isinstance(fm.distributed.gathered_bytes(), int)
        True
    """
    alive = {s.data_ptr(): s.nbytes() for s in (r() for r in _LIVE) if s is not None}
    return sum(alive.values())


def _shard_axis(mesh: Any, mesh_dim: str | int | None) -> int:
    """The index of the mesh axis that splits the parameters."""
    names = list(mesh.mesh_dim_names or ())
    if mesh.ndim > 2:
        raise ShardingError(
            f"shard_model takes a 1-D or 2-D DeviceMesh (tasks and shards); got one of shape "
            f"{tuple(mesh.shape)}"
        )
    if mesh_dim is None:
        if mesh.ndim == 1:
            return 0
        raise ShardingError(
            f"a 2-D DeviceMesh (shape {tuple(mesh.shape)}, axes {names or 'unnamed'}) needs "
            "mesh_dim=: the axis whose ranks split the parameters (the other splits the tasks)"
        )
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ShardingError(f"mesh_dim={mesh_dim!r} is not an axis of the mesh: {names}")
        return names.index(mesh_dim)
    if not 0 <= mesh_dim < mesh.ndim:
        raise ShardingError(f"mesh_dim={mesh_dim} is not an axis of a {mesh.ndim}-D mesh")
    return mesh_dim


def sharded_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that are ``DTensor`` shards."""
    return [n for n, p in module.named_parameters() if is_sharded(p)]


@exposed_in("funcmeta.distributed")
def shard_model(
    module: nn.Module,
    mesh: Any,
    *,
    mesh_dim: str | int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> nn.Module:
    """Shard ``module``'s parameters across the processes of a ``DeviceMesh``, in place, and
    gather each layer's parameters only while that layer runs; returns ``module``.

    On a 1-D mesh every rank holds a shard. On a 2-D mesh ``mesh_dim`` (a name or an index)
    is the axis that splits the parameters; along the other the parameters are replicated,
    and the ranks there may run different tasks (split them with
    :func:`shard` over ``mesh.get_group(other)`` and average the meta-gradients with
    :func:`average_gradients` over that group, which takes the shards' ``.grad``).

    Build the functional model after it (``fm.functional_model(module, checkpoint_layers=...)``:
    checkpointing the same layers keeps one layer's full parameters at a time). Every rank
    must run the same tasks on the same data, unless it gathers the whole parameters for
    its own tasks with :func:`gather_params`. :func:`funcmeta.adapt`, calls of the functional
    model, and the task-batched calls (:func:`funcmeta.adapt_tasks`,
    :func:`funcmeta.task_losses`, :func:`funcmeta.apply_tasks`, the recipes) take a sharded
    model; the task-batched ones run its tasks one at a time, since a ``DTensor`` does not run
    under ``torch.func.vmap``. :func:`funcmeta.compile_meta_step` raises
    :class:`ShardingError`. Learnable hyperparameters (``fm.hyper`` rates) are placed beside
    the shards with :func:`shard_hyper`.

    Raises :class:`ShardingError` for a mesh of more than two axes, a 2-D mesh without
    ``mesh_dim``, a module already sharded, and a
    parameter held by two layers (tied weights): each layer gathers its own parameters, so a
    shared one would be gathered by one layer and read as a shard by the other. The ranks
    first compare their modules' parameters (names, shapes, dtypes): a difference raises
    :class:`MismatchError` on every rank, and a rank that does not answer within ``timeout``
    seconds :class:`PeerError`. A gather that fails later (a peer gone) raises
    :class:`PeerError` naming the layer.

    Example (one process; under ``torchrun`` every rank runs the same code):
        >>> import tempfile, torch, torch.distributed as dist
        >>> import funcmeta as fm
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> rendezvous = tempfile.mktemp()
        >>> dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
        >>> net = fm.distributed.shard_model(torch.nn.Linear(4, 2), init_device_mesh("cpu", (1,)))
        >>> type(net.weight).__name__, tuple(net(torch.ones(3, 4)).shape)
        ('DTensor', (3, 2))
        >>> dist.destroy_process_group()
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    axis = _shard_axis(mesh, mesh_dim)
    owners: dict[int, list[str]] = {}
    for prefix, layer in module.named_modules(remove_duplicate=False):
        for name, p in parameter_dict(layer).items():
            if p is not None:
                owners.setdefault(id(p), []).append(f"{prefix}.{name}" if prefix else name)
    shared = [names for names in owners.values() if len(names) > 1]
    if shared:
        raise ShardingError(
            f"parameter {shared[0][0]!r} is held by {len(shared[0])} layers ({shared[0]}): "
            "shard_model gathers a layer's parameters while that layer runs, so a tied or "
            "shared weight would be a shard in the other layer; untie it (a copy per layer) "
            "or leave the model unsharded"
        )
    already = sharded_names(module)
    if already:
        raise ShardingError(
            f"the module is sharded already ({already[0]!r} is a DTensor): shard it once"
        )
    check_same_everywhere(
        [(n, p.detach()) for n, p in module.named_parameters()],
        mesh.get_group(axis),
        timeout,
        "the ranks disagree on the model they shard (fm.distributed.shard_model needs the same "
        "parameter names, shapes and dtypes in the same order on every rank of the mesh)",
    )
    for layer in module.modules():
        own = [n for n, p in parameter_dict(layer).items() if p is not None]
        if not own:
            continue
        for name in own:
            p = parameter_dict(layer)[name]
            assert p is not None
            placements: list[Any] = [Replicate()] * mesh.ndim
            if p.dim() > 0:
                placements[axis] = Shard(0)
            parameter_dict(layer)[name] = nn.Parameter(
                distribute_tensor(p.detach(), mesh, placements), requires_grad=p.requires_grad
            )
        gather = _Gather()
        layer.register_forward_pre_hook(gather.before)
        layer.register_forward_hook(gather.after, always_call=True)
    return module


@exposed_in("funcmeta.distributed")
def shard_hyper(hyper: HyperTree, module: nn.Module) -> HyperTree:
    """Place learnable hyperparameters (an ``fm.hyper`` tree: inner learning rates) beside
    the parameters of ``module``, sharded by :func:`shard_model`, in place; returns ``hyper``.

    Per-element values (``fm.hyper.per_element``, Meta-SGD's rates) are sharded as their
    parameter is, the per-step axis (``steps=``) kept whole on every rank; scalar, per-layer
    and per-tensor values are replicated. Their meta-gradients land where they live: a
    sharded rate's ``.grad`` holds this rank's slice, a replicated rate's the whole sum over
    the ranks' shards. Call it before building the outer optimizer (it replaces the
    tree's parameters), on every rank, as :func:`shard_model` is called. The values
    are rank 0's (``distribute_tensor``). A rate tree used with a sharded model without this
    raises :class:`ShardingError` in :func:`funcmeta.adapt`: applied to a shard's gradient, a
    plain rate's gradient would be this rank's partial sum.

    Raises :class:`ShardingError` when ``module`` has no sharded parameter, when the tree is
    placed already, or when a per-element group names no sharded parameter of ``module`` or
    has another shape.

    Example (one process; under ``torchrun`` every rank runs the same code):
        >>> import tempfile, torch, torch.distributed as dist
        >>> import funcmeta as fm
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> rendezvous = tempfile.mktemp()
        >>> dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
        >>> net = fm.distributed.shard_model(torch.nn.Linear(4, 2), init_device_mesh("cpu", (1,)))
        >>> fmodel = fm.functional_model(net)
        >>> rates = fm.distributed.shard_hyper(fm.hyper.per_element(fmodel.params, 0.1), net)
        >>> [type(r).__name__ for r in rates.parameters()]
        ['DTensor', 'DTensor']
        >>> dist.destroy_process_group()
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if not isinstance(hyper, HyperTree):
        raise TypeError(
            "shard_hyper takes a learnable hyperparameter tree (fm.hyper.scalar, per_layer, "
            f"per_tensor or per_element), got {type(hyper).__name__}"
        )
    shards: dict[str, Any] = {n: p for n, p in module.named_parameters() if is_sharded(p)}
    if not shards:
        raise ShardingError(
            "the module has no sharded parameter: shard it first "
            "(fm.distributed.shard_model(module, mesh)), then place its rates beside it"
        )
    if any(is_sharded(r) for r in hyper.parameters()):
        raise ShardingError("these hyperparameters are placed already: place them once")
    some = next(iter(shards.values()))
    mesh = some.device_mesh
    lead = 0 if hyper.steps is None else 1

    def placed(raw: Tensor, placements: list[Any]) -> nn.Parameter:
        return nn.Parameter(
            distribute_tensor(raw.detach(), mesh, placements), requires_grad=raw.requires_grad
        )

    if hyper.kind != "per_element":
        assert isinstance(hyper.raw, nn.Parameter)  # one Parameter for every other kind
        hyper.raw = placed(hyper.raw, [Replicate()] * mesh.ndim)
        return hyper
    assert isinstance(hyper.raw, nn.ParameterList)  # one Parameter per group
    for i, name in enumerate(hyper.groups):
        raw = hyper.raw[i]
        param = shards.get(name)
        if param is None:
            where = (
                "is a parameter held whole"
                if name in dict(module.named_parameters())
                else ("names no parameter of the module")
            )
            raise ShardingError(
                f"per-element rate {name!r} {where}: shard_hyper places the rates of the "
                f"sharded parameters of the module they were built for "
                f"(fm.hyper.per_element(fm.functional_model(module).params, ...)); sharded: "
                f"{sorted(shards)[:6]}"
            )
        if tuple(raw.shape[lead:]) != tuple(param.shape):
            raise ShardingError(
                f"per-element rate {name!r} has shape {tuple(raw.shape)}, its parameter "
                f"{tuple(param.shape)}: build the rates from this module's parameters"
            )
        placements = [
            Shard(pl.dim + lead) if isinstance(pl, Shard) else pl for pl in param.placements
        ]
        hyper.raw[i] = placed(raw, placements)
    return hyper
