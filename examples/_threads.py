"""The intra-op thread count each example runs with, chosen for its work.

Small operations (the sinusoid MLP, a 50-feature linear solve) gain nothing from more
threads, and lose badly when another process holds a core: each parallel region waits for
its slowest thread. Measured on 2 cores with another process spinning on one of them, the
``make demo`` run took 2.1x longer with 2 threads and no longer with 1. Convolutions on
28x28 images do gain (conv4 MAML, 20-way, meta-batch 4: 0.61 s per iteration with 1 thread,
0.35 s with 2), so those examples take every core they may run on.

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

__all__ = ["add_threads_option", "available_cores", "use_threads"]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
        help=f"intra-op threads (torch.set_num_threads); default {default}: {workload}",
    )


def use_threads(args: argparse.Namespace) -> int:
    """Set torch's intra-op thread count from ``args.threads``; returns it."""
    torch.set_num_threads(args.threads)
    return args.threads
