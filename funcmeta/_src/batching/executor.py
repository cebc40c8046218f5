"""The task executor: runs a functional model on task-batched inputs as one computation, with
the meta-gradients of a loop over the tasks, or once per task where the model cannot run
under ``vmap``; it owns the chunk choice (``funcmeta._src.batching.chunks``: the rule of
``task_chunk="auto"``, the measurements of ``"tune"``) and the report of which layers ran once
per task.

:func:`funcmeta.functional_model` gives every model one (see
``funcmeta._src.module.task_protocol``). The stand-ins for layer families
(``funcmeta._src.batching.layers``) run inside the task runner it is built with.

Example:
    >>> import torch, funcmeta as fm
    >>> fmodel = fm.functional_model(torch.nn.Linear(3, 1))
    >>> type(fmodel.executor).__name__, fmodel.per_task
    ('TaskExecutor', None)
    >>> p = {k: v.expand(4, *v.shape) for k, v in fmodel.params.items()}
    >>> out = torch.func.vmap(fmodel)(p, torch.randn(4, 5, 3))
    >>> fmodel.per_task
    False
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from funcmeta._src.batching import packed
from funcmeta._src.batching.chunks import ChunkRule, ChunkTuner, TimedRun
from funcmeta._src.batching.fallback import describe_refusal
from funcmeta._src.batching.intercept import TaskMode, task_mode
from funcmeta._src.batching.layers import task_standins
from funcmeta._src.batching.recurrent import bind_fallback_report
from funcmeta._src.core import kernels
from funcmeta._src.core.fence import inside_transform, is_vmap_refusal
from funcmeta._src.core.replay import recomputation
from funcmeta._src.core.vmap import any_batched, call_outside_vmap
from funcmeta._src.module.functional import Swap, run_in_place
from funcmeta._src.module.task_protocol import (
    CHOOSERS,
    ChunkSpec,
    PlainRunner,
    TaskCall,
    TaskChunk,
)

__all__ = ["TaskExecutor"]

RunnerBuilder = Callable[[dict[str, Any]], tuple[nn.Module, list[tuple[nn.Module, nn.Module]]]]
"""Builds a runner (a shadow of the module) with the given stand-ins in place: what
per-layer checkpointing adds around them is the builder's business."""

_FAST_PATH_LAYERS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


class TaskExecutor:
    """Runs one model's task-batched calls (see the module docstring).

    ``build_runner`` makes the task runner from the task stand-ins (with the model's
    checkpointed layers around them). Each call brings its own ``task_chunk``: ``"auto"``
    (the rule), ``"tune"`` (measured), ``None`` (all tasks), a number, or the
    :class:`~funcmeta.TaskChunk` of the inner loop a pass follows; the rule's choices and the
    tuner's measurements are kept per kind of call.
    """

    def __init__(self, module: nn.Module, build_runner: RunnerBuilder) -> None:
        self._per_task_layers: dict[str, str] = {}
        self.runner, self.copies = build_runner(
            bind_fallback_report(task_standins(module), self._per_task_layers)
        )
        self.swap = Swap(module, self.runner)
        self.module = module
        self.rule = ChunkRule()  # the choices of task_chunk="auto", per kind of call
        self.tuner = ChunkTuner()  # the measurements of task_chunk="tune", per kind of call
        self._chooser = "auto"  # the chooser of the latest call that chose, for its report
        self._per_task: bool | None = None
        self._task_mode = False  # run task-batched forwards under a TaskMode
        # layers with torch's inference fast path, which task batching must keep off
        self._fast_path_layers = any(isinstance(m, _FAST_PATH_LAYERS) for m in module.modules())

    def chunk_for(self, call: TaskCall, task_chunk: ChunkSpec) -> TaskChunk:
        if task_chunk not in CHOOSERS:
            assert not isinstance(task_chunk, TaskChunk | str)  # checked at the entry point
            return TaskChunk(task_chunk)
        if inside_transform() is not False:
            return TaskChunk(None)  # inside a torch.func transform: all at once, not timed
        self._chooser = task_chunk
        if task_chunk == "auto":
            return self.rule.chunk_for(call, self._parameter_count())
        return self.tuner.chunk_for(call)

    def run_following(
        self,
        run: Callable[[int | None], tuple[Any, dict[str, Tensor]]],
        task_chunk: ChunkSpec,
        describe: Callable[[], TaskCall],
    ) -> tuple[Any, dict[str, Tensor]]:
        if isinstance(task_chunk, TimedRun):
            return self.tuner.count_with(task_chunk.trial, lambda: run(task_chunk.chunk))
        if isinstance(task_chunk, TaskChunk):
            return run(task_chunk.chunk)
        if task_chunk != "auto":
            assert not isinstance(task_chunk, str)  # checked at the entry point
            return run(task_chunk)
        if inside_transform() is not False:
            return run(None)  # inside a torch.func transform: all at once
        self._chooser = "auto"
        return run(self.rule.chunk_for(describe(), self._parameter_count()).chunk)

    def _parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def choices(self) -> dict[Any, dict[str, Any]]:
        chooser = self.rule if self._chooser == "auto" else self.tuner
        return {k: dict(v) for k, v in chooser.choices.items()}

    @property
    def per_task(self) -> bool | None:
        return self._per_task

    @property
    def per_task_layers(self) -> dict[str, str]:
        return dict(self._per_task_layers)

    def run(
        self,
        model: PlainRunner,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        if not self._fast_path_layers:
            return self._run_tasks(model, params, buffers, args, kwargs)
        with kernels.no_fast_path():
            return self._run_tasks(model, params, buffers, args, kwargs)

    def _run_tasks(
        self,
        model: PlainRunner,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """Batched, or once per task when the model cannot run under vmap (found out once, by
        a run without a graph and with the random number generators restored, so that a
        checkpoint around this call sees one forward)."""
        task_run = (self.runner, self.copies, self.swap)
        if self._per_task is None:
            refusal = self._vmaps(task_run, params, buffers, args, kwargs)
            self._per_task = refusal is not None
            if refusal is not None:
                self._report(refusal)
        if not self._per_task:
            try:
                with task_mode() if self._task_mode else contextlib.nullcontext():
                    return packed.check_output(
                        run_in_place(*task_run, params, buffers, args, kwargs)
                    )
            except RuntimeError as error:
                if not is_vmap_refusal(error):
                    raise
                self._per_task = True
                self._report(error)

        def one_task(p: Any, b: Any, a: Any, kw: Any) -> tuple[Any, dict[str, Tensor]]:
            if any_batched(p, b, a, kw):
                # batched at an outer vmap level too (two task axes): what the inner level
                # refused, plain vmap would refuse at the outer one; it runs per task as well
                return self._run_tasks(model, p, b, a, kw)
            return model.run_plain(p, b, a, kw)

        return call_outside_vmap(
            lambda f, flat: f(*flat),
            one_task,
            (dict(params), dict(buffers), args, kwargs),
            per_task=True,
        )

    def _report(self, refusal: RuntimeError) -> None:
        """Record and say once which layer refused vmap, and why."""
        name, why = describe_refusal(refusal, [self.runner, self.module])
        self._per_task_layers[name] = why
        where = f"layer {name!r}" if name else "the model's forward"
        warnings.warn(
            f"task batching runs this model once per task: {where} cannot run under vmap "
            f"({why}). The results are exact; the batched speed-up is lost "
            "(fmodel.per_task_layers)",
            stacklevel=6,
        )

    def _vmaps(self, task_run: tuple[Any, ...], *inputs: Any) -> RuntimeError | None:
        """None when the task runner runs under vmap on these inputs, else vmap's refusal.
        It runs under a ``funcmeta._src.batching.intercept.TaskMode``, and keeps the
        mode for later calls if it was needed."""
        mode = TaskMode()
        devices = sorted(
            {p.device.index or 0 for p in self.module.parameters() if p.device.type == "cuda"}
        )
        with torch.random.fork_rng(devices=devices), torch.no_grad(), recomputation():
            try:
                with task_mode(mode):
                    packed.check_output(run_in_place(*task_run, *inputs))
            except RuntimeError as error:
                if is_vmap_refusal(error):
                    return error
                raise
        self._task_mode = mode.needed()
        return None
