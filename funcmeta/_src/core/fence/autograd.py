"""autograd's private state: autocast's state to put back, whether saved-tensor hooks are
allowed, and ``torch.utils.checkpoint.checkpoint``'s code, redirected to funcmeta's
dispatcher while funcmeta runs a model or recomputes a layer (however the caller imported it:
HuggingFace binds it in a ``functools.partial``); calls from other threads, or outside those
blocks, run torch's own code."""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from funcmeta._src.core.fence.registry import ACCESSES

__all__ = [
    "AutocastState",
    "autocast_enabled",
    "checkpoint_redirected",
    "dispatch_checkpoint",
    "original_checkpoint",
    "saved_hooks_in_force",
    "saved_tensor_hooks_state",
    "set_checkpoint_dispatch",
    "set_saved_tensor_hooks_state",
    "tensor_version",
]


def autocast_enabled() -> bool:
    """Whether autocast is on now, for CPU or CUDA."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


class AutocastState:
    """The autocast state in force now (CPU, and CUDA if ``cuda``), to be put back later."""

    __slots__ = ("cache", "states")

    def __init__(self, cuda: bool) -> None:
        types = ("cpu", "cuda") if cuda else ("cpu",)
        self.states = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types
        ]
        self.cache = torch.is_autocast_cache_enabled()

    def enter(self, stack: contextlib.ExitStack) -> None:
        for device_type, enabled, dtype in self.states:
            if enabled or torch.is_autocast_enabled(device_type):
                stack.enter_context(
                    torch.autocast(
                        device_type, enabled=enabled, dtype=dtype, cache_enabled=self.cache
                    )
                )

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            self.enter(stack)
            yield


def saved_tensor_hooks_state() -> str | None:
    """Whether saved-tensor hooks are allowed now: ``None`` when they are, else the message
    torch raises for them. ``torch.func``'s gradient transforms turn them off while they
    run; a compile that fails inside one (inductor tracing ``torch.func.grad``) can leave
    them off for the rest of the process, so that every later ``torch.utils.checkpoint``
    call fails (``docs/decisions/compiled-meta-step.md``)."""
    autograd: Any = torch._C._autograd
    if autograd._saved_tensors_hooks_is_enabled():
        return None
    return str(autograd._saved_tensors_hooks_get_disabled_error_message())


def saved_hooks_in_force() -> tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None:
    """The saved-tensor hooks in force now (the innermost ``saved_tensors_hooks`` pair, the
    one a tensor saved now would go through), or ``None``: none, or a torch without the
    query (then a pair pushed on top of another hides it)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        found = top(False)
    except TypeError:  # an older signature, without ignore_is_tracing
        found = top()
    return found if found else None


def set_saved_tensor_hooks_state(state: str | None) -> None:
    """Put back what :func:`saved_tensor_hooks_state` returned."""
    autograd: Any = torch._C._autograd
    if state is None:
        autograd._saved_tensors_hooks_enable()
    else:
        autograd._saved_tensors_hooks_disable(state)


def tensor_version(tensor: Tensor) -> int:
    """``tensor``'s version counter (``Tensor._version``): autograd bumps it at every
    in-place write to the tensor or a view of it, which is how a kept copy of it can tell
    that it went stale."""
    return int(tensor._version)


# ------------------------------------------------------------------ torch.utils.checkpoint

# The function whose code runs for torch.utils.checkpoint.checkpoint (under the decorators
# torch puts on it), and that code.
_CHECKPOINT: Any = inspect.unwrap(torch.utils.checkpoint.checkpoint)
_CHECKPOINT_CODE: types.CodeType = _CHECKPOINT.__code__


def _copy_function(fn: Any) -> Any:
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = dict(fn.__kwdefaults__ or {})
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return copy


original_checkpoint: Callable[..., Any] = _copy_function(_CHECKPOINT)
"""torch's ``checkpoint``, never redirected (a copy of the function with its own code)."""

_DISPATCH: list[Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None] = [
    None
]
_REDIRECT_LOCK = threading.Lock()
_REDIRECT_DEPTH = [0]


def set_checkpoint_dispatch(
    dispatch: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
) -> None:
    """Where redirected ``checkpoint(function, *args, **kwargs)`` calls go:
    ``dispatch(function, args, kwargs)``."""
    _DISPATCH[0] = dispatch


def dispatch_checkpoint(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A redirected call: to the dispatcher, or torch's own code if none is set."""
    dispatch = _DISPATCH[0]
    if dispatch is None:
        return original_checkpoint(function, *args, **kwargs)
    return dispatch(function, args, kwargs)


def _trampoline(function: Any, *args: Any, **kwargs: Any) -> Any:
    # runs as torch.utils.checkpoint.checkpoint's code, with that module's globals
    from funcmeta._src.core.fence.autograd import dispatch_checkpoint

    return dispatch_checkpoint(function, args, kwargs)


@contextlib.contextmanager
def checkpoint_redirected() -> Iterator[None]:
    """Send every call of ``torch.utils.checkpoint.checkpoint`` to the dispatcher for the
    block (nested and concurrent blocks share one redirection; torch's code is back when
    the last ends, also on error)."""
    with _REDIRECT_LOCK:
        if _REDIRECT_DEPTH[0] == 0:
            _CHECKPOINT.__code__ = _trampoline.__code__
        _REDIRECT_DEPTH[0] += 1
    try:
        yield
    finally:
        with _REDIRECT_LOCK:
            _REDIRECT_DEPTH[0] -= 1
            if _REDIRECT_DEPTH[0] == 0:
                _CHECKPOINT.__code__ = _CHECKPOINT_CODE


def _redirects_checkpoint() -> bool:
    """Whether a redirection reaches every way of calling ``checkpoint``: the public name,
    the function bound elsewhere before (``from torch.utils.checkpoint import checkpoint``),
    and ``checkpoint_sequential``."""
    if _CHECKPOINT.__closure__ or "function" not in inspect.signature(_CHECKPOINT).parameters:
        return False
    seen: list[Any] = []
    saved = _DISPATCH[0]

    def record(f: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        seen.append(f)
        return f(*a)

    set_checkpoint_dispatch(record)
    bound = torch.utils.checkpoint.checkpoint
    try:
        with checkpoint_redirected():
            x = torch.ones(2)
            bound(torch.neg, x, use_reentrant=False)
            torch.utils.checkpoint.checkpoint_sequential(
                [nn.Identity(), nn.Identity()], 2, x, use_reentrant=False
            )
    finally:
        _DISPATCH[0] = saved
    return len(seen) == 2 and _CHECKPOINT.__code__ is _CHECKPOINT_CODE


ACCESSES["torch.utils.checkpoint.checkpoint's code (redirected while funcmeta runs a model)"] = (
    _redirects_checkpoint
)
ACCESSES["torch._C._autograd._saved_tensors_hooks_{is_enabled,enable,disable,...}"] = lambda: all(
    hasattr(torch._C._autograd, f"_saved_tensors_hooks_{n}")
    for n in ("is_enabled", "enable", "disable", "get_disabled_error_message")
)
ACCESSES["torch.Tensor._version (the version counter)"] = lambda: isinstance(
    getattr(torch.zeros(()), "_version", None), int
)
ACCESSES["torch._C._autograd._top_saved_tensors_default_hooks"] = lambda: hasattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks"
)
