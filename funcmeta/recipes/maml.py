"""MAML (Finn et al., 2017) and first-order MAML, on a batch of tasks.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functionalize(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> loss = fm.recipes.maml(fmodel, (b.x_support, b.y_support), (b.x_query, b.y_query), F.mse_loss)
    >>> loss.backward()      # second-order meta-gradients in net's .grad
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from funcmeta.functional import FunctionalModel
from funcmeta.inner import LossFn
from funcmeta.inputs import check_model
from funcmeta.optim.base import GradientTransformation
from funcmeta.recipes._common import query_loss, resolve_opt
from funcmeta.tasks import adapt_tasks

__all__ = ["fomaml", "maml"]


def maml(
    fmodel: FunctionalModel,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    loss_fn: LossFn,
    *,
    lr: Any = 0.01,
    steps: int = 1,
    opt: GradientTransformation | None = None,
    first_order: bool = False,
    **options: Any,
) -> Tensor:
    """The MAML outer loss: the mean over tasks of the query loss after ``steps`` inner steps
    on the support set, starting from ``fmodel.params``.

    ``support`` and ``query`` are ``(inputs, targets)`` with a leading task axis. The inner
    optimizer is ``opt``, or SGD with learning rate ``lr`` (a number, a tensor or a learnable
    tree). ``options`` go to :func:`funcmeta.adapt_tasks` (``trainable``, ``clip_grad_norm``,
    ``checkpoint_steps``, ...). Call ``.backward()`` on the result: the meta-gradients land in
    the module's ``.grad``.
    """
    check_model(fmodel)
    result = adapt_tasks(
        fmodel,
        fmodel.params,
        loss_fn,
        support,
        resolve_opt(opt, lr),
        steps,
        first_order=first_order,
        **options,
    )
    return query_loss(fmodel, result.params, result.buffers, loss_fn, query)


def fomaml(
    fmodel: FunctionalModel,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    loss_fn: LossFn,
    **kwargs: Any,
) -> Tensor:
    """First-order MAML: :func:`maml` with the inner gradients treated as constants."""
    return maml(fmodel, support, query, loss_fn, first_order=True, **kwargs)
