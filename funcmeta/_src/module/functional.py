"""Pure functions from ``nn.Module``: :func:`functional_model` and :class:`FunctionalModel`.

A :class:`FunctionalModel` calls its module through :func:`torch.func.functional_call`
with the parameters (and buffers) you pass, so the same module can run with adapted
parameters inside an inner loop while its own tensors stay untouched.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    >>> fmodel = fm.functional_model(net)
    >>> params = fmodel.params                 # the module's own Parameters
    >>> out, buffers = fmodel.run(params, fmodel.buffers, torch.randn(8, 3))
    >>> bool(net[1].running_mean.eq(0).all())  # the module's buffers are not mutated
    True
    >>> bool(buffers["1.running_mean"].ne(0).any())  # the updated statistics come back
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from funcmeta._src.core.checks import check_tree
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import buffer_dict, parameter_dict
from funcmeta._src.core.sharding import ShardingError, sharding_epoch, sharding_of
from funcmeta._src.core.vmap import any_batched
from funcmeta._src.module import scope
from funcmeta._src.module.guard import guard_of
from funcmeta._src.module.shadow import synced
from funcmeta._src.module.task_protocol import Executor

__all__ = ["FunctionalModel", "Swap", "check_layers", "run_in_place"]


@exposed_in("funcmeta")
class FunctionalModel:
    """A module as a pure function ``(params, buffers, *args) -> (out, new_buffers)``.

    Build one with :func:`funcmeta.functional_model`, which chooses the checkpointed layers
    (the ``runner``: a shadow of the module with those layers checkpointed, and its
    ``copies`` kept in step), gives it the task executor and its runtime (how its steps run:
    eager, or the runtime of a model sharded by ``fm.distributed.shard_model``, when
    ``sharded``).

    A module sharded after its functional model was built is refused by name at the model's
    next use (``params``, a call, an entry point): the functional model holds the whole
    tensors from before, which no gradient would reach through the shards.

    Attributes:
        module: the wrapped module; never mutated by calls.
        checkpointed: names of the submodules run under per-layer checkpointing.
        executor: what runs task-batched calls (``None``: vmap's own rules).
        params: ``dict[str, Tensor]`` of the module's own Parameters, by reference (tied
            weights appear once, under their first name), so meta-gradients reach
            ``param.grad`` and an outer ``torch.optim`` optimizer over
            ``module.parameters()``. A new dict on every access.
        buffers: ``dict[str, Tensor]`` of the module's buffers, by reference.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        runner: nn.Module | None = None,
        copies: Sequence[tuple[nn.Module, nn.Module]] = (),
        checkpointed: Sequence[str] = (),
        executor: Executor | None = None,
        runtime: Any,
        sharded: bool,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"functional_model expects an nn.Module, got {type(module).__name__}")
        check_layers(module)
        self.module = module
        self._runtime = runtime
        self._sharded = sharded
        self._epoch = sharding_epoch()
        self.checkpointed = list(checkpointed)
        self.runner = module if runner is None else runner
        self.copies = list(copies)
        self.swap = Swap(module, self.runner)
        # whether one tensor sits in two places of the module (or its runner): a traced call
        # then asks functional_call to put a given tensor in every place (its tie_weights)
        self.tied = shares_tensors(module) or (
            self.runner is not module and shares_tensors(self.runner)
        )
        self.executor = executor
        self._own_params = dict(module.named_parameters())
        self._own_buffers = dict(module.named_buffers())
        self._param_shapes = {k: v.shape for k, v in self._own_params.items()}
        self._buffer_shapes = {k: v.shape for k, v in self._own_buffers.items()}

    @property
    def params(self) -> dict[str, Tensor]:
        self.check_sharding()
        return dict(self._own_params)

    @property
    def runtime(self) -> Any:
        """How this model's steps run (``funcmeta._src.runtime``): chosen once, where the model
        was made; an entry point asks it for the call's runtime (``runtime.for_params``)."""
        self.check_sharding()
        return self._runtime

    def check_sharding(self) -> None:
        """Raise :class:`funcmeta.distributed.ShardingError` when the module was sharded (or
        sharded again) after this functional model was built. Costs an integer comparison
        unless a module was sharded since the last check."""
        if self._epoch == sharding_epoch():
            return
        now = sharding_of(self.module)
        if now is not (self._runtime if self._sharded else None):
            raise ShardingError(
                f"the module {type(self.module).__name__} was sharded "
                "(fm.distributed.shard_model) after fm.functional_model took it: this "
                "functional model holds its whole tensors from before, so no meta-gradient "
                "would reach the shards and an outer optimizer would train nothing. Build the "
                "functional model after sharding: fm.functional_model(net, ...) once "
                "fm.distributed.shard_model(net, mesh) has run"
            )
        self._epoch = sharding_epoch()

    @property
    def task_chunk_choices(self) -> dict[Any, dict[str, Any]]:
        """What ``task_chunk="auto"`` or ``"tune"`` chose per kind of task-batched call, with
        what it read or measured (the report of the latest call's chooser).

        Under ``"auto"``, ``{"chunk": c, "parameters": p, "inputs_per_task": n}`` (what the
        rule read); under ``"tune"``, ``{"chunk": c, "seconds": {candidate: seconds}}``, a
        candidate's seconds the least of its two trials. Empty before such a call."""
        return {} if self.executor is None else self.executor.choices

    @property
    def param_shapes(self) -> dict[str, torch.Size]:
        """The shape of each parameter, by name."""
        return dict(self._param_shapes)

    @property
    def buffer_shapes(self) -> dict[str, torch.Size]:
        """The shape of each buffer, by name."""
        return dict(self._buffer_shapes)

    @property
    def buffers(self) -> dict[str, Tensor]:
        return dict(self._own_buffers)

    @property
    def frozen(self) -> list[str]:
        """Names of the module's parameters with ``requires_grad=False``, read at each access.
        :func:`funcmeta.adapt` holds them fixed, and they get no meta-gradient."""
        return [k for k, p in self._own_params.items() if not p.requires_grad]

    @property
    def per_task(self) -> bool | None:
        """Whether task batching runs this model once per task, because part of its forward
        cannot run under ``vmap`` (data-dependent control flow, as in HuggingFace's attention
        mask code, or an operator without a batching rule). ``None`` until the first
        task-batched call finds out. :attr:`per_task_layers` says which layer and why."""
        return None if self.executor is None else self.executor.per_task

    @property
    def per_task_layers(self) -> dict[str, str]:
        """The layers task batching has run once per task so far, by name (``""`` for the
        model's own forward), each with why: the layer whose forward refused ``vmap`` when
        :attr:`per_task` is True, and recurrent layers that stepped aside from their
        one-pass path. Empty when everything ran batched. Each entry is also said once, as a
        warning, when it is first found."""
        return {} if self.executor is None else self.executor.per_task_layers

    def __call__(self, params: Mapping[str, Tensor], *args: Any, **kwargs: Any) -> Any:
        """The module's output with ``params`` and the module's buffers (left unmutated)."""
        return self.run(params, self._own_buffers, *args, **kwargs)[0]

    def run(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, Tensor]]:
        """Run the module on ``args`` and ``kwargs`` with ``params`` and ``buffers``.

        Returns ``(out, new_buffers)``. ``new_buffers`` are new tensors holding whatever the
        forward wrote into its buffers (BatchNorm running statistics in train mode); the
        buffers passed in and the module's own are left unchanged.
        """
        self.check_sharding()
        self.check_params(params)
        return self.run_checked(params, buffers, args, kwargs)

    def check_params(self, params: Mapping[str, Tensor]) -> None:
        """Raise ``TypeError``/``ValueError`` naming the entry unless ``params`` has the
        module's parameter names, each a tensor of the module's shape."""
        check_tree(params, self._param_shapes, "params")

    def check_buffers(self, buffers: Mapping[str, Tensor]) -> None:
        """Raise ``TypeError``/``ValueError`` naming the entry unless ``buffers`` has the
        module's buffer names, each a tensor of the module's shape."""
        check_tree(buffers, self._buffer_shapes, "buffers")

    def run_plain(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """Swap ``params`` and ``buffers`` (both checked) in and run the module's runner as it
        is, whatever the inputs: the executor's per-task runs, and unbatched calls."""
        return run_in_place(self.runner, self.copies, self.swap, params, buffers, args, kwargs)

    def run_checked(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """:meth:`run` for ``params`` already checked against the module (the inner loop's
        adapted parameters); the buffers are checked here."""
        self.check_buffers(buffers)
        if self.executor is not None and any_batched(params, buffers, args, kwargs):
            return self.executor.run(self, params, buffers, args, kwargs)
        return self.run_plain(params, buffers, args, kwargs)

    def __repr__(self) -> str:
        checkpointed = f", checkpointed={self.checkpointed}" if self.checkpointed else ""
        return (
            f"FunctionalModel({type(self.module).__name__}, params={len(self._own_params)}, "
            f"buffers={len(self._own_buffers)}{checkpointed})"
        )


def run_in_place(
    runner: nn.Module,
    copies: Sequence[tuple[nn.Module, nn.Module]],
    swap: Swap,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, dict[str, Tensor]]:
    """Run ``runner`` (the module or its shadow) with ``params`` and fresh copies of
    ``buffers`` in place: ``(out, new_buffers)``, inside a model-run scope
    (``funcmeta._src.module.scope``)."""
    new_buffers = {k: b.clone() for k, b in buffers.items()}
    with (
        synced(copies) if copies else contextlib.nullcontext(),
        swap(params, new_buffers),
        scope.model_run(runner),
    ):
        out = runner(*args, **kwargs)
    return out, new_buffers


class Swap:
    """Puts given tensors in place of a module's parameters and buffers for one call.

    What ``torch.func.functional_call`` does, with the module's layout worked out once: for
    each name, every parameter or buffer dict that holds the tensor (tied weights and
    modules registered twice included). On exit the original tensors go back. A buffer the
    forward replaced (``self.stat = ...``) is written back to the ``buffers`` dict given.
    """

    def __init__(self, module: nn.Module, runner: nn.Module) -> None:
        self.params = self._places(module, runner, "params")
        self.buffers = self._places(module, runner, "buffers")
        self.guard = guard_of(module)
        self.guard.what = f"the model {type(module).__name__}"

    @staticmethod
    def _places(
        module: nn.Module, runner: nn.Module, kind: str
    ) -> list[tuple[str, list[tuple[dict, str]]]]:
        named = (
            module.named_parameters(remove_duplicate=False)
            if kind == "params"
            else module.named_buffers(remove_duplicate=False)
        )
        first: dict[int, str] = {}
        places: dict[str, list[tuple[dict, str]]] = {}
        for name, tensor in named:
            key = first.setdefault(id(tensor), name)
            path, _, attr = name.rpartition(".")
            owner = _DICTS[kind](runner.get_submodule(path))
            slots = places.setdefault(key, [])
            if not any(d is owner and a == attr for d, a in slots):
                slots.append((owner, attr))
        return list(places.items())

    @contextlib.contextmanager
    def __call__(self, params: Mapping[str, Tensor], buffers: dict[str, Tensor]) -> Iterator[None]:
        """The tensors in place for the block, inside the module's guard (one thread at a
        time: :exc:`funcmeta.ConcurrentUseError` for a second one)."""
        with self.guard:
            saved: list[tuple[dict, str, Any]] = []
            try:
                for places, values in ((self.params, params), (self.buffers, buffers)):
                    for key, slots in places:
                        value = values[key]
                        for owner, attr in slots:
                            saved.append((owner, attr, owner[attr]))
                            owner[attr] = value
                yield
            finally:
                for key, slots in self.buffers:
                    owner, attr = slots[0]
                    if owner[attr] is not buffers[key]:
                        buffers[key] = owner[attr]
                for owner, attr, value in reversed(saved):
                    owner[attr] = value


_DICTS = {"params": parameter_dict, "buffers": buffer_dict}


def shares_tensors(module: nn.Module) -> bool:
    """Whether one parameter or buffer of ``module`` sits in two places (two names of
    different submodules' dicts, or a parameter dict and a buffer dict): tied weights. A
    submodule registered under two names is one place.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> shares_tensors(net)
        False
        >>> net[1].weight = net[0].weight
        >>> shares_tensors(net)
        True
    """
    places: dict[int, set[tuple[int, str]]] = {}
    for kind in ("params", "buffers"):
        named = (
            module.named_parameters(remove_duplicate=False)
            if kind == "params"
            else module.named_buffers(remove_duplicate=False)
        )
        for name, tensor in named:
            path, _, attr = name.rpartition(".")
            owner = _DICTS[kind](module.get_submodule(path))
            places.setdefault(id(tensor), set()).add((id(owner), attr))
    return any(len(slots) > 1 for slots in places.values())


def check_layers(module: nn.Module) -> None:
    """Refuse layers whose forward or gradient cannot be a pure, differentiable function of
    the parameters passed in: embeddings with ``max_norm`` (the forward renormalises the
    weight in place, which would overwrite the initial parameters) or ``sparse=True`` (sparse
    gradients, which the optimizers' tree maps cannot take)."""
    for name, m in module.named_modules():
        if not isinstance(m, nn.Embedding | nn.EmbeddingBag):
            continue
        what = f"{type(m).__name__} {name or '(the root module)'!r}"
        if m.max_norm is not None:
            raise ValueError(
                f"{what} has max_norm={m.max_norm}: its forward renormalises the weight in "
                "place, which would overwrite the parameters passed in (the initial, "
                "meta-learned ones included). Build it with max_norm=None and normalise in "
                "the model instead (for example a parametrization that divides each row by "
                "max(1, norm / max_norm))"
            )
        if m.sparse:
            raise ValueError(
                f"{what} has sparse=True: its gradient is a sparse tensor, which the "
                "differentiable optimizers cannot take. Build it with sparse=False"
            )
