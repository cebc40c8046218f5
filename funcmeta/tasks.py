"""Many tasks at once: :func:`adapt_tasks` runs :func:`funcmeta.adapt`'s inner loop for T
tasks in one batched computation, and :func:`apply_tasks` runs a model for T tasks.

Every tensor of the batch has a leading task axis ``T``. A parameter, buffer or
hyperparameter tensor shaped like the module's is shared by all tasks. One with a leading
task axis, ``(T, *shape)``, holds a value per task. A per-task learning rate for a parameter
of shape ``(a, b)`` is ``(T, a, b)``, or ``(T, 1, 1)`` for one rate per task: ordinary
broadcasting against the per-task parameters ``(T, a, b)``. Results carry the task axis:
adapted parameters, optimizer state and buffers are ``(T, ...)``, and losses are
``(steps, T)``.

How it works: the model's forward runs under ``torch.func.vmap`` over the task axis, and the
inner gradient is ``torch.autograd.grad`` of the *sum* of the per-task losses, taken outside
vmap. The tasks share nothing, so that sum's gradient with respect to the per-task
parameters is each task's own gradient. Second order, BatchNorm, per-layer and step-level
checkpointing compose with it. ``vmap(torch.func.grad(...))`` gives wrong second-order
meta-gradients with BatchNorm (see docs/tasks.md); this does not.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(16, support=10, query=10)
    >>> opt = fm.optim.sgd(lr=0.01)
    >>> result = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (b.x_support, b.y_support), opt, steps=5)
    >>> result.params["0.weight"].shape, result.losses.shape
    (torch.Size([16, 40, 1]), torch.Size([5, 16]))
    >>> out, _ = fm.apply_tasks(fmodel, result.params, b.x_query, buffers=result.buffers)
    >>> F.mse_loss(out, b.y_query).backward()   # the mean of the 16 query losses
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from funcmeta import tree
from funcmeta._check import check_tree
from funcmeta._loop import check_adapt_call, forward_loss, run_inner_loop
from funcmeta.batching.vmap import vmap_flat
from funcmeta.functional import FunctionalModel
from funcmeta.inputs import (
    CallInputs,
    check_batch_call,
    task_count,
)
from funcmeta.optim.base import GradientTransformation
from funcmeta.options import AdaptOptions, takes_options
from funcmeta.types import AdaptResult, LossFn

__all__ = ["adapt_tasks", "apply_tasks", "task_count", "task_losses"]


def _task_trees(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor] | None,
    tasks: int,
) -> tuple[dict[str, int | None], dict[str, Tensor]]:
    """``(param_dims, per_task_buffers)``: which parameters carry the task axis, and the
    buffers (default: the module's) with one copy per task."""
    buffers = fmodel.buffers if buffers is None else buffers
    dims = check_tree(buffers, fmodel.buffer_shapes, "buffers", tasks=tasks)
    per_task = {
        k: v if dims[k] == 0 else v.expand(tasks, *v.shape).clone() for k, v in buffers.items()
    }
    return check_tree(params, fmodel.param_shapes, "params", tasks=tasks), per_task


def _batch_dims(batch: Any) -> Any:
    return tree.map(lambda x: 0 if isinstance(x, Tensor) else None, batch)


def apply_tasks(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    inputs: Any,
    *,
    buffers: Mapping[str, Tensor] | None = None,
) -> tuple[Any, dict[str, Tensor]]:
    """``fmodel.apply`` for T tasks at once: ``(outputs, new_buffers)``, both with a task axis.

    ``inputs`` are the model's arguments as in :func:`funcmeta.adapt` (a tuple is positional,
    a dict is keywords, ``fm.Args`` is both, anything else is the one argument); their
    tensors carry a leading task axis. ``params`` and ``buffers`` (default: the module's) may
    be shared or per task. Per-task buffers come back new; nothing passed in is mutated.
    """
    (call, _), tasks = check_batch_call(
        fmodel, params, inputs, buffers=buffers, task_batched=True, targets=False
    )
    pdims, buffers = _task_trees(fmodel, params, buffers, tasks)

    def one_task(p: dict[str, Tensor], bufs: dict[str, Tensor], call: CallInputs) -> Any:
        return fmodel.apply(p, bufs, *call[0], **call[1])

    trees = (dict(params), buffers, call)
    in_dims = (pdims, {k: 0 for k in buffers}, _batch_dims(call))
    return vmap_flat(one_task, trees, in_dims, fmodel.task_chunk)


def task_losses(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    *,
    buffers: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(losses, new_buffers)``: ``loss_fn`` of each task's outputs and targets, shape ``(T,)``.

    ``batch = (inputs, targets)`` with a leading task axis (``inputs`` as in
    :func:`funcmeta.adapt`: a tuple, a dict of keyword inputs or ``fm.Args``); ``params`` and
    ``buffers`` (default: the module's) shared or per task, as in :func:`apply_tasks`.

    Example:
        >>> import torch, torch.nn.functional as F, funcmeta as fm
        >>> fmodel = fm.functional_model(torch.nn.Linear(1, 1))
        >>> b = fm.data.Sinusoid().sample(4, 5, 5)
        >>> losses, _ = fm.task_losses(fmodel, fmodel.params, F.mse_loss, (b.x_query, b.y_query))
        >>> losses.shape
        torch.Size([4])
    """
    split, tasks = check_batch_call(fmodel, params, batch, buffers=buffers, task_batched=True)
    dims, buffers = _task_trees(fmodel, params, buffers, tasks)
    return _task_forward(fmodel, loss_fn, split, dims, params, buffers)


def _task_forward(
    fmodel: FunctionalModel,
    loss_fn: LossFn,
    batch: tuple[CallInputs, Any],
    dims: dict[str, int | None],
    params: Mapping[str, Tensor],
    buffers: dict[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-task losses ``(T,)`` and new per-task buffers, the forward under vmap.

    ``dims`` says which parameters carry the task axis (0) and which are shared (None).
    """

    def one_task(b: Any, p: dict[str, Tensor], bufs: dict[str, Tensor]) -> Any:
        return forward_loss(fmodel, loss_fn, b, p, bufs)

    trees = (batch, dict(params), buffers)
    in_dims = (_batch_dims(batch), dims, {k: 0 for k in buffers})
    return vmap_flat(one_task, trees, in_dims, fmodel.task_chunk)


def _warn_one_example_tasks(split: tuple[CallInputs, Any], tasks: int) -> None:
    """Warn when every target holds one value per task (a scalar target after the task
    axis): most likely one task's batch without a task axis, read as ``tasks`` tasks of one
    example each."""
    targets = [x for x in tree.leaves(split[1]) if isinstance(x, Tensor)]
    if tasks > 1 and targets and all(x.dim() == 1 for x in targets):
        warnings.warn(
            f"adapt_tasks reads the leading axis of every batch tensor as the task axis: these "
            f"targets of shape {tuple(targets[0].shape)} make {tasks} tasks of one example "
            "each. If this is one task's batch, call fm.adapt, or give it a task axis "
            "(x.unsqueeze(0), y.unsqueeze(0))",
            stacklevel=3,
        )


@takes_options
def adapt_tasks(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    opt: GradientTransformation,
    *,
    steps: int,
    buffers: Mapping[str, Tensor] | None = None,
    state: Any = None,
    **options: Any,
) -> AdaptResult:
    """:func:`funcmeta.adapt` for T tasks at once; the batch carries a leading task axis.

    Takes the arguments and options of :func:`funcmeta.adapt` with the same meanings, per
    task: ``loss_fn`` sees one task's outputs and targets, ``clip_grad_norm`` clips each
    task's gradient by its own norm, and ``on_nonfinite="raise"`` names the step and the
    tasks. ``params``, ``buffers`` and hyperparameters are shared by all tasks unless given
    with a leading task axis. ``on_nonfinite="skip"`` is not available: the tasks share the
    optimizer's step count, so one task cannot skip a step alone.

    Returns:
        :class:`funcmeta.AdaptResult` with task axes: adapted parameters, optimizer state and
        buffers ``(T, ...)`` (parameters held fixed by ``trainable`` are passed through as
        given), losses ``(steps, T)``. The meta-gradients equal those of a loop over the tasks.
    """
    opts = AdaptOptions.of(options)
    split, tasks = check_adapt_call(
        fmodel, params, opt, batch, steps, opts, task_batched=True, buffers=buffers
    )
    if opts.on_nonfinite == "skip":
        raise ValueError(
            "on_nonfinite='skip' is not available with task batching: the tasks share the "
            "optimizer's step count; use 'raise', or adapt the tasks one by one"
        )
    _warn_one_example_tasks(split, tasks)
    dims, buffers = _task_trees(fmodel, params, buffers, tasks)

    def prepare(adapted: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        # Every task adapts its own copy: shared initial parameters get a task axis (a view).
        # The view is made with grad enabled: a view made under no_grad reports
        # requires_grad but is no graph node of its own, so gradients would skip it.
        with torch.enable_grad():
            return {
                k: v if v is None or dims[k] == 0 else v.expand(tasks, *v.shape)
                for k, v in adapted.items()
            }

    def forward_for(adapted: dict[str, Tensor | None]) -> Any:
        # adapted parameters carry the task axis now; fixed ones keep their dims
        step_dims = {k: 0 if adapted[k] is not None else dims[k] for k in dims}
        return functools.partial(_task_forward, fmodel, loss_fn, split, step_dims)

    return run_inner_loop(
        params,
        opt,
        steps,
        buffers,
        opts,
        frozen=fmodel.frozen,
        forward_for=forward_for,
        prepare=prepare,
        tasks=tasks,
        state=state,
    )
