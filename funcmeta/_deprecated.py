"""Renamed public names kept for one release: a module ``__getattr__`` that serves each old
name with a ``DeprecationWarning`` saying the new one.

Example:
    >>> import sys, types, warnings
    >>> from funcmeta._deprecated import renamed
    >>> demo = types.ModuleType("demo")
    >>> demo.new = 1
    >>> demo.__getattr__ = renamed("demo", {"old": ("new", "a clearer name")})
    >>> sys.modules["demo"] = demo
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     demo.old
    1
    >>> str(seen[0].message)
    'demo.old is renamed demo.new (a clearer name); the old name goes in the next release'
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

__all__ = ["renamed"]


def renamed(module: str, names: dict[str, tuple[str, str]]) -> Callable[[str], object]:
    """A ``__getattr__`` for module ``module``: ``names[old] = (new, why)``; other missing
    names raise ``AttributeError`` as usual."""

    def __getattr__(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, why = names[name]
        warnings.warn(
            f"{module}.{name} is renamed {module}.{new} ({why}); the old name goes in the next "
            "release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sys.modules[module], new)

    return __getattr__
