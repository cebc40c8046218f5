"""Which attention and RNN kernels a step runs on, and the same kernels on recomputation:
the implementation of :mod:`funcmeta.checkpoint.kernels`."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import (
    get_fast_path,
    sdp_backends,
    sdp_getters,
    sdp_priority,
    sdp_setters,
    set_fast_path,
    set_sdp_priority,
)
from funcmeta._src.core.replay import recomputation

__all__ = [
    "KernelState",
    "capture",
    "entered_again",
    "in_twice_differentiable",
    "no_fast_path",
    "recompute_with",
    "KernelRestore",
    "restore",
    "twice_differentiable",
]


class _Local(threading.local):
    twice: bool = False
    again: tuple[Callable[[], contextlib.AbstractContextManager], ...] = ()


_LOCAL = _Local()


@exposed_in("funcmeta.checkpoint.kernels")
@dataclass(frozen=True)
class KernelState:
    """The kernel choice in force: attention backends (and their priority), the MHA fast
    path, and whether :func:`twice_differentiable` is active (RNNs then avoid cuDNN)."""

    attention: tuple[bool, ...]
    priority: tuple[int, ...] | None
    fast_path: bool
    twice: bool
    again: tuple[Callable[[], contextlib.AbstractContextManager], ...] = ()
    """Contexts in force that a recomputation enters again (:func:`entered_again`)."""


@exposed_in("funcmeta.checkpoint.kernels")
def capture() -> KernelState:
    """The kernel choice in force now."""
    return KernelState(
        attention=tuple([get() for get in sdp_getters]),
        priority=tuple(sdp_priority()) if sdp_priority is not None else None,
        fast_path=get_fast_path(),
        twice=_LOCAL.twice,
        again=_LOCAL.again,
    )


@exposed_in("funcmeta.checkpoint.kernels")
@contextlib.contextmanager
def entered_again(make: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Mark the block as running inside ``make()`` (entered by the caller), so that a
    recomputation of what it runs (a checkpointed layer, a checkpointed step) enters a new
    ``make()`` too: a ``TorchFunctionMode`` that task batching needs is one."""
    before = _LOCAL.again
    _LOCAL.again = (*before, make)
    try:
        yield
    finally:
        _LOCAL.again = before


class _Shared:
    """torch's attention backends and MHA fast path are process-wide flags: the requests for
    math-only attention and for no fast path are counted across threads, the flags set when
    the first request comes and put back when the last one ends. Saving and restoring per
    block instead let one thread's exit turn flash attention back on under another thread's
    second-order step (torch then raised its missing-derivative error)."""

    lock = threading.Lock()
    math = 0  # blocks asking for math-only attention, in all threads
    no_fast = 0  # blocks asking for no MHA fast path, in all threads
    attention: tuple[bool, ...] = ()  # the backends before the first math-only request
    fast_path = True  # the fast path before the first no-fast-path request


def _hold(math: bool, no_fast: bool) -> None:
    """Count a request for math-only attention and/or no fast path; set what the first
    request of its kind needs."""
    with _Shared.lock:
        if math:
            if _Shared.math == 0:
                _Shared.attention = tuple([get() for get in sdp_getters])
                if _Shared.attention != _MATH_ONLY:
                    _set_attention(_MATH_ONLY)
            _Shared.math += 1
        if no_fast:
            if _Shared.no_fast == 0:
                _Shared.fast_path = get_fast_path()
                if _Shared.fast_path:
                    set_fast_path(False)
            _Shared.no_fast += 1


def _release(math: bool, no_fast: bool) -> None:
    """End a request counted by :func:`_hold`; the last of its kind puts the flags back."""
    with _Shared.lock:
        if math:
            _Shared.math -= 1
            if _Shared.math == 0 and _Shared.attention != tuple([get() for get in sdp_getters]):
                _set_attention(_Shared.attention)
        if no_fast:
            _Shared.no_fast -= 1
            if _Shared.no_fast == 0 and _Shared.fast_path != get_fast_path():
                set_fast_path(_Shared.fast_path)


def _apply(state: KernelState, current: KernelState) -> tuple[bool, bool]:
    """Put ``state`` in force, setting only what differs from ``current`` (the attention
    backends and fast path only where no request of :func:`_hold` holds them): whether it
    set the attention backends, and the fast path."""
    with _Shared.lock:
        attention = state.attention != current.attention and _Shared.math == 0
        if attention:
            _set_attention(state.attention)
        fast_path = state.fast_path != current.fast_path and _Shared.no_fast == 0
        if fast_path:
            set_fast_path(state.fast_path)
    if state.priority != current.priority and state.priority is not None and set_sdp_priority:
        set_sdp_priority(list(state.priority))
    _LOCAL.twice = state.twice
    _LOCAL.again = state.again
    return attention, fast_path


@exposed_in("funcmeta.checkpoint.kernels")
class KernelRestore(contextlib.AbstractContextManager):
    """Put ``state`` (from :func:`capture`) in force for the block; the choice before it
    comes back afterwards. Reusable: a checkpoint may recompute more than once."""

    def __init__(self, state: KernelState) -> None:
        self.state = state
        self._before: list[
            tuple[KernelState, contextlib.ExitStack, tuple[bool, bool], tuple[bool, bool]]
        ] = []

    def __enter__(self) -> None:
        now = capture()
        entered = contextlib.ExitStack()
        # math-only attention and no fast path are counted requests (other threads may hold
        # them too); any other choice is set for the block and put back after it
        held = (self.state.attention == _MATH_ONLY, not self.state.fast_path)
        _hold(*held)
        set_here = _apply(self.state, capture()) if now != self.state else (False, False)
        self._before.append((now, entered, held, set_here))
        for make in self.state.again[len(now.again) :] if self.state.again != now.again else ():
            entered.enter_context(make())

    def __exit__(self, *exc: object) -> None:
        before, entered, held, (attention, fast_path) = self._before.pop()
        entered.close()
        _release(*held)
        now = capture()
        # the flags this block set go back; those of counted requests are theirs to put back
        if not attention:
            before = dataclasses.replace(before, attention=now.attention)
        if not fast_path:
            before = dataclasses.replace(before, fast_path=now.fast_path)
        if now != before:
            _apply(before, now)


@exposed_in("funcmeta.checkpoint.kernels")
def restore(state: KernelState) -> KernelRestore:
    """A reusable context manager that puts ``state`` (from :func:`capture`) in force for its
    block and the choice before it back afterwards (:class:`KernelRestore`)."""
    return KernelRestore(state)


_MATH_ONLY = tuple(name == "math" for name in sdp_backends)


def _set_attention(enabled: tuple[bool, ...]) -> None:
    for set_enabled, on in zip(sdp_setters, enabled, strict=True):
        set_enabled(on)


class _Override:
    """Math-only attention (if ``math``), no MHA fast path, and the twice-differentiable mark
    (if ``twice``) for the block: counted requests (:class:`_Shared`), so that blocks in
    several threads at once keep the flags set until the last one ends. On the path of every
    inner step, so kept to a few calls."""

    __slots__ = ("_saved", "math", "twice")

    def __init__(self, math: bool, twice: bool) -> None:
        self.math, self.twice = math, twice
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved.append(_LOCAL.twice)
        _hold(self.math, True)
        if self.twice:
            _LOCAL.twice = True

    def __exit__(self, *exc: object) -> None:
        _release(self.math, True)
        _LOCAL.twice = self._saved.pop()


@exposed_in("funcmeta.checkpoint.kernels")
def twice_differentiable() -> contextlib.AbstractContextManager[None]:
    """A block whose graph can be differentiated twice: math attention only, RNNs without
    cuDNN, no MHA inference fast path (see the module docstring)."""
    return _Override(math=True, twice=True)


@exposed_in("funcmeta.checkpoint.kernels")
def no_fast_path() -> contextlib.AbstractContextManager[None]:
    """A block without the MHA/Transformer inference fast path (which has no derivative and no
    vmap support); other choices unchanged."""
    return _Override(math=False, twice=False)


@exposed_in("funcmeta.checkpoint.kernels")
def in_twice_differentiable() -> bool:
    """Whether a :func:`twice_differentiable` block (or a recomputation of one) is running."""
    return _LOCAL.twice


@exposed_in("funcmeta.checkpoint.kernels")
def recompute_with(
    state: KernelState,
) -> Callable[[], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: the forward runs as it is,
    the recomputation under ``state`` (the choice captured when the forward ran)."""
    return lambda: (contextlib.nullcontext(), _Recompute(state))


class _Recompute(KernelRestore):
    """:class:`restore`, and the block marked for :func:`funcmeta.recomputing`. Reusable."""

    def __init__(self, state: KernelState) -> None:
        super().__init__(state)
        self._marks: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        super().__enter__()
        mark = recomputation()
        mark.__enter__()
        self._marks.append(mark)

    def __exit__(self, *exc: object) -> None:
        self._marks.pop().__exit__(None, None, None)
        super().__exit__(*exc)
