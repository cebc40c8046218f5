"""One run of a module at a time: :class:`RunGuard` and :exc:`ConcurrentUseError`.

Running a :class:`~funcmeta.FunctionalModel` puts the given tensors into its module's
parameter and buffer dicts for the run (as ``torch.func.functional_call`` does), and a
checkpointed layer's recomputation in the backward puts the forward's tensors back into its
layer. A module holds one set of tensors at a time: a second thread running the same module
meanwhile would read the first one's tensors (torch then says a tensor "escaped from inside
a function being vmapped", or the result is silently another thread's). So every place that
puts tensors into a module enters the module's guard; a thread that enters while another
thread is inside raises :exc:`ConcurrentUseError`, before it touches anything. The same
thread may enter again (a checkpointed layer inside a model's run).

One guard serves a whole module tree (:func:`guard_of`): the root's, shared by every
submodule, so a layer recomputed in a backward meets the runs of its model.

Example:
    >>> import torch
    >>> from funcmeta._src.module.guard import guard_of
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> guard_of(net) is guard_of(net[0])
    True
    >>> with guard_of(net), guard_of(net[0]):   # the same thread may enter again
    ...     pass
"""

from __future__ import annotations

import threading
import weakref
from types import TracebackType

from torch import nn

from funcmeta._src.core.exposed import exposed_in

__all__ = ["ConcurrentUseError", "RunGuard", "guard_of"]


@exposed_in("funcmeta")
class ConcurrentUseError(RuntimeError):
    """One :class:`~funcmeta.FunctionalModel` (or one module) was run by two threads at once.

    A module holds one set of tensors at a time, so its runs cannot overlap. Give each thread
    its own model and pass the shared parameters explicitly; the meta-gradients still reach
    them::

        local = fm.functional_model(copy.deepcopy(net))     # once per thread
        result = fm.adapt(local, fmodel.params, loss_fn, batch, opt, steps=1)

    or run the calls (and their backward) one after another.
    """


class RunGuard:
    """Lets one thread at a time inside (re-entrant for that thread); another thread that
    tries to enter meanwhile gets :exc:`ConcurrentUseError`."""

    __slots__ = ("_depth", "_lock", "_owner", "_owner_name", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self._owner = 0
        self._owner_name = ""
        self._depth = 0

    def __enter__(self) -> None:
        me = threading.get_ident()
        with self._lock:
            if self._depth and self._owner != me:
                raise ConcurrentUseError(self._message())
            if not self._depth:
                self._owner = me
                self._owner_name = threading.current_thread().name
            self._depth += 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with self._lock:
            self._depth -= 1

    def _message(self) -> str:
        return (
            f"{self.what} is running in thread {self._owner_name!r}, and thread "
            f"{threading.current_thread().name!r} started another run of it meanwhile (a "
            "forward, or a checkpointed layer's recomputation in a backward). A module holds "
            "one set of tensors at a time, so one model cannot run in two threads at once. "
            "Use one model per thread, passing the shared parameters explicitly: local = "
            "fm.functional_model(copy.deepcopy(net)) in each thread, then fm.adapt(local, "
            "fmodel.params, ...) (the meta-gradients still reach fmodel.params); or run the "
            "calls and their backward one after another"
        )


_GUARDS: dict[int, tuple[weakref.ref[nn.Module], RunGuard]] = {}
_REGISTER = threading.Lock()


def _held(module: nn.Module) -> RunGuard | None:
    entry = _GUARDS.get(id(module))
    if entry is None or entry[0]() is not module:
        return None
    return entry[1]


def guard_of(module: nn.Module) -> RunGuard:
    """The guard of the tree ``module`` belongs to: the one of a tree that already holds it
    (a submodule of a model's module), else a new one for ``module`` and its submodules."""
    guard = _held(module)
    if guard is not None:
        return guard
    with _REGISTER:
        members = list(module.modules())
        guard = next((g for g in map(_held, members) if g is not None), None)
        if guard is None:
            guard = RunGuard(f"the module {type(module).__name__}")
        for m in members:
            if _held(m) is None:
                _GUARDS[id(m)] = (weakref.ref(m), guard)
                weakref.finalize(m, _forget, id(m), guard)
        return guard


def _forget(key: int, guard: RunGuard) -> None:
    entry = _GUARDS.get(key)
    if entry is not None and entry[1] is guard and entry[0]() is None:
        del _GUARDS[key]
