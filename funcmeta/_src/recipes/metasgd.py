"""Meta-SGD (Li et al., 2017): MAML with a learned learning rate for every parameter element.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> rates = fm.recipes.metasgd_rates(fmodel.params, generator=torch.Generator().manual_seed(0))
    >>> outer = torch.optim.Adam([*net.parameters(), *rates.parameters()], lr=1e-3)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> fm.recipes.metasgd(fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=1, lr=rates).loss.backward()
    >>> all(r.grad is not None for r in rates.raw)   # every rate learns
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core import tree
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.options import AdaptKeywords, takes_options
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.hyper import HyperTree, per_element
from funcmeta._src.recipes.maml import maml
from funcmeta._src.recipes.results import RecipeResult

__all__ = ["metasgd", "metasgd_rates"]


@exposed_in("funcmeta.recipes")
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


@exposed_in("funcmeta.recipes")
@takes_options
def metasgd(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int,
    lr: HyperTree | Tree,
    task_chunk: int | str | None = "auto",
    **options: Unpack[AdaptKeywords],
) -> RecipeResult:
    """Meta-SGD: :func:`funcmeta.recipes.maml` with the inner step ``p - lr * grad``, where
    ``lr`` holds a rate per element, usually :func:`metasgd_rates`. Train its parameters
    with the outer optimizer along with the model's."""
    leaves = tree.leaves(lr() if isinstance(lr, HyperTree) else lr)
    if not leaves or not all(isinstance(r, Tensor) for r in leaves):
        hint = (
            f" learnable ones starting at {lr}: lr=fm.hyper.per_element(params, {lr}) (put "
            "their .parameters() in the outer optimizer), or fm.recipes.metasgd_rates(params) "
            "for the paper's U[0.005, 0.1] initialisation"
            if isinstance(lr, int | float) and not isinstance(lr, bool)
            else " fm.hyper.per_element(params, lr) or fm.recipes.metasgd_rates(params)"
        )
        raise TypeError(
            "Meta-SGD rates lr= must be tensors (a HyperTree or a tree of tensors), one per "
            f"element, learned by the outer optimizer; got {type(lr).__name__}. Use{hint}"
        )
    return maml(
        fmodel,
        params,
        loss_fn,
        support,
        query,
        steps=steps,
        lr=lr,
        task_chunk=task_chunk,
        **options,
    )
