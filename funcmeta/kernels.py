"""Deprecated alias of :mod:`funcmeta.remat.kernels`, kept for one release.

The kernel choice moved into the rematerialisation package, whose recomputations replay it.
Importing this module warns once; use ``fm.remat.kernels`` (for example
``fm.remat.kernels.twice_differentiable()``).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     import funcmeta.kernels as old
    >>> import funcmeta as fm
    >>> old.twice_differentiable is fm.remat.kernels.twice_differentiable
    True
"""

import warnings

from funcmeta.remat.kernels import *  # noqa: F403
from funcmeta.remat.kernels import __all__  # noqa: F401

warnings.warn(
    "funcmeta.kernels is moved to funcmeta.remat.kernels (fm.remat.kernels); the old name goes "
    "in the next release",
    DeprecationWarning,
    stacklevel=2,
)
