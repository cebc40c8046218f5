"""The decoder benchmark (benchmarks/memory/decoder_meta.py) runs each setting on a tiny decoder:
the meta-gradients of the settings agree to bf16 rounding, and the model's own gradient
checkpointing, run by funcmeta, keeps less memory than no checkpointing."""

from __future__ import annotations

import argparse

import pytest
from bench_scripts import load

pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[dev]'")
pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
decoder_meta = load("memory/decoder_meta.py")


@pytest.mark.slow
def test_the_decoder_benchmark_runs_every_setting_on_a_tiny_decoder():
    args = argparse.Namespace(device="cpu", steps=3, repeats=1, length=16, small=True)
    results = {m: decoder_meta.run_point(args, m) for m in ("none", "model's own", "per-layer")}
    norms = [r["grad_norm"] for r in results.values()]
    assert max(norms) - min(norms) < 1e-2 * norms[0]
    assert results["model's own"]["peak"] < results["none"]["peak"]
    batched = decoder_meta.run_point(args, "per-layer", tasks=2, batched=True)
    assert batched["seconds"] > 0
