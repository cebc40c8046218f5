"""Deprecated alias of :mod:`funcmeta.remat` (per-layer checkpointing), kept for one release.

The module was renamed: ``checkpoint`` collided with ``torch.utils.checkpoint`` in every file
that used both. Importing it warns once; use ``fm.remat.select``, ``fm.remat.PRESETS`` and
``fm.remat.CheckpointSpec``.

Example:
    >>> import warnings, torch
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     import funcmeta.checkpoint as old
    >>> old.select(torch.nn.Sequential(torch.nn.Linear(1, 1)), "sequential")
    ['0']
"""

import warnings

from funcmeta.remat.layers import PRESETS, CheckpointSpec, checkpointed_runner, select

POLICIES = PRESETS

__all__ = ["POLICIES", "PRESETS", "CheckpointSpec", "checkpointed_runner", "select"]

warnings.warn(
    "funcmeta.checkpoint is renamed funcmeta.remat (fm.remat.select, fm.remat.PRESETS); "
    "the old name goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
