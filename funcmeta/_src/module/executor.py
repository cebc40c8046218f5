"""The executor protocol: what runs a :class:`~funcmeta._src.module.functional.FunctionalModel`
on inputs that carry a task axis (a ``vmap`` level), and what it reports.

The model itself knows nothing of tasks: it swaps tensors in and runs its module. When its
inputs are batched over tasks and it was given an executor, it hands the call over. The task
executor of :mod:`funcmeta._src.batching.executor` is the one :func:`funcmeta.functional_model`
gives it; without one, a model under ``vmap`` runs on vmap's own rules.

Example:
    >>> from funcmeta._src.module.executor import Executor
    >>> sorted(name for name in vars(Executor) if not name.startswith("_"))
    ['choices', 'chunk_now', 'per_task', 'per_task_layers', 'run', 'task_chunk']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from funcmeta._src.module.functional import FunctionalModel

__all__ = ["Executor"]


class Executor(Protocol):
    """Runs task-batched calls of one model (see the module docstring)."""

    @property
    def task_chunk(self) -> int | str | None:
        """How many tasks a call runs at once: ``"auto"``, ``None`` (all) or a number."""
        ...

    @task_chunk.setter
    def task_chunk(self, value: int | str | None) -> None: ...

    def chunk_now(self) -> int | None:
        """The chunk a task-batched call runs with now."""
        ...

    @property
    def choices(self) -> dict[Any, dict[str, Any]]:
        """Under ``"auto"``: what was measured and chosen, per kind of call."""
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
        model: FunctionalModel,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """``model.run`` on task-batched inputs: ``(out, new_buffers)``."""
        ...
