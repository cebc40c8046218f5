"""Checkpointing: per-layer activation checkpointing that composes with double backward.

Public names: :func:`select` and :data:`PRESETS` choose layers
(``fm.functional_model(..., checkpoint_layers=...)``), :data:`CheckpointSpec` is what
``checkpoint_layers`` takes, and :mod:`kernels` the kernels a twice-differentiated step runs
on (``fm.checkpoint.kernels.twice_differentiable()``). Whether a run is a recomputation:
:func:`funcmeta.recomputing`. Step-level checkpointing is the inner loop's option
``checkpoint_steps`` (:class:`funcmeta.AdaptOptions`). The engine lives in
``funcmeta/_src/checkpoint/`` (``docs/design.md``).

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fm.checkpoint.select(net, "sequential")
    ['0', '2']
"""

from funcmeta._src.checkpoint import layers as _layers
from funcmeta._src.checkpoint.layers import select
from funcmeta._src.core import kernels

PRESETS = _layers.PRESETS
"""Named layer choices. ``"sequential"`` selects every child, with parameters or buffers, of
each ``nn.Sequential``/``nn.ModuleList`` (outermost first: the blocks of a network of blocks).
``"leaves"`` selects every module without children that holds parameters or buffers."""

CheckpointSpec = _layers.CheckpointSpec
"""What ``checkpoint_layers`` takes: ``None``; a preset name (see :data:`PRESETS`); submodule
names; or a predicate ``(name, module) -> bool``."""

__all__ = ["PRESETS", "CheckpointSpec", "kernels", "select"]
