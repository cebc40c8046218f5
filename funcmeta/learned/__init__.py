"""Learned update rules: optimizers with meta-learnable parameters of their own.

Each is an ``nn.Module`` (hand its ``parameters()`` to the outer optimizer) whose
``transform()`` is a :class:`~funcmeta.optim.GradientTransformation`, so it composes with
:func:`funcmeta.optim.chain`, clipping and the other optimizers, and is meta-trained through
:func:`funcmeta.adapt` (second order) like any learnable hyperparameter.

- :class:`MetaCurvature`: learned Kronecker-factored preconditioning matrices per parameter
  (Park and Oliva, 2019); chain it before an optimizer.
- :class:`LearnedOptimizer`: a per-coordinate MLP on gradient, momentum, scale, parameter and
  step features; a whole optimizer that starts as SGD.

Example:
    >>> import torch, funcmeta as fm
    >>> params = {"w": torch.randn(3, 2)}
    >>> mc, lopt = fm.learned.MetaCurvature(params), fm.learned.LearnedOptimizer(hidden=8)
    >>> opt = fm.optim.chain(fm.optim.clip_by_global_norm(1.0), mc.transform(), lopt.transform())
    >>> updates, state = opt.update({"w": torch.ones(3, 2)}, opt.init(params), params)
    >>> updates["w"].shape
    torch.Size([3, 2])
"""

from funcmeta._src.learned.curvature import MetaCurvature, MetaCurvatureState
from funcmeta._src.learned.mlp import LearnedOptimizer, LearnedOptimizerState

__all__ = ["LearnedOptimizer", "LearnedOptimizerState", "MetaCurvature", "MetaCurvatureState"]
