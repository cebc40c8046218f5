"""Differentiable optimizers as pure ``(init, update)`` pairs, in the optax shape.

``sgd``, ``adam``, ``adamw``, ``rmsprop`` and ``adagrad`` give the same numbers, step for step,
as their ``torch.optim`` namesakes with the same arguments, and are differentiable in the
gradients, the parameters, the state and every hyperparameter. :func:`from_torch` converts a
configured ``torch.optim`` optimizer, parameter groups included. A hyperparameter may be a
number, a tensor, a tree of tensors that is a prefix of the parameter tree (per layer, per
tensor, per element) or a per-step schedule; see
:data:`Hyperparameter` and :mod:`funcmeta.hyper`.

Example:
    >>> import torch, funcmeta as fm
    >>> params = {"w": torch.randn(3, requires_grad=True)}
    >>> lr = torch.tensor(0.1, requires_grad=True)
    >>> opt = fm.optim.adam(lr=lr, betas=(0.9, 0.99))
    >>> state = opt.init(params)
    >>> grads = {"w": 2 * params["w"]}
    >>> updates, state = opt.update(grads, state, params)
    >>> new = fm.apply_updates(params, updates)
    >>> new["w"].sum().backward()
    >>> lr.grad is not None
    True
"""

from funcmeta._src.optim.adagrad import ScaleByAdagradState, adagrad, scale_by_adagrad
from funcmeta._src.optim.adam import ScaleByAdamState, adam, adamw, scale_by_adam
from funcmeta._src.optim.base import (
    DescendFn,
    GradientTransformation,
    InitFn,
    UpdateFn,
    apply_updates,
    chain,
)
from funcmeta._src.optim.clip import ClipState, clip_by_global_norm, global_norm
from funcmeta._src.optim.from_torch import from_torch
from funcmeta._src.optim.hyper import Hyperparameter
from funcmeta._src.optim.primitives import (
    AddDecayedWeightsState,
    AddProximalState,
    ScaleByLearningRateState,
    TraceState,
    add_decayed_weights,
    add_proximal,
    momentum_trace,
    scale_by_learning_rate,
)
from funcmeta._src.optim.rmsprop import ScaleByRmsState, rmsprop, scale_by_rms
from funcmeta._src.optim.sgd import sgd

__all__ = [
    "AddDecayedWeightsState",
    "AddProximalState",
    "ClipState",
    "DescendFn",
    "GradientTransformation",
    "Hyperparameter",
    "InitFn",
    "ScaleByAdagradState",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "ScaleByRmsState",
    "TraceState",
    "UpdateFn",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "add_proximal",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "from_torch",
    "global_norm",
    "momentum_trace",
    "rmsprop",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rms",
    "sgd",
]
