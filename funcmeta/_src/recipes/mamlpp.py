"""MAML++ (Antoniou et al., 2019): MAML with per-layer per-step learnable rates (LSLR), a
multi-step loss with annealed weights (MSL), derivative-order annealing (DA) and per-step
BatchNorm running statistics (BNRS).

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.BatchNorm1d(40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> rates = fm.hyper.per_layer(fmodel.params, 0.01, steps=5)      # LSLR
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> weights = fm.recipes.mamlpp_step_weights(5, epoch=0, msl_epochs=10)
    >>> out = fm.recipes.mamlpp(fmodel, fmodel.params, F.mse_loss, b.support, b.query,
    ...                         steps=5, lr=rates, step_weights=weights, first_order=False)
    >>> out.loss.backward()
    >>> len(out.step_buffers)    # one set of BatchNorm statistics per inner step
    5
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.options import AdaptKeywords, takes_options
from funcmeta._src.inner.tasks import adapt_tasks
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.sgd import sgd
from funcmeta._src.recipes.common import check_recipe, query_loss
from funcmeta._src.recipes.results import MamlppResult

__all__ = ["mamlpp", "mamlpp_step_weights"]


@exposed_in("funcmeta.recipes")
def mamlpp_step_weights(steps: int, epoch: int, msl_epochs: int) -> Tensor:
    """The multi-step loss weights of MAML++ at ``epoch`` (its reference schedule).

    All steps weigh ``1/steps`` at epoch 0. Each epoch, the weights of the steps before the
    last decay by ``1/(steps * msl_epochs)`` down to ``0.03/steps``, and the last weight grows
    to match. From epoch ``msl_epochs`` on, almost all weight is on the last step.
    """
    check_int(steps, "steps", low=1)
    check_int(msl_epochs, "msl_epochs", low=1)
    check_int(epoch, "epoch", low=0)
    decay = 1.0 / steps / msl_epochs
    floor = 0.03 / steps
    weights = torch.full((steps,), 1.0 / steps, dtype=torch.float64)
    weights[:-1] = torch.clamp(weights[:-1] - epoch * decay, min=floor)
    weights[-1] = min(1.0 / steps + epoch * (steps - 1) * decay, 1.0 - (steps - 1) * floor)
    return weights


@exposed_in("funcmeta.recipes")
@takes_options
def mamlpp(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int,
    lr: Tree,
    step_weights: Tensor,
    step_buffers: list[dict[str, Tensor]] | None = None,
    task_chunk: int | str | None = "auto",
    **options: Unpack[AdaptKeywords],
) -> MamlppResult:
    """MAML++: ``loss`` is ``sum_k step_weights[k] * query_loss(after step k+1)``.

    ``lr`` gives step ``k``'s learning rates as ``lr(k)``; usually
    ``fm.hyper.per_layer(params, init, steps=steps)`` (LSLR). ``step_weights`` come from
    :func:`mamlpp_step_weights` (MSL). The option ``first_order`` is the derivative-order
    annealing switch: MAML++ trains first order for the first epochs, then second order.
    Step ``k`` runs with its own BatchNorm running statistics, ``step_buffers[k]`` (default:
    the module's), returned updated as ``result.step_buffers`` (BNRS). ``options`` are the
    inner-loop options of :class:`funcmeta.AdaptOptions`; ``result.query_loss`` is the last
    step's query loss. ``task_chunk`` is :func:`funcmeta.adapt_tasks`'; each query pass runs
    on its step's chunk.
    """
    check_recipe(fmodel, support, query)
    check_int(steps, "steps", low=1, what="an int >= 1 for MAML++")
    if not callable(lr):
        raise TypeError("MAML++ needs per-step rates lr(k): fm.hyper.per_layer(..., steps=steps)")
    weights = torch.as_tensor(step_weights)
    if weights.shape != (steps,):
        raise ValueError(f"step_weights must have shape ({steps},), got {tuple(weights.shape)}")
    if step_buffers is None:
        step_buffers = [fmodel.buffers for _ in range(steps)]
    if len(step_buffers) != steps:
        raise ValueError(f"step_buffers must hold {steps} buffer dicts, got {len(step_buffers)}")
    opt = sgd(lr=lr)
    state = None
    total: Tensor | float = 0.0
    new_buffers = []
    for k in range(steps):
        adapted = adapt_tasks(
            fmodel,
            params,
            loss_fn,
            support,
            opt,
            steps=1,
            buffers=step_buffers[k],
            state=state,
            task_chunk=task_chunk,
            **options,
        )
        params, state = adapted.params, adapted.state
        new_buffers.append(_across_tasks(adapted.buffers))
        step_loss, logits = query_loss(
            fmodel, params, loss_fn, query, adapted.buffers, adapted.chunk
        )
        total = total + weights[k].to(step_loss.dtype) * step_loss
    loss = cast(Tensor, total)  # a tensor: steps >= 1 (checked above)
    return MamlppResult(loss, step_loss.detach(), adapted, logits=logits, step_buffers=new_buffers)


def _across_tasks(buffers: dict[str, Tensor]) -> dict[str, Tensor]:
    """One set of statistics for the step: floating buffers averaged over the task axis,
    counters (equal across tasks) taken from the first task."""
    return {
        k: v.detach().mean(0) if v.is_floating_point() else v[0].detach()
        for k, v in buffers.items()
    }
