"""Reptile (Nichol et al., 2018): move the initialisation towards the adapted parameters.

Reptile is not loss-based. :func:`reptile` returns a surrogate scalar whose gradient with
respect to each initial parameter is ``theta - mean_t(phi_t)``, the average displacement
of the task-adapted parameters ``phi_t``. ``loss.backward()`` then writes that into
``.grad``, and an outer ``torch.optim.SGD(lr=eps)`` step performs Reptile's update
``theta += eps * (mean_t(phi_t) - theta)``.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functionalize(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> surrogate = fm.recipes.reptile(fmodel, (b.x_support, b.y_support), F.mse_loss, steps=5, lr=0.02)
    >>> surrogate.backward()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from funcmeta.functional import FunctionalModel
from funcmeta.inner import LossFn
from funcmeta.inputs import check_model
from funcmeta.optim.base import GradientTransformation
from funcmeta.recipes._common import resolve_opt
from funcmeta.tasks import adapt_tasks

__all__ = ["reptile"]


def reptile(
    fmodel: FunctionalModel,
    support: tuple[Any, Any],
    loss_fn: LossFn,
    *,
    steps: int = 5,
    lr: Any = 0.01,
    opt: GradientTransformation | None = None,
    **options: Any,
) -> Tensor:
    """Reptile's surrogate: gradient ``theta - mean_t(phi_t)`` for every initial parameter.

    ``phi_t`` is the result of ``steps`` steps of ``opt`` (default: SGD with ``lr``) on task
    ``t``'s ``support`` batch, taken without a graph. ``options`` go to
    :func:`funcmeta.adapt_tasks`.
    """
    check_model(fmodel)
    params = fmodel.params
    with torch.no_grad():
        result = adapt_tasks(
            fmodel, params, loss_fn, support, resolve_opt(opt, lr), steps, **options
        )
        adapted = result.params
        displacement = {
            k: p - (adapted[k].mean(0) if adapted[k].dim() > p.dim() else adapted[k])
            for k, p in params.items()
        }
    return sum((params[k] * d).sum() for k, d in displacement.items())
