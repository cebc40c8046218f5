"""Rematerialisation: per-layer activation checkpointing that composes with double backward.

What it owns:

- :mod:`~funcmeta.remat.layers`: choosing layers (:func:`select`, :data:`PRESETS`) and
  running each as a checkpointed pure function (``fm.functional_model(...,
  checkpoint_layers=...)``);
- :mod:`~funcmeta.remat.engine`: the autograd Functions that keep a layer's inputs and
  rematerialise it, its backward and the derivative of that (``jax.checkpoint`` under
  grad-of-grad);
- :mod:`~funcmeta.remat.shadow`: shadow module trees, the user's module untouched, with
  stand-ins for chosen submodules (shared with task batching's stand-ins);
- :mod:`~funcmeta.remat.kernels`: the kernels a twice-differentiated step runs on, and the
  forward's kernel choice replayed by every recomputation;
- :mod:`~funcmeta.remat.replay`: whether a run is a recomputation
  (:func:`funcmeta.recomputing`).

Step-level checkpointing is the inner loop's option ``checkpoint_steps``
(:class:`funcmeta.AdaptOptions`).

What it may import: :mod:`funcmeta._torch_private`, :mod:`funcmeta.tree`, and
:mod:`funcmeta.batching.vmap` (a checkpointed layer under task batching leaves the vmap
level). ``docs/design.md`` has the
whole layering.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fm.remat.select(net, "sequential")
    ['0', '2']
"""

from funcmeta._deprecated import renamed
from funcmeta.remat import kernels, replay
from funcmeta.remat.layers import PRESETS, CheckpointSpec, select

__all__ = ["PRESETS", "CheckpointSpec", "kernels", "replay", "select"]

__getattr__ = renamed(
    "funcmeta.remat",
    {"POLICIES": ("PRESETS", "they choose layers; a jax.checkpoint policy chooses what to save")},
)
