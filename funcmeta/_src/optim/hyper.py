"""Hyperparameters: what an optimizer hyperparameter may be, and learnable ones.

**What the optimizers take.** Every hyperparameter of :mod:`funcmeta.optim` (learning rate,
momentum, betas, eps, weight decay, ...) may be

- a Python number (the fast path; checked for range once, when the optimizer is built);
- a tensor, typically one that requires grad: a 0-d tensor applies to every parameter, a
  tensor of a parameter's shape applies element-wise (it must broadcast to the shape of
  every parameter it covers);
- a tree of such values that is a prefix of the parameter tree: one entry per parameter
  (per tensor), per group, or the full structure (per element, Meta-SGD);
- a callable ``step -> value`` returning any of the above, called with the 0-based index of
  the update (per-step rates, MAML++): a :class:`HyperTree` is one.

A tensor hyperparameter always takes its branch: ``momentum=torch.tensor(0.0)`` keeps a
momentum buffer, ``momentum=0`` does not; the numbers agree either way. :func:`per_leaf`
resolves a value for each parameter and step.

**Learnable hyperparameter trees**: scalar, per layer, per tensor, per element, per step.
Each constructor returns a :class:`HyperTree`, an ``nn.Module`` holding the raw learnable
values as Parameters (hand ``hyper.parameters()`` to your outer ``torch.optim`` optimizer)
and callable as ``hyper(step)`` to get the values for inner step ``step``: a 0-d tensor
(``scalar``) or a tree shaped like the parameters. Because it is callable, a ``HyperTree``
is used directly as an optimizer hyperparameter: ``fm.optim.sgd(lr=hyper)`` calls
``hyper(k)`` at the k-th update.

- ``steps=K`` keeps one set of values per inner step (MAML++'s per-layer per-step rates);
  without it the values are shared by every step.
- ``parameterization`` maps the raw Parameter to the value: ``"raw"`` (identity; Meta-SGD,
  MAML++), ``"softplus"`` or ``"exp"`` (always positive). ``init`` is the initial *value*;
  the raw Parameter is set to its inverse image.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    >>> params = fm.functional_model(net).params
    >>> lrs = fm.hyper.per_layer(params, 0.01, steps=5, parameterization="softplus")
    >>> lrs.groups
    ['0', '2']
    >>> round(lrs(0)["2.bias"].item(), 6)
    0.01
    >>> opt = fm.optim.sgd(lr=lrs)   # step k uses lrs(k)
    >>> from funcmeta._src.optim.hyper import per_leaf
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
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_choice, check_int, check_real, is_number
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree

__all__ = [
    "Hyperparameter",
    "HyperTree",
    "LeafResolver",
    "Parameterization",
    "is_zero",
    "per_element",
    "per_layer",
    "per_leaf",
    "per_tensor",
    "scalar",
]

Hyperparameter = float | Tensor | Tree | Callable[[int], Any]


def is_zero(value: Any) -> bool:
    """A Python number equal to 0: the only value that switches a branch off."""
    return is_number(value) and value == 0


def per_leaf(
    value: Hyperparameter, grads: Tree, grad_leaves: list[Tensor], step: int, name: str
) -> list[Any]:
    """``value`` resolved to one entry per leaf of ``grads`` (numbers or broadcastable tensors).

    Raises ``TypeError``/``ValueError``/:class:`funcmeta.tree.TreeMismatchError` naming the
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


Parameterization = Literal["raw", "softplus", "exp"]
_PARAMETERIZATIONS = ("raw", "softplus", "exp")
Kind = Literal["scalar", "per_layer", "per_tensor", "per_element"]


def _inverse(value: float, parameterization: Parameterization) -> float:
    check_real(value, "init")
    if parameterization == "raw":
        return float(value)
    if value <= 0:
        raise ValueError(f"a {parameterization} hyperparameter needs a positive init, got {value}")
    if parameterization == "exp":
        return math.log(value)
    # softplus^-1(y) = log(expm1(y)); for large y, y + log1p(-exp(-y)) avoids overflow.
    return value + math.log(-math.expm1(-value))


@exposed_in("funcmeta.hyper")
class HyperTree(nn.Module):
    """Learnable hyperparameter values; build one with :func:`scalar`, :func:`per_layer`,
    :func:`per_tensor` or :func:`per_element`.

    Attributes:
        kind: ``"scalar"``, ``"per_layer"``, ``"per_tensor"`` or ``"per_element"``.
        steps: number of per-step value sets, or ``None`` when shared by all steps.
        parameterization: ``"raw"``, ``"softplus"`` or ``"exp"``.
        groups: names of the learnable groups (layer paths, tensor paths, ...), in the order
            of the parameter tree's paths, which sorts names (``"0.bias"`` before
            ``"0.weight"``), not module order: address a group by name, with
            :meth:`raw_for` and :meth:`value_for`, or list them in module order with
            :meth:`in_module_order`.
    """

    def __init__(
        self,
        kind: Kind,
        raw: Tensor | list[Tensor],
        *,
        groups: list[str],
        spec: tree.PyTreeSpec | None,
        group_of: list[int] | None,
        steps: int | None,
        parameterization: Parameterization,
    ) -> None:
        super().__init__()
        check_choice(parameterization, "parameterization", _PARAMETERIZATIONS)
        self.kind = kind
        self.steps = steps
        self.parameterization = parameterization
        self.groups = groups
        self._spec = spec
        # the tree's layout as plain containers of leaf indices, when it has one: rebuilt by
        # plain Python in forward, which torch.compile traces (it cannot take an optree spec
        # made outside the compiled region)
        self._layout = (
            None
            if spec is None
            else _plain_layout(tree.unflatten(spec, list(range(spec.num_leaves))))
        )
        self._group_of = group_of
        self.raw: nn.ParameterList | nn.Parameter
        if isinstance(raw, list):
            self.raw = nn.ParameterList([nn.Parameter(r) for r in raw])
        else:
            self.raw = nn.Parameter(raw)

    def _transform(self, x: Tensor) -> Tensor:
        if self.parameterization == "softplus":
            return F.softplus(x)
        if self.parameterization == "exp":
            return torch.exp(x)
        return x

    def _check_step(self, step: int | None) -> None:
        if self.steps is None:
            return
        if step is None:
            raise ValueError(f"this hyperparameter has {self.steps} per-step values: pass the step")
        if not 0 <= step < self.steps:
            raise IndexError(
                f"step {step} is out of range for a hyperparameter with {self.steps} per-step values"
            )

    def forward(self, step: int | None = None) -> Tree:
        """The values for inner step ``step`` (0-based; ignored unless ``steps`` was given)."""
        self._check_step(step)
        per_step = self.steps is not None
        # the builders give every kind but scalar a spec, per_element a ParameterList, the
        # other kinds one Parameter and a group_of
        if self.kind == "per_element":
            values = [self._transform(r[step] if per_step else r) for r in self.raw]
            return self._as_tree(values)
        whole = cast(nn.Parameter, self.raw)
        raw = whole[step] if per_step else whole
        value = self._transform(raw)
        if self.kind == "scalar":
            return value
        by_group = value.unbind(0)
        groups = [by_group[i] for i in cast(list[int], self._group_of)]
        return self._as_tree(groups)

    def _as_tree(self, values: list[Tensor]) -> Tree:
        """``values`` (one per leaf, in flattening order) in the layout of the tree given."""
        if self._layout is not None:
            return _rebuild(self._layout, values)
        return tree.unflatten(cast(tree.PyTreeSpec, self._spec), values)

    def _index(self, name: str) -> int:
        try:
            return self.groups.index(name)
        except ValueError:
            raise KeyError(
                f"no group {name!r} in this {self.kind} hyperparameter; its groups are "
                f"{self.groups}"
            ) from None

    def raw_for(self, name: str) -> Tensor:
        """The learnable (unparameterised) values of group ``name`` (a parameter path for
        ``per_element`` and ``per_tensor``, a layer path for ``per_layer``, ``""`` for a
        scalar): the group's own ``nn.Parameter`` for ``per_element``, a view of the shared
        one otherwise (write through it with ``torch.no_grad()`` to set an initial value)."""
        i = self._index(name)
        if self.kind == "per_element":
            return self.raw[i]
        whole = cast(nn.Parameter, self.raw)  # one Parameter for every other kind
        return whole[..., i] if self.kind != "scalar" else whole

    def value_for(self, name: str, step: int | None = None) -> Tensor:
        """The value of group ``name`` at ``step``, after the parameterisation."""
        self._check_step(step)
        raw = self.raw_for(name)
        if self.steps is not None:
            raw = raw[step]
        return self._transform(raw)

    def in_module_order(self, module: nn.Module) -> list[str]:
        """The group names in the order of ``module.named_parameters()`` (learn2learn's
        ``MetaSGD.lrs`` order), for code that addresses rates by position."""
        order: list[str] = []
        for name, _ in module.named_parameters():
            group = name if self.kind in ("per_element", "per_tensor") else name.rpartition(".")[0]
            if self.kind == "scalar":
                group = ""
            if group in self.groups and group not in order:
                order.append(group)
        return order

    def extra_repr(self) -> str:
        steps = "" if self.steps is None else f", steps={self.steps}"
        return (
            f"kind={self.kind}, groups={len(self.groups)}{steps}, "
            f"parameterization={self.parameterization}"
        )


def _lead(steps: int | None) -> tuple[int, ...]:
    if steps is None:
        return ()
    return (check_int(steps, "steps (None, or the number of per-step values)", low=1),)


def _template(params: Tree) -> tuple[list[str], list[Tensor], tree.PyTreeSpec]:
    leaves, spec = tree.flatten(params)
    if not leaves:
        raise ValueError("params has no tensors to build a hyperparameter tree for")
    for path, leaf in zip(tree.paths(params), leaves, strict=True):
        if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
            raise TypeError(f"params leaf {path!r} is not a floating-point tensor")
    return tree.paths(params), leaves, spec


@exposed_in("funcmeta.hyper")
def scalar(
    init: float,
    *,
    steps: int | None = None,
    parameterization: Parameterization = "raw",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> HyperTree:
    """One learnable value for all parameters (one per step with ``steps``)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"dtype must be a floating-point torch.dtype (a learnable value needs gradients), "
            f"got {dtype!r}; e.g. dtype=torch.float32, or None for torch's default"
        )
    raw = torch.full(_lead(steps), _inverse(init, parameterization), dtype=dtype, device=device)
    return HyperTree(
        "scalar",
        raw,
        groups=[""],
        spec=None,
        group_of=None,
        steps=steps,
        parameterization=parameterization,
    )


def _grouped(
    kind: Kind,
    params: Tree,
    init: float,
    group_names: list[str],
    steps: int | None,
    parameterization: Parameterization,
) -> HyperTree:
    _, leaves, spec = _template(params)
    groups = list(dict.fromkeys(group_names))
    where = {g: i for i, g in enumerate(groups)}
    raw = torch.full(
        (*_lead(steps), len(groups)),
        _inverse(init, parameterization),
        dtype=leaves[0].dtype,
        device=leaves[0].device,
    )
    return HyperTree(
        kind,
        raw,
        groups=groups,
        spec=spec,
        group_of=[where[g] for g in group_names],
        steps=steps,
        parameterization=parameterization,
    )


@exposed_in("funcmeta.hyper")
def per_layer(
    params: Tree,
    init: float,
    *,
    steps: int | None = None,
    parameterization: Parameterization = "raw",
) -> HyperTree:
    """One learnable value per layer: tensors whose paths share everything up to the last
    ``.`` (``"0.weight"`` and ``"0.bias"``) share a value."""
    names, _, _ = _template(params)
    layers = [name.rpartition(".")[0] for name in names]
    return _grouped("per_layer", params, init, layers, steps, parameterization)


@exposed_in("funcmeta.hyper")
def per_tensor(
    params: Tree,
    init: float,
    *,
    steps: int | None = None,
    parameterization: Parameterization = "raw",
) -> HyperTree:
    """One learnable value per parameter tensor."""
    names, _, _ = _template(params)
    return _grouped("per_tensor", params, init, names, steps, parameterization)


@exposed_in("funcmeta.hyper")
def per_element(
    params: Tree,
    init: float,
    *,
    steps: int | None = None,
    parameterization: Parameterization = "raw",
) -> HyperTree:
    """One learnable value per parameter element (Meta-SGD's learning-rate tensors)."""
    names, leaves, spec = _template(params)
    start = _inverse(init, parameterization)
    raw = [
        torch.full((*_lead(steps), *p.shape), start, dtype=p.dtype, device=p.device) for p in leaves
    ]
    return HyperTree(
        "per_element",
        raw,
        groups=names,
        spec=spec,
        group_of=None,
        steps=steps,
        parameterization=parameterization,
    )


def _plain_layout(layout: Any) -> Any:
    """``layout`` if it is made of dicts, lists and tuples (exactly those types) of leaf
    indices, else ``None``."""

    def plain(x: Any) -> bool:
        if type(x) is int:
            return True
        if type(x) is dict:
            return all(plain(v) for v in x.values())
        if type(x) in (list, tuple):
            return all(plain(v) for v in x)
        return False

    return layout if plain(layout) else None


def _rebuild(layout: Any, values: list[Tensor]) -> Any:
    if type(layout) is int:
        return values[layout]
    if type(layout) is dict:
        return {k: _rebuild(v, values) for k, v in layout.items()}
    return type(layout)(_rebuild(v, values) for v in layout)
