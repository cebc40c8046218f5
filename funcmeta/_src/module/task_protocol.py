"""The executor protocol: what runs a :class:`~funcmeta.FunctionalModel`
on inputs that carry a task axis (a ``vmap`` level), how many tasks it runs at once, and what
it reports.

The model itself knows nothing of tasks: it swaps tensors in and runs its module. When its
inputs are batched over tasks and it was given an executor, it hands the call over. The task
executor of ``funcmeta._src.batching.executor`` is the one :func:`funcmeta.functional_model`
gives it; without one, a model under ``vmap`` runs on vmap's own rules.

The chunk of a task-batched call is an argument of that call (``task_chunk=``, as
``vmap``'s ``chunk_size`` is), never a setting of the model: the entry point hands it to the
executor with a description of the call (:class:`TaskCall`), which chooses under ``"auto"``
and ``"tune"`` and returns the :class:`TaskChunk` the call runs on. :func:`funcmeta.adapt_tasks`
returns its chunk (``AdaptResult.chunk``), and the pass that follows
(:func:`funcmeta.task_losses`, :func:`funcmeta.apply_tasks`) runs on it when given it as its
``task_chunk``. Nothing below the entry point reads a chunk off the model.

Example:
    >>> from funcmeta._src.module.task_protocol import TaskChunk, Executor
    >>> sorted(name for name in vars(Executor) if not name.startswith("_"))
    ['choices', 'chunk_for', 'per_task', 'per_task_layers', 'run', 'run_following']
    >>> TaskChunk(4).chunk, TaskChunk(None)
    (4, TaskChunk(None))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from funcmeta._src.core.types import TaskChunk

__all__ = [
    "CHOOSERS",
    "ChunkSpec",
    "Executor",
    "PlainRunner",
    "TaskCall",
    "TaskChunk",
    "check_task_chunk",
]

CHOOSERS = ("auto", "tune")
"""The ``task_chunk`` values that choose the chunk per call."""


class PlainRunner(Protocol):
    """What an executor runs a task's call with (a :class:`~funcmeta.FunctionalModel`): its
    module run as it is, the tensors given swapped in."""

    def run_plain(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]: ...


@dataclass(frozen=True)
class TaskCall:
    """A task-batched inner loop (:func:`funcmeta.adapt_tasks`), as the chunk choice sees it."""

    tasks: int
    """The number of tasks T."""
    steps: int
    inputs: tuple[Tensor, ...]
    """The tensors of the model's inputs, each with the task axis first."""
    targets: tuple[Tensor, ...]
    details: tuple[Any, ...]
    """The options and which parameters are given per task: what else tells kinds of calls
    apart (hashable)."""
    expect_backward: bool
    """Whether a backward through the call can follow (grad enabled, parameters that
    require grad)."""


ChunkSpec = int | str | TaskChunk | None
"""A call's ``task_chunk``: ``"auto"``, ``"tune"`` (inner loops only), ``None`` (all tasks at
once), a positive int, or the :class:`TaskChunk` of the inner loop a pass follows."""


def check_task_chunk(
    value: Any, where: str, *, inner_loop: bool, follows: bool = True
) -> ChunkSpec:
    """``value`` if it is a ``task_chunk`` that ``where`` takes (``inner_loop``: an inner loop,
    which takes ``"tune"``; else a pass, which takes a :class:`TaskChunk`; ``follows``: a
    pass that can follow an inner loop, whose refusal of ``"tune"`` points to
    ``result.chunk``), else a precise error."""
    if (
        value is None
        or value == "auto"
        or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    ):
        return value
    if isinstance(value, TaskChunk) and not inner_loop:
        return value
    if value == "tune" and inner_loop:
        return value
    if value == "tune" and not follows:
        raise ValueError(
            f'{where} takes no task_chunk="tune": it has no inner loop to measure; pass '
            '"auto", None or a number of tasks'
        )
    if value == "tune":
        raise ValueError(
            f'{where} takes no task_chunk="tune": "tune" measures inner loops. Pass the chunk '
            "of the inner loop this pass follows (task_chunk=result.chunk, from "
            "fm.adapt_tasks), which also counts this pass's time with that measured loop"
        )
    what = (
        '"auto", "tune", None or a positive int'
        if inner_loop
        else ('"auto", None, a positive int or the TaskChunk of an inner loop (result.chunk)')
    )
    raise ValueError(f"{where}: task_chunk must be {what}, got {value!r}")


class Executor(Protocol):
    """Runs task-batched calls of one model (see the module docstring)."""

    def chunk_for(self, call: TaskCall, task_chunk: ChunkSpec) -> TaskChunk:
        """The chunk of a task-batched inner loop given ``task_chunk`` (checked), chosen here
        under ``"auto"`` or ``"tune"``."""
        ...

    def run_following(
        self,
        run: Callable[[int | None], tuple[Any, dict[str, Tensor]]],
        task_chunk: ChunkSpec,
        describe: Callable[[], TaskCall],
    ) -> tuple[Any, dict[str, Tensor]]:
        """``run(chunk)``, a task-batched pass (:func:`funcmeta.apply_tasks`,
        :func:`funcmeta.task_losses`; ``describe()`` says the call) on the chunk
        ``task_chunk`` gives: the rule on this pass's own shapes under ``"auto"``; the
        :class:`TaskChunk` of an inner loop, whose time this pass's counts with when it is a
        measured one."""
        ...

    @property
    def choices(self) -> dict[Any, dict[str, Any]]:
        """Under ``"auto"`` or ``"tune"``: the chunk chosen per kind of call, and why."""
        ...

    @property
    def per_task(self) -> bool | None:
        """Whether the model runs once per task (``None`` until the first call finds out)."""
        ...

    @property
    def per_task_layers(self) -> dict[str, str]:
        """The layers run once per task so far, by name, each with why."""
        ...

    def run(
        self,
        model: PlainRunner,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """``model.run`` on task-batched inputs: ``(out, new_buffers)``."""
        ...
