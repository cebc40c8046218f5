"""The public types of the inner loop: what a loss function is, what an inner loop returns,
and the error it raises for non-finite values.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> from funcmeta._src.core.types import AdaptResult, LossFn
    >>> loss: LossFn = F.mse_loss
    >>> fmodel = fm.functional_model(torch.nn.Linear(1, 1))
    >>> r = fm.adapt(fmodel, fmodel.params, loss, (torch.ones(2, 1), torch.ones(2, 1)),
    ...              fm.optim.sgd(lr=0.1), steps=2)
    >>> isinstance(r, AdaptResult), r.losses.shape
    (True, torch.Size([2]))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from torch import Tensor

from funcmeta._src.core.exposed import exposed_in

__all__ = ["AdaptResult", "LossFn", "NonFiniteError", "TaskChunk", "TaskLosses"]

LossFn = Callable[[Any, Any], Tensor]
"""``(output, targets) -> scalar tensor``, e.g. ``torch.nn.functional.mse_loss``."""


@exposed_in("funcmeta")
class TaskChunk:
    """The chunk of tasks one task-batched call ran with: ``chunk`` tasks at a time
    (``None``: all at once). :func:`funcmeta.adapt_tasks` returns it as
    ``AdaptResult.chunk``; pass it as the ``task_chunk`` of the pass that follows
    (:func:`funcmeta.task_losses`, :func:`funcmeta.apply_tasks`) to run that pass on the same
    chunk, and, under ``task_chunk="tune"``, to count its time with the measured inner loop.

    A measured call overrides the two ``watch`` methods to note when the backward reaches
    the tensors it is shown; here they change nothing.

    Example:
        >>> import torch, torch.nn.functional as F, funcmeta as fm
        >>> fmodel = fm.functional_model(torch.nn.Linear(1, 1))
        >>> b = fm.data.Sinusoid().sample(8, 5, 5)
        >>> r = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support,
        ...                    fm.optim.sgd(lr=0.1), steps=1, task_chunk=2)
        >>> r.chunk
        TaskChunk(2)
        >>> fm.task_losses(fmodel, r.params, F.mse_loss, b.query, task_chunk=r.chunk).losses.shape
        torch.Size([8])
    """

    def __init__(self, chunk: int | None) -> None:
        self.chunk = chunk

    def __repr__(self) -> str:
        return f"TaskChunk({self.chunk})"

    def watch_initial(self, adapted: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        """The initial parameters the loop adapts (with their task axis), made under grad
        mode; returns what the loop should start from (the same tensors, or views of them)."""
        return adapted

    def watch_adapted(self, adapted: Mapping[str, Tensor]) -> None:
        """Called with the adapted parameters once the loop's forward has finished."""
        return None


@exposed_in("funcmeta")
class AdaptResult(NamedTuple):
    """What :func:`funcmeta.adapt` and :func:`funcmeta.adapt_tasks` return (the latter with a
    leading task axis on parameters, buffers and state, and losses of shape ``(steps, T)``).

    Attributes:
        params: the adapted parameters (all of them; the ones held fixed are passed through).
        buffers: the buffers after the last inner forward (BatchNorm running statistics).
        losses: the inner loss before each step, shape ``(steps,)``; attached to the graph
            for second-order steps (``.detach()`` it to log it).
        state: the optimizer state after the last step (pass it back to continue).
        skipped: indices of steps skipped for non-finite values (``on_nonfinite="skip"``),
            or not taken after an overflow under a GradScaler.
        overflowed: an inner step overflowed under a ``torch.amp.GradScaler``
            (``loss_scale=scaler``): the loop stopped there, and every gradient through the
            adapted parameters is non-finite, so ``scaler.step`` skips this meta-iteration.
        chunk: :func:`funcmeta.adapt_tasks`' chunk of tasks (a :class:`TaskChunk`), to pass
            as the ``task_chunk`` of the query pass that follows; ``None`` from
            :func:`funcmeta.adapt`.
    """

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    losses: Tensor
    state: Any
    skipped: tuple[int, ...] = ()
    overflowed: bool = False
    chunk: TaskChunk | None = None


@exposed_in("funcmeta")
class TaskLosses(NamedTuple):
    """What :func:`funcmeta.task_losses` returns.

    Attributes:
        losses: each task's loss, shape ``(T,)``.
        buffers: the buffers after the forward, per task (BatchNorm running statistics).
        outputs: the model's outputs the losses were computed from, with a task axis, where
            ``return_outputs=True`` was given (the query logits, for accuracy); else ``None``.
    """

    losses: Tensor
    buffers: dict[str, Tensor]
    outputs: Any = None


@exposed_in("funcmeta")
class NonFiniteError(FloatingPointError):
    """An inner loss or gradient was NaN or infinite; the message names the step."""
