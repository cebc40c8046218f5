"""Building blocks shared by the optimizers: learning-rate scaling, weight decay, momentum.

Each is a :class:`~funcmeta.optim.GradientTransformation` whose state carries ``count``, the
number of updates made so far (a Python int), which schedules receive as the step index.

Example:
    >>> import torch, funcmeta as fm
    >>> opt = fm.optim.chain(fm.optim.momentum_trace(momentum=0.9), fm.optim.scale_by_learning_rate(0.5))
    >>> params = {"w": torch.zeros(2)}
    >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> updates["w"].tolist()
    [-0.5, -0.5]
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_number, is_number
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import compiling
from funcmeta._src.core.tree import Tree
from funcmeta._src.optim.base import GradientTransformation, same_dtype
from funcmeta._src.optim.hyper import Hyperparameter, LeafResolver, is_zero, per_leaf

__all__ = [
    "AddDecayedWeightsState",
    "AddProximalState",
    "ScaleByLearningRateState",
    "TraceState",
    "add_decayed_weights",
    "add_proximal",
    "scale_by_learning_rate",
    "momentum_trace",
]


def check_hyperparameter(value: Hyperparameter, params: Tree, name: str) -> None:
    """Resolve a (non-schedule) hyperparameter against ``params`` once, so a mismatch raises
    at ``init`` rather than at the first step."""
    if callable(value) and not isinstance(value, Tensor):
        return
    per_leaf(value, params, tree.leaves(params), 0, name)


def scale(x: Tensor, factor: Any) -> Tensor:
    """``x * factor`` with Python numbers kept off the autograd graph."""
    return x.mul(factor) if is_number(factor) else x * factor


@exposed_in("funcmeta.optim")
class ScaleByLearningRateState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count


@exposed_in("funcmeta.optim")
def scale_by_learning_rate(lr: Hyperparameter) -> GradientTransformation:
    """``updates = -lr * updates``: the last link of every optimizer here."""
    check_number(lr, "learning rate")
    rates = LeafResolver(lr, "lr")

    def init(params: Tree) -> ScaleByLearningRateState:
        # a traced step skips the check: the step's eager run checked it before its graph,
        # and the first update resolves the rates against the parameters' structure again
        if not compiling() and (not callable(lr) or isinstance(lr, Tensor)):
            leaves, spec = tree.flatten(params)
            rates(params, spec, leaves, 0)  # checked against the parameters before any step
        return ScaleByLearningRateState(0)

    def update(
        updates: Tree, state: ScaleByLearningRateState, params: Tree | None = None
    ) -> tuple[Tree, ScaleByLearningRateState]:
        g, spec = tree.flatten(updates)
        lrs = rates(updates, spec, g, state.count)
        out = [x.mul(-h) if is_number(h) else -(h * x) for x, h in zip(g, lrs, strict=True)]
        return tree.unflatten(spec, out), ScaleByLearningRateState(state.count + 1)

    def descend(
        updates: Tree, state: ScaleByLearningRateState, params: Tree
    ) -> tuple[Tree, ScaleByLearningRateState]:
        # p - lr * g in two operations instead of update's three (lr * g, its negation,
        # the addition); the same numbers, since p + -(x) and p - x round alike
        g, spec = tree.flatten(updates)
        p = cast(list[Tensor], spec.flatten_up_to(params))
        lrs = rates(updates, spec, g, state.count)
        out = [
            same_dtype(w - (x.mul(h) if is_number(h) else h * x), w)
            for w, x, h in zip(p, g, lrs, strict=True)
        ]
        return tree.unflatten(spec, out), ScaleByLearningRateState(state.count + 1)

    return GradientTransformation(init, update, descend=descend)


@exposed_in("funcmeta.optim")
class AddDecayedWeightsState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count


@exposed_in("funcmeta.optim")
def add_decayed_weights(weight_decay: Hyperparameter) -> GradientTransformation:
    """``updates = updates + weight_decay * params`` (L2 when placed before the moments,
    decoupled when placed after them, as in AdamW)."""
    check_number(weight_decay, "weight_decay")

    def init(params: Tree) -> AddDecayedWeightsState:
        check_hyperparameter(weight_decay, params, "weight_decay")
        return AddDecayedWeightsState(0)

    def update(
        updates: Tree, state: AddDecayedWeightsState, params: Tree | None = None
    ) -> tuple[Tree, AddDecayedWeightsState]:
        if params is None:
            raise ValueError("weight decay needs the parameters: call update(grads, state, params)")
        g, spec = tree.flatten(updates)
        p = spec.flatten_up_to(params)
        wds = per_leaf(weight_decay, updates, g, state.count, "weight_decay")
        out = [
            x.add(w, alpha=d) if is_number(d) else x + d * w
            for x, w, d in zip(g, p, wds, strict=True)
        ]
        return tree.unflatten(spec, out), AddDecayedWeightsState(state.count + 1)

    return GradientTransformation(init, update)


@exposed_in("funcmeta.optim")
class AddProximalState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count


@exposed_in("funcmeta.optim")
def add_proximal(strength: Hyperparameter, anchor: Tree) -> GradientTransformation:
    """``updates = updates + strength * (params - anchor)``: the gradient of the proximal term
    ``strength / 2 * ||params - anchor||^2`` (iMAML's inner objective).

    ``anchor`` has the structure of the parameters. Its leaves broadcast against them, so
    shared initial parameters serve as the anchor of task-batched ones. It is used as given:
    detach it if no gradient should flow into it.
    """
    check_number(strength, "strength")

    def init(params: Tree) -> AddProximalState:
        check_hyperparameter(strength, params, "strength")
        tree.broadcast_prefix(anchor, params, name="anchor")
        return AddProximalState(0)

    def update(
        updates: Tree, state: AddProximalState, params: Tree | None = None
    ) -> tuple[Tree, AddProximalState]:
        if params is None:
            raise ValueError(
                "the proximal term needs the parameters: call update(grads, state, params)"
            )
        g, spec = tree.flatten(updates)
        p = spec.flatten_up_to(params)
        anchors = tree.broadcast_prefix(anchor, updates, name="anchor")
        strengths = per_leaf(strength, updates, g, state.count, "strength")
        out = [x + scale(w - a, s) for x, w, a, s in zip(g, p, anchors, strengths, strict=True)]
        return tree.unflatten(spec, out), AddProximalState(state.count + 1)

    return GradientTransformation(init, update)


@exposed_in("funcmeta.optim")
class TraceState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count
    momentum_buffer: Tree


@exposed_in("funcmeta.optim")
def momentum_trace(
    momentum: Hyperparameter, dampening: Hyperparameter = 0.0, nesterov: bool = False
) -> GradientTransformation:
    """Heavy-ball momentum exactly as ``torch.optim.SGD`` keeps it.

    The first update sets the buffer to the gradient; later ones compute
    ``buf = momentum * buf + (1 - dampening) * g``. The output is ``buf``, or
    ``g + momentum * buf`` with ``nesterov``.
    """
    check_number(momentum, "momentum")
    check_number(dampening, "dampening")
    if nesterov and (is_zero(momentum) or not is_zero(dampening)):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def init(params: Tree) -> TraceState:
        check_hyperparameter(momentum, params, "momentum")
        check_hyperparameter(dampening, params, "dampening")
        return TraceState(0, tree.tree_map(torch.zeros_like, params))

    def update(
        updates: Tree, state: TraceState, params: Tree | None = None
    ) -> tuple[Tree, TraceState]:
        g, spec = tree.flatten(updates)
        moms = per_leaf(momentum, updates, g, state.count, "momentum")
        if state.count == 0:
            bufs = list(g)
        else:
            old = cast(list[Tensor], spec.flatten_up_to(state.momentum_buffer))
            damps = per_leaf(dampening, updates, g, state.count, "dampening")
            bufs = [
                scale(b, m) + (x if is_zero(d) else scale(x, 1 - d))
                for b, x, m, d in zip(old, g, moms, damps, strict=True)
            ]
        out = [x + scale(b, m) for x, b, m in zip(g, bufs, moms, strict=True)] if nesterov else bufs
        return tree.unflatten(spec, out), TraceState(state.count + 1, tree.unflatten(spec, bufs))

    return GradientTransformation(init, update)
