"""Meta-SGD (Li et al., 2017): MAML with a learned learning rate for every parameter element.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functionalize(net)
    >>> rates = fm.recipes.metasgd_rates(fmodel.params, generator=torch.Generator().manual_seed(0))
    >>> outer = torch.optim.Adam([*net.parameters(), *rates.parameters()], lr=1e-3)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> fm.recipes.metasgd(fmodel, rates, (b.x_support, b.y_support), (b.x_query, b.y_query), F.mse_loss).backward()
    >>> all(r.grad is not None for r in rates.raw)   # every rate learns
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from funcmeta import tree
from funcmeta.functional import FunctionalModel
from funcmeta.hyper import HyperTree, per_element
from funcmeta.inner import LossFn
from funcmeta.recipes.maml import maml
from funcmeta.tree import Tree

__all__ = ["metasgd", "metasgd_rates"]


def metasgd_rates(
    params: Tree,
    low: float = 0.005,
    high: float = 0.1,
    *,
    generator: torch.Generator | None = None,
) -> HyperTree:
    """Per-element learnable rates drawn from ``U[low, high]``, the initialisation of Li et al.

    Raw parameterisation, as in the paper: the rates are free to change sign.
    """
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    rates = per_element(params, low)
    with torch.no_grad():
        for r in rates.raw:
            r.copy_(torch.rand(r.shape, generator=generator, dtype=r.dtype) * (high - low) + low)
    return rates


def metasgd(
    fmodel: FunctionalModel,
    rates: HyperTree | Tree,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    loss_fn: LossFn,
    *,
    steps: int = 1,
    **options: Any,
) -> Tensor:
    """The Meta-SGD outer loss: :func:`funcmeta.recipes.maml` with the inner step
    ``p - rates * grad``. ``rates`` is per element, usually :func:`metasgd_rates`. Train its
    parameters with the outer optimizer along with the model's."""
    leaves = tree.leaves(rates() if isinstance(rates, HyperTree) else rates)
    if not all(isinstance(r, Tensor) for r in leaves):
        raise TypeError("Meta-SGD rates must be tensors (a HyperTree or a tree of tensors)")
    return maml(fmodel, support, query, loss_fn, lr=rates, steps=steps, **options)
