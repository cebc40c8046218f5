"""The runtime's contract: :class:`Runtime`, what every way of running a step provides.

The abstract methods are how a step computes; the others are what an entry point asks of the
runtime before and around a call (the checks of a sharded model, the chunk of tasks), each
a no-op here and overridden where a runtime differs (``funcmeta._src.distributed.runtime``).

Example:
    >>> from funcmeta._src.runtime import EAGER, TRACED, Runtime
    >>> isinstance(EAGER, Runtime) and isinstance(TRACED, Runtime)
    True
    >>> sorted(name for name in vars(Runtime) if not name.startswith("_"))  # doctest: +NORMALIZE_WHITESPACE
    ['check_batch', 'check_options', 'chunk_for', 'entry', 'following', 'for_params',
     'gradient', 'keeps_layer_graphs', 'outputs', 'over_tasks', 'recomputes_steps', 'refuse',
     'run', 'second_order_kernels', 'step_scope']
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.module.task_protocol import ChunkSpec, TaskCall, TaskChunk

__all__ = ["Objective", "Runtime"]

#: ``objective(wrt, buffers) -> (objective, loss, new_buffers)``: the inner step's objective
#: (the loss summed over the tasks, scaled), the loss itself, the forward's new buffers.
Objective = Callable[[list[Tensor], dict[str, Tensor]], tuple[Tensor, Tensor, dict[str, Tensor]]]


class Runtime(abc.ABC):
    """How a step runs: the model, the task axis, the inner gradient, each step's frame;
    and what an entry point asks of it around a call."""

    #: Whether a second-order step's checkpointed layers may take their inner gradient on
    #: their forward's graph (a sharded model's may not: a kept graph holds its layer's
    #: gathered parameters, every layer's at once).
    keeps_layer_graphs: bool = True

    #: Whether this runtime recomputes the steps of ``checkpoint_steps=True`` itself (the
    #: compiled autograd graph: torch's rematerialization, each step a region of
    #: :meth:`step_scope`), so that the loop runs each step as it is, without a step
    #: checkpoint.
    recomputes_steps: bool = False

    def for_params(self, params: Mapping[str, Any]) -> Runtime:
        """The runtime of a call on ``params``: this one. (A sharded model's runtime answers
        the eager one for whole parameters, ``fm.distributed.gather_params``'.)"""
        return self

    def check_batch(self, batch: Any, entry: str) -> None:
        """Raise unless ``batch`` (inputs and targets) may be computed on here: nothing to
        check but on a sharded model, whose ranks must hold the same batch."""
        return None

    def check_options(self, options: Any, entry: str) -> None:
        """Raise for inner-loop ``options`` (an ``AdaptOptions``) this runtime cannot run."""
        return None

    def refuse(self, entry: str, why: str) -> None:
        """Raise where ``entry`` (a feature named in the error, with ``why``) cannot run on
        this runtime; nothing here."""
        return None

    def entry(self) -> contextlib.AbstractContextManager[Any]:
        """Around an entry point's whole computation, once its batch is checked."""
        return contextlib.nullcontext()

    def outputs(self, out: Any) -> Any:
        """The model's outputs handed to the user (``fm.apply_tasks``), who computes a loss
        from them this runtime does not see: as they are here."""
        return out

    def chunk_for(
        self, fmodel: FunctionalModel, task_chunk: ChunkSpec, describe: Callable[[], TaskCall]
    ) -> TaskChunk:
        """The chunk of tasks of a task-batched inner loop given the call's ``task_chunk``
        (``describe()`` says the call): all tasks at once here."""
        return TaskChunk(None)

    def following(
        self,
        fmodel: FunctionalModel,
        task_chunk: ChunkSpec,
        describe: Callable[[], TaskCall],
        run: Callable[[int | None], tuple[Any, dict[str, Tensor]]],
    ) -> tuple[Any, dict[str, Tensor]]:
        """``run(chunk)``, a task-batched pass (``fm.task_losses``, ``fm.apply_tasks``) on the
        chunk its ``task_chunk`` gives (``describe()`` says the call): all tasks here."""
        return run(None)

    @abc.abstractmethod
    def run(
        self,
        fmodel: FunctionalModel,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """The model's output and new buffers for one call (one task, or all under vmap)."""

    @abc.abstractmethod
    def over_tasks(
        self,
        one_task: Callable[..., Any],
        trees: tuple[Any, ...],
        in_dims: tuple[Any, ...],
        chunk: int | None,
    ) -> Any:
        """``one_task`` mapped over the task axis of ``trees`` (``in_dims`` as vmap's),
        ``chunk`` tasks at a time where this runtime chunks (``None``: all), as the call's
        entry point chose."""

    @abc.abstractmethod
    def gradient(
        self,
        objective: Objective,
        leaves: list[Tensor],
        buffers: dict[str, Tensor],
        *,
        second_order: bool,
        keep_graph: bool,
    ) -> tuple[Tensor, list[Tensor | None], dict[str, Tensor]]:
        """``(loss, gradients, new_buffers)`` of ``objective`` at ``leaves``: with a graph to
        differentiate again in second order; ``keep_graph``: checkpointed layers may take
        their gradient on the forward's own graph. A gradient is ``None`` for a leaf the
        objective does not use, where the runtime can tell."""

    @abc.abstractmethod
    def second_order_kernels(self, steps: contextlib.ExitStack) -> None:
        """Enter, into the inner loop's ``steps`` stack, what the steps whose graph is
        differentiated again run under (once, at the first of them)."""

    @abc.abstractmethod
    def step_scope(
        self, k: int, steps: int, first_order: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Around inner step ``k`` of ``steps``."""
