"""The intra-op thread count each example runs with, chosen for its work, and whether it
keeps freed memory (:func:`funcmeta.keep_freed_memory`).

Small operations (the sinusoid MLP, a 50-feature linear solve) gain nothing from more
threads, and lose badly when another process holds a core: each parallel region waits for
its slowest thread. Measured on this project's 2-core AMD EPYC (2026-11-24) with another
process spinning on one of its cores, the ``make demo`` run took 2.1x longer with 2 threads
and no longer with 1. Convolutions on 28x28 images do gain (conv4 MAML, 20-way, meta-batch 4,
on the same machine: 0.61 s per iteration with 1 thread, 0.35 s with 2), so those examples
take every core they may run on.

A shared module of the examples, not an example: each one imports it plainly (``from _threads
import ...``), as Python puts a script's own folder on ``sys.path``; the benchmarks reach it
through ``benchmarks/_common.py``, so that an example and a benchmark take the same options.

Example:
    >>> import argparse
    >>> from _threads import add_threads_option, use_threads
    >>> parser = argparse.ArgumentParser()
    >>> add_threads_option(parser, 1, "a tiny MLP")
    >>> use_threads(parser.parse_args([]))
    1
"""

from __future__ import annotations

import argparse
import os

import torch

import funcmeta as fm

__all__ = [
    "add_allocator_option",
    "add_threads_option",
    "available_cores",
    "idle_cores",
    "use_allocator",
    "use_threads",
]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def idle_cores() -> int:
    """The cores this process may run on less those the last minute's load average says
    other work holds (at least 1): where another job runs, a thread pool as wide as the
    machine waits at every parallel region for the thread that job has descheduled."""
    cores = available_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system
        return cores
    return max(1, min(cores, cores - round(load)))


def add_threads_option(parser: argparse.ArgumentParser, default: int, workload: str) -> None:
    """``--threads N``, with the default and the reason for it in ``--help``."""

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"--threads must be at least 1, got {value}")
        return value

    parser.add_argument(
        "--threads",
        type=positive,
        default=default,
        # %(default)s: argparse fills it in, and ArgumentDefaultsHelpFormatter adds no second one
        help="intra-op threads (torch.set_num_threads); default %(default)s: "
        + workload.replace("%", "%%"),
    )


def use_threads(args: argparse.Namespace) -> int:
    """Set torch's intra-op thread count from ``args.threads``; returns it."""
    torch.set_num_threads(args.threads)
    return args.threads


def add_allocator_option(parser: argparse.ArgumentParser, default: bool, workload: str) -> None:
    """``--keep-freed-memory`` / ``--no-keep-freed-memory``, the default and why in ``--help``."""
    parser.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="fm.keep_freed_memory(): the C allocator keeps freed blocks for reuse, so "
        "large tensors cost no fresh pages (Linux with glibc; the process keeps its peak "
        f"memory); default {'on' if default else 'off'}: {workload}",
    )


def use_allocator(args: argparse.Namespace) -> str:
    """Apply ``args.keep_freed_memory``; returns the allocator setting in words, to print
    once (with the reason where :func:`funcmeta.keep_freed_memory` does not apply)."""
    if not args.keep_freed_memory:
        return "allocator: the C library's defaults"
    if fm.keep_freed_memory():
        return "allocator: freed memory kept (fm.keep_freed_memory)"
    reason = fm.cpu_memory.why_not_kept()
    return f"allocator: the C library's defaults (fm.keep_freed_memory does not apply: {reason})"
