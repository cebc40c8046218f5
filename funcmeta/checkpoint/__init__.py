"""Checkpointing: per-layer activation checkpointing that composes with double backward.

Public names: :func:`select` and :data:`PRESETS` choose layers
(``fm.functional_model(..., checkpoint_layers=...)``), :data:`CheckpointSpec` is what
``checkpoint_layers`` takes, and :mod:`funcmeta.checkpoint.kernels` the kernels a twice-differentiated step runs
on (``fm.checkpoint.kernels.twice_differentiable()``). Whether a run is a recomputation:
:func:`funcmeta.recomputing`. Step-level checkpointing is the inner loop's option
``checkpoint_steps`` (:class:`funcmeta.AdaptOptions`). How the engine works:
``docs/memory.md`` and ``docs/design.md``.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fm.checkpoint.select(net, "sequential")
    ['0', '2']
"""

from funcmeta._src.checkpoint.layers import PRESETS, CheckpointSpec, select
from funcmeta.checkpoint import kernels

__all__ = ["PRESETS", "CheckpointSpec", "kernels", "select"]
