"""Argument checks shared across the package: whole numbers and finite real numbers.

Each raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for one out of
range, naming the argument, what it got and what it takes. NaN and infinities are refused by
name: ``nan < 0`` is False, so a bare range check lets them through.

Example:
    >>> from funcmeta._check import check_int, check_real
    >>> check_int(3, "steps", low=1)
    3
    >>> check_real(float("nan"), "lr", low=0.0)
    Traceback (most recent call last):
      ...
    ValueError: lr must be a finite number, got nan
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

__all__ = ["check_int", "check_real"]


def check_int(value: Any, name: str, *, low: int | None = 0, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``; ``None`` bounds are open."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int{_bounds(low, high)}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an int{_bounds(low, high)}, got {value!r}")
    return int(value)


def check_real(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` if it is a finite real number (not a bool) within the bounds; ``low_open`` and
    ``high_open`` exclude the bounds themselves."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        raise ValueError(f"{name} must be {' and '.join(p for p in (lo, hi) if p)}, got {value!r}")
    return float(value)


def _bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""
