"""The argument checks shared across the package: whole numbers, finite real numbers, a value
among fixed choices, and dicts of tensors against a module's names and shapes (with or without
a task axis).

Each raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for one out of
range, naming the argument, what it got and what it takes. NaN and infinities are refused by
name: ``nan < 0`` is False, so a bare range check lets them through.

Example:
    >>> from funcmeta._src.core.checks import check_choice, check_int, check_real
    >>> check_int(3, "steps", low=1)
    3
    >>> check_choice("skip", "on_nonfinite", (None, "raise", "skip"))
    'skip'
    >>> check_real(float("nan"), "lr", low=0.0)
    Traceback (most recent call last):
      ...
    ValueError: lr must be a finite number, got nan
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "NotAnIntError",
    "check_choice",
    "check_int",
    "check_keys",
    "check_max_norm",
    "check_number",
    "check_real",
    "check_tree",
    "is_number",
    "error_like",
]

T = TypeVar("T")


class NotAnIntError(TypeError, ValueError):
    """A whole-number argument given as something else (``2.5``, ``True``, ``"3"``): a
    ``TypeError``, and a ``ValueError`` as the range errors of the same argument are."""


def check_int(
    value: Any,
    name: str,
    *,
    low: int | None = 0,
    high: int | None = None,
    what: str | None = None,
) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``; ``None`` bounds are open.
    The message reads ``"{name} must be {what}, got {value!r}"``, ``what`` defaulting to
    ``"an int >= {low}"`` and the like."""
    what = what or f"an int{_bounds(low, high)}"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise NotAnIntError(f"{name} must be {what}, got {value!r}")
    number: Any = value  # numbers.Integral's stubs declare only < and <=
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name} must be {what}, got {value!r}")
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
    number: Any = value  # numbers.Real's stubs declare only < and <=
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and (number >= high if high_open else number > high)
    if below or above:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        raise ValueError(f"{name} must be {' and '.join(p for p in (lo, hi) if p)}, got {value!r}")
    return float(value)


def check_choice(value: Any, name: str, choices: Collection[T]) -> T:
    """``value`` if it is one of ``choices``; else a ``ValueError`` listing them, as in
    ``"{name} must be 'a', 'b' or 'c', got 'x'"`` (each choice by its ``repr``). Membership
    is ``in``'s: ``1.0`` is among ``(0, 1)``."""
    try:
        found = value in choices
    except (TypeError, ValueError, RuntimeError):  # unhashable, or a tensor's ambiguous ==
        found = False
    if found:
        return cast(T, value)
    names = [repr(c) for c in choices]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    raise ValueError(f"{name} must be {listed}, got {value!r}")


def check_keys(given: Any, expected: Mapping[str, Any], what: str) -> None:
    """Raise ``TypeError``/``ValueError`` naming the keys unless ``given`` is a mapping with
    exactly the keys of ``expected``."""
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{what} must be a dict of tensors keyed by name, got {type(given).__name__}"
        )
    if given.keys() != expected.keys():
        missing = sorted(expected.keys() - given.keys())
        unexpected = sorted(given.keys() - expected.keys())
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        raise ValueError(f"{what} do not match the module: " + "; ".join(parts))


def check_tree(
    given: Any, shapes: Mapping[str, torch.Size], what: str, *, tasks: int | None = None
) -> dict[str, int | None]:
    """Check a dict of tensors against the module's names and shapes; returns, per name,
    ``None`` for a tensor of the module's shape and ``0`` for one with a leading task axis.

    Without ``tasks`` every tensor must have the module's shape; with ``tasks`` it may also be
    ``(tasks, *shape)``, one value per task. Errors name the entry and both shapes."""
    check_keys(given, shapes, what)
    dims: dict[str, int | None] = {}
    for name, shape in shapes.items():
        value = given[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}[{name!r}] is a {type(value).__name__}, not a tensor")
        if value.shape == shape:
            dims[name] = None
        elif tasks is not None and value.shape == (tasks, *shape):
            dims[name] = 0
        elif tasks is None:
            raise ValueError(
                f"{what}[{name!r}] has shape {tuple(value.shape)}; the module expects "
                f"{tuple(shape)}"
            )
        else:
            raise ValueError(
                f"{what}[{name!r}] has shape {tuple(value.shape)}; expected {tuple(shape)} "
                f"(shared by all tasks) or {(tasks, *shape)} (one per task, task axis first)"
            )
    return dims


def is_number(value: Any) -> TypeIs[float]:
    """A Python real number (bools excluded)."""
    kind = type(value)
    if kind is float or kind is int:  # the hot path: skip the ABC machinery
        return True
    return isinstance(value, Real) and kind is not bool


def check_number(
    value: Any,
    name: str,
    *,
    low: float = 0.0,
    high: float | None = None,
    include_high: bool = False,
    if_not_finite: str = "",
) -> None:
    """Range check for a hyperparameter given as a Python number (NaN and infinities are
    refused); tensors are not inspected (that would cost a device sync per call)."""
    if isinstance(value, bool) or value is None or isinstance(value, str | bytes):
        raise TypeError(
            f"{name} must be a number, a tensor, a tree of tensors or a schedule, got {value!r}"
        )
    if not is_number(value):
        return
    if not math.isfinite(value):
        raise ValueError(f"invalid {name}: {value} (must be a finite number{if_not_finite})")
    if value < low or (high is not None and (value > high if include_high else value >= high)):
        limit = "" if high is None else f" and {'<=' if include_high else '<'} {high}"
        raise ValueError(f"invalid {name}: {value} (must be >= {low}{limit})")


def check_max_norm(max_norm: Any, name: str = "max_norm") -> None:
    """A clipping norm: a finite number (>= 0) or a 0-d tensor."""
    if isinstance(max_norm, Tensor):
        if max_norm.dim() != 0:
            raise ValueError(
                f"{name} must be a number or a 0-d tensor, got shape {tuple(max_norm.shape)}"
            )
    elif is_number(max_norm):
        check_number(max_norm, name, if_not_finite="; None means no clipping")
    else:
        raise TypeError(f"{name} must be a number or a 0-d tensor, got {type(max_norm).__name__}")


def _bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def error_like(error: Exception, message: str) -> Exception:
    """An error of ``error``'s type with ``message`` (a ``RuntimeError`` if that type takes
    another constructor); raise it ``from error``."""
    try:
        return type(error)(message)
    except Exception:  # pragma: no cover - an error type with another constructor
        return RuntimeError(message)
