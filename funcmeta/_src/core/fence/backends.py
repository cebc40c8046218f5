"""The kernel choices torch keeps as process-wide flags: the attention backends'
(``torch._C._get/_set_*_sdp_*``), the multi-head attention fast path's
(``torch.backends.mha``), cuDNN's and oneDNN's (recurrent layers' fused kernels)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from funcmeta._src.core.fence.registry import ACCESSES

__all__ = [
    "cudnn_disabled",
    "fused_rnn",
    "get_fast_path",
    "sdp_backends",
    "sdp_getters",
    "sdp_priority",
    "sdp_setters",
    "set_fast_path",
    "set_sdp_priority",
]

sdp_backends: tuple[str, ...] = tuple(
    name
    for name in ("flash", "mem_efficient", "math", "cudnn", "overrideable")
    if hasattr(torch._C, f"_get_{name}_sdp_enabled") and hasattr(torch._C, f"_set_sdp_use_{name}")
)
"""The attention backends whose enabled flags torch keeps as global state (torch >= 2.5 has
at least the first four), read and written as ``torch.nn.attention.sdpa_kernel`` does."""
sdp_getters: tuple[Callable[[], bool], ...] = tuple(
    getattr(torch._C, f"_get_{name}_sdp_enabled") for name in sdp_backends
)
sdp_setters: tuple[Callable[[bool], None], ...] = tuple(
    getattr(torch._C, f"_set_sdp_use_{name}") for name in sdp_backends
)
sdp_priority: Callable[[], Any] | None = getattr(torch._C, "_get_sdp_priority_order", None)
set_sdp_priority: Callable[[Any], None] | None = getattr(torch._C, "_set_sdp_priority_order", None)

_mha = torch.backends.mha
# the flag itself (torch.backends.mha.get_fastpath_enabled also asks TorchScript each time)
get_fast_path: Callable[[], bool] = (
    (lambda: _mha._is_fastpath_enabled)
    if hasattr(_mha, "_is_fastpath_enabled")
    else _mha.get_fastpath_enabled
)
set_fast_path: Callable[[bool], None] = _mha.set_fastpath_enabled


@contextlib.contextmanager
def cudnn_disabled() -> Iterator[None]:
    """cuDNN off for the block (a process-wide flag), put back afterwards."""
    if not torch.backends.cudnn.enabled:
        yield
        return
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = True


def fused_rnn(mode: str, x: Tensor, packed: bool = False) -> bool:
    """Whether torch runs a recurrent layer of ``mode`` (``nn.RNNBase.mode``) on ``x`` (the
    steps of a packed sequence with ``packed``) on a fused kernel in first order: cuDNN on
    CUDA (when enabled), oneDNN's LSTM on CPU in float32 or bfloat16 (when enabled; not for
    packed sequences, which torch runs op by op on CPU). Elsewhere it runs op by op, one time
    step at a time."""
    if x.device.type == "cuda":
        return bool(torch.backends.cudnn.enabled) and torch.backends.cudnn.is_available()
    return (
        not packed
        and x.device.type == "cpu"
        and mode == "LSTM"
        and x.dtype in (torch.float32, torch.bfloat16)
        and bool(torch.backends.mkldnn.enabled)
        and torch.backends.mkldnn.is_available()
    )


ACCESSES["torch._C._get/_set_{flash,mem_efficient,math,cudnn}_sdp_*"] = lambda: (
    {"flash", "mem_efficient", "math", "cudnn"} <= set(sdp_backends)
)
ACCESSES["torch.backends.mha fast-path flag"] = lambda: (
    callable(get_fast_path) and isinstance(get_fast_path(), bool)
)
