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


def test_the_tensor_follower_counts_what_a_block_makes_once_and_names_it():
    """``_common.tensor_peak`` (``llm_scale.py --tensors``): tensors made before the block,
    views and in-place results are not counted again; the peak is the most alive at once,
    and a backward's tensors are named as such."""
    import _common

    weight = torch.ones(MIB // 4, requires_grad=True)  # made before: not counted

    def forward():
        with torch.no_grad():
            w = weight.view(-1, 4).t()  # a view of a tensor made before: nothing new
            a = weight * 2  # 1 MiB
            a.view(-1, 4).t().mul_(3)  # a view, written in place: nothing new
            d = torch.ones(2 * MIB // 4)  # 3 MiB at once: the peak
            del d
            e = a + 1  # 2 MiB at once
            del a, e, w

    found = _common.tensor_peak(forward, step=1)
    assert found["peak"] == 3 * MIB
    assert sorted((g["what"], g["bytes"]) for g in found["groups"]) == [
        ("forward mul (262144,) float32", MIB),
        ("forward ones (524288,) float32", 2 * MIB),
    ]

    def backward():
        (weight * weight).sum().backward()

    found = _common.tensor_peak(backward)
    assert any(g["what"].startswith("backward mul (262144,)") for g in found["groups"])


def test_the_tensor_follower_passes_over_a_wrapper_subclass():
    """A wrapper subclass (a ``DTensor``'s kind) has no storage to read: the follower passes
    over its results and counts the plain tensors beside them."""
    import _common
    from torch.utils._pytree import tree_map

    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            def unwrap(t):
                return t.inner if isinstance(t, Wrapper) else t

            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            return tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)

    wrapped = Wrapper(torch.ones(MIB // 4))

    def work():
        doubled = wrapped * 2  # a wrapper: passed over
        plain = torch.ones(2 * MIB // 4)
        del doubled, plain

    found = _common.tensor_peak(work, step=1)
    assert found["peak"] == 2 * MIB
    assert [g["what"] for g in found["groups"]] == ["forward ones (524288,) float32"]
