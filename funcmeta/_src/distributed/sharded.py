"""A model's parameters sharded across processes, gathered a layer at a time: the
implementation of :func:`funcmeta.distributed.shard_model` (and :func:`shard_hyper`, which
places learnable rates beside the shards). The model's gathers, checks and collectives are
its runtime's (``funcmeta._src.distributed.runtime``).

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

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from funcmeta._src.core.capabilities import require
from funcmeta._src.core.checks import check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import buffer_dict, parameter_dict
from funcmeta._src.core.sharding import (
    DEFAULT_TIMEOUT,
    ShardingError,
    is_sharded,
    record_sharding,
)
from funcmeta._src.distributed import comm
from funcmeta._src.distributed.collectives import check_same_everywhere
from funcmeta._src.distributed.parallel import choose_on_shards, install_on_shards
from funcmeta._src.distributed.runtime import ShardedRuntime, _LayerGather, digest
from funcmeta._src.optim.hyper import HyperTree

__all__ = ["shard_hyper", "shard_model", "sharded_names"]


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


_MESHES = itertools.count(1)  # each shard_model call's own mesh gets its own axis names


def _own_mesh(mesh: Any, timeout: float) -> Any:
    """A mesh of the same ranks and shape as ``mesh``, on process groups of its own whose
    collectives wait at most ``timeout`` seconds, its axes named apart from every other mesh
    (``name@funcmetaN``). torch's ``DeviceMesh`` compares equal to any mesh of the same ranks
    and axis names, whatever its process groups, and a ``DTensor`` placed on one may come back
    on an equal mesh made earlier, with that mesh's groups and timeout
    (docs/decisions/sharded-parameters.md); a mesh of its own keeps the timeout."""
    from torch.distributed.device_mesh import DeviceMesh

    grid = mesh.mesh
    where = (grid == comm.rank()).nonzero()
    if where.shape[0] == 0:
        raise ShardingError(
            f"rank {comm.rank()} is not in the mesh {grid.tolist()}: call shard_model on the "
            "ranks of the mesh (every rank of it runs the same code)"
        )
    at = where[0].tolist()
    groups = []
    for axis in range(grid.dim()):
        index: list[Any] = list(at)
        index[axis] = slice(None)
        groups.append(comm.new_group(grid[tuple(index)].tolist(), timeout))
    names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(grid.dim()))
    return DeviceMesh.from_group(
        groups if grid.dim() > 1 else groups[0],
        mesh.device_type,
        mesh=grid if grid.dim() > 1 else None,
        mesh_dim_names=comm.own_axis_names(names, next(_MESHES)),
    )


#: What ``shard_model(init=...)`` is called with: a tensor's qualified name and the meta
#: tensor it replaces; it returns that tensor's whole values (the same on every rank).
Init = Callable[[str, Tensor], Tensor]


def _mesh_device(mesh: Any) -> torch.device:
    """The device a mesh's tensors live on (this process's CUDA device on a CUDA mesh)."""
    if mesh.device_type == "cuda":  # pragma: no cover - GPU
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _meta_tensors(module: nn.Module) -> list[str]:
    """The qualified names of ``module``'s parameters and buffers on the meta device."""
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    return [n for n, t in named if t is not None and t.is_meta]


class _Values:
    """``init``'s whole tensors, checked (:meth:`take`), and a running checksum of all of them
    in order: the ranks compare it once every tensor is placed, since each keeps its slice of
    its own values without communication."""

    def __init__(self, init: Init, device: torch.device) -> None:
        self.init, self.device = init, device
        self.digest = torch.zeros((), dtype=torch.int64)

    def take(self, name: str, like: Tensor) -> Tensor:
        """``init(name, like)``: a tensor of ``like``'s shape and dtype, on the device."""
        value = self.init(name, like)
        if not isinstance(value, Tensor):
            raise ShardingError(
                f"init({name!r}, ...) returned {type(value).__name__}: it must return the whole "
                f"tensor's values (shape {tuple(like.shape)}, {like.dtype})"
            )
        if value.is_meta or tuple(value.shape) != tuple(like.shape) or value.dtype != like.dtype:
            where = (
                "on the meta device" if value.is_meta else f"{tuple(value.shape)}, {value.dtype}"
            )
            raise ShardingError(
                f"init({name!r}, ...) returned a tensor {where}; {name!r} needs shape "
                f"{tuple(like.shape)} and {like.dtype}, with its values"
            )
        value = value.detach().to(self.device)
        self.digest = self.digest * 31 + digest(value).cpu()
        return value

    def check(self, runtime: ShardedRuntime) -> None:
        """Raise :class:`ShardingError` on every rank unless ``init`` gave every rank the same
        values (one 8-byte all-gather)."""
        runtime.check_digest(
            self.digest,
            "the values init= gave",
            "init= gave different values on different ranks of the shard axis (a random draw "
            "without the same seed on every rank?): each rank kept its slice of other tensors, "
            "and the model they make up is none of them. Give init the same values everywhere "
            "(seed the draw the same, or read the same file) and build the model again",
        )


def _materialize_buffers(module: nn.Module, values: _Values) -> None:
    """Each buffer on the meta device replaced by ``init``'s whole values (buffers are not
    sharded: every rank holds them whole)."""
    for prefix, layer in module.named_modules(remove_duplicate=False):
        buffers = buffer_dict(layer)
        for name, b in list(buffers.items()):
            if b is not None and b.is_meta:
                buffers[name] = values.take(f"{prefix}.{name}" if prefix else name, b)


@exposed_in("funcmeta.distributed")
def shard_model(
    module: nn.Module,
    mesh: Any,
    *,
    mesh_dim: str | int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    init: Callable[[str, Tensor], Tensor] | None = None,
    reshard_after_forward: bool = True,
    compute_on_shards: Sequence[str] = (),
    split_activations: bool = True,
) -> nn.Module:
    """Shard ``module``'s parameters across the processes of a ``DeviceMesh``, in place, and
    gather each layer's parameters only while that layer runs; returns ``module``.

    On a 1-D mesh every rank holds a shard. On a 2-D mesh ``mesh_dim`` (a name or an index)
    is the axis that splits the parameters; along the other the parameters are replicated,
    and the ranks there may run different tasks (split them with
    :func:`shard` over ``mesh.get_group(other)`` and average the meta-gradients with
    :func:`average_gradients` over that group, which takes the shards' ``.grad``).

    The parameters are placed on a mesh of the same ranks built for this call, on process
    groups of its own: every collective of the model (its gathers, its checks, the
    reductions of its gradients) waits at most ``timeout`` seconds for the other ranks, then
    raises :class:`PeerError`, whatever meshes the process made before. Its runtime owns
    them (``fm.functional_model(module).runtime``).

    Build the functional model after it (``fm.functional_model(module, checkpoint_layers=...)``:
    checkpointing the same layers keeps one layer's full parameters at a time); a functional
    model built before is refused by name at its next use. Every rank of the shard axis must
    compute on the same data, unless it gathers the whole parameters for its own tasks with
    :func:`gather_params`. Every way of computing a loss on the shards checks this and
    raises :class:`ShardingError` on every rank where they differ: :func:`funcmeta.adapt`
    and the task-batched calls (:func:`funcmeta.adapt_tasks`, :func:`funcmeta.task_losses`,
    :func:`funcmeta.apply_tasks`, the recipes) compare the batch; a direct call
    (``fmodel(params, x)`` or ``module(x)``) compares its inputs, and in the backward the
    gradient reaching its outputs, where the targets show. The task-batched calls run the
    tasks one at a time, since a ``DTensor`` does not run under ``torch.func.vmap``.
    :func:`funcmeta.compile_meta_step` raises :class:`ShardingError`. Learnable
    hyperparameters (``fm.hyper`` rates) are placed beside the shards with :func:`shard_hyper`.

    **What stays gathered.** With ``reshard_after_forward=True`` (the default, as in FSDP)
    what autograd saves of a gathered parameter (a product's weight, for its backward; in
    second order also for the double backward of the inner gradients funcmeta takes) is the
    parameter's shard, gathered again when a backward reads it: one layer's full parameters
    alive at a time, checkpointed or not, for a gather per saved parameter read. ``False``
    keeps what autograd saves whole: fewer gathers, but without checkpointing every layer's
    full parameters stay alive from its forward to its backward, once per pass.

    **What stays of the activations.** Every rank of the shard axis computes the same
    activations, so with ``split_activations=True`` (the default) each keeps only its slice
    (1/world) of what autograd saves in the forwards and inner gradients of the entry points
    (:func:`funcmeta.adapt`, the task-batched calls, the recipes), checkpointed or not, and
    the ranks all-gather a slice when a backward reads it: a gather per saved activation
    read, the same values (exact). A checkpointed layer keeps its slices of the inputs it
    saves either way. ``False`` keeps the unchecked activations whole: fewer collectives,
    each rank holding all of them. Floating CPU tensors (gloo) of 4096 elements or more; a
    direct call of the model (``fmodel(params, x)``) keeps its activations whole, and so do
    the ``compute_on_shards`` layers what they save of their own part (their shards, their
    slices of a gradient), which differs between the ranks.

    **Layers computed on their shards.** ``compute_on_shards`` names layers that are never
    gathered: an ``nn.Embedding`` looks up the ids in its rank's rows and the ranks sum the
    rows (an all-reduce of its output), an ``nn.Linear`` computes its rank's slice of the
    output features and the ranks join the slices (an all-gather of its output). Their
    collectives move the outputs (tokens x features) instead of the weight: name a language
    model's embedding and head (``["model.embed_tokens", "lm_head"]``), each larger than a
    decoder layer, and a rank never holds more than one decoder layer's whole parameters.
    Exact, second order included.

    **A model no rank holds whole.** Build it on the meta device (``with
    torch.device("meta"):``) and pass ``init``: for each parameter and buffer, in order,
    ``init(name, meta_tensor)`` returns its whole values (the same on every rank: a seeded
    draw, or the tensor read from a file); the rank keeps its own shard of it (no
    communication) and drops the rest before asking for the next. A rank's memory during the
    build is then its shards plus one whole tensor. Buffers are kept whole.

    Raises :class:`ShardingError` for a mesh of more than two axes, a 2-D mesh without
    ``mesh_dim``, a module already sharded, a ``compute_on_shards`` name that is no
    ``nn.Embedding`` or ``nn.Linear`` of the module, and a
    parameter held by two layers (tied weights): each layer gathers its own parameters, so a
    shared one would be gathered by one layer and read as a shard by the other. The ranks
    first compare their modules' parameters (names, shapes, dtypes): a difference raises
    :class:`MismatchError` on every rank, and a rank that does not answer within ``timeout``
    seconds :class:`PeerError`. A gather that fails later (a peer gone) raises
    :class:`PeerError` naming the layer. A module with tensors on the meta device and no
    ``init`` (or ``init`` and none), and an ``init`` that returns anything but a tensor of
    the meta tensor's shape and dtype, raise :class:`ShardingError` naming the tensor; an
    ``init`` that gives the ranks different values raises it on every rank once the model is
    placed (the ranks compare a checksum of all the values). A torch older than the sharded
    runtime's floor raises :class:`funcmeta.UnsupportedTorchError` (``docs/torch-versions.md``).

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
    from torch.distributed.tensor import Replicate, Shard

    require("sharded models", "fm.distributed.shard_model")
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard_model takes an nn.Module, got {type(module).__name__}")
    check_real(timeout, "timeout (seconds)", low=0.0, low_open=True)
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            "reshard_after_forward must be True (keep the shards of the gathered parameters "
            "autograd saves, gathered again when a backward reads them) or False (keep them "
            f"whole), got {type(reshard_after_forward).__name__}"
        )
    if not isinstance(split_activations, bool):
        raise TypeError(
            "split_activations must be True (each rank keeps its slice of the activations "
            "autograd saves, gathered again when a backward reads them) or False (keep them "
            f"whole), got {type(split_activations).__name__}"
        )
    axis = _shard_axis(mesh, mesh_dim)
    if init is not None and not callable(init):
        raise TypeError(
            f"init must be a function (name, meta tensor) -> whole tensor, got {type(init).__name__}"
        )
    on_meta = _meta_tensors(module)
    if on_meta and init is None:
        raise ShardingError(
            f"{on_meta[0]!r} (and {len(on_meta) - 1} more) is on the meta device: pass "
            "init=(name, meta tensor) -> its whole values, and each rank keeps its shard"
        )
    if init is not None and not on_meta:
        raise ShardingError(
            "init= materializes a module built on the meta device, and this one has no tensor "
            "there: shard it without init (its values are rank 0's)"
        )
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
    chosen = choose_on_shards(module, compute_on_shards)
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
    own = _own_mesh(mesh, timeout)
    runtime = ShardedRuntime(
        own, axis, timeout, reshard=reshard_after_forward, split=split_activations
    )
    install_on_shards(chosen, runtime)
    values = None if init is None else _Values(init, _mesh_device(own))
    if values is not None:
        _materialize_buffers(module, values)
    for prefix, layer in module.named_modules():
        names = [n for n, p in parameter_dict(layer).items() if p is not None]
        if not names:
            continue
        for name in names:
            p = parameter_dict(layer)[name]
            assert p is not None
            placements: list[Any] = [Replicate()] * own.ndim
            if p.dim() > 0:
                placements[axis] = Shard(0)
            with torch.no_grad():
                if p.is_meta:
                    assert values is not None
                    whole = values.take(f"{prefix}.{name}" if prefix else name, p)
                    placed = comm.distribute(whole, own, placements, local=True)
                    del whole  # one whole tensor at a time
                else:
                    placed = comm.distribute(p.detach(), own, placements)
            parameter_dict(layer)[name] = nn.Parameter(placed, requires_grad=p.requires_grad)
        if prefix in chosen:
            continue
        gather = _LayerGather(reshard_after_forward)
        layer.register_forward_pre_hook(gather.before)
        layer.register_forward_hook(gather.after, always_call=True)
    if values is not None:
        values.check(runtime)
    # a direct call's checks: before any layer gathers (prepended), after every layer is back
    runtime.watch(module)
    record_sharding(module, own, runtime)
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
    from torch.distributed.tensor import Replicate, Shard

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
        with torch.no_grad():
            placed_raw = comm.distribute(raw.detach(), mesh, placements)
        return nn.Parameter(placed_raw, requires_grad=raw.requires_grad)

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
