"""Differentiable RMSprop, centered and with momentum (``torch.optim.RMSprop``).

Example:
    >>> import torch, funcmeta as fm
    >>> opt = fm.optim.rmsprop(lr=0.01, momentum=0.9, centered=True)
    >>> params = {"w": torch.zeros(2)}
    >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_number
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.optim._moments import ema, ema_sq
from funcmeta._src.optim.base import GradientTransformation, chain, safe_sqrt
from funcmeta._src.optim.hyper import Hyperparameter, is_zero, per_leaf
from funcmeta._src.optim.primitives import (
    add_decayed_weights,
    check_hyperparameter,
    momentum_trace,
    scale_by_learning_rate,
)

__all__ = ["ScaleByRmsState", "rmsprop", "scale_by_rms"]


@exposed_in("funcmeta.optim")
class ScaleByRmsState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count
    square_avg: Tree
    grad_avg: Tree | None


@exposed_in("funcmeta.optim")
def scale_by_rms(
    alpha: Hyperparameter = 0.99, eps: Hyperparameter = 1e-8, centered: bool = False
) -> GradientTransformation:
    """``g / (sqrt(E[g^2] - [E[g]^2 if centered]) + eps)`` with running averages of rate alpha."""
    check_number(alpha, "alpha", high=1.0, include_high=True)
    check_number(eps, "eps")

    def init(params: Tree) -> ScaleByRmsState:
        check_hyperparameter(alpha, params, "alpha")
        check_hyperparameter(eps, params, "eps")
        return ScaleByRmsState(
            0,
            tree.tree_map(torch.zeros_like, params),
            tree.tree_map(torch.zeros_like, params) if centered else None,
        )

    def update(
        updates: Tree, state: ScaleByRmsState, params: Tree | None = None
    ) -> tuple[Tree, ScaleByRmsState]:
        g, spec = tree.flatten(updates)
        alphas = per_leaf(alpha, updates, g, state.count, "alpha")
        epss = per_leaf(eps, updates, g, state.count, "eps")
        sqs = cast(list[Tensor], spec.flatten_up_to(state.square_avg))
        avgs = (
            # init keeps a grad_avg tree when centered
            cast(list[Tensor], spec.flatten_up_to(cast(Tree, state.grad_avg)))
            if centered
            else [None] * len(g)
        )
        out, new_sq, new_avg = [], [], []
        for x, sq, avg, a, e in zip(g, sqs, avgs, alphas, epss, strict=True):
            sq = ema_sq(sq, x, a)
            new_sq.append(sq)
            if centered:
                avg = ema(cast(Tensor, avg), x, a)  # a leaf of grad_avg when centered
                new_avg.append(avg)
                rms = safe_sqrt(torch.addcmul(sq, avg, avg, value=-1))
            else:
                rms = safe_sqrt(sq)
            out.append(x / (rms + e))
        new_state = ScaleByRmsState(
            state.count + 1,
            tree.unflatten(spec, new_sq),
            tree.unflatten(spec, new_avg) if centered else None,
        )
        return tree.unflatten(spec, out), new_state

    return GradientTransformation(init, update)


@exposed_in("funcmeta.optim")
def rmsprop(
    lr: Hyperparameter = 1e-2,
    alpha: Hyperparameter = 0.99,
    eps: Hyperparameter = 1e-8,
    weight_decay: Hyperparameter = 0.0,
    momentum: Hyperparameter = 0.0,
    centered: bool = False,
) -> GradientTransformation:
    """RMSprop giving the same numbers as ``torch.optim.RMSprop`` with the same arguments."""
    parts = [] if is_zero(weight_decay) else [add_decayed_weights(weight_decay)]
    parts.append(scale_by_rms(alpha, eps, centered))
    if not is_zero(momentum):
        parts.append(momentum_trace(momentum))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)
