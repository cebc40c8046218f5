"""Differentiable Adagrad with learning-rate decay (``torch.optim.Adagrad``).

Example:
    >>> import torch, funcmeta as fm
    >>> opt = fm.optim.adagrad(lr=0.1, initial_accumulator_value=0.1)
    >>> params = {"w": torch.zeros(2)}
    >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_number, is_number
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.optim.base import GradientTransformation, chain, safe_sqrt
from funcmeta._src.optim.hyper import Hyperparameter, is_zero, per_leaf
from funcmeta._src.optim.primitives import (
    add_decayed_weights,
    check_hyperparameter,
    scale_by_learning_rate,
)

__all__ = ["ScaleByAdagradState", "adagrad", "scale_by_adagrad"]


@exposed_in("funcmeta.optim")
class ScaleByAdagradState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count
    sum: Tree


@exposed_in("funcmeta.optim")
def scale_by_adagrad(
    lr_decay: Hyperparameter = 0.0,
    initial_accumulator_value: Hyperparameter = 0.0,
    eps: Hyperparameter = 1e-10,
) -> GradientTransformation:
    """``g / (sqrt(sum of g^2) + eps) / (1 + step * lr_decay)``, before the learning rate."""
    check_number(lr_decay, "lr_decay")
    check_number(initial_accumulator_value, "initial_accumulator_value")
    check_number(eps, "eps")

    def init(params: Tree) -> ScaleByAdagradState:
        check_hyperparameter(lr_decay, params, "lr_decay")
        check_hyperparameter(eps, params, "eps")
        leaves, spec = tree.flatten(params)
        starts = per_leaf(initial_accumulator_value, params, leaves, 0, "initial_accumulator_value")
        sums = [
            torch.full_like(p, s) if is_number(s) else torch.zeros_like(p) + s
            for p, s in zip(leaves, starts, strict=True)
        ]
        return ScaleByAdagradState(0, tree.unflatten(spec, sums))

    def update(
        updates: Tree, state: ScaleByAdagradState, params: Tree | None = None
    ) -> tuple[Tree, ScaleByAdagradState]:
        g, spec = tree.flatten(updates)
        decays = per_leaf(lr_decay, updates, g, state.count, "lr_decay")
        epss = per_leaf(eps, updates, g, state.count, "eps")
        sums = cast(list[Tensor], spec.flatten_up_to(state.sum))
        out, new_sums = [], []
        for x, s, d, e in zip(g, sums, decays, epss, strict=True):
            s = torch.addcmul(s, x, x)
            new_sums.append(s)
            direction = x / (safe_sqrt(s) + e)
            if not (is_zero(d) or state.count == 0):
                direction = direction / (1 + state.count * d)
            out.append(direction)
        return tree.unflatten(spec, out), ScaleByAdagradState(
            state.count + 1, tree.unflatten(spec, new_sums)
        )

    return GradientTransformation(init, update)


@exposed_in("funcmeta.optim")
def adagrad(
    lr: Hyperparameter = 1e-2,
    lr_decay: Hyperparameter = 0.0,
    weight_decay: Hyperparameter = 0.0,
    initial_accumulator_value: Hyperparameter = 0.0,
    eps: Hyperparameter = 1e-10,
) -> GradientTransformation:
    """Adagrad giving the same numbers as ``torch.optim.Adagrad`` with the same arguments."""
    parts = [] if is_zero(weight_decay) else [add_decayed_weights(weight_decay)]
    parts += [
        scale_by_adagrad(lr_decay, initial_accumulator_value, eps),
        scale_by_learning_rate(lr),
    ]
    return chain(*parts)
