"""The inner loop: :func:`adapt` takes K explicit, differentiable optimizer steps on a task.

Example (5 second-order steps of SGD, then a meta-gradient for the initial parameters):
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fmodel = fm.functional_model(net)
    >>> x, y = torch.randn(10, 1), torch.randn(10, 1)
    >>> result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=5)
    >>> result.losses.shape
    torch.Size([5])
    >>> F.mse_loss(fmodel(result.params, x), y).backward()   # reaches net's .grad
    >>> net[0].weight.grad is not None
    True
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core.checks import error_like
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.precision import warn_tf32_second_order
from funcmeta._src.core.types import AdaptResult, LossFn, NonFiniteError
from funcmeta._src.inner.forward import forward_loss, raised_at_the_call
from funcmeta._src.inner.inputs import TaskAxisSuspect, check_adapt_call, leftover_task_axis
from funcmeta._src.inner.loop import inner_loop, split_adapted
from funcmeta._src.inner.options import AdaptKeywords, AdaptOptions, takes_options
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation

__all__ = ["AdaptResult", "LossFn", "NonFiniteError", "adapt"]


@exposed_in("funcmeta")
@raised_at_the_call
@takes_options
def adapt(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    opt: GradientTransformation,
    *,
    steps: int,
    buffers: Mapping[str, Tensor] | None = None,
    state: Any = None,
    **options: Unpack[AdaptKeywords],
) -> AdaptResult:
    """Take ``steps`` optimizer steps on ``loss_fn(fmodel(params, inputs), targets)``.

    Every core call and recipe takes its arguments in this order: the model, the parameters,
    the loss, the data, then keywords (:doc:`/conventions`).

    Args:
        fmodel: from :func:`funcmeta.functional_model`.
        params: the initial parameters, usually ``fmodel.params`` (meta-gradients then reach
            the module's ``.grad``); a dict with the module's parameter names.
        loss_fn: ``(output, targets) -> scalar tensor``, e.g. ``F.mse_loss``.
        batch: ``(inputs, targets)``. ``inputs`` are the model's arguments: a tuple is
            positional, a dict (a HuggingFace batch) is keywords, ``fm.Args(x, mask=m)`` is
            both, anything else is the one argument (:mod:`funcmeta.inputs`).
        opt: a :class:`~funcmeta.optim.GradientTransformation` (hyperparameters may require
            grad).
        steps: number of inner steps K.
        buffers: initial buffers (default: the module's); never mutated.
        state: optimizer state to continue from (default: ``opt.init`` of the adapted params).
        **options: the inner-loop options of :class:`funcmeta.AdaptOptions`
            (``first_order``, ``trainable``, ``clip_grad_norm``, ``truncate``,
            ``loss_scale``, ``on_nonfinite``, ``allow_unused``, ``checkpoint_steps``,
            ``offload_activations``).

    Returns:
        :class:`AdaptResult` ``(params, buffers, losses, state, skipped, overflowed)``.

    Second-order steps run on kernels that can be differentiated twice (math attention,
    RNNs without cuDNN: :mod:`funcmeta.checkpoint.kernels`); other steps keep the kernels in force.

    Works under ``torch.no_grad()`` too (evaluation): gradients are still taken, no outer
    graph is kept, and the steps run first order (the same values) on the kernels in force.
    """
    opts = AdaptOptions.of(options)
    checked = check_adapt_call(fmodel, params, opt, batch, steps, opts, buffers=buffers)
    warn_tf32_second_order(fmodel.module, params.values(), opts.first_order)
    (args, kwargs), targets = checked.batch
    axis = leftover_task_axis(args, kwargs, targets)
    if axis is not None:
        loss_fn = _first_call_checked(loss_fn, axis)
    runtime = fmodel.runtime.for_params(params)
    runtime.check_batch(checked.batch, "fm.adapt")
    runtime.check_options(opts, "fm.adapt")
    forward = functools.partial(forward_loss, fmodel, loss_fn, checked.batch, runtime=runtime)
    adapted, fixed = split_adapted(dict(params), opts.trainable, fmodel.frozen)
    try:
        with runtime.entry():
            return inner_loop(
                adapted,
                fixed,
                opt,
                steps,
                checked.buffers,
                opts,
                frozen=fmodel.frozen,
                forward=forward,
                tasks=None,
                state=state,
                runtime=runtime,
            )
    except (RuntimeError, ValueError) as error:
        if axis is None or not _about_shapes(error) or axis.hint() in str(error):
            raise
        raise error_like(error, f"{error}\n{axis.hint()}") from error


def _about_shapes(error: Exception) -> bool:
    text = str(error).lower()
    return any(w in text for w in ("shape", "size", "dimension", "mat1", "expected input"))


def _first_call_checked(loss_fn: LossFn, axis: TaskAxisSuspect) -> LossFn:
    """``loss_fn``, whose first call raises if its output and targets show the leftover task
    axis that the batch's shapes suggest (see ``funcmeta._src.inner.inputs.leftover_task_axis``)."""
    called = [False]

    def checked(out: Any, targets: Any) -> Tensor:
        if not called[0]:
            called[0] = True
            axis.check_output(out, targets, loss_fn)
        return loss_fn(out, targets)

    return checked
