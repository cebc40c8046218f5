"""Learnable hyperparameter trees: scalar, per layer, per tensor, per element, per step.

Each constructor returns a :class:`HyperTree`, an ``nn.Module`` holding the raw learnable
values as Parameters and callable as ``hyper(step)``; it is used directly as an optimizer
hyperparameter (``fm.optim.sgd(lr=hyper)`` calls ``hyper(k)`` at the k-th update). What an
optimizer hyperparameter may be, learnable or not, is :data:`funcmeta.optim.Hyperparameter`.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    >>> lrs = fm.hyper.per_layer(fm.functional_model(net).params, 0.01, steps=5)
    >>> lrs.groups, lrs.steps
    (['0', '2'], 5)
"""

from funcmeta._src.optim.hyper import HyperTree as HyperTree
from funcmeta._src.optim.hyper import Parameterization as Parameterization
from funcmeta._src.optim.hyper import per_element as per_element
from funcmeta._src.optim.hyper import per_layer as per_layer
from funcmeta._src.optim.hyper import per_tensor as per_tensor
from funcmeta._src.optim.hyper import scalar as scalar

__all__ = [
    "HyperTree",
    "Parameterization",
    "per_element",
    "per_layer",
    "per_tensor",
    "scalar",
]
