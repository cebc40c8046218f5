"""Keeping freed CPU memory in the process, so that large tensors stop costing page faults.

PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves a large block
(above a threshold that grows to at most 32 MiB) with a fresh ``mmap`` and hands it back to
the system on free, and it trims the top of its heap whenever more than a few MiB lie free
there. The next tensor of that size then starts on pages the kernel must fault in and zero,
one 4 KiB page at a time, at every step of a training loop. Task batching makes tensors T
times larger, so it pays this most (``benchmarks/RESULTS.md``, "Keeping freed memory on a CPU":
second-order MAML through conv4 and a batched GPT-2 path).

:func:`funcmeta.keep_freed_memory` turns both off for the rest of the process: every block comes
from the heap, and freed memory stays there for the next tensor, as a GPU caching allocator
keeps it. The cost is memory: the process keeps its peak resident size (and whatever the
heap fragments into) until it exits. It changes no result, only where tensors live.

Example:
    >>> import funcmeta as fm
    >>> reason = fm.cpu_memory.why_not_kept()   # None on Linux with glibc, else why not
    >>> # fm.keep_freed_memory() applies for the rest of the process: call it in a script
    >>> applied = fm.keep_freed_memory()  # doctest: +SKIP
"""

from funcmeta._src.cpu_memory.glibc import keep_freed_memory, why_not_kept

__all__ = ["keep_freed_memory", "why_not_kept"]
