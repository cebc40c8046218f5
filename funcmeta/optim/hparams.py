"""Deprecated alias of :mod:`funcmeta.optim.values`, kept for one release.

Renamed beside :mod:`funcmeta.hyper`: ``fm.hyper`` builds *learnable* hyperparameters,
``funcmeta.optim.values`` says what values an optimizer hyperparameter may take and resolves
them per parameter and step. Importing this module warns once.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     import funcmeta.optim.hparams as old
    >>> import funcmeta.optim.values as new
    >>> old.per_leaf is new.per_leaf
    True
"""

import warnings

from funcmeta.optim.values import *  # noqa: F403
from funcmeta.optim.values import __all__  # noqa: F401

warnings.warn(
    "funcmeta.optim.hparams is renamed funcmeta.optim.values; the old name goes in the next "
    "release",
    DeprecationWarning,
    stacklevel=2,
)
