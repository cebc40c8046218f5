"""The values an optimizer hyperparameter may take: numbers, tensors, trees, per-step schedules.

(:mod:`funcmeta.hyper` builds learnable ones; this module says what the optimizers accept
and resolves a value for each parameter and step.)

Every hyperparameter of :mod:`funcmeta.optim` (learning rate, momentum, betas, eps, weight
decay, ...) may be

- a Python number (the fast path; checked for range once, when the optimizer is built);
- a tensor, typically one that requires grad: a 0-d tensor applies to every parameter, a
  tensor of a parameter's shape applies element-wise (it must broadcast to the shape of
  every parameter it covers);
- a tree of such values that is a prefix of the parameter tree: one entry per parameter
  (per tensor), per group, or the full structure (per element, Meta-SGD);
- a callable ``step -> value`` returning any of the above, called with the 0-based index of
  the update (per-step rates, MAML++): :class:`funcmeta.hyper.HyperTree` is one.

A tensor hyperparameter always takes its branch: ``momentum=torch.tensor(0.0)`` keeps a
momentum buffer, ``momentum=0`` does not; the numbers agree either way.

Example:
    >>> import torch
    >>> from funcmeta._src.optim.values import per_leaf
    >>> grads = {"a": torch.zeros(2), "b": torch.zeros(3)}
    >>> leaves = [grads["a"], grads["b"]]
    >>> per_leaf({"a": 0.1, "b": 0.2}, grads, leaves, step=0, name="lr")
    [0.1, 0.2]
    >>> per_leaf(lambda step: 0.5 ** step, grads, leaves, step=2, name="lr")
    [0.25, 0.25]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from numbers import Real
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from typing_extensions import TypeIs

from funcmeta._src.core import tree
from funcmeta._src.core.tree import Tree

__all__ = ["Hyperparameter", "check_max_norm", "check_number", "is_number", "is_zero", "per_leaf"]

Hyperparameter = float | Tensor | Tree | Callable[[int], Any]


def is_number(value: Any) -> TypeIs[float]:
    """A Python real number (bools excluded)."""
    kind = type(value)
    if kind is float or kind is int:  # the hot path: skip the ABC machinery
        return True
    return isinstance(value, Real) and kind is not bool


def is_zero(value: Any) -> bool:
    """A Python number equal to 0: the only value that switches a branch off."""
    return is_number(value) and value == 0


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


def per_leaf(
    value: Hyperparameter, grads: Tree, grad_leaves: list[Tensor], step: int, name: str
) -> list[Any]:
    """``value`` resolved to one entry per leaf of ``grads`` (numbers or broadcastable tensors).

    Raises ``TypeError``/``ValueError``/:class:`funcmeta._src.core.tree.TreeMismatchError` naming the
    hyperparameter and the offending parameter path.
    """
    if callable(value) and not isinstance(value, Tensor):
        value = value(step)
    n = len(grad_leaves)
    if is_number(value):
        return [value] * n
    if isinstance(value, Tensor):
        if value.dim() == 0:
            return [value] * n
        values = [value] * n
    else:
        values = tree.broadcast_prefix(value, grads, name=name)
    for i, (v, g) in enumerate(zip(values, grad_leaves, strict=True)):
        if isinstance(v, Tensor):
            if v.dim() and v.shape != g.shape and _broadcast_shape(v.shape, g.shape) != g.shape:
                raise ValueError(
                    f"{name} for parameter {tree.paths(grads)[i]!r} has shape "
                    f"{tuple(v.shape)}, which does not broadcast to the parameter's shape "
                    f"{tuple(g.shape)}"
                )
        elif not is_number(v):
            raise TypeError(
                f"{name} for parameter {tree.paths(grads)[i]!r} is a {type(v).__name__}; "
                "expected a number or a tensor"
            )
    return values


class LeafResolver:
    """:func:`per_leaf` for one hyperparameter, remembering its last answer: a fixed
    (non-schedule) value resolved against parameters of the same structure and shapes, with
    the same tensors in it, gives the same list, so an inner loop resolves it once per call
    instead of once per step."""

    def __init__(self, value: Hyperparameter, name: str) -> None:
        self.value, self.name = value, name
        self._key: Any = None
        self._leaves: list[Any] = []
        self._out: list[Any] = []

    def __call__(self, grads: Tree, spec: Any, grad_leaves: list[Tensor], step: int) -> list[Any]:
        """``per_leaf(value, grads, grad_leaves, step, name)``; ``spec`` is ``grads``'s
        structure."""
        value = self.value
        if is_number(value) or (callable(value) and not isinstance(value, Tensor)):
            return per_leaf(value, grads, grad_leaves, step, self.name)
        # what the answer depends on: the value's entries (by identity; a dict's items are
        # read directly, cheaper than flattening it), the structure and the shapes
        if isinstance(value, Mapping):
            held: list[Any] = list(value.items())
            same = len(held) == len(self._leaves) and all(
                k == k0 and v is v0 for (k, v), (k0, v0) in zip(held, self._leaves, strict=True)
            )
        else:
            held = tree.leaves(value)
            same = len(held) == len(self._leaves) and all(
                a is b for a, b in zip(held, self._leaves, strict=True)
            )
        key = (spec, tuple(g.shape for g in grad_leaves))
        if same and key == self._key:
            return list(self._out)
        out = per_leaf(value, grads, grad_leaves, step, self.name)
        self._key, self._leaves, self._out = key, held, out
        return list(out)


def _broadcast_shape(a: torch.Size, b: torch.Size) -> torch.Size | None:
    try:
        return torch.broadcast_shapes(a, b)
    except RuntimeError:
        return None
