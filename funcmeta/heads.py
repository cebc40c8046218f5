"""Heads: a classifier solved on each task's support embeddings, and a language model's loss.

:func:`ridge` solves ridge regression in closed form, for many tasks at once, differentiable
in the features, the targets and the regulariser: exactly (autograd through a dense solve) or
implicitly (:func:`funcmeta.implicit.root` on its optimality condition). :class:`RidgeHead`
is the R2D2 classifier (Bertinetto et al., 2019): ridge regression onto one-hot support
labels, with a learnable regulariser, scale and bias; :func:`funcmeta.recipes.r2d2` trains an
embedding through it. :func:`linear_cross_entropy` is a language model's loss from its last
hidden states and its linear head, computed on the head's shards (no whole logit tensor on any
rank) where ``fm.distributed.shard_model`` computes the head on them.

Example:
    >>> import torch, funcmeta as fm
    >>> g = torch.Generator().manual_seed(0)
    >>> z_s, y_s = torch.randn(4, 10, 16, generator=g), torch.arange(5).repeat(4, 2)  # 4 tasks
    >>> head = fm.heads.RidgeHead(lam=1.0, scale=10.0)
    >>> logits = head(z_s, y_s, torch.randn(4, 3, 16, generator=g), ways=5)
    >>> logits.shape                                    # (tasks, queries, ways)
    torch.Size([4, 3, 5])
    >>> logits.sum().backward()                         # into lam, scale and bias
    >>> head.log_lam.grad is not None
    True
"""

from funcmeta._src.heads.cross_entropy import linear_cross_entropy
from funcmeta._src.heads.ridge import RidgeHead, ridge

__all__ = ["RidgeHead", "linear_cross_entropy", "ridge"]
