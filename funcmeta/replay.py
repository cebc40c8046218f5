"""Deprecated alias of :mod:`funcmeta.remat.replay`, kept for one release.

Importing this module warns once; use ``fm.recomputing()`` (or ``fm.remat.replay``).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     import funcmeta.replay as old
    >>> import funcmeta as fm
    >>> old.recomputing is fm.recomputing
    True
"""

import warnings

from funcmeta.remat.replay import *  # noqa: F403
from funcmeta.remat.replay import __all__  # noqa: F401

warnings.warn(
    "funcmeta.replay is moved to funcmeta.remat.replay; use fm.recomputing()",
    DeprecationWarning,
    stacklevel=2,
)
