"""ANIL (Raghu et al., 2020): MAML that adapts only the head; the body is reused as it is.

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

from funcmeta.functional import FunctionalModel
from funcmeta.optim.base import GradientTransformation
from funcmeta.options import takes_options
from funcmeta.recipes._common import RecipeResult
from funcmeta.recipes.maml import maml
from funcmeta.tree import Filter
from funcmeta.types import LossFn

__all__ = ["anil"]


@takes_options
def anil(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int,
    trainable: Filter,
    lr: Any = None,
    opt: GradientTransformation | None = None,
    **options: Any,
) -> RecipeResult:
    """ANIL: :func:`funcmeta.recipes.maml` adapting only the parameters that ``trainable``
    selects (the head: a name prefix, several, or a predicate ``(name, tensor) -> bool``).
    The rest is held fixed in the inner loop and receives outer gradients."""
    return maml(
        fmodel,
        params,
        loss_fn,
        support,
        query,
        steps=steps,
        lr=lr,
        opt=opt,
        trainable=trainable,
        **options,
    )
