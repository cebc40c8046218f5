"""Leaving a ``vmap`` level around a checkpointed layer.

``torch.utils.checkpoint`` cannot run inside ``torch.func.vmap`` (its recomputation happens
in backward, outside the vmap, on tensors of a finished vmap level). ``vmap`` *inside* a
checkpoint works. So when a checkpointed layer is called under task batching,
:func:`call_outside_vmap` unwraps the batched arguments of the innermost vmap level into
ordinary tensors with a task axis. It runs ``checkpoint(vmap(fn))`` on them and wraps the
outputs back into that level. Autograd sees ordinary tensors throughout, so second-order
gradients flow as without vmap.

:class:`TaskLinear` is the task-batched fast path for ``nn.Linear``. Under ``vmap``, a linear
layer whose weights are batched costs about ten times an unbatched one (torch 2.13, CPU): the
generic batching rule. When the input, weight and bias are batched at the same level,
``TaskLinear`` does the whole batch as one ``torch.baddbmm`` on the unwrapped tensors.

Both use functorch's batching primitives from ``torch._C._functorch`` (present from torch
2.0 to at least 2.13). If a torch release lacks them, :func:`call_outside_vmap` raises an
error that says so, and :class:`TaskLinear` falls back to ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._shadow import Standin

__all__ = ["TaskLinear", "call_outside_vmap", "fast_vmap", "is_batched"]

try:
    from torch._C._functorch import (
        _add_batch_dim,
        _remove_batch_dim,
        _unwrap_batched,
        _vmap_decrement_nesting,
        _vmap_increment_nesting,
        is_batchedtensor,
        maybe_get_level,
    )
except ImportError:  # pragma: no cover - depends on the torch release
    _add_batch_dim = _remove_batch_dim = _unwrap_batched = None
    _vmap_decrement_nesting = _vmap_increment_nesting = None
    is_batchedtensor = maybe_get_level = None

#: Whether :func:`fast_vmap` uses the primitives (tests switch it off to check the fallback).
USE_PRIMITIVES = _vmap_increment_nesting is not None
_PREPARED = False


def _prepare() -> None:
    """Let ``torch.func.vmap`` register its batching decompositions (``nll_loss`` and others
    would otherwise take the slow per-example fallback): it does so on its first call."""
    global _PREPARED
    torch.func.vmap(torch.neg)(torch.zeros(1))
    _PREPARED = True


def fast_vmap(
    fn: Callable[..., Any],
    flat_args: tuple[Any, ...],
    in_dims: tuple[int | None, ...],
    batch_size: int,
    randomness: str = "different",
) -> Any:
    """``torch.func.vmap(fn, in_dims, randomness=...)(*flat_args)`` with the outputs' batch
    dimension first, for flat positional arguments.

    It is the core of ``torch.func.vmap`` without its argument and output processing. For a
    small model that processing costs more than the model, once per inner step. Tensor
    outputs get the batch dimension first; other outputs pass through as they are.
    """
    if not USE_PRIMITIVES:
        return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*flat_args)
    if not _PREPARED:
        _prepare()
    level = _vmap_increment_nesting(batch_size, randomness)
    try:
        batched = [
            x if d is None else _add_batch_dim(x, d, level)
            for x, d in zip(flat_args, in_dims, strict=True)
        ]
        out = fn(*batched)
        leaves, spec = optree.tree_flatten(out)
        return optree.tree_unflatten(
            spec,
            [
                _remove_batch_dim(t, level, batch_size, 0) if isinstance(t, Tensor) else t
                for t in leaves
            ],
        )
    finally:
        _vmap_decrement_nesting()


def is_batched(x: Any) -> bool:
    """Whether ``x`` is a tensor batched by an enclosing ``vmap``."""
    return is_batchedtensor is not None and isinstance(x, Tensor) and is_batchedtensor(x)


def call_outside_vmap(
    wrap: Callable[[Callable[..., Any], tuple[Any, ...]], Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    extra: tuple[Any, ...] = (),
    randomness: str = "different",
) -> Any:
    """Run ``fn(*args, *extra)`` vmapped, outside the innermost vmap level of its inputs.

    ``wrap(f, flat_args)`` calls ``f(*flat_args)``, typically under a checkpoint that keeps
    ``flat_args`` for the recomputation. ``extra`` reaches ``fn`` without passing through
    ``wrap``: tensors the first call writes into. Tensors batched at the innermost level are
    unwrapped (vmapped over their batch dimension), and everything else is passed as it is
    (broadcast across the batch). The outputs come back batched at that level.
    """
    if _unwrap_batched is None:  # pragma: no cover - depends on the torch release
        raise RuntimeError(
            "checkpointed layers under task batching need torch._C._functorch's batching "
            f"primitives, which torch {torch.__version__} does not have"
        )
    leaves, spec = optree.tree_flatten((args, extra))
    level = max(maybe_get_level(x) for x in leaves if is_batched(x))
    flat, dims = [], []
    for x in leaves:
        if is_batched(x) and maybe_get_level(x) == level:
            tensor, dim = _unwrap_batched(x, level)
            flat.append(tensor)
            dims.append(dim)
        else:
            flat.append(x)
            dims.append(None)
    n_args = len(optree.tree_leaves(args))

    def unflat_fn(*xs: Any) -> Any:
        a, e = optree.tree_unflatten(spec, list(xs))
        return fn(*a, *e)

    size = next(x.shape[d] for x, d in zip(flat, dims, strict=True) if d is not None)
    flat_args, flat_extra = tuple(flat[:n_args]), tuple(flat[n_args:])

    def batched_fn(*xs: Any) -> Any:
        return fast_vmap(unflat_fn, (*xs, *flat_extra), tuple(dims), size, randomness)

    out = wrap(batched_fn, flat_args)
    return optree.tree_map(
        lambda t: _add_batch_dim(t, 0, level) if isinstance(t, Tensor) else t, out
    )


def _physical(x: Tensor, level: int) -> Tensor:
    tensor, dim = _unwrap_batched(x, level)
    return tensor if dim == 0 else tensor.movedim(dim, 0)


class TaskLinear(Standin):
    """Stands in for an ``nn.Linear`` under task batching: one ``baddbmm`` for all tasks when
    the input, weight and bias are batched at the same vmap level, ``F.linear`` otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        if not (is_batched(x) and is_batched(w)):
            return F.linear(x, w, b)
        level = maybe_get_level(w)
        if maybe_get_level(x) != level or (
            b is not None and not (is_batched(b) and maybe_get_level(b) == level)
        ):
            return F.linear(x, w, b)
        xp, wp = _physical(x, level), _physical(w, level)
        flat = xp.dim() != 3  # (T, N, in) goes in as it is; other shapes via (T, -1, in)
        x3 = xp.reshape(xp.shape[0], -1, xp.shape[-1]) if flat else xp
        if b is None:
            out = torch.bmm(x3, wp.transpose(1, 2))
        else:
            out = torch.baddbmm(_physical(b, level).unsqueeze(1), x3, wp.transpose(1, 2))
        if flat:
            out = out.reshape(*xp.shape[:-1], out.shape[-1])
        return _add_batch_dim(out, 0, level)


def task_linears(module: nn.Module) -> dict[str, type[TaskLinear]]:
    """The submodules of ``module`` that are plain ``nn.Linear`` (subclasses may override
    ``forward``), for the task-batched runner."""
    if _unwrap_batched is None:  # pragma: no cover - depends on the torch release
        return {}
    return {name: TaskLinear for name, m in module.named_modules() if type(m) is nn.Linear}
