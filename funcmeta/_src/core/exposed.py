"""Each public name's public home: ``__module__`` set to the public module that exports it.

The code of a public name lives in ``funcmeta/_src``; its ``__module__`` names the module
users import it from (the one the API reference documents), as ``torch``'s ``exposed_in``
does. So ``repr``, tracebacks, pickling and the reference all show the public name, and the
docstring examples of a public name run with its public module (``doctest`` collects an
object's examples from the module its ``__module__`` names).

Example:
    >>> import funcmeta as fm
    >>> fm.AdaptResult.__module__, fm.snapshot.save.__module__
    ('funcmeta', 'funcmeta.snapshot')
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["exposed_in"]

T = TypeVar("T")


def _move(obj: Any, old: str, new: str) -> None:
    """Set ``obj``'s ``__module__`` to ``new``; for a class, also that of its own methods and
    nested classes (those whose ``__module__`` is still ``old``), so that their examples
    follow the class."""
    obj.__module__ = new
    if not inspect.isclass(obj):
        return
    for value in vars(obj).values():
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if isinstance(value, property):
            value = value.fget
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == old:
            _move(value, old, new)


def exposed_in(module: str) -> Callable[[T], T]:
    """A decorator that sets the ``__module__`` of a function or class to ``module``, its
    public home, which must export it under its ``__qualname__``."""

    def expose(obj: T) -> T:
        _move(obj, getattr(obj, "__module__", ""), module)
        return obj

    return expose
