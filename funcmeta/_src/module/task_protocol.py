"""The executor protocol: what runs a :class:`~funcmeta.FunctionalModel`
on inputs that carry a task axis (a ``vmap`` level), how many tasks it runs at once, and what
it reports.

The model itself knows nothing of tasks: it swaps tensors in and runs its module. When its
inputs are batched over tasks and it was given an executor, it hands the call over. The task
executor of ``funcmeta._src.batching.executor`` is the one :func:`funcmeta.functional_model`
gives it; without one, a model under ``vmap`` runs on vmap's own rules.

The chunk of a task-batched call is the executor's to choose, once per call at the entry
point, and is handed down with the call: :func:`funcmeta.adapt_tasks` describes its inner
loop (:class:`TaskCall`) and runs on the :class:`ChunkRun` it gets back; a pass that follows
(:func:`funcmeta.task_losses`, :func:`funcmeta.apply_tasks`) runs on the chunk
``run_following`` gives it. Nothing below the entry point reads a chunk off the model.

Example:
    >>> from funcmeta._src.module.task_protocol import ChunkRun, Executor
    >>> sorted(name for name in vars(Executor) if not name.startswith("_"))
    ['choices', 'chunk_for', 'chunk_now', 'per_task', 'per_task_layers', 'run', 'run_following', 'task_chunk']
    >>> ChunkRun(4).chunk
    4
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

__all__ = ["ChunkRun", "Executor", "PlainRunner", "TaskCall"]


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


class ChunkRun:
    """The chunk one task-batched inner loop runs with (``None``: all tasks at once).

    A measured call (``task_chunk="tune"``) overrides the two ``watch`` methods to note when
    the backward reaches the tensors it is shown; here they change nothing.
    """

    def __init__(self, chunk: int | None) -> None:
        self.chunk = chunk

    def watch_initial(self, adapted: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        """The initial parameters the loop adapts (with their task axis), made under grad
        mode; returns what the loop should start from (the same tensors, or views of them)."""
        return adapted

    def watch_adapted(self, adapted: Mapping[str, Tensor]) -> None:
        """Called with the adapted parameters once the loop's forward has finished."""
        return None


class Executor(Protocol):
    """Runs task-batched calls of one model (see the module docstring)."""

    @property
    def task_chunk(self) -> int | str | None:
        """How many tasks a call runs at once: ``"auto"``, ``"tune"``, ``None`` (all) or a
        number."""
        ...

    @task_chunk.setter
    def task_chunk(self, value: int | str | None) -> None: ...

    def chunk_for(self, call: TaskCall) -> ChunkRun:
        """The chunk of a task-batched inner loop, chosen under ``"auto"`` or ``"tune"``."""
        ...

    def chunk_now(self) -> int | None:
        """The chunk a pass that follows an inner loop runs with: ``task_chunk``, or the
        latest inner loop's chunk under ``"auto"`` and ``"tune"``."""
        ...

    def run_following(
        self, run: Callable[[int | None], tuple[Any, dict[str, Tensor]]]
    ) -> tuple[Any, dict[str, Tensor]]:
        """``run(chunk)``, a task-batched pass after an inner loop (:func:`funcmeta.apply_tasks`,
        :func:`funcmeta.task_losses`), on the chunk chosen for it once, here (that of the
        latest inner loop under ``"auto"`` and ``"tune"``); under ``"tune"``, its time counts
        with the measured inner loop it follows."""
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
