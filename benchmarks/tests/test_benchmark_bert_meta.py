"""The BERT scenario of ``benchmarks/memory/bert_meta.py`` at small scale: a HuggingFace BERT
classifier, every encoder layer checkpointed, learnable per-layer softplus rates, only the last
layers and the head adapted, dropout on, meta-gradients clipped in the outer step. The
meta-gradients of every checkpointing setting equal the unchecked ones (float64), and under
bf16 autocast they differ from them by far less than bf16 itself does."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
bert_meta = load("memory/bert_meta.py")

SMALL = bert_meta.Scenario(
    layers=4,
    hidden=32,
    heads=2,
    intermediate=64,
    vocab=50,
    seq=16,
    batch=4,
    classes=3,
    adapted_layers=2,
    steps=3,
    lr=0.05,
)


def meta_grads(mode: str, dtype=None, autocast: bool = False) -> list[torch.Tensor]:
    device = torch.device("cpu")
    parts = bert_meta.setup(SMALL, mode, device, dtype=dtype)
    support, query = bert_meta.batches(SMALL, device)
    torch.manual_seed(5)  # dropout masks
    grads = bert_meta.meta_iteration(SMALL, mode, parts, support, query, autocast=autocast)
    return [torch.zeros(()) if g is None else g for g in grads]


def test_small_scenario_checkpointing_is_exact_in_float64():
    reference = meta_grads("none", dtype=torch.float64)
    assert reference[0].abs().sum() > 0 and reference[-1].abs().sum() > 0  # body and rates
    for mode in ("per-layer", "step", "both"):
        ours = meta_grads(mode, dtype=torch.float64)
        for a, b in zip(ours, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=mode)


def test_small_scenario_under_bf16_autocast():
    reference = meta_grads("none", autocast=True)
    float32 = meta_grads("none")
    total = sum(((b - c) ** 2).sum() for b, c in zip(reference, float32, strict=True)).sqrt()
    for mode in ("per-layer", "both"):
        ours = meta_grads(mode, autocast=True)
        assert all(torch.isfinite(g).all() for g in ours)
        diff = sum(((a - b) ** 2).sum() for a, b in zip(ours, reference, strict=True)).sqrt()
        assert diff <= 0.5 * total, (mode, float(diff), float(total))


def test_small_scenario_first_order_floor_runs():
    grads = meta_grads("fomaml")
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[0].abs().sum() > 0
