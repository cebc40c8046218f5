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
from typing import Any

import torch
from torch import Tensor

from funcmeta.functional import FunctionalModel
from funcmeta.optim.base import GradientTransformation
from funcmeta.options import takes_options
from funcmeta.recipes._common import RecipeResult, check_recipe, query_loss, resolve_opt
from funcmeta.tasks import adapt_tasks
from funcmeta.types import LossFn

__all__ = ["reptile"]


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
    **options: Any,
) -> RecipeResult:
    """Reptile: ``loss`` is a surrogate with gradient ``theta - mean_t(phi_t)`` for every
    initial parameter ``theta`` in ``params``.

    ``phi_t`` is the result of ``steps`` steps of ``opt`` (default: SGD with ``lr``) on task
    ``t``'s ``support`` batch, taken without a graph. Reptile trains on the support set
    alone; a ``query`` set, if given, is only evaluated (``result.query_loss``). ``options``
    are the inner-loop options of :class:`funcmeta.AdaptOptions`.
    """
    check_recipe(fmodel, support, query)
    with torch.no_grad():
        adapted = adapt_tasks(
            fmodel, params, loss_fn, support, resolve_opt(opt, lr), steps=steps, **options
        )
        phi = adapted.params
        displacement = {
            k: p - (phi[k].mean(0) if phi[k].dim() > p.dim() else phi[k]) for k, p in params.items()
        }
        evaluated, logits = (
            (None, None)
            if query is None
            else query_loss(fmodel, phi, loss_fn, query, adapted.buffers)
        )
    surrogate = sum((params[k] * d).sum() for k, d in displacement.items())
    return RecipeResult(surrogate, evaluated, adapted, logits=logits)
