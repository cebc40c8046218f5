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
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from funcmeta._check import check_int, check_tree
from funcmeta._torch_private import buffer_dict, is_vmap_refusal, parameter_dict
from funcmeta.batching import packed
from funcmeta.batching.auto import ChunkTuner
from funcmeta.batching.fallback import describe_refusal
from funcmeta.batching.intercept import TaskMode, task_mode
from funcmeta.batching.layers import task_standins
from funcmeta.batching.recurrent import recurrent_layers, reporting
from funcmeta.batching.vmap import any_batched, call_outside_vmap
from funcmeta.remat import kernels, scope, takeover
from funcmeta.remat.layers import CheckpointSpec, checkpointed_runner, select
from funcmeta.remat.replay import recomputation
from funcmeta.remat.shadow import synced

__all__ = ["FunctionalModel", "functional_model"]

assert takeover.dispatch  # checkpoints a model takes itself go to funcmeta (see the module)


class FunctionalModel:
    """A module as a pure function ``(params, buffers, *args) -> (out, new_buffers)``.

    Attributes:
        module: the wrapped module; never mutated by calls.
        checkpointed: names of the submodules run under per-layer checkpointing.
        task_chunk: how many tasks a task-batched call runs at once (see
            :func:`functional_model`); settable: ``"auto"`` (measured), ``None`` for all of
            them, or a number.
        task_chunk_choices: under ``"auto"``, what was measured and chosen, per kind of call:
            ``{"chunk": c, "seconds": {candidate: seconds}}``, a candidate's seconds the
            least of its two trials.
        params: ``dict[str, Tensor]`` of the module's own Parameters, by reference (tied
            weights appear once, under their first name), so meta-gradients reach
            ``param.grad`` and an outer ``torch.optim`` optimizer over
            ``module.parameters()``. A new dict on every access.
        buffers: ``dict[str, Tensor]`` of the module's buffers, by reference.
    """

    def __init__(
        self,
        module: nn.Module,
        checkpoint_layers: CheckpointSpec = None,
        task_chunk: int | str | None = "auto",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"functional_model expects an nn.Module, got {type(module).__name__}")
        _check_layers(module)
        self.module = module
        self.task_chunk = task_chunk
        self.checkpointed = select(module, checkpoint_layers)
        self._runner, self._copies = checkpointed_runner(
            module, self.checkpointed, recurrent_layers(module)
        )
        # the runner used under task batching (vmap): linear, convolution, BatchNorm,
        # pooling and recurrent layers on their fast paths
        self._loop_layers: dict[str, str] = {}
        self._task_runner, self._task_copies = checkpointed_runner(
            module, self.checkpointed, reporting(task_standins(module), self._loop_layers)
        )
        self._swap = _Swap(module, self._runner)
        self._task_swap = _Swap(module, self._task_runner)
        self._own_params = dict(module.named_parameters())
        self._own_buffers = dict(module.named_buffers())
        self._param_shapes = {k: v.shape for k, v in self._own_params.items()}
        self._buffer_shapes = {k: v.shape for k, v in self._own_buffers.items()}
        self._task_loop: bool | None = None
        self._task_mode = False  # run task-batched forwards under a TaskMode
        # layers with torch's inference fast path, which task batching must keep off
        self._fast_path_layers = any(isinstance(m, _FAST_PATH_LAYERS) for m in module.modules())

    @property
    def params(self) -> dict[str, Tensor]:
        return dict(self._own_params)

    @property
    def task_chunk(self) -> int | str | None:
        return self._task_chunk

    @task_chunk.setter
    def task_chunk(self, value: int | str | None) -> None:
        if value is not None and value != "auto":
            check_int(value, "task_chunk", low=1, what='"auto", None or a positive int')
        self._task_chunk = value
        self._chunk_tuner = ChunkTuner()  # measured afresh

    @property
    def task_chunk_choices(self) -> dict[Any, dict[str, Any]]:
        return {k: dict(v) for k, v in self._chunk_tuner.choices.items()}

    def chunk_now(self) -> int | None:
        """The chunk a task-batched call runs with now: ``task_chunk``, or under ``"auto"``
        the chunk of the latest task-batched inner loop (all tasks until there is one)."""
        if self._task_chunk == "auto":
            return self._chunk_tuner.hint
        return self._task_chunk  # type: ignore[return-value]

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
    def task_loop(self) -> bool | None:
        """Whether task batching runs this model once per task, because part of its forward
        cannot run under ``vmap`` (data-dependent control flow, as in HuggingFace's attention
        mask code, or an operator without a batching rule). ``None`` until the first
        task-batched call finds out. :attr:`task_loop_layers` says which layer and why."""
        return self._task_loop

    @property
    def task_loop_layers(self) -> dict[str, str]:
        """The layers task batching has run once per task so far, by name (``""`` for the
        model's own forward), each with why: the layer whose forward refused ``vmap`` when
        :attr:`task_loop` is True, and recurrent layers that stepped aside from their
        one-pass path (:mod:`funcmeta.batching.recurrent`). Empty when everything ran
        batched. Each entry is also said once, as a warning, when it is first found."""
        return dict(self._loop_layers)

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
        self.check_params(params)
        return self.run_checked(params, buffers, args, kwargs)

    def apply(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, Tensor]]:
        """Deprecated name of :meth:`run`, kept for one release (``nn.Module.apply(fn)`` means
        something else)."""
        warnings.warn(
            "FunctionalModel.apply is renamed FunctionalModel.run (nn.Module.apply(fn) means "
            "something else); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.run(params, buffers, *args, **kwargs)

    def check_params(self, params: Mapping[str, Tensor]) -> None:
        """Raise ``TypeError``/``ValueError`` naming the entry unless ``params`` has the
        module's parameter names, each a tensor of the module's shape."""
        check_tree(params, self._param_shapes, "params")

    def run_checked(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """:meth:`run` for ``params`` already checked against the module (the inner loop's
        adapted parameters); the buffers are checked here."""
        check_tree(buffers, self._buffer_shapes, "buffers")
        if any_batched(params, buffers, args, kwargs):
            if not self._fast_path_layers:
                return self._apply_tasks(params, buffers, args, kwargs)
            with kernels.no_fast_path():
                return self._apply_tasks(params, buffers, args, kwargs)
        return self._execute(self._runner, self._copies, self._swap, params, buffers, args, kwargs)

    @staticmethod
    def _execute(
        runner: nn.Module,
        copies: list[tuple[nn.Module, nn.Module]],
        swap: _Swap,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        new_buffers = {k: b.clone() for k, b in buffers.items()}
        with (
            synced(copies) if copies else contextlib.nullcontext(),
            swap(params, new_buffers),
            scope.model_run(runner),
        ):
            out = runner(*args, **kwargs)
        return out, new_buffers

    def _apply_tasks(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """``run`` under task batching: batched, or once per task when the model cannot
        run under vmap (found out once, by a run without a graph and with the random number
        generators restored, so that a checkpoint around this call sees one forward)."""
        task_run = (self._task_runner, self._task_copies, self._task_swap)
        if self._task_loop is None:
            refusal = self._vmaps(task_run, params, buffers, args, kwargs)
            self._task_loop = refusal is not None
            if refusal is not None:
                self._report(refusal)
        if not self._task_loop:
            try:
                with task_mode() if self._task_mode else contextlib.nullcontext():
                    return packed.check_output(
                        self._execute(*task_run, params, buffers, args, kwargs)
                    )
            except RuntimeError as error:
                if not is_vmap_refusal(error):
                    raise
                self._task_loop = True
                self._report(error)

        def one_task(p: Any, b: Any, a: Any, kw: Any) -> tuple[Any, dict[str, Tensor]]:
            if any_batched(p, b, a, kw):
                # batched at an outer vmap level too (two task axes): what the inner level
                # refused, plain vmap would refuse at the outer one; it runs per task as well
                return self._apply_tasks(p, b, a, kw)
            return self._execute(self._runner, self._copies, self._swap, p, b, a, kw)

        return call_outside_vmap(
            lambda f, flat: f(*flat),
            one_task,
            (dict(params), dict(buffers), args, kwargs),
            per_task=True,
        )

    def _report(self, refusal: RuntimeError) -> None:
        """Record and say once which layer refused vmap, and why."""
        name, why = describe_refusal(refusal, [self._task_runner, self.module])
        self._loop_layers[name] = why
        where = f"layer {name!r}" if name else "the model's forward"
        warnings.warn(
            f"task batching runs this model once per task: {where} cannot run under vmap "
            f"({why}). The results are exact; the batched speed-up is lost "
            "(fmodel.task_loop_layers)",
            stacklevel=5,
        )

    def _vmaps(self, task_run: tuple[Any, ...], *inputs: Any) -> RuntimeError | None:
        """None when the task runner runs under vmap on these inputs, else vmap's refusal.
        It runs under a :class:`~funcmeta.batching.intercept.TaskMode`, and keeps the mode
        for later calls if it was needed."""
        devices = sorted(
            {t.device.index or 0 for t in self._own_params.values() if t.device.type == "cuda"}
        )
        mode = TaskMode()
        with torch.random.fork_rng(devices=devices), torch.no_grad(), recomputation():
            try:
                with task_mode(mode):
                    packed.check_output(self._execute(*task_run, *inputs))
            except RuntimeError as error:
                if is_vmap_refusal(error):
                    return error
                raise
        self._task_mode = mode.needed()
        return None

    def __repr__(self) -> str:
        checkpointed = f", checkpointed={self.checkpointed}" if self.checkpointed else ""
        return (
            f"FunctionalModel({type(self.module).__name__}, params={len(self._own_params)}, "
            f"buffers={len(self._own_buffers)}{checkpointed})"
        )


class _Swap:
    """Puts given tensors in place of a module's parameters and buffers for one call.

    What ``torch.func.functional_call`` does, with the module's layout worked out once: for
    each name, every parameter or buffer dict that holds the tensor (tied weights and
    modules registered twice included). On exit the original tensors go back. A buffer the
    forward replaced (``self.stat = ...``) is written back to the ``buffers`` dict given.
    """

    def __init__(self, module: nn.Module, runner: nn.Module) -> None:
        self.params = self._places(module, runner, "params")
        self.buffers = self._places(module, runner, "buffers")

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

_FAST_PATH_LAYERS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


def _check_layers(module: nn.Module) -> None:
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


def functional_model(
    module: nn.Module,
    *,
    checkpoint_layers: CheckpointSpec = None,
    task_chunk: int | str | None = "auto",
) -> FunctionalModel:
    """Turn ``module`` into a :class:`FunctionalModel`: a pure function of a parameter dict.

    ``checkpoint_layers`` chooses layers to run under per-layer activation checkpointing
    (see :mod:`funcmeta.remat`): ``None``; a preset name (``"sequential"``: the
    children of every ``nn.Sequential``/``nn.ModuleList``; ``"leaves"``); a list of
    submodule names; or a predicate ``(name, module) -> bool``. A checkpointed layer keeps its
    inputs instead of its activations, in first and in second order (the graph of a
    ``create_graph`` backward keeps the layer's inputs and incoming gradients only). Outputs
    and gradients, second order included, are those of the unchecked model (to float
    round-off). Unknown names, or a predicate that
    matches nothing, raise ``ValueError``. (Step-level checkpointing is the inner-loop option
    ``checkpoint_steps``: :class:`funcmeta.AdaptOptions`.)

    ``task_chunk`` sets how many tasks the task-batched functions (:func:`funcmeta.adapt_tasks`,
    :func:`funcmeta.apply_tasks`, :func:`funcmeta.task_losses`) run in one vmapped call:
    ``"auto"`` (the default: on the CPU, measured on the first calls of each kind, see
    :mod:`funcmeta.batching.auto`), ``None`` (all), or ``c``, for chunks of ``c`` tasks one
    after another (``1``: each task on its own, without vmap). The results are the same up to
    float rounding (random draws such as dropout masks aside); only speed and the size of the
    largest intermediate tensors change. Pin it (``None`` or a number) for float32 runs that
    must repeat bit for bit. :func:`funcmeta.tune_task_chunk` measures the choices up front.

    Example:
        >>> import torch, funcmeta as fm
        >>> fmodel = fm.functional_model(torch.nn.Linear(2, 1))
        >>> params = {k: torch.zeros_like(v) for k, v in fmodel.params.items()}
        >>> fmodel(params, torch.ones(1, 2)).item()
        0.0
    """
    return FunctionalModel(module, checkpoint_layers, task_chunk)
