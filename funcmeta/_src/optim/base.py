"""The optimizer interface: pure ``(init, update)`` pairs, :func:`chain` and :func:`apply_updates`.

An optimizer is a :class:`GradientTransformation`. ``init(params)`` returns its state;
``update(grads, state, params)`` returns ``(updates, new_state)`` without mutating anything,
and ``apply_updates(params, updates)`` adds the updates. Every step is differentiable in the
gradients, the parameters, the state and the hyperparameters.

Example:
    >>> import torch, funcmeta as fm
    >>> params = {"w": torch.tensor([1.0, 2.0])}
    >>> opt = fm.optim.sgd(lr=0.5)
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params)
    >>> fm.apply_updates(params, updates)["w"].tolist()
    [0.5, 1.5]
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree

__all__ = [
    "DescendFn",
    "GradientTransformation",
    "InitFn",
    "UpdateFn",
    "apply_updates",
    "chain",
    "step",
]


@exposed_in("funcmeta.optim")
class InitFn(Protocol):
    """``init(params) -> state``: the optimizer state for ``params`` (a NamedTuple, or a tuple
    of them for a :func:`chain`). Pure: it reads ``params`` and writes nothing."""

    def __call__(self, params: Tree) -> Any: ...


@exposed_in("funcmeta.optim")
class UpdateFn(Protocol):
    """``update(updates, state, params=None) -> (new_updates, new_state)``: transform the
    gradients (or the updates of the previous transformation in a :func:`chain`). Pure and
    differentiable in all its arguments and in the hyperparameters it closes over; it never
    mutates ``state`` or ``params``."""

    def __call__(
        self, updates: Tree, state: Any, params: Tree | None = None
    ) -> tuple[Tree, Any]: ...


@exposed_in("funcmeta.optim")
class DescendFn(Protocol):
    """``descend(grads, state, params) -> (new_params, new_state)``: the same result as
    ``update`` followed by :func:`apply_updates`, in fewer operations (a plain SGD step,
    ``p - lr * g``, in two instead of three)."""

    def __call__(self, updates: Tree, state: Any, params: Tree) -> tuple[Tree, Any]: ...


@exposed_in("funcmeta.optim")
class GradientTransformation(NamedTuple):
    """A pure optimizer, the pair ``(init, update)`` of :class:`InitFn` and :class:`UpdateFn`
    (optax's contract), and optionally ``update_tasks`` for updates with a task axis. Any
    such pair can be built by hand:

    Example:
        >>> import torch, funcmeta as fm
        >>> def init(params):
        ...     return ()
        >>> def update(updates, state, params=None):
        ...     return fm.tree.tree_map(lambda g: -0.5 * g, updates), state
        >>> opt = fm.optim.GradientTransformation(init, update)
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init(None))
        >>> updates["w"].tolist()
        [-0.5, -0.5]
    """

    init: InitFn
    update: UpdateFn
    update_tasks: UpdateFn | None = None
    """The update for updates that carry a leading task axis (the inner loop of
    :func:`funcmeta.adapt_tasks`), where it differs from ``update``: a transformation that
    reduces over a whole tree (:func:`clip_by_global_norm`) reduces per task there, as the
    per-task loop would. ``None``: ``update`` serves both (it works leaf by leaf)."""
    descend: DescendFn | None = None
    """A direct step on the parameters, the same numbers as ``update`` then
    :func:`apply_updates` (the inner loop's step uses it where there is one; :func:`chain`
    keeps its last link's). ``None``: ``update`` then :func:`apply_updates`."""


@exposed_in("funcmeta.optim")
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations left to right; the state is the tuple of their states.

    Example:
        >>> import funcmeta as fm
        >>> opt = fm.optim.chain(fm.optim.clip_by_global_norm(1.0), fm.optim.sgd(lr=0.1))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain argument {i} is a {type(t).__name__}, not a GradientTransformation"
            )

    def init(params: Tree) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state of "
                f"{len(state) if isinstance(state, tuple) else type(state).__name__} entries"
            )

    def update(
        updates: Tree, state: tuple[Any, ...], params: Tree | None = None
    ) -> tuple[Tree, Any]:
        check(state)
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def update_tasks(
        updates: Tree, state: tuple[Any, ...], params: Tree | None = None
    ) -> tuple[Tree, Any]:
        check(state)
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = (t.update_tasks or t.update)(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    per_task = update_tasks if any(t.update_tasks for t in transforms) else None
    last = transforms[-1].descend if transforms else None
    if last is None:
        return GradientTransformation(init, update, per_task)

    def descend(updates: Tree, state: tuple[Any, ...], params: Tree) -> tuple[Tree, Any]:
        check(state)
        new_state = []
        for t, s in zip(transforms[:-1], state[:-1], strict=True):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        new_params, s = last(updates, state[-1], params)
        return new_params, (*new_state, s)

    return GradientTransformation(init, update, per_task, descend)


def step(
    opt: GradientTransformation, grads: Tree, state: Any, params: Tree, *, tasks: bool = False
) -> tuple[Tree, Any]:
    """``(apply_updates(params, updates), new_state)`` for ``updates, new_state =
    opt.update(grads, state, params)``: one optimizer step on ``params``. With ``tasks``,
    every leaf carries a leading task axis and ``opt.update_tasks`` is used where there is
    one.

    Example:
        >>> import torch, funcmeta as fm
        >>> from funcmeta._src.optim.base import step
        >>> opt, params = fm.optim.sgd(lr=0.5), {"w": torch.tensor([1.0, 2.0])}
        >>> new, _ = step(opt, {"w": torch.ones(2)}, opt.init(params), params)
        >>> new["w"].tolist()
        [0.5, 1.5]
    """
    if tasks and opt.update_tasks is not None:
        updates, state = opt.update_tasks(grads, state, params)
        return apply_updates(params, updates), state
    if opt.descend is not None:
        return opt.descend(grads, state, params)
    updates, state = opt.update(grads, state, params)
    return apply_updates(params, updates), state


@exposed_in("funcmeta")
def apply_updates(params: Tree, updates: Tree) -> Tree:
    """``params + updates`` leaf by leaf, keeping each parameter's dtype.

    A ``None`` update (a parameter left out of adaptation) leaves that parameter as it is.
    """

    def add(p: Tensor | None, u: Tensor | None) -> Tensor | None:
        if u is None or p is None:
            return p
        return same_dtype(p + u, p)

    return tree.tree_map(add, params, updates, none_is_leaf=True)


def same_dtype(x: Tensor, like: Tensor) -> Tensor:
    """``x`` in ``like``'s dtype: a stepped parameter keeps its dtype (a float32 rate on a
    bfloat16 parameter)."""
    return x if x.dtype == like.dtype else x.to(like.dtype)


def safe_sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` for ``x >= 0`` whose derivatives of every order are finite at 0 (taken as 0).

    ``torch.sqrt`` has an infinite derivative at 0; under double backward that meets a zero
    chain-rule factor and yields NaN (Adam's second moment of a gradient entry that is
    exactly zero). The double ``where`` keeps every branch finite.
    """
    positive = x > 0
    return torch.where(positive, torch.where(positive, x, 1.0).sqrt(), 0.0)
