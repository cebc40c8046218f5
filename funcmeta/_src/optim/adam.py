"""Differentiable Adam and AdamW, AMSGrad included (``torch.optim.Adam`` / ``AdamW``).

Example:
    >>> import torch, funcmeta as fm
    >>> opt = fm.optim.adam(lr=0.1)
    >>> params = {"w": torch.zeros(2)}
    >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
    >>> [round(u, 6) for u in updates["w"].tolist()]  # the first Adam step is -lr * sign(g)
    [-0.1, 0.1]
"""

from __future__ import annotations

import math
from typing import NamedTuple, cast

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_number, is_number
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.optim._moments import ema, ema_sq
from funcmeta._src.optim.base import GradientTransformation, chain, safe_sqrt
from funcmeta._src.optim.hyper import Hyperparameter, is_zero, per_leaf
from funcmeta._src.optim.primitives import (
    add_decayed_weights,
    check_hyperparameter,
    scale_by_learning_rate,
)

__all__ = ["ScaleByAdamState", "adam", "adamw", "scale_by_adam"]


@exposed_in("funcmeta.optim")
class ScaleByAdamState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count
    exp_avg: Tree
    exp_avg_sq: Tree
    max_exp_avg_sq: Tree | None


def _power_complement(beta: float | Tensor, t: int) -> float | Tensor:
    return 1 - beta**t


def _sqrt(x: float | Tensor) -> float | Tensor:
    return math.sqrt(x) if is_number(x) else torch.sqrt(x)


@exposed_in("funcmeta.optim")
def scale_by_adam(
    b1: Hyperparameter = 0.9,
    b2: Hyperparameter = 0.999,
    eps: Hyperparameter = 1e-8,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Adam's bias-corrected direction ``m_hat / (sqrt(v_hat) + eps)``, before the learning rate.

    ``sqrt`` is taken with finite derivatives at 0, so double backward through a gradient
    entry that is exactly zero stays finite.
    """
    check_number(b1, "beta1", high=1.0)
    check_number(b2, "beta2", high=1.0)
    check_number(eps, "eps")
    if eps == 0 and isinstance(eps, int | float):
        raise ValueError(
            "invalid eps: 0 (must be > 0): Adam divides m_hat by sqrt(v_hat) + eps, which is "
            "0 / 0 wherever a gradient is exactly zero, and the parameters turn NaN "
            "(torch.optim.Adam does the same, silently); use a small positive eps, e.g. 1e-8"
        )

    def init(params: Tree) -> ScaleByAdamState:
        for value, name in ((b1, "beta1"), (b2, "beta2"), (eps, "eps")):
            check_hyperparameter(value, params, name)
        zeros = tree.tree_map(torch.zeros_like, params)
        return ScaleByAdamState(
            0,
            zeros,
            tree.tree_map(torch.zeros_like, params),
            tree.tree_map(torch.zeros_like, params) if amsgrad else None,
        )

    def update(
        updates: Tree, state: ScaleByAdamState, params: Tree | None = None
    ) -> tuple[Tree, ScaleByAdamState]:
        g, spec = tree.flatten(updates)
        step = state.count
        t = step + 1
        b1s = per_leaf(b1, updates, g, step, "beta1")
        b2s = per_leaf(b2, updates, g, step, "beta2")
        epss = per_leaf(eps, updates, g, step, "eps")
        mus = spec.flatten_up_to(state.exp_avg)
        nus = spec.flatten_up_to(state.exp_avg_sq)
        # init keeps a max_exp_avg_sq tree with amsgrad
        maxes = spec.flatten_up_to(cast(Tree, state.max_exp_avg_sq)) if amsgrad else [None] * len(g)
        out, new_mu, new_nu, new_max = [], [], [], []
        for x, mu, nu, nmax, beta1, beta2, e in zip(
            g, mus, nus, maxes, b1s, b2s, epss, strict=True
        ):
            mu = ema(mu, x, beta1)
            nu = ema_sq(nu, x, beta2)
            if amsgrad:
                nmax = torch.maximum(nmax, nu)
                new_max.append(nmax)
            bias2_sqrt = _sqrt(_power_complement(beta2, t))
            denom = safe_sqrt(nmax if amsgrad else nu) / bias2_sqrt + e
            out.append(mu / denom / _power_complement(beta1, t))
            new_mu.append(mu)
            new_nu.append(nu)
        new_state = ScaleByAdamState(
            t,
            tree.unflatten(spec, new_mu),
            tree.unflatten(spec, new_nu),
            tree.unflatten(spec, new_max) if amsgrad else None,
        )
        return tree.unflatten(spec, out), new_state

    return GradientTransformation(init, update)


@exposed_in("funcmeta.optim")
def adam(
    lr: Hyperparameter = 1e-3,
    betas: tuple[Hyperparameter, Hyperparameter] = (0.9, 0.999),
    eps: Hyperparameter = 1e-8,
    weight_decay: Hyperparameter = 0.0,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Adam giving the same numbers as ``torch.optim.Adam`` (L2 weight decay added to the
    gradient). Any hyperparameter, each beta included, may be a tensor, tree or schedule."""
    b1, b2 = _betas(betas)
    parts = [] if is_zero(weight_decay) else [add_decayed_weights(weight_decay)]
    parts += [scale_by_adam(b1, b2, eps, amsgrad), scale_by_learning_rate(lr)]
    return chain(*parts)


@exposed_in("funcmeta.optim")
def adamw(
    lr: Hyperparameter = 1e-3,
    betas: tuple[Hyperparameter, Hyperparameter] = (0.9, 0.999),
    eps: Hyperparameter = 1e-8,
    weight_decay: Hyperparameter = 1e-2,
    amsgrad: bool = False,
) -> GradientTransformation:
    """AdamW giving the same numbers as ``torch.optim.AdamW``: decoupled weight decay,
    ``p -= lr * (adam_direction + weight_decay * p)``."""
    b1, b2 = _betas(betas)
    parts = [scale_by_adam(b1, b2, eps, amsgrad)]
    if not is_zero(weight_decay):
        parts.append(add_decayed_weights(weight_decay))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)


def _betas(betas: tuple[Hyperparameter, Hyperparameter]) -> tuple[Hyperparameter, Hyperparameter]:
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return betas[0], betas[1]
