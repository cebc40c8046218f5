"""ANIL (Raghu et al., 2020): MAML that adapts only the head; the body is reused as it is.

Two ways to run it, which differ where the body has BatchNorm in training mode:

- ``trainable=``: one model; the head's parameters are adapted, and the whole model runs on
  the support set at every inner step and on the query set alone (separate batch
  statistics);
- ``body=``: the body is a model of its own, run once per task on the support and query
  sets *together* (one batch, as learn2learn's ANIL and the paper's code do), and the head
  (``fmodel``) is adapted on the support features. Its batch statistics mix both sets.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> out = fm.recipes.anil(fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=1, trainable="2", lr=0.01)
    >>> out.loss.backward()      # the body still learns, through the query loss
    >>> net[0].weight.grad is not None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Filter
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.inputs import check_model
from funcmeta._src.inner.options import HeadKeywords, takes_options
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.recipes.maml import maml
from funcmeta._src.recipes.protonet import embed_episodes
from funcmeta._src.recipes.results import RecipeResult

__all__ = ["anil"]


@exposed_in("funcmeta.recipes")
@takes_options
def anil(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int,
    trainable: Filter | None = None,
    body: FunctionalModel | None = None,
    body_params: Mapping[str, Tensor] | None = None,
    lr: Any = None,
    opt: GradientTransformation | None = None,
    task_chunk: int | str | None = "auto",
    **options: Unpack[HeadKeywords],
) -> RecipeResult:
    """ANIL: :func:`funcmeta.recipes.maml` adapting only the head.

    With ``trainable`` (a name prefix, several, or a predicate ``(name, tensor) -> bool``):
    the parameters it selects are adapted; the rest is held fixed in the inner loop and
    receives outer gradients.

    With ``body`` (a functional model of the feature network, its parameters
    ``body_params``, default ``body.params``): ``fmodel`` is the head, and all of its
    parameters are adapted on the body's features, computed once per task from the support
    and query inputs in one batch (its output flattened after the example axis). Give
    exactly one of the two. ``task_chunk`` is :func:`funcmeta.adapt_tasks`'; the body's pass
    runs on the rule of ``"auto"`` unless it is a number or ``None``.

    Example:
        >>> import torch, torch.nn.functional as F, funcmeta as fm
        >>> body = fm.functional_model(torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU()))
        >>> head = fm.functional_model(torch.nn.Linear(8, 3))
        >>> ys = torch.arange(3).repeat(2, 2)                    # 2 tasks, 3-way 2-shot
        >>> support, query = (torch.randn(2, 6, 4), ys), (torch.randn(2, 6, 4), ys)
        >>> out = fm.recipes.anil(head, head.params, F.cross_entropy, support, query,
        ...                       steps=2, lr=0.5, body=body)
        >>> out.loss.backward()                                 # the body learns too
        >>> body.module[0].weight.grad is not None
        True
    """
    if (trainable is None) == (body is None):
        raise TypeError(
            "anil takes trainable= (the head's parameters, within one model) or body= (a "
            "functional model of the feature network, with fmodel the head), exactly one"
        )
    if body is not None:
        check_model(body)
        z_s, z_q = embed_episodes(
            body,
            body.params if body_params is None else body_params,
            support[0],
            query[0],
            None,
            "auto" if task_chunk == "tune" else task_chunk,
        )
        support, query = (z_s, support[1]), (z_q, query[1])
    chosen = None if body is not None else trainable
    return maml(
        fmodel,
        params,
        loss_fn,
        support,
        query,
        steps=steps,
        lr=lr,
        opt=opt,
        trainable=chosen,
        task_chunk=task_chunk,
        **options,
    )
