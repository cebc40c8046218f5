"""The forward pass of the inner loop: a model's loss on a batch, for one task or for T tasks
under ``vmap``, and the outputs of T tasks (:func:`funcmeta.apply_tasks`).

:func:`forward_loss` is one task's ``loss_fn(fmodel(params, *args, **kwargs), targets)``;
a failing ``loss_fn`` is re-raised with what it was given. :func:`vmapped_losses` and
:func:`task_outputs_of` run the model once for T tasks, the task axis taken by ``vmap``
(``funcmeta._src.core.vmap.vmap_flat``, in the chunks the entry point chose for the call). The
inputs were checked before (``funcmeta._src.inner.inputs.check_batch_call``).

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> from funcmeta._src.inner.forward import forward_loss
    >>> fmodel = fm.functional_model(torch.nn.Linear(2, 1))
    >>> batch = (((torch.ones(3, 2),), {}), torch.zeros(3, 1))
    >>> runtime = fmodel.runtime
    >>> loss, _ = forward_loss(fmodel, F.mse_loss, batch, fmodel.params, fmodel.buffers, runtime=runtime)
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import error_like
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.inputs import CallInputs, TaskAxisError
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.runtime import Runtime

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "LossShapeError",
    "batch_dims",
    "raised_at_the_call",
    "forward_loss",
    "forward_loss_outputs",
    "vmapped_losses",
    "task_outputs_of",
]


def forward_loss(
    fmodel: FunctionalModel,
    loss_fn: LossFn,
    batch: tuple[CallInputs, Any],
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    *,
    runtime: Runtime,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(loss_fn(fmodel(params, *args, **kwargs), targets), new_buffers)`` for a batch
    ``((args, kwargs), targets)`` made by ``funcmeta._src.inner.inputs.check_adapt_call``,
    the model run by ``runtime``."""
    (loss, _), new_buffers = forward_loss_outputs(
        fmodel, loss_fn, batch, params, buffers, runtime=runtime
    )
    return loss, new_buffers


def forward_loss_outputs(
    fmodel: FunctionalModel,
    loss_fn: LossFn,
    batch: tuple[CallInputs, Any],
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    *,
    runtime: Runtime,
) -> tuple[tuple[Tensor, Any], dict[str, Tensor]]:
    """:func:`forward_loss` that also gives the model's outputs: ``((loss, outputs),
    new_buffers)``."""
    (args, kwargs), targets = batch
    # the inner loop's parameters have the checked names and shapes
    out, new_buffers = runtime.run(fmodel, params, buffers, args, kwargs)
    _check_elementwise(loss_fn, out, targets)
    try:
        loss = loss_fn(out, targets)
    except TaskAxisError:
        raise
    except (IndexError, RuntimeError, ValueError, TypeError) as error:
        raise _loss_error(error, out, targets) from error
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise LossShapeError(_loss_shape_message(loss_fn, loss))
    return (loss, out), new_buffers


class LossShapeError(ValueError):
    """``loss_fn`` returned something other than a scalar tensor; raised again at the public
    call (:func:`raised_at_the_call`), where the user can act on it."""


def _loss_shape_message(loss_fn: Any, loss: Any) -> str:
    got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    return (
        f"loss_fn must return a scalar tensor (one number per task), got {got} from {name}: "
        "reduce it over the examples, e.g. F.mse_loss(out, y) or F.cross_entropy(out, y) with "
        "their default reduction='mean' (not reduction='none'), or end a loss of your own with "
        ".mean()"
    )


def raised_at_the_call(function: _F) -> _F:
    """``function`` with a :class:`LossShapeError` from deep inside the inner loop raised
    again at the call, its traceback starting there."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except LossShapeError as error:
            raise error.with_traceback(None) from None

    return cast(_F, call)


_ELEMENTWISE = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)


def _check_elementwise(loss_fn: Any, out: Any, targets: Any) -> None:
    """Refuse an elementwise loss of an output and targets of different shapes: torch
    broadcasts them (every output against every target) and only warns."""
    if loss_fn not in _ELEMENTWISE or not (isinstance(out, Tensor) and isinstance(targets, Tensor)):
        return
    if out.shape == targets.shape:
        return
    try:
        both = tuple(torch.broadcast_shapes(out.shape, targets.shape))
    except RuntimeError:
        return  # torch's own error names the shapes
    raise ValueError(
        f"{loss_fn.__name__} of the model's output {tuple(out.shape)} and targets "
        f"{tuple(targets.shape)} (per task under task batching): they would broadcast to "
        f"{both}, comparing every output with every target (torch only warns). Give both one "
        "shape, e.g. targets of shape (N, 1) for an output (N, 1): y.view_as(out) or "
        "y.unsqueeze(-1)"
    )


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _loss_error(error: Exception, out: Any, targets: Any) -> Exception:
    """``error`` again, its message saying what ``loss_fn`` was given (per task under task
    batching) and, for class-index targets, the range they must lie in."""
    hint = ""
    if (
        isinstance(targets, Tensor)
        and not targets.is_floating_point()
        and isinstance(out, Tensor)
        and out.dim() > 0
    ):
        hint = (
            f" Class-index targets must lie in [0, {out.shape[-1]}) for an output with "
            f"{out.shape[-1]} columns: an episode with more ways than the model's head, or "
            "labels not numbered 0..ways-1 within each task, fails here."
        )
    message = (
        f"loss_fn failed on the model's output ({_describe(out)}) and the targets "
        f"({_describe(targets)}), shapes per task under task batching: "
        f"{type(error).__name__}: {str(error).rstrip('.')}.{hint}"
    )
    return error_like(error, message)


def batch_dims(batch: Any) -> Any:
    """The ``vmap`` in-dims of a batch: 0 for every tensor (the task axis), None otherwise."""
    return tree.tree_map(lambda x: 0 if isinstance(x, Tensor) else None, batch)


def vmapped_losses(
    fmodel: FunctionalModel,
    loss_fn: LossFn,
    batch: tuple[CallInputs, Any],
    dims: dict[str, int | None],
    params: Mapping[str, Tensor],
    buffers: dict[str, Tensor],
    *,
    outputs: bool = False,
    chunk: int | None,
    runtime: Runtime,
) -> tuple[Any, dict[str, Tensor]]:
    """Per-task losses ``(T,)`` and new per-task buffers, the forward under vmap; with
    ``outputs``, ``((losses, outputs), new_buffers)``, the outputs with a task axis.

    ``dims`` says which parameters carry the task axis (0) and which are shared (None); the
    buffers carry it. ``chunk``: the tasks run at once (``None``: all), chosen for this call
    by its entry point, where ``runtime`` maps the tasks in chunks (the eager one; the traced
    one maps them all).
    """
    forward = forward_loss_outputs if outputs else forward_loss

    def one_task(b: Any, p: dict[str, Tensor], bufs: dict[str, Tensor]) -> Any:
        return forward(fmodel, loss_fn, b, p, bufs, runtime=runtime)

    trees = (batch, dict(params), buffers)
    in_dims = (batch_dims(batch), dims, {k: 0 for k in buffers})
    return runtime.over_tasks(one_task, trees, in_dims, chunk)


def task_outputs_of(
    fmodel: FunctionalModel,
    call: CallInputs,
    dims: dict[str, int | None],
    params: Mapping[str, Tensor],
    buffers: dict[str, Tensor],
    *,
    chunk: int | None,
    runtime: Runtime,
) -> tuple[Any, dict[str, Tensor]]:
    """Per-task outputs and new per-task buffers of the call ``(args, kwargs)``, under vmap;
    ``dims``, ``chunk`` and ``runtime`` as in :func:`vmapped_losses`."""

    def one_task(p: dict[str, Tensor], bufs: dict[str, Tensor], c: CallInputs) -> Any:
        return runtime.run(fmodel, p, bufs, c[0], c[1])

    trees = (dict(params), buffers, call)
    in_dims = (dims, {k: 0 for k in buffers}, batch_dims(call))
    return runtime.over_tasks(one_task, trees, in_dims, chunk)
