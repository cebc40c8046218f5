"""The runtime's contract: :class:`Runtime`, what every way of running a step provides.

Example:
    >>> from funcmeta._src.runtime import EAGER, TRACED, Runtime
    >>> isinstance(EAGER, Runtime) and isinstance(TRACED, Runtime)
    True
    >>> sorted(name for name in vars(Runtime) if not name.startswith("_"))
    ['gradient', 'over_tasks', 'run', 'second_order_kernels', 'step_scope']
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from funcmeta._src.module.functional import FunctionalModel

__all__ = ["Objective", "Runtime"]

#: ``objective(wrt, buffers) -> (objective, loss, new_buffers)``: the inner step's objective
#: (the loss summed over the tasks, scaled), the loss itself, the forward's new buffers.
Objective = Callable[[list[Tensor], dict[str, Tensor]], tuple[Tensor, Tensor, dict[str, Tensor]]]


class Runtime(abc.ABC):
    """How a step runs: the model, the task axis, the inner gradient, each step's frame."""

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
