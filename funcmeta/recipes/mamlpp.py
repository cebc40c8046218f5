"""MAML++ (Antoniou et al., 2019): MAML with per-layer per-step learnable rates (LSLR), a
multi-step loss with annealed weights (MSL), derivative-order annealing (DA) and per-step
BatchNorm running statistics (BNRS).

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.BatchNorm1d(40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functionalize(net)
    >>> rates = fm.hyper.per_layer(fmodel.params, 0.01, steps=5)      # LSLR
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> weights = fm.recipes.mamlpp_step_weights(5, epoch=0, msl_epochs=10)
    >>> out = fm.recipes.mamlpp(fmodel, rates, (b.x_support, b.y_support), (b.x_query, b.y_query),
    ...                         F.mse_loss, steps=5, step_weights=weights, first_order=False)
    >>> out.loss.backward()
    >>> len(out.step_buffers)    # one set of BatchNorm statistics per inner step
    5
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from funcmeta.functional import FunctionalModel
from funcmeta.inner import LossFn
from funcmeta.inputs import check_model
from funcmeta.optim.sgd import sgd
from funcmeta.recipes._common import query_loss
from funcmeta.tasks import adapt_tasks
from funcmeta.tree import Tree

__all__ = ["MamlppResult", "mamlpp", "mamlpp_step_weights"]


class MamlppResult(NamedTuple):
    """``loss``: the weighted multi-step query loss; ``step_buffers``: the buffers of each
    inner step after this call (pass them back as ``step_buffers`` next time)."""

    loss: Tensor
    step_buffers: list[dict[str, Tensor]]


def mamlpp_step_weights(steps: int, epoch: int, msl_epochs: int) -> Tensor:
    """The multi-step loss weights of MAML++ at ``epoch`` (its reference schedule).

    All steps weigh ``1/steps`` at epoch 0. Each epoch, the weights of the steps before the
    last decay by ``1/(steps * msl_epochs)`` down to ``0.03/steps``, and the last weight grows
    to match. From epoch ``msl_epochs`` on, almost all weight is on the last step.
    """
    if steps < 1 or msl_epochs < 1 or epoch < 0:
        raise ValueError("need steps >= 1, msl_epochs >= 1 and epoch >= 0")
    decay = 1.0 / steps / msl_epochs
    floor = 0.03 / steps
    weights = torch.full((steps,), 1.0 / steps, dtype=torch.float64)
    weights[:-1] = torch.clamp(weights[:-1] - epoch * decay, min=floor)
    weights[-1] = min(1.0 / steps + epoch * (steps - 1) * decay, 1.0 - (steps - 1) * floor)
    return weights


def mamlpp(
    fmodel: FunctionalModel,
    rates: Tree,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    loss_fn: LossFn,
    *,
    steps: int,
    step_weights: Tensor,
    first_order: bool = False,
    step_buffers: list[dict[str, Tensor]] | None = None,
    **options: Any,
) -> MamlppResult:
    """The MAML++ outer loss: ``sum_k step_weights[k] * query_loss(after step k+1)``.

    ``rates`` gives step ``k``'s learning rates as ``rates(k)``; usually
    ``fm.hyper.per_layer(params, init, steps=steps)`` (LSLR). ``step_weights`` come from
    :func:`mamlpp_step_weights` (MSL). ``first_order`` is the derivative-order annealing
    switch: MAML++ trains first order for the first epochs, then second order. Step ``k``
    runs with its own BatchNorm running statistics, ``step_buffers[k]`` (default: the
    module's), returned updated (BNRS). ``options`` go to :func:`funcmeta.adapt_tasks`.
    """
    check_model(fmodel)
    weights = torch.as_tensor(step_weights)
    if weights.shape != (steps,):
        raise ValueError(f"step_weights must have shape ({steps},), got {tuple(weights.shape)}")
    if step_buffers is None:
        step_buffers = [fmodel.buffers for _ in range(steps)]
    if len(step_buffers) != steps:
        raise ValueError(f"step_buffers must hold {steps} buffer dicts, got {len(step_buffers)}")
    opt = sgd(lr=rates)
    params, state = fmodel.params, None
    total: Tensor | float = 0.0
    new_buffers = []
    for k in range(steps):
        result = adapt_tasks(
            fmodel,
            params,
            loss_fn,
            support,
            opt,
            1,
            first_order=first_order,
            buffers=step_buffers[k],
            state=state,
            **options,
        )
        params, state = result.params, result.state
        new_buffers.append(_across_tasks(result.buffers))
        step_loss = query_loss(fmodel, params, result.buffers, loss_fn, query)
        total = total + weights[k].to(step_loss.dtype) * step_loss
    return MamlppResult(total, new_buffers)


def _across_tasks(buffers: dict[str, Tensor]) -> dict[str, Tensor]:
    """One set of statistics for the step: floating buffers averaged over the task axis,
    counters (equal across tasks) taken from the first task."""
    return {
        k: v.detach().mean(0) if v.is_floating_point() else v[0].detach()
        for k, v in buffers.items()
    }
