"""Reptile (Nichol et al., 2018): move the initialisation towards the adapted parameters.

Reptile is not loss-based. :func:`reptile`'s ``loss`` is a surrogate whose gradient with
respect to each initial parameter is ``theta - mean_t(phi_t)``, the average displacement of
the task-adapted parameters ``phi_t``. ``result.loss.backward()`` then writes that into
``.grad``, and an outer ``torch.optim.SGD(lr=eps)`` step performs Reptile's update
``theta += eps * (mean_t(phi_t) - theta)``.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> out = fm.recipes.reptile(fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=5, lr=0.02)
    >>> out.loss.backward()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.options import AdaptKeywords, takes_options
from funcmeta._src.inner.tasks import adapt_tasks
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.recipes.common import check_recipe, query_loss, resolve_opt
from funcmeta._src.recipes.results import RecipeResult

__all__ = ["reptile"]


@exposed_in("funcmeta.recipes")
@takes_options
def reptile(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any] | None = None,
    *,
    steps: int,
    lr: Any = None,
    opt: GradientTransformation | None = None,
    inner_batch: int | None = None,
    generator: torch.Generator | None = None,
    task_chunk: int | str | None = "auto",
    **options: Unpack[AdaptKeywords],
) -> RecipeResult:
    """Reptile: ``loss`` is a surrogate with gradient ``theta - mean_t(phi_t)`` for every
    initial parameter ``theta`` in ``params``.

    ``phi_t`` is the result of ``steps`` steps of ``opt`` (or SGD with ``lr``; one of them is required) on task
    ``t``'s ``support`` batch, taken without a graph. Reptile trains on the support set
    alone; a ``query`` set, if given, is only evaluated (``result.query_loss``). ``options``
    are the inner-loop options of :class:`funcmeta.AdaptOptions`, and ``task_chunk``
    :func:`funcmeta.adapt_tasks`'.

    With ``inner_batch=b``, each step takes a mini-batch of ``b`` support examples instead
    of the whole set, as Nichol et al. do: each task's examples in a random order (drawn
    from ``generator``), consecutive batches of it, a new order when one runs out. The
    support targets and inputs must then be tensors with an example axis after the task axis.
    """
    check_recipe(fmodel, support, query)
    opt = resolve_opt(opt, lr)
    with torch.no_grad():
        if inner_batch is None:
            adapted = adapt_tasks(
                fmodel,
                params,
                loss_fn,
                support,
                opt,
                steps=steps,
                task_chunk=task_chunk,
                **options,
            )
        else:
            adapted = _minibatch_steps(
                fmodel,
                params,
                loss_fn,
                support,
                opt,
                steps,
                inner_batch,
                generator,
                task_chunk,
                options,
            )
        phi = adapted.params
        displacement = {
            k: p - (phi[k].mean(0) if phi[k].dim() > p.dim() else phi[k]) for k, p in params.items()
        }
        evaluated, logits = (
            (None, None)
            if query is None
            else query_loss(fmodel, phi, loss_fn, query, adapted.buffers, adapted.chunk)
        )
    # a tensor: adapt_tasks refuses a call without parameters to adapt, so the sum has a term
    surrogate = cast(Tensor, sum((params[k] * d).sum() for k, d in displacement.items()))
    return RecipeResult(surrogate, evaluated, adapted, logits=logits)


def _minibatch_steps(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    opt: GradientTransformation,
    steps: int,
    inner_batch: int,
    generator: torch.Generator | None,
    task_chunk: int | str | None,
    options: AdaptKeywords,
) -> Any:
    """``steps`` steps, each on the next ``inner_batch`` examples of every task's support set
    in a random order (one order per task, renewed when it runs out)."""
    check_int(steps, "steps", low=1)
    x, y = support
    if not (isinstance(x, Tensor) and isinstance(y, Tensor)) or x.dim() < 2 or y.dim() < 2:
        raise TypeError(
            "reptile(inner_batch=...) needs support (inputs, targets) as tensors of shape "
            "(tasks, examples, ...)"
        )
    tasks, examples = y.shape[:2]
    if x.shape[:2] != (tasks, examples):
        raise ValueError(
            f"support inputs {tuple(x.shape[:2])} and targets {tuple(y.shape[:2])} differ in "
            "their (tasks, examples) axes"
        )
    check_int(inner_batch, "inner_batch", low=1, high=examples)
    device = y.device
    rows = torch.arange(tasks, device=device).unsqueeze(1)
    order = torch.empty(tasks, 0, dtype=torch.long, device=device)
    state, adapted, losses = None, None, []
    for _ in range(steps):
        while order.shape[1] < inner_batch:
            fresh = torch.rand(tasks, examples, generator=generator).argsort(1).to(device)
            order = torch.cat([order, fresh], 1)
        take, order = order[:, :inner_batch], order[:, inner_batch:]
        batch = (x[rows, take], y[rows, take])
        adapted = adapt_tasks(
            fmodel,
            params,
            loss_fn,
            batch,
            opt,
            steps=1,
            state=state,
            task_chunk=task_chunk,
            **options,
        )
        params, state = adapted.params, adapted.state
        losses.append(adapted.losses)
    assert adapted is not None  # steps >= 1 (checked above): the loop ran
    return adapted._replace(losses=torch.cat(losses))
