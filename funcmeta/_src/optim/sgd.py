"""Differentiable SGD with momentum, dampening, Nesterov and weight decay (``torch.optim.SGD``).

Example:
    >>> import torch, funcmeta as fm
    >>> opt = fm.optim.sgd(lr=torch.tensor(0.1, requires_grad=True), momentum=0.9)
    >>> params = {"w": torch.ones(3)}
    >>> updates, state = opt.update({"w": torch.ones(3)}, opt.init(params), params)
    >>> updates["w"].requires_grad  # differentiable in the learning rate
    True
"""

from __future__ import annotations

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.optim.base import GradientTransformation, chain
from funcmeta._src.optim.hyper import Hyperparameter, is_zero
from funcmeta._src.optim.primitives import (
    add_decayed_weights,
    momentum_trace,
    scale_by_learning_rate,
)

__all__ = ["sgd"]


@exposed_in("funcmeta.optim")
def sgd(
    lr: Hyperparameter = 1e-3,
    momentum: Hyperparameter = 0.0,
    dampening: Hyperparameter = 0.0,
    nesterov: bool = False,
    weight_decay: Hyperparameter = 0.0,
) -> GradientTransformation:
    """SGD giving the same numbers as ``torch.optim.SGD`` with the same arguments.

    Per step: ``g += weight_decay * p``; with momentum ``buf = momentum * buf +
    (1 - dampening) * g`` (``buf = g`` on the first step) and ``g = buf`` (or
    ``g + momentum * buf`` with ``nesterov``); ``p -= lr * g``. Any hyperparameter may be a
    tensor, a tree of tensors or a schedule (see
    :data:`funcmeta.optim.Hyperparameter`).
    """
    parts = []
    if not is_zero(weight_decay):
        parts.append(add_decayed_weights(weight_decay))
    if not is_zero(momentum):
        parts.append(momentum_trace(momentum, dampening, nesterov))
    elif nesterov:
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)
