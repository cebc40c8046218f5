"""ANIL (Raghu et al., 2020): MAML that adapts only the head; the body is reused as it is.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functionalize(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> loss = fm.recipes.anil(fmodel, (b.x_support, b.y_support), (b.x_query, b.y_query), F.mse_loss, head="2")
    >>> loss.backward()      # the body still learns, through the query loss
    >>> net[0].weight.grad is not None
    True
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from funcmeta.functional import FunctionalModel
from funcmeta.inner import LossFn
from funcmeta.recipes.maml import maml
from funcmeta.tree import Filter

__all__ = ["anil"]


def anil(
    fmodel: FunctionalModel,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    loss_fn: LossFn,
    *,
    head: Filter,
    **kwargs: Any,
) -> Tensor:
    """The ANIL outer loss: :func:`funcmeta.recipes.maml` adapting only the parameters that
    ``head`` selects (a name prefix, several, or a predicate ``(path, tensor) -> bool``). The
    rest is held fixed in the inner loop and receives outer gradients."""
    return maml(fmodel, support, query, loss_fn, trainable=head, **kwargs)
