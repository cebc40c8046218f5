"""glibc's malloc settings that keep freed CPU memory in the process: the implementation of
:mod:`funcmeta.cpu_memory`."""

from __future__ import annotations

import ctypes
import platform
import sys

from funcmeta._src.core.exposed import exposed_in

__all__ = ["keep_freed_memory", "why_not_kept"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1

_state: dict[str, bool] = {"kept": False}


@exposed_in("funcmeta.cpu_memory")
def why_not_kept() -> str | None:
    """Why :func:`funcmeta.keep_freed_memory` cannot apply in this process (not Linux, not glibc, no
    ``mallopt``), or ``None`` when it can."""
    if not sys.platform.startswith("linux"):
        return f"the C library's allocator settings are glibc's, and this is {sys.platform}"
    name, version = platform.libc_ver()
    if name != "glibc":
        return f"the C library is {name or 'not glibc'}, not glibc"
    if not hasattr(ctypes.CDLL(None), "mallopt"):  # pragma: no cover - glibc has it
        return f"glibc {version} has no mallopt"
    return None


@exposed_in("funcmeta")
def keep_freed_memory() -> bool:
    """Keep memory that tensors free inside the process, for later tensors to reuse.

    Sets glibc's ``M_MMAP_MAX`` to 0 (no block gets its own ``mmap``) and its
    ``M_TRIM_THRESHOLD`` to the largest value (the heap is not trimmed), for the rest of the
    process; it cannot be undone. Call it once, before training; calling it again does
    nothing. Returns True when the settings are in force, False where they do not exist
    (:func:`funcmeta.cpu_memory.why_not_kept` says why: macOS, Windows, musl); nothing changes then.

    It speeds up CPU training whose tensors are large, task batching above all (see
    ``docs/tasks.md``), and leaves the results as they are. The process's resident memory
    stays at its peak until it exits.
    """
    if _state["kept"]:
        return True
    if why_not_kept() is not None:
        return False
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if not libc.mallopt(_M_MMAP_MAX, 0) or not libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX):
        raise RuntimeError("glibc refused mallopt(M_MMAP_MAX, 0) or mallopt(M_TRIM_THRESHOLD)")
    _state["kept"] = True
    return True
