"""Which batch the model runs on now (the support batch at an inner step, the query batch,
a batch given to :func:`funcmeta.task_losses`), so that an error inside the model's forward
can say where it happened (``funcmeta._src.runtime.eager.EagerRuntime.run``).

Example:
    >>> from funcmeta._src.runtime.place import at, current
    >>> with at("the query batch"):
    ...     current()
    'the query batch'
    >>> current() is None
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["at", "current", "unless_set"]

_PLACE: ContextVar[str | None] = ContextVar("funcmeta_place", default=None)


@contextlib.contextmanager
def at(place: str) -> Iterator[None]:
    """The model runs on ``place`` inside the block."""
    token = _PLACE.set(place)
    try:
        yield
    finally:
        _PLACE.reset(token)


def unless_set(place: str) -> contextlib.AbstractContextManager[None]:
    """:func:`at` ``place`` unless a caller already said where the model runs (a recipe's
    query batch through :func:`funcmeta.task_losses`)."""
    return contextlib.nullcontext() if _PLACE.get() is not None else at(place)


def current() -> str | None:
    """Where the model runs now, if a caller said."""
    return _PLACE.get()
