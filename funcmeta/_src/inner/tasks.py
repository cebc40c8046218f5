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
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core import tree
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.precision import warn_tf32_second_order
from funcmeta._src.core.types import AdaptResult, LossFn, TaskLosses
from funcmeta._src.inner.forward import raised_at_the_call, task_outputs_of, vmapped_losses
from funcmeta._src.inner.inputs import (
    CallInputs,
    CheckedCall,
    check_adapt_call,
    check_batch_call,
    task_count,
    with_task_axis,
)
from funcmeta._src.inner.loop import inner_loop, split_adapted
from funcmeta._src.inner.options import AdaptKeywords, AdaptOptions, takes_options
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.module.task_protocol import ChunkSpec, TaskCall, check_task_chunk
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.runtime import Runtime
from funcmeta._src.runtime.place import unless_set

__all__ = ["adapt_tasks", "apply_tasks", "task_count", "task_inner_loop", "task_losses"]


@exposed_in("funcmeta")
def apply_tasks(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    inputs: Any,
    *,
    buffers: Mapping[str, Tensor] | None = None,
    task_chunk: ChunkSpec = "auto",
) -> tuple[Any, dict[str, Tensor]]:
    """``fmodel.run`` for T tasks at once: ``(outputs, new_buffers)``, both with a task axis.

    ``inputs`` are the model's arguments as in :func:`funcmeta.adapt` (a tuple is positional,
    a dict is keywords, ``fm.Args`` is both, anything else is the one argument); their
    tensors carry a leading task axis. ``params`` and ``buffers`` (default: the module's) may
    be shared or per task. Per-task buffers come back new; nothing passed in is mutated.
    ``task_chunk`` is how many tasks run at once: ``"auto"`` (the rule of
    :func:`funcmeta.adapt_tasks` on these inputs), ``None`` (all), a number, or the
    ``result.chunk`` of the inner loop these parameters come from (the same chunk; under
    ``"tune"`` this pass is timed with that loop).
    """
    task_chunk = check_task_chunk(task_chunk, "fm.apply_tasks", inner_loop=False)
    checked = check_batch_call(
        fmodel, params, inputs, buffers=buffers, task_batched=True, targets=False
    )
    call = checked.batch[0]
    assert checked.param_dims is not None  # task-batched: one entry per parameter
    runtime = fmodel.runtime.for_params(params)
    runtime.check_batch(call, "fm.apply_tasks")
    run = functools.partial(
        task_outputs_of, fmodel, call, checked.param_dims, params, checked.buffers, runtime=runtime
    )
    describe = functools.partial(_pass_call, checked, params)
    with unless_set("the inputs given to fm.apply_tasks"), runtime.entry():
        out, new_buffers = runtime.following(
            fmodel, task_chunk, describe, lambda chunk: run(chunk=chunk)
        )
    # the user computes a loss from the outputs with targets the runtime never saw
    return runtime.outputs(out), new_buffers


@exposed_in("funcmeta")
@raised_at_the_call
def task_losses(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    *,
    buffers: Mapping[str, Tensor] | None = None,
    return_outputs: bool = False,
    task_chunk: ChunkSpec = "auto",
) -> TaskLosses:
    """``loss_fn`` of each task's outputs and targets, shape ``(T,)``, with the buffers after
    the forward: a :class:`~funcmeta.TaskLosses` ``(losses, buffers, outputs)``.

    ``batch = (inputs, targets)`` with a leading task axis (``inputs`` as in
    :func:`funcmeta.adapt`: a tuple, a dict of keyword inputs or ``fm.Args``); ``params`` and
    ``buffers`` (default: the module's) shared or per task, as in :func:`apply_tasks`.
    With ``return_outputs=True``, ``outputs`` holds the model's outputs that the losses were
    computed from, with a task axis (the query logits, for accuracy), from the same forward
    pass; else it is ``None``. ``task_chunk`` is as in :func:`apply_tasks`: pass the inner
    loop's ``result.chunk`` to run the query pass on its chunk.

    Example:
        >>> import torch, torch.nn.functional as F, funcmeta as fm
        >>> fmodel = fm.functional_model(torch.nn.Linear(1, 1))
        >>> b = fm.data.Sinusoid().sample(4, 5, 5)
        >>> losses = fm.task_losses(fmodel, fmodel.params, F.mse_loss, (b.x_query, b.y_query)).losses
        >>> losses.shape
        torch.Size([4])
        >>> losses, _, outputs = fm.task_losses(
        ...     fmodel, fmodel.params, F.mse_loss, (b.x_query, b.y_query), return_outputs=True)
        >>> outputs.shape
        torch.Size([4, 5, 1])
    """
    if not isinstance(return_outputs, bool):
        raise TypeError(f"return_outputs must be True or False, got {return_outputs!r}")
    task_chunk = check_task_chunk(task_chunk, "fm.task_losses", inner_loop=False)
    checked = check_batch_call(fmodel, params, batch, buffers=buffers, task_batched=True)
    assert checked.param_dims is not None  # task-batched: one entry per parameter
    runtime = fmodel.runtime.for_params(params)
    runtime.check_batch(checked.batch, "fm.task_losses")
    run = functools.partial(
        vmapped_losses,
        fmodel,
        loss_fn,
        checked.batch,
        checked.param_dims,
        params,
        checked.buffers,
        outputs=return_outputs,
        runtime=runtime,
    )
    describe = functools.partial(_pass_call, checked, params)
    with unless_set("the batch given to fm.task_losses"), runtime.entry():
        found, new_buffers = runtime.following(
            fmodel, task_chunk, describe, lambda chunk: run(chunk=chunk)
        )
    if not return_outputs:
        return TaskLosses(found, new_buffers)
    losses, outputs = found
    return TaskLosses(losses, new_buffers, runtime.outputs(outputs))


@exposed_in("funcmeta")
@raised_at_the_call
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
    task_chunk: int | str | None = "auto",
    **options: Unpack[AdaptKeywords],
) -> AdaptResult:
    """:func:`funcmeta.adapt` for T tasks at once; the batch carries a leading task axis.

    Takes the arguments and options of :func:`funcmeta.adapt` with the same meanings, per
    task: ``loss_fn`` sees one task's outputs and targets, ``clip_grad_norm`` clips each
    task's gradient by its own norm, and ``on_nonfinite="raise"`` names the step and the
    tasks. ``params``, ``buffers`` and hyperparameters are shared by all tasks unless given
    with a leading task axis. ``on_nonfinite="skip"`` is not available: the tasks share the
    optimizer's step count, so one task cannot skip a step alone.

    ``task_chunk`` is how many tasks run in one vmapped computation, chosen for this call (as
    ``vmap``'s ``chunk_size``): ``"auto"`` (the default: a rule of the shapes, the model's
    size and the device, never a timing), ``"tune"`` (measured on the first calls of each
    kind, on the CPU), ``None`` (all), or ``c``, for chunks of ``c`` tasks one after another
    (``1``: each task on its own, without vmap). The rule: on a CPU, the largest power of two
    ``c`` with ``c x parameters x input elements per task <= 2**31`` (at least 1; all tasks
    at once where ``c`` reaches their number), and all tasks at once on CUDA. The results
    are the same up to float rounding (random draws such as dropout masks aside); every
    setting but ``"tune"`` repeats float32 runs bit for bit. The chunk taken comes back as
    ``result.chunk``: pass it as the ``task_chunk`` of the query pass
    (:func:`funcmeta.task_losses`, :func:`funcmeta.apply_tasks`), as the recipes do.
    :attr:`funcmeta.FunctionalModel.task_chunk_choices` says what ``"auto"`` and ``"tune"``
    chose; :func:`funcmeta.tune_task_chunk` measures the choices up front.

    Returns:
        :class:`funcmeta.AdaptResult` with task axes: adapted parameters, optimizer state and
        buffers ``(T, ...)`` (parameters held fixed by ``trainable`` are passed through as
        given), losses ``(steps, T)``, and the chunk taken. The meta-gradients equal those of
        a loop over the tasks.

    Example:
        >>> import torch, funcmeta as fm
        >>> conv = fm.functional_model(fm.models.conv4(5))  # 112,261 parameters
        >>> support = (torch.randn(16, 5, 1, 28, 28), torch.arange(5).repeat(16, 1))
        >>> with torch.no_grad():  # 16 tasks of 5 images, 3,920 input elements each
        ...     r = fm.adapt_tasks(conv, conv.params, torch.nn.functional.cross_entropy,
        ...                        support, fm.optim.sgd(lr=0.1), steps=1)
        >>> r.chunk  # 4 x 112,261 x 3,920 <= 2**31 < 8 x 112,261 x 3,920
        TaskChunk(4)
    """
    chunk_spec = check_task_chunk(task_chunk, "fm.adapt_tasks", inner_loop=True)
    opts = AdaptOptions.of(options)
    checked = check_adapt_call(
        fmodel, params, opt, batch, steps, opts, task_batched=True, buffers=buffers
    )
    warn_tf32_second_order(fmodel.module, params.values(), opts.first_order)
    tasks, dims = checked.tasks, checked.param_dims
    assert tasks is not None and dims is not None  # task-batched: both are set
    runtime = fmodel.runtime.for_params(params)
    runtime.check_batch(checked.batch, "fm.adapt_tasks")
    runtime.check_options(opts, "fm.adapt_tasks")
    chunking = runtime.chunk_for(
        fmodel, chunk_spec, functools.partial(_task_call, checked, params, steps, opts)
    )
    with runtime.entry():
        result, _ = task_inner_loop(
            fmodel,
            loss_fn,
            checked.batch,
            params,
            dims,
            checked.buffers,
            opt,
            steps,
            opts,
            tasks=tasks,
            state=state,
            chunk=chunking.chunk,
            watch=chunking.watch_initial,
            runtime=runtime,
        )
    chunking.watch_adapted(result.params)
    return result._replace(chunk=chunking)


def task_inner_loop(
    fmodel: FunctionalModel,
    loss_fn: LossFn,
    batch: tuple[CallInputs, Any],
    params: Mapping[str, Tensor],
    dims: dict[str, int | None],
    buffers: dict[str, Tensor],
    opt: GradientTransformation,
    steps: int,
    opts: AdaptOptions,
    *,
    tasks: int,
    state: Any = None,
    chunk: int | None = None,
    watch: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    runtime: Runtime,
) -> tuple[AdaptResult, dict[str, int | None]]:
    """The inner loop of T tasks on a checked call: the adapted parameters split off
    (``funcmeta._src.inner.loop.split_adapted``), given a task axis
    (``funcmeta._src.inner.inputs.with_task_axis``), and the steps of
    ``funcmeta._src.inner.loop.inner_loop`` on the forward
    ``funcmeta._src.inner.forward.vmapped_losses``. Returns the result and which of its
    parameters carry the task axis (0) and which are shared (``None``).

    ``dims`` says that of ``params``, and ``buffers`` carry the axis. ``chunk`` is the forward's
    chunk of tasks, ``watch`` sees the parameters given the task axis (the measured chunk
    tuner's marks), and ``runtime`` how the steps run (``funcmeta._src.runtime``: the traced
    one for :func:`funcmeta.compile_meta_step`).
    """
    adapted, fixed = split_adapted(dict(params), opts.trainable, fmodel.frozen)
    # Every task adapts its own copy: shared initial parameters get a task axis (a view).
    # The view is made with grad enabled: a view made under no_grad reports requires_grad
    # but is no graph node of its own, so gradients would skip it.
    with torch.enable_grad():
        adapted = with_task_axis(adapted, dims, tasks)
        if watch is not None:
            adapted = watch(adapted)
    # adapted parameters carry the task axis now; fixed ones keep their dims
    step_dims = {k: 0 if adapted.get(k) is not None else dims[k] for k in dims}
    forward = functools.partial(
        vmapped_losses, fmodel, loss_fn, batch, step_dims, chunk=chunk, runtime=runtime
    )
    result = inner_loop(
        adapted,
        fixed,
        opt,
        steps,
        buffers,
        opts,
        frozen=fmodel.frozen,
        forward=forward,
        tasks=tasks,
        state=state,
        runtime=runtime,
    )
    return result, step_dims


def _pass_call(checked: CheckedCall, params: Mapping[str, Tensor]) -> TaskCall:
    """A task-batched pass (:func:`task_losses`, :func:`apply_tasks`) described for the rule of
    ``task_chunk="auto"``: its own inputs, no steps."""
    assert checked.tasks is not None  # task-batched
    inputs, targets = (
        tuple(x for x in tree.leaves(part) if isinstance(x, Tensor)) for part in checked.batch
    )
    return TaskCall(
        tasks=checked.tasks,
        steps=0,
        inputs=inputs,
        targets=targets,
        details=("pass",),
        expect_backward=torch.is_grad_enabled()
        and any(isinstance(v, Tensor) and v.requires_grad for v in params.values()),
    )


def _task_call(
    checked: CheckedCall,
    params: Mapping[str, Tensor],
    steps: int,
    opts: AdaptOptions,
) -> TaskCall:
    """The task-batched inner loop described for the executor that chooses its chunk (see
    ``funcmeta._src.batching.chunks``)."""
    # checked by check_adapt_call(task_batched=True): both are set
    assert checked.tasks is not None and checked.param_dims is not None
    inputs, targets = (
        tuple(x for x in tree.leaves(part) if isinstance(x, Tensor)) for part in checked.batch
    )
    return TaskCall(
        tasks=checked.tasks,
        steps=steps,
        inputs=inputs,
        targets=targets,
        details=(
            tuple(sorted(checked.param_dims.items())),
            tuple(v for v in vars(opts).values() if isinstance(v, bool | int | str | type(None))),
        ),
        expect_backward=torch.is_grad_enabled()
        and any(isinstance(v, Tensor) and v.requires_grad for v in params.values()),
    )
