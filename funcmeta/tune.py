"""Deprecated alias of :mod:`funcmeta.batching.tune`, kept for one release: use
``fm.tune_task_chunk``.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     import funcmeta.tune as old
    >>> import funcmeta as fm
    >>> old.tune_task_chunk is fm.tune_task_chunk
    True
"""

import warnings

from funcmeta.batching.tune import tune_task_chunk

__all__ = ["tune_task_chunk"]

warnings.warn(
    "funcmeta.tune is moved to funcmeta.batching.tune; use fm.tune_task_chunk",
    DeprecationWarning,
    stacklevel=2,
)
