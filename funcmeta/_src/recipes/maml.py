"""MAML (Finn et al., 2017) and first-order MAML, on a batch of tasks.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> out = fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=1, lr=0.01)
    >>> out.loss.backward()      # second-order meta-gradients in net's .grad
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.options import AdaptKeywords, FirstOrderKeywords, takes_options
from funcmeta._src.inner.tasks import adapt_tasks
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.recipes.common import check_recipe, query_loss, resolve_opt
from funcmeta._src.recipes.results import RecipeResult

__all__ = ["fomaml", "maml"]


@exposed_in("funcmeta.recipes")
@takes_options
def maml(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int,
    lr: Any = None,
    opt: GradientTransformation | None = None,
    task_chunk: int | str | None = "auto",
    **options: Unpack[AdaptKeywords],
) -> RecipeResult:
    """MAML: ``loss`` is the mean over tasks of the query loss after ``steps`` inner steps on
    the support set, starting from ``params`` (usually ``fmodel.params``).

    ``support`` and ``query`` are ``(inputs, targets)`` with a leading task axis. The inner
    optimizer is ``opt``, or SGD with learning rate ``lr`` (a number, a tensor or a learnable
    tree; one of the two is required). ``options`` are the inner-loop options of
    :class:`funcmeta.AdaptOptions` (``first_order``, ``trainable``, ``checkpoint_steps``, ...).
    Call ``.backward()`` on ``result.loss``: the meta-gradients land in the module's ``.grad``.
    ``task_chunk`` is :func:`funcmeta.adapt_tasks`'; the query pass runs on the inner loop's
    chunk.
    """
    check_recipe(fmodel, support, query)
    adapted = adapt_tasks(
        fmodel,
        params,
        loss_fn,
        support,
        resolve_opt(opt, lr),
        steps=steps,
        task_chunk=task_chunk,
        **options,
    )
    loss, logits = query_loss(
        fmodel, adapted.params, loss_fn, query, adapted.buffers, adapted.chunk
    )
    return RecipeResult(loss, loss.detach(), adapted, logits=logits)


@exposed_in("funcmeta.recipes")
def fomaml(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int,
    lr: Any = None,
    opt: GradientTransformation | None = None,
    task_chunk: int | str | None = "auto",
    **options: Unpack[FirstOrderKeywords],
) -> RecipeResult:
    """First-order MAML: :func:`maml` with ``first_order=True`` (the inner gradients treated
    as constants)."""
    if "first_order" in options:
        raise TypeError("fomaml is first order by definition; use maml(first_order=...)")
    return maml(
        fmodel,
        params,
        loss_fn,
        support,
        query,
        steps=steps,
        lr=lr,
        opt=opt,
        task_chunk=task_chunk,
        first_order=True,
        **options,
    )


takes_options(fomaml, without=("first_order",))
