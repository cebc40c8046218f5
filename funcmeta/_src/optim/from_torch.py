"""From ``torch.optim`` to funcmeta: :func:`from_torch` turns a configured ``torch.optim``
optimizer into the equivalent differentiable funcmeta optimizer.

Code written for ``torch.optim`` (or for ``higher``'s differentiable copies of it) ports in
one line: the optimizer keeps its class, its parameter groups and each group's
hyperparameters; the funcmeta one gives the same numbers step for step and is
differentiable in every hyperparameter.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 1))
    >>> torch_opt = torch.optim.SGD([
    ...     {"params": net[0].parameters(), "lr": 0.1},
    ...     {"params": net[1].parameters()},
    ... ], lr=0.01, momentum=0.9)
    >>> opt = fm.optim.from_torch(torch_opt, dict(net.named_parameters()))
    >>> fmodel = fm.functional_model(net)
    >>> x, y = torch.randn(8, 2), torch.randn(8, 1)
    >>> result = fm.adapt(fmodel, fmodel.params, torch.nn.functional.mse_loss, (x, y), opt, steps=3)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.optim.adagrad import adagrad
from funcmeta._src.optim.adam import adam, adamw
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.optim.rmsprop import rmsprop
from funcmeta._src.optim.sgd import sgd

__all__ = ["from_torch"]

# torch.optim class -> (funcmeta constructor, the hyperparameters it takes, the flags that
# must be the same in every group)
_TABLE: dict[type, tuple[Callable[..., GradientTransformation], tuple[str, ...], tuple[str, ...]]]
_TABLE = {
    torch.optim.SGD: (sgd, ("lr", "momentum", "dampening", "weight_decay"), ("nesterov",)),
    torch.optim.Adam: (adam, ("lr", "betas", "eps", "weight_decay"), ("amsgrad",)),
    torch.optim.AdamW: (adamw, ("lr", "betas", "eps", "weight_decay"), ("amsgrad",)),
    torch.optim.RMSprop: (
        rmsprop,
        ("lr", "alpha", "eps", "weight_decay", "momentum"),
        ("centered",),
    ),
    torch.optim.Adagrad: (
        adagrad,
        ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
        (),
    ),
}

# group options that choose an implementation, not the numbers
_IMPLEMENTATION = {"params", "foreach", "fused", "capturable", "differentiable", "initial_lr"}


def _names(params: Any) -> dict[int, str]:
    """``id(tensor) -> name`` for a parameter dict, a module or a functional model."""
    if isinstance(params, nn.Module):
        named = dict(params.named_parameters())
    elif hasattr(params, "params") and isinstance(getattr(params, "module", None), nn.Module):
        named = params.params
    elif isinstance(params, Mapping):
        named = dict(params)
    else:
        raise TypeError(
            "from_torch needs the parameters' names: a dict name -> tensor (fmodel.params), "
            f"an nn.Module or a FunctionalModel; got {type(params).__name__}"
        )
    return {id(t): name for name, t in named.items()}


def _value(
    groups: list[dict[str, Any]], names: list[list[str]], key: str, *, per_name: bool
) -> Any:
    """One hyperparameter: the groups' common value, or a dict ``{name: value}`` with each
    parameter's group value when the groups differ or ``per_name`` (when the groups do not
    hold every parameter: those they leave out get no value, and adapting them is an
    error rather than a silent update)."""
    values = [g[key] for g in groups]
    if not per_name and all(_same(v, values[0]) for v in values[1:]):
        return values[0]
    if key == "betas":
        return tuple(
            {n: v[i] for ns, v in zip(names, values, strict=True) for n in ns} for i in (0, 1)
        )
    return {n: v for ns, v in zip(names, values, strict=True) for n in ns}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return a == b


@exposed_in("funcmeta.optim")
def from_torch(optimizer: torch.optim.Optimizer, params: Any) -> GradientTransformation:
    """The funcmeta optimizer equivalent to ``optimizer``, for the parameters ``params``.

    Args:
        optimizer: a configured ``torch.optim.SGD``, ``Adam``, ``AdamW``, ``RMSprop`` or
            ``Adagrad``. Each parameter group's hyperparameters are kept: equal values stay
            numbers (or the same tensor), differing ones become per-parameter trees
            (``{name: value}``). Tensor hyperparameters stay tensors, so they can be learned.
        params: the parameters' names: ``fmodel.params``, a dict name -> tensor, an
            ``nn.Module`` or a ``FunctionalModel``, holding the tensors the optimizer holds.

    Returns:
        A :class:`~funcmeta.optim.GradientTransformation` over a parameter dict with the
        names of the parameters in the optimizer's groups. The optimizer's state (momentum
        buffers, step counts) is not carried over: ``init`` starts afresh, as an inner loop
        does. Parameters that ``params`` names but no group holds get no hyperparameters:
        adapt only the optimizer's parameters (``trainable=``) or add them to a group.

    Raises:
        TypeError: for an optimizer class without a funcmeta counterpart, or ``params`` of
            the wrong kind.
        ValueError: for a group parameter that ``params`` does not name, an option
            funcmeta does not implement (``maximize=True``), or flags (``nesterov``,
            ``amsgrad``, ``centered``) that differ between groups.
    """
    kind = type(optimizer)
    if kind not in _TABLE:
        supported = ", ".join(f"torch.optim.{c.__name__}" for c in _TABLE)
        raise TypeError(f"from_torch supports {supported}; got {kind.__module__}.{kind.__name__}")
    make, hyper, flags = _TABLE[kind]
    ids = _names(params)
    groups = optimizer.param_groups
    names: list[list[str]] = []
    for i, group in enumerate(groups):
        unnamed = [tuple(p.shape) for p in group["params"] if id(p) not in ids]
        if unnamed:
            raise ValueError(
                f"parameter group {i} holds tensors that params does not name (shapes "
                f"{unnamed}); pass the dict, module or functional model they belong to"
            )
        names.append([ids[id(p)] for p in group["params"]])
        unknown = set(group) - _IMPLEMENTATION - set(hyper) - set(flags)
        unknown.discard("decoupled_weight_decay")
        for key in sorted(unknown):
            if (key == "maximize" and not group[key]) or isinstance(group[key], str):
                continue  # the default, or a tag of the user's (a group's name)
            raise ValueError(
                f"parameter group {i} sets {key}={group[key]!r}, which funcmeta's "
                f"{make.__name__} does not implement"
            )
    decoupled = {bool(g.get("decoupled_weight_decay", False)) for g in groups}
    if len(decoupled) > 1:
        raise ValueError("decoupled_weight_decay differs between parameter groups")
    if kind is torch.optim.Adam and decoupled.pop():
        make = adamw  # torch >= 2.6: Adam(decoupled_weight_decay=True) is AdamW
    if kind is torch.optim.Adagrad:
        # torch fills every group's accumulator from the constructor's value at construction
        start = optimizer.defaults["initial_accumulator_value"]
        odd = [i for i, g in enumerate(groups) if g["initial_accumulator_value"] != start]
        if odd:
            raise ValueError(
                f"parameter groups {odd} set initial_accumulator_value, which "
                f"torch.optim.Adagrad ignores (it starts every group at the constructor's "
                f"{start}); set it in the constructor"
            )
    every = set(ids.values())
    covered = {n for ns in names for n in ns}
    kwargs = {key: _value(groups, names, key, per_name=covered != every) for key in hyper}
    for flag in flags:
        values = {bool(g[flag]) for g in groups}
        if len(values) > 1:
            raise ValueError(f"{flag} differs between parameter groups; funcmeta needs one value")
        kwargs[flag] = values.pop()
    return make(**kwargs)
