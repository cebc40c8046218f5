"""The runtime of a model sharded by :func:`funcmeta.distributed.shard_model`: one object
that owns the mesh, its process groups and their timeout, and every gather, check and
collective of the model's steps.

:func:`funcmeta.functional_model` gives a sharded module's functional model this runtime
(``FunctionalModel.runtime``), and every way of computing a loss on it goes through it:

- the entry points (:func:`funcmeta.adapt`, :func:`funcmeta.adapt_tasks`,
  :func:`funcmeta.task_losses`, :func:`funcmeta.apply_tasks`, the recipes) compare the
  batch's checksum across the ranks of the shard axis before they compute
  (:meth:`ShardedRuntime.check_batch`), and each inner step compares its loss
  (:meth:`ShardedRuntime.gradient`: a random draw that differs between ranks shows there);
- a direct call of the model (``fmodel(params, x)``, or ``net(x)``) is checked by hooks on
  the sharded module (and on a part of it made functional on its own,
  :meth:`ShardedRuntime.watch`): its inputs' checksum before the forward, and in the backward the
  gradient that reaches its outputs (:meth:`ShardedRuntime.outputs`), which holds the
  targets and the loss the model never sees. ``fm.apply_tasks``' outputs get the same check;
- each layer gathers its parameters while it runs (:class:`_LayerGather`), and each rank
  keeps its slice of the activations autograd saves: a checkpointed layer's
  (:meth:`ShardedRuntime.split_saving`), and every one saved in the entry points' forwards
  and inner gradients (:meth:`ShardedRuntime.splitting`).

Every collective is started by ``funcmeta._src.distributed.comm``. The ranks of the shard
axis must compute on the same data: a gathered parameter's backward keeps each rank's slice
of a gradient it assumes is the same on every rank (``docs/decisions/sharded-parameters.md``).
Where they do not, every rank raises :class:`~funcmeta.distributed.ShardingError`.

Example (one process; under ``torchrun`` every rank runs the same code):
    >>> import tempfile, torch, torch.distributed as dist
    >>> import funcmeta as fm
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    >>> net = fm.distributed.shard_model(torch.nn.Linear(4, 2), init_device_mesh("cpu", (1,)), timeout=30)
    >>> runtime = fm.functional_model(net).runtime
    >>> type(runtime).__name__, runtime.timeout
    ('ShardedRuntime', 30.0)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from funcmeta._src.checkpoint.engine import recomputing_for_a_vjp
from funcmeta._src.core import tree
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import (
    parameter_dict,
    saved_hooks_in_force,
    saved_tensor_hooks_state,
)
from funcmeta._src.core.saved import keep, kept
from funcmeta._src.core.sharding import ShardingError, is_sharded
from funcmeta._src.core.vmap import loop_flat
from funcmeta._src.distributed import comm, crossing
from funcmeta._src.module import scope
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.runtime import EAGER, EagerRuntime, Runtime
from funcmeta._src.runtime.base import Objective

__all__ = ["ShardedRuntime", "gathered_bytes"]

_DETERMINISM = (
    "If the data and the random draws (dropout) are the same on every rank, a kernel that "
    "is not bitwise deterministic made them differ: run every rank with the same "
    "torch.set_num_threads and torch.use_deterministic_algorithms(True)"
)


class ShardedRuntime(EagerRuntime):
    """The runtime of one :func:`funcmeta.distributed.shard_model` call (see the module
    docstring): the eager runtime with the tasks of a call run one at a time (a ``DTensor``
    runs under no ``torch.func`` transform), the same-data checks, the layers' gathers.

    Attributes:
        mesh: the mesh the parameters are placed on (built by ``shard_model`` from the one
            it was given: the same ranks, process groups of its own with ``timeout``).
        axis: the mesh axis that splits the parameters.
        group: that axis's process group for this rank.
        timeout: seconds each collective waits for the other ranks.
        reshard: whether what autograd saves of a gathered parameter is its shard, gathered
            again when read (``shard_model(reshard_after_forward=)``).
        split: whether each rank keeps only its slice of the activations autograd saves in
            the entry points' forwards and inner gradients, gathered again when a backward
            reads them (``shard_model(split_activations=)``; :meth:`splitting`).
    """

    keeps_layer_graphs = False

    def __init__(
        self, mesh: Any, axis: int, timeout: float, reshard: bool = True, split: bool = True
    ) -> None:
        self.mesh = mesh
        self.reshard = reshard
        self.split = split
        self.axis = axis
        self.group = mesh.get_group(axis)
        self.ranks = comm.size(self.group)
        self.timeout = float(timeout)
        self._local = threading.local()
        self._watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # ------------------------------------------------------------ the call's runtime

    def for_params(self, params: Mapping[str, Any]) -> Runtime:
        """This runtime for the shards; the eager one for whole parameters
        (``fm.distributed.gather_params``: each rank its own tasks, ``vmap`` over them)."""
        return self if any(is_sharded(v) for v in params.values()) else EAGER

    def refuse(self, entry: str, why: str) -> None:
        raise ShardingError(f"{entry} cannot take a sharded model: {why}")

    def check_options(self, options: Any, entry: str) -> None:
        """Refuse ``on_nonfinite`` and ``loss_scale``: their non-finite check reduces the
        gradients with a product, which DTensor refuses ("Replicate to Partial(product)
        conversion is not supported")."""
        for option in ("on_nonfinite", "loss_scale"):
            if getattr(options, option) is not None:
                self.refuse(
                    f"{entry} with {option}=",
                    "its check of the inner gradients for non-finite values does not run on "
                    "DTensor shards yet; leave it out (a non-finite loss then reaches the "
                    "parameters, as it does without the option)",
                )

    @contextlib.contextmanager
    def entry(self) -> Iterator[None]:
        """Refuse a learnable tensor meeting a shard outside the model's forward (a rate not
        placed by ``shard_hyper``)."""
        with _LearnableMeetsShard(lambda: scope.current() is not None):
            yield

    # ------------------------------------------------------------ the checks

    def check_batch(self, batch: Any, entry: str) -> None:
        """Raise :class:`ShardingError` on every rank of the shard axis unless all hold the
        same ``batch`` (values, shapes, order): one 8-byte all-gather."""
        if self.ranks == 1:
            return
        device = self._device()
        leaves = [x for x in tree.leaves_registered(batch) if isinstance(x, Tensor)]
        total = torch.zeros((), dtype=torch.int64, device=device)
        for i, x in enumerate(leaves):
            shape = torch.tensor(list(x.shape) or [0], dtype=torch.int64, device=device)
            total = total * 31 + digest(x).to(device) + (i + 1) * digest(shape)
        self._same(total, f"the batches given to {entry}", _different_batches(entry))

    def check_result(self, value: Tensor, what: str) -> None:
        """Raise :class:`ShardingError` on every rank unless ``value`` (a loss computed on
        the checked batch) is the same bits on every rank of the shard axis."""
        if self.ranks == 1:
            return
        self._same(
            digest(value).to(self._device()),
            what,
            f"{what} differs between the ranks that split the parameters, on the same batch: "
            f"their gradients would be wrong. {_DETERMINISM}",
        )

    def check_digest(self, digest: Tensor, what: str, message: str) -> None:
        """Raise :class:`ShardingError` with ``message`` on every rank of the shard axis
        unless ``digest`` (an int64 checksum, :func:`digest`) is the same on all of them."""
        if self.ranks == 1:
            return
        self._same(digest.to(self._device()), what, message)

    def _same(self, digest: Tensor, what: str, message: str) -> None:
        every = comm.all_gather(digest.reshape(1), self.group, self.timeout, f"comparing {what}")
        if not bool((every == every[0]).all()):
            raise ShardingError(message)

    def _device(self) -> torch.device:
        return comm.world_device(torch.device(self.mesh.device_type), self.group)

    # ------------------------------------------------------------ the steps

    def run(
        self,
        fmodel: FunctionalModel,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """The eager run; the direct-call hooks of the sharded module stand aside (the entry
        point checked the batch, targets included)."""
        depth = getattr(self._local, "inside", 0)
        self._local.inside = depth + 1
        try:
            with self.splitting():
                return super().run(fmodel, params, buffers, args, kwargs)
        finally:
            self._local.inside = depth

    def over_tasks(
        self,
        one_task: Callable[..., Any],
        trees: tuple[Any, ...],
        in_dims: tuple[Any, ...],
        chunk: int | None,
    ) -> Any:
        return loop_flat(one_task, trees, in_dims)

    def gradient(
        self,
        objective: Objective,
        leaves: list[Tensor],
        buffers: dict[str, Tensor],
        *,
        second_order: bool,
        keep_graph: bool,
    ) -> tuple[Tensor, list[Tensor | None], dict[str, Tensor]]:
        """The eager inner gradient, its loss compared across the ranks. A second-order
        gradient's graph saves the gathered parameters its products read (their double
        backward needs them): it keeps their shards instead, gathered again when the outer
        backward reads them (:func:`regathering`)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.splitting())
            saving = regathering() if second_order and self.reshard and self.ranks > 1 else None
            if saving is not None:  # under the splitting hooks: it hands them activations
                stack.enter_context(saving)
            loss, found, new_buffers = super().gradient(
                objective, leaves, buffers, second_order=second_order, keep_graph=keep_graph
            )
        self.check_result(loss.detach(), "an inner step's loss")
        return loss, found, new_buffers

    def outputs(self, out: Any) -> Any:
        """``out`` whose backward compares the gradient reaching it across the ranks: a loss
        of targets that differ between ranks shows there."""
        if self.ranks == 1 or not torch.is_grad_enabled():
            return out
        leaves, spec = tree.flatten_registered(out)
        if not any(isinstance(x, Tensor) and x.requires_grad for x in leaves):
            return out
        checked = [
            _SameGradient.apply(self, x) if isinstance(x, Tensor) and x.requires_grad else x
            for x in leaves
        ]
        return tree.unflatten_registered(checked, spec)

    # ------------------------------------------------------------ direct calls

    def watch(self, module: nn.Module) -> None:
        """Check each direct call of ``module`` (the sharded module, or a part of it made
        functional on its own): hooks that compare its inputs before the forward and, in
        the backward, the gradient reaching its outputs. Once per module."""
        if module in self._watched:
            return
        self._watched.add(module)
        module.register_forward_pre_hook(self._before_call, with_kwargs=True, prepend=True)
        module.register_forward_hook(self._after_call, with_kwargs=True, always_call=True)

    def _before_call(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        stack = self._calls()
        check = (
            getattr(self._local, "inside", 0) == 0  # an entry point checked its batch
            and not any(stack)  # a watched call around this one checks
            and torch.is_grad_enabled()
            and any(is_sharded(p) for p in module.parameters())
        )
        stack.append(check)
        if check:
            self.check_batch((args, kwargs), "a call of the sharded model")

    def _after_call(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        stack = self._calls()
        if stack and stack.pop() and output is not None:
            return self.outputs(output)
        return None

    def _calls(self) -> list[bool]:
        return _per_thread(self._local, "calls")

    # ------------------------------------------------------------ saved activations

    def splitting(self) -> contextlib.AbstractContextManager[Any]:
        """Saved-tensor hooks under which autograd keeps only this rank's slice of each
        activation it saves (a plain floating CPU tensor of ``_SPLIT_MIN`` elements or more
        that is no gathered parameter), all-gathered back when a backward reads it: every
        rank of the shard axis computes the same activations, so each keeps 1/world of them.
        In force around the entry points' forwards (:meth:`run`) and inner gradients
        (:meth:`gradient`, whose second-order graph is saved through them too). Hooks in
        force under these (a step checkpoint's, an offload) get the slice to keep, so that
        a step checkpoint's recomputation keeps slices too. A nullcontext where ``split`` is
        off, on one rank, where torch allows no saved-tensor hooks now (inside a
        ``torch.func`` transform), where these are in force already, and in a checkpointed
        layer's recomputation for a VJP taken right away (one layer's graph, dropped after
        it)."""
        if not self.split or self.ranks == 1 or saved_tensor_hooks_state() is not None:
            return contextlib.nullcontext()
        outer = saved_hooks_in_force()
        if _splitting_in(outer) is not None or recomputing_for_a_vjp():
            return contextlib.nullcontext()
        hooks = _Splitting(self, outer)
        return torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)

    def keeping_whole(self) -> contextlib.AbstractContextManager[Any]:
        """Saved-tensor hooks under which what autograd saves is kept whole, not split by
        :meth:`splitting`'s hooks in force around it: a tensor that differs between the
        ranks (a shard, a layer computed on its shards' slice of a gradient) gathered from
        every rank's slice would be a mix of them. Gathered parameters keep their shards as
        under :meth:`splitting`; other tensors go to the hooks in force under the splitting
        ones (a step checkpoint's), or are kept. A nullcontext where no splitting hooks are
        in force."""
        hooks = saved_hooks_in_force()
        found = _splitting_in(hooks)
        if found is None:
            return contextlib.nullcontext()
        whole = _Regathering(found.outer)
        return torch.autograd.graph.saved_tensors_hooks(whole.pack, whole.unpack)

    def split_saving(self, tensors: Iterable[Tensor]) -> contextlib.AbstractContextManager[Any]:
        """Saved-tensor hooks that keep only this rank's slice of each plain (replicated)
        floating tensor a checkpointed layer saves, its inputs and incoming gradients,
        all-gathered back when the backward reads them. Every rank of the shard axis holds
        the same activations (the same data), so each keeps 1/world of them. CPU tensors of
        ``_SPLIT_MIN`` elements or more only (gloo)."""
        if self.ranks == 1:
            return contextlib.nullcontext()

        def pack(t: Tensor) -> Any:
            return _Piece(t, self) if _splittable(t) else keep(t)

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpacked)


def _per_thread(local: threading.local, name: str) -> list[Any]:
    """The list ``name`` of ``local`` for this thread (a new one at its first use)."""
    found = getattr(local, name, None)
    if found is None:
        found = []
        setattr(local, name, found)
    return found


def _different_batches(entry: str) -> str:
    return (
        f"the ranks that split the parameters hold different batches in {entry}: a sharded "
        "model needs the same data on every rank of its shard axis, through every way of "
        "computing a loss (fm.adapt, fm.adapt_tasks, fm.task_losses, fm.apply_tasks, the "
        "recipes, and a direct call of the model), since a gathered parameter's backward sums "
        "nothing across the ranks and the gradients would be wrong. To give each rank its own "
        "tasks, gather the whole parameters for them (fm.distributed.gather_params), or split "
        "the tasks along another mesh axis (shard_model(..., mesh_dim=) on a 2-D mesh) and "
        "average with fm.distributed.average_gradients over it"
    )


def digest(tensor: Tensor) -> Tensor:
    """An exact checksum of ``tensor``'s values and their order, the same on any device and
    thread count: its bit patterns as integers, weighted by position, summed in int64."""
    if is_sharded(tensor):
        tensor = tensor.to_local()  # type: ignore[attr-defined]
    x = tensor.detach().contiguous().reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.is_floating_point() or x.is_complex():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        x = x.view(bits[x.element_size()]) if x.element_size() in bits else x.view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, x.numel(), _DIGEST_CHUNK):  # int64 temporaries of 8 MiB at most
        part = x[start : start + _DIGEST_CHUNK]
        place = torch.arange(start, start + part.numel(), device=x.device, dtype=torch.int64)
        total += (part.to(torch.int64) * (place % 1021 + 1)).sum()
    return total


#: Elements a checksum converts to int64 at a time (a query's logits can be large).
_DIGEST_CHUNK = 1 << 20


class _SameGradient(torch.autograd.Function):
    """The identity, whose backward compares the incoming gradient's checksum across the
    ranks of the shard axis (one 8-byte all-gather) and raises :class:`ShardingError` on
    every rank where it differs."""

    @staticmethod
    def forward(ctx: Any, runtime: ShardedRuntime, x: Tensor) -> Tensor:
        ctx.runtime = runtime
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        runtime: ShardedRuntime = ctx.runtime
        runtime._same(
            digest(grad).to(runtime._device()),
            "the gradient reaching the model's outputs",
            "the gradient reaching a sharded model's outputs differs between the ranks that "
            "split its parameters: the loss computed from them (its targets, or what it adds) "
            "is not the same on every rank, so the meta-gradients would be wrong. Give every "
            "rank of the shard axis the same batch, targets included, or gather the whole "
            "parameters for each rank's own tasks (fm.distributed.gather_params). " + _DETERMINISM,
        )
        return None, grad


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


# ------------------------------------------------------------------ the layers' gathers


class _LayerGather:
    """The forward hooks of one layer: its ``DTensor`` parameters gathered for the forward,
    the shards back afterwards (also when the forward raises). Per thread, and nested
    (a layer called again inside its own forward). With ``reshard`` what autograd saves of
    the gathered parameters while the forward runs keeps their shards instead
    (:func:`regathering`), so that a layer's whole parameters live while it runs and again
    while a backward reads them, not from its forward to its backward."""

    def __init__(self, reshard: bool = True) -> None:
        self._local = threading.local()
        self.reshard = reshard

    def _stack(self) -> list[tuple[dict[str, Any], Any]]:
        return _per_thread(self._local, "stack")

    def before(self, module: nn.Module, args: Any) -> None:
        shards = {n: p for n, p in parameter_dict(module).items() if is_sharded(p)}
        entry: tuple[dict[str, Any], Any] = (shards, None)
        self._stack().append(entry)
        whole = False
        for name, shard in shards.items():
            what = f"{type(module).__name__} parameter {name!r}"
            full = crossing.whole(shard, what)
            if full.data_ptr() != shard.to_local().data_ptr():  # one rank: the shard itself
                _remember(full, shard, what)
                whole = True
            parameter_dict(module)[name] = full
        saving = regathering() if whole and self.reshard else None
        if saving is not None:
            saving.__enter__()
            self._stack()[-1] = (shards, saving)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if not stack:
            return
        shards, saving = stack.pop()
        try:
            if saving is not None:
                saving.__exit__(None, None, None)
        finally:
            for name, shard in shards.items():
                parameter_dict(module)[name] = shard


# ------------------------------------------------------------------ gathered, saved, gathered again

#: The gathered storages alive, by address: a weak reference to the storage, the shard it was
#: gathered from, what it is (for messages), its whole tensor's offset and dtype.
_SOURCES: dict[int, tuple[weakref.ref[Any], Any, str, int, torch.dtype]] = {}


def _remember(full: Tensor, shard: Any, what: str) -> None:
    """Note that ``full`` was gathered from ``shard``, while its storage lives (and count it
    in :func:`gathered_bytes`)."""
    _count(full)
    storage = full.untyped_storage()
    key = storage.data_ptr()

    def forget(ref: weakref.ref[Any]) -> None:
        entry = _SOURCES.get(key)
        if entry is not None and entry[0] is ref:
            del _SOURCES[key]

    offset = int(full.storage_offset())
    _SOURCES[key] = (weakref.ref(storage, forget), shard, what, offset, full.dtype)


class _Regather:
    """What autograd keeps of a saved gathered parameter (or a view of it): its shard and
    the view's geometry; :meth:`whole` gathers it again."""

    __slots__ = ("offset", "shape", "shard", "stride", "what")

    def __init__(self, t: Tensor, shard: Any, what: str, base: int) -> None:
        self.shard, self.what = shard, what
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset() - base

    def whole(self) -> Tensor:
        """The saved tensor again, from a new gather (the same values)."""
        with torch.no_grad():
            full = comm.gather_whole(
                self.shard, f"gathering {self.what} again for a backward that reads it"
            )
        _remember(full, self.shard, self.what)
        return full.as_strided(self.shape, self.stride, full.storage_offset() + self.offset)


class _Outer:
    """A tensor packed by the saved-tensor hooks that were in force under ours."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], Tensor]) -> None:
        self.packed, self.unpack = packed, unpack


class _Regathering:
    """Saved-tensor hooks: a gathered parameter saved is kept as its shard
    (:class:`_Regather`); any other tensor goes to the hooks in force under these (a
    checkpoint's, ``save_on_cpu``), or is kept as it is."""

    __slots__ = ("outer",)

    outer: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None

    def __init__(self, outer: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None):
        below = getattr(outer[0], "__self__", None) if outer is not None else None
        self.outer = below.outer if isinstance(below, _Regathering) else outer

    def pack(self, t: Tensor) -> Any:
        found = _source(t)
        if found is not None:
            return found
        if self.outer is not None:
            return _Outer(self.outer[0](t), self.outer[1])
        return keep(t)  # checked for in-place writes at the unpack

    @staticmethod
    def unpack(x: Any) -> Tensor:
        return _unpacked(x)


def _source(t: Tensor) -> _Regather | None:
    """``t``'s :class:`_Regather` when it is (a view of) a gathered parameter alive."""
    if not _SOURCES or type(t) is not Tensor:
        return None
    key = t.untyped_storage().data_ptr()
    entry = _SOURCES.get(key)
    if entry is None:
        return None
    ref, shard, what, base, dtype = entry
    storage = ref()
    if storage is None or storage.data_ptr() != key or t.dtype != dtype:
        return None
    return _Regather(t, shard, what, base)


def regathering() -> contextlib.AbstractContextManager[Any] | None:
    """Saved-tensor hooks under which autograd keeps a gathered parameter's shard, not the
    whole tensor, and gathers it again when a backward reads it, as FSDP reshards after
    the forward: a layer's whole parameters live while it runs and while a backward reads
    them. ``None`` where torch allows no saved-tensor hooks now (inside a ``torch.func``
    transform), and in a checkpointed layer's recomputation for a VJP taken right away,
    whose graph, gathered parameters included, is dropped after it (one layer's)."""
    if saved_tensor_hooks_state() is not None or recomputing_for_a_vjp():
        return None
    hooks = _Regathering(saved_hooks_in_force())
    return torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)


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


# ------------------------------------------------------------------ saved activations split

#: Elements below which a saved tensor is kept whole (its gather would cost more than it saves).
_SPLIT_MIN = 4096


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _splittable(t: Tensor) -> bool:
    """Whether a saved tensor is kept as this rank's slice: a plain (replicated) floating
    CPU tensor (gloo) of ``_SPLIT_MIN`` elements or more, whose values lie in a run of its
    storage at most twice their number (:func:`_span`: a transposed or permuted view, an
    expanded one; not a column of a wide matrix), and no conjugated or negated view (``.mH``
    of a complex tensor)."""
    return (
        not is_sharded(t)
        and t.numel() >= _SPLIT_MIN
        and _differentiable(t)
        and t.device.type == "cpu"
        and not t.is_conj()  # a conjugated or negated view reads its storage's values
        and not t.is_neg()  # changed: its slice would pass for the storage's own
        and _span(t) <= 2 * t.numel()
    )


def _span(t: Tensor) -> int:
    """The elements of ``t``'s storage from its offset to its last value (strides are never
    negative): its number of values where it is contiguous."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def _unpacked(x: Any) -> Tensor:
    """What the saved-tensor hooks of this module kept, as a tensor again: a slice or a shard
    gathered (:class:`_Piece`, :class:`_Regather`), or what the hooks under them made of it
    (:class:`_Outer`)."""
    if isinstance(x, (_Piece, _Regather)):
        return x.whole()
    if isinstance(x, _Outer):
        return x.unpack(x.packed)
    return kept(x)


class _Piece:
    """This rank's slice of the run of storage a saved tensor's values lie in (:func:`_span`,
    padded to an equal share), and the tensor's geometry; or, where other saved-tensor hooks
    were in force, what they made of that slice. A tensor saved again (one input of several
    products, a transposed view) gets the same slice (:func:`_slice_of`)."""

    __slots__ = ("packed", "piece", "runtime", "shape", "span", "stride", "unpack")

    def __init__(
        self,
        t: Tensor,
        runtime: ShardedRuntime,
        outer: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None = None,
    ) -> None:
        self.shape, self.stride, self.span, self.runtime = t.shape, t.stride(), _span(t), runtime
        piece = _slice_of(t, runtime)
        self.piece: Tensor | None = piece
        self.packed: Any = None
        self.unpack: Callable[[Any], Tensor] | None = None
        if outer is not None:
            self.piece, self.packed, self.unpack = None, outer[0](piece), outer[1]

    def whole(self) -> Tensor:
        """The tensor again, of the same shape and strides: every rank's slice, all-gathered
        (a copy of the same values)."""
        runtime = self.runtime
        piece = self.piece if self.unpack is None else self.unpack(self.packed)
        assert piece is not None
        out = piece.new_empty(piece.numel() * runtime.ranks)
        comm.all_gather_into(
            out,
            piece,
            runtime.group,
            runtime.timeout,
            f"gathering a saved activation (shape {tuple(self.shape)}) across the shard axis "
            "in a backward",
        )
        whole = out.as_strided(self.shape, self.stride, 0)
        # a second-order graph saves what its backward read (this tensor) again: the same
        # slice, not a new one of the copy
        _remember_slice(whole, runtime, piece)
        return whole


#: The slices made of saved tensors, by their storage's address: a weak reference to the
#: storage, the run's offset and length, the dtype, version and runtime, a weak reference to
#: the slice.
_SLICES: dict[int, list[tuple[Any, ...]]] = {}


def _slice_of(t: Tensor, runtime: ShardedRuntime) -> Tensor:
    """This rank's slice of the run of storage ``t``'s values lie in (flat, padded to an
    equal share): the one made for an earlier save of the same run while that slice lives
    (the same storage, offset, length, dtype and version: unchanged since, a view of another
    shape or order included), else a new one. Autograd saves one activation for several
    products (a layer's input, for each projection that reads it, some as a reshaped or
    transposed view), and one slice each would hold more than the activation did. Values in
    the run that ``t`` does not read (a gap between strided rows) are carried, never read."""
    found = _slice_found(t, runtime)
    if found is not None:
        return found
    world, me = runtime.ranks, comm.rank(runtime.group)
    flat = t.detach().as_strided((_span(t),), (1,))
    share = -(-flat.numel() // world)
    piece = flat[me * share : (me + 1) * share].clone()
    if piece.numel() < share:
        piece = torch.cat([piece, piece.new_zeros(share - piece.numel())])
    _remember_slice(t, runtime, piece)
    return piece


def _slice_key(t: Tensor, runtime: ShardedRuntime) -> tuple[Any, ...]:
    # the run of storage a tensor's values lie in, whatever its shape and strides: a view of
    # it (a reshape or a transpose for a product) gets the same slice
    return (t.storage_offset(), _span(t), t.dtype, t._version, id(runtime))


def _slice_found(t: Tensor, runtime: ShardedRuntime) -> Tensor | None:
    """The slice remembered for ``t``'s values (:func:`_remember_slice`), while it lives."""
    storage = t.untyped_storage()
    what = _slice_key(t, runtime)
    for ref, key, piece in _SLICES.get(storage.data_ptr(), ()):
        found = piece()
        if ref() is storage and key == what and found is not None:
            return found
    return None


def _remember_slice(t: Tensor, runtime: ShardedRuntime, piece: Tensor) -> None:
    """Remember that ``piece`` is this rank's slice of ``t``'s values while both live: one
    made of it, or the one ``t`` was gathered from (a backward's saved tensor, which a
    second-order graph saves again)."""
    storage = t.untyped_storage()
    address = storage.data_ptr()

    def forget(_: Any) -> None:
        alive = [e for e in _SLICES.get(address, ()) if e[0]() is not None and e[2]() is not None]
        if alive:
            _SLICES[address] = alive
        else:
            _SLICES.pop(address, None)

    entries = [e for e in _SLICES.get(address, ()) if e[0]() is not None and e[2]() is not None]
    entries.append(
        (weakref.ref(storage, forget), _slice_key(t, runtime), weakref.ref(piece, forget))
    )
    _SLICES[address] = entries


class _Splitting:
    """:meth:`ShardedRuntime.splitting`'s hooks: a splittable activation is kept as this
    rank's slice (:class:`_Piece`), handed to the hooks in force under these if any (a step
    checkpoint then keeps, or recomputes into, the slice); anything else goes to those hooks
    as it is, or is kept."""

    __slots__ = ("outer", "runtime")

    def __init__(
        self,
        runtime: ShardedRuntime,
        outer: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None,
    ) -> None:
        self.runtime, self.outer = runtime, outer

    def pack(self, t: Tensor) -> Any:
        if _splittable(t) and _source(t) is None:  # a gathered parameter: reshard's own
            return _Piece(t, self.runtime, self.outer)
        if self.outer is not None:
            return _Outer(self.outer[0](t), self.outer[1])
        return keep(t)  # checked for in-place writes at the unpack

    @staticmethod
    def unpack(x: Any) -> Tensor:
        return _unpacked(x)


def _splitting_in(
    hooks: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None,
) -> _Splitting | None:
    """``hooks``' :class:`_Splitting` when they are its, or a layer's :class:`_Regathering`
    over it."""
    below = getattr(hooks[0], "__self__", None) if hooks is not None else None
    if isinstance(below, _Regathering):
        return _splitting_in(below.outer)
    return below if isinstance(below, _Splitting) else None
