"""functorch's batching primitives (``torch._C._functorch``): stepping in and out of a
``vmap`` level, wrapping and unwrapping batched tensors, for task batching's fast layers and
checkpointed layers under ``vmap``; the operators under packed sequences as function modes
see them; and which ``RuntimeError`` texts are ``vmap``'s refusals."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from funcmeta._src.core.fence.registry import ACCESSES

__all__ = [
    "FUNCTORCH",
    "add_batch_dim",
    "inside_transform",
    "is_batchedtensor",
    "is_vmap_refusal",
    "maybe_get_level",
    "missing_functorch",
    "pack_padded_op",
    "pad_packed_op",
    "peek_interpreter_stack",
    "pop_dynamic_layer_stack",
    "prepare_vmap",
    "push_dynamic_layer_stack",
    "remove_batch_dim",
    "unwrap_batched",
    "vmap_decrement_nesting",
    "vmap_increment_nesting",
]

FUNCTORCH = (
    "_add_batch_dim",
    "_remove_batch_dim",
    "_unwrap_batched",
    "_vmap_decrement_nesting",
    "_vmap_increment_nesting",
    "is_batchedtensor",
    "maybe_get_level",
    "peek_interpreter_stack",
    "pop_dynamic_layer_stack",
    "push_dynamic_layer_stack",
)
"""The names taken from ``torch._C._functorch`` (present from torch 2.0 to at least 2.15)."""

_functorch_c: types.ModuleType | None
try:
    import torch._C._functorch as _functorch_c
except ImportError:  # pragma: no cover - depends on the torch release
    _functorch_c = None


def _functorch(name: str) -> Any:
    return getattr(_functorch_c, name, None)


add_batch_dim = _functorch("_add_batch_dim")
remove_batch_dim = _functorch("_remove_batch_dim")
unwrap_batched = _functorch("_unwrap_batched")
vmap_increment_nesting = _functorch("_vmap_increment_nesting")
vmap_decrement_nesting = _functorch("_vmap_decrement_nesting")
is_batchedtensor = _functorch("is_batchedtensor")
maybe_get_level = _functorch("maybe_get_level")
peek_interpreter_stack = _functorch("peek_interpreter_stack")
pop_dynamic_layer_stack = _functorch("pop_dynamic_layer_stack")
push_dynamic_layer_stack = _functorch("push_dynamic_layer_stack")

# The operators under ``pack_padded_sequence`` and ``pad_packed_sequence``, as the function
# modes see them (``torch._VF`` forwards to them).
pack_padded_op: Any = getattr(torch._C._VariableFunctions, "_pack_padded_sequence", None)
pad_packed_op: Any = getattr(torch._C._VariableFunctions, "_pad_packed_sequence", None)

_PREPARED = [False]


def inside_transform() -> bool | None:
    """Whether a ``torch.func`` transform (vmap, grad, ...) is running now; ``None`` where
    this torch cannot tell (no ``peek_interpreter_stack``)."""
    if peek_interpreter_stack is None:
        return None
    return peek_interpreter_stack() is not None


def prepare_vmap() -> None:
    """Let ``torch.func.vmap`` register its batching decompositions (``nll_loss`` and others
    would otherwise take the slow per-example fallback): it does so on its first call, which
    the primitives above bypass. Once per process."""
    if not _PREPARED[0]:
        torch.func.vmap(torch.neg)(torch.zeros(1))
        _PREPARED[0] = True


_VMAP_REFUSALS = ("vmap:", "vmap support", "batching rule", "data-dependent control flow")


def is_vmap_refusal(error: BaseException) -> bool:
    """Whether ``error`` is ``vmap`` saying it cannot batch something (data-dependent control
    flow, an operator without a batching rule). torch has no exception type for it; the
    texts are checked against real refusals on every torch the suite runs on."""
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in message for t in _VMAP_REFUSALS)


def _functorch_probe(name: str) -> Callable[[], bool]:
    """Whether ``torch._C._functorch`` has ``name``, as a probe for :data:`ACCESSES`."""
    return lambda: _functorch(name) is not None


def missing_functorch() -> list[str]:
    """The names of :data:`FUNCTORCH` that this torch's ``torch._C._functorch`` lacks."""
    return [name for name in FUNCTORCH if _functorch(name) is None]


ACCESSES.update({f"torch._C._functorch.{n}": _functorch_probe(n) for n in FUNCTORCH})
ACCESSES["torch._C._VariableFunctions._pack_padded_sequence / _pad_packed_sequence"] = lambda: (
    callable(pack_padded_op) and callable(pad_packed_op)
)
