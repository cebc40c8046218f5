"""The sequence benchmark's peak memory (``benchmarks/speed/sequence_tasks.py``, through ``benchmarks/_common.py``) counts the bytes
tensors take from the profiler's allocation events: many small tensors count in full (the
resident set undercounted them), and the peak is the most held at once inside the window."""

from __future__ import annotations

import torch
from helpers import profiled

MIB = 2**20


def test_many_small_tensors_count_in_full():
    warm = [torch.ones(25, 128) for _ in range(2000)]  # freed heap memory for glibc to reuse
    del warm
    kept = []

    def allocate():
        kept.extend(torch.ones(25, 128) for _ in range(2000))  # 24.4 MiB in 12.8 KB tensors

    peak = profiled(allocate)
    assert 2000 * 25 * 128 * 4 <= peak < 2000 * 25 * 128 * 4 + MIB


def test_the_peak_is_the_most_held_at_once_above_the_start():
    before = torch.ones(4 * MIB // 4)  # held before the window: not counted

    def work():
        a = torch.ones(8 * MIB // 4)
        del a  # 8 MiB, freed
        b = torch.ones(2 * MIB // 4)
        c = torch.ones(3 * MIB // 4)  # 5 MiB at once: less than the 8 before
        del b, c

    peak = profiled(work)
    assert 8 * MIB <= peak < 8 * MIB + MIB // 2
    assert before.numel() == MIB
