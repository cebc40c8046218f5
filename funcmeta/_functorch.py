"""Leaving a ``vmap`` level around a checkpointed layer.

``torch.utils.checkpoint`` cannot run inside ``torch.func.vmap`` (its recomputation happens
in backward, outside the vmap, on tensors of a finished vmap level). ``vmap`` *inside* a
checkpoint works. So when a checkpointed layer is called under task batching,
:func:`call_outside_vmap` unwraps the batched arguments of the innermost vmap level into
ordinary tensors with a task axis. It runs ``checkpoint(vmap(fn))`` on them and wraps the
outputs back into that level. Autograd sees ordinary tensors throughout, so second-order
gradients flow as without vmap.

This uses functorch's batching primitives from ``torch._C._functorch`` (present from torch
2.0 to at least 2.13). If a torch release lacks them, :func:`call_outside_vmap` raises an
error that says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

__all__ = ["call_outside_vmap", "is_batched"]

try:
    from torch._C._functorch import (
        _add_batch_dim,
        _unwrap_batched,
        is_batchedtensor,
        maybe_get_level,
    )
except ImportError:  # pragma: no cover - depends on the torch release
    _add_batch_dim = _unwrap_batched = is_batchedtensor = maybe_get_level = None


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

    batched_fn = torch.func.vmap(unflat_fn, in_dims=tuple(dims), randomness=randomness)
    flat_args, flat_extra = tuple(flat[:n_args]), tuple(flat[n_args:])
    out = wrap(lambda *xs: batched_fn(*xs, *flat_extra), flat_args)
    return optree.tree_map(
        lambda t: _add_batch_dim(t, 0, level) if isinstance(t, Tensor) else t, out
    )
