"""Second-order MAML on a BERT-base-sized classifier: peak memory and time by checkpointing.

The scenario: a HuggingFace ``BertForSequenceClassification`` built from a config (12 layers,
hidden 768, 12 heads, intermediate 3072, vocabulary 30522, dropout 0.1; random init, nothing
downloaded); every encoder layer checkpointed (per-layer settings); learnable per-layer
softplus inner rates; bf16 autocast on CPU (fp16 with loss scaling on CUDA); only the last 4
encoder layers, the pooler and the classifier adapted; 5 second-order SGD steps at sequence
length 128; an outer AdamW step with the meta-gradient clipped to norm 1.

Settings: ``none``; ``per-layer``; ``step`` (``checkpoint_steps=True``); ``both``; and
``fomaml`` (first order, per-layer checkpointing): the floor second order is compared with.
Each runs in a fresh process with a warm-up meta-iteration (one step) first; memory is
measured as in ``benchmarks/memory/memory.py`` (peak RSS above the start on CPU, with glibc's mmap
threshold fixed; peak allocated bytes on CUDA).

    python benchmarks/memory/bert_meta.py [--device cpu] [--batch 8] [--steps 5] [--repeats 1]

``benchmarks/tests/test_benchmark_bert_meta.py`` runs :func:`meta_iteration` on a small config.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

MODES = ("none", "per-layer", "step", "both", "fomaml")


@dataclass(frozen=True)
class Scenario:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    vocab: int = 30522
    dropout: float = 0.1
    seq: int = 128
    batch: int = 8
    classes: int = 5
    adapted_layers: int = 4
    steps: int = 5
    lr: float = 1e-3
    clip: float = 1.0


def build(sc: Scenario, seed: int = 0, dtype: Any = None) -> Any:
    """``BertForSequenceClassification`` of the scenario's size, random init (math or SDPA
    attention as HuggingFace picks; funcmeta runs second-order steps on the math kernel)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=sc.vocab,
        hidden_size=sc.hidden,
        num_hidden_layers=sc.layers,
        num_attention_heads=sc.heads,
        intermediate_size=sc.intermediate,
        max_position_embeddings=max(512, sc.seq),
        hidden_dropout_prob=sc.dropout,
        attention_probs_dropout_prob=sc.dropout,
        num_labels=sc.classes,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    return model.to(dtype) if dtype is not None else model


def adapted_names(sc: Scenario) -> list[str]:
    """The adapted submodules: the last encoder layers, the pooler and the classifier."""
    last = range(sc.layers - sc.adapted_layers, sc.layers)
    return [f"bert.encoder.layer.{i}" for i in last] + ["bert.pooler", "classifier"]


def batches(sc: Scenario, device: Any, seed: int = 1) -> tuple[Any, Any]:
    """A support and a query batch of random token sequences with random labels."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def one() -> tuple[Any, Any]:
        ids = torch.randint(0, sc.vocab, (sc.batch, sc.seq), generator=g)
        labels = torch.randint(0, sc.classes, (sc.batch,), generator=g)
        return ids.to(device), labels.to(device)

    return one(), one()


def setup(sc: Scenario, mode: str, device: Any, dtype: Any = None) -> dict[str, Any]:
    """The model, its functional form for ``mode``, the learnable rates and the outer
    optimizer."""
    import torch

    import funcmeta as fm

    model = build(sc, dtype=dtype).to(device).train()
    layers = [f"bert.encoder.layer.{i}" for i in range(sc.layers)]
    fmodel = fm.functional_model(
        model, checkpoint_layers=layers if mode in ("per-layer", "both", "fomaml") else None
    )
    adapted = adapted_names(sc)
    chosen = {k: v for k, v in fmodel.params.items() if any(k.startswith(n + ".") for n in adapted)}
    rates = fm.hyper.per_layer(chosen, sc.lr, parameterization="softplus").to(device)
    outer = torch.optim.AdamW([*model.parameters(), *rates.parameters()], lr=1e-5)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" else None
    return {"model": model, "fmodel": fmodel, "rates": rates, "outer": outer, "scaler": scaler}


def meta_iteration(
    sc: Scenario,
    mode: str,
    parts: dict[str, Any],
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int | None = None,
    autocast: bool = True,
    outer_step: bool = True,
) -> Any:
    """One meta-iteration; returns the meta-gradients (of the model, then of the rates),
    before clipping, as a list."""
    import torch
    import torch.nn.functional as F

    import funcmeta as fm

    model, fmodel, rates = parts["model"], parts["fmodel"], parts["rates"]
    outer, scaler = parts["outer"], parts["scaler"]
    device = next(model.parameters()).device
    cuda = device.type == "cuda"

    def loss_fn(out: Any, y: Any) -> Any:
        return F.cross_entropy(out.logits.float(), y)

    outer.zero_grad(set_to_none=True)
    with torch.autocast(
        device.type, dtype=torch.float16 if cuda else torch.bfloat16, enabled=autocast
    ):
        result = fm.adapt(
            fmodel,
            fmodel.params,
            loss_fn,
            support,
            fm.optim.sgd(lr=rates),
            steps=sc.steps if steps is None else steps,
            trainable=adapted_names(sc),
            first_order=mode == "fomaml",
            checkpoint_steps=mode in ("step", "both"),
            loss_scale=1024.0 if cuda and autocast else None,
        )
        loss = loss_fn(fmodel(result.params, query[0]), query[1])
    inputs = [*model.parameters(), *rates.parameters()]
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(outer)
    else:
        loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in inputs]
    torch.nn.utils.clip_grad_norm_(inputs, sc.clip)
    if outer_step:
        if scaler is not None:
            scaler.step(outer)
            scaler.update()
        else:
            outer.step()
    return grads


def worker(args: argparse.Namespace) -> dict:
    import torch

    device = torch.device(args.device)
    sc = Scenario(**json.loads(args.config))
    parts = setup(sc, args.mode, device)
    support, query = batches(sc, device)
    meta_iteration(sc, args.mode, parts, support, query, steps=1)  # warm-up
    peak, seconds = _common.measure(
        lambda: meta_iteration(sc, args.mode, parts, support, query), device, args.repeats
    )
    params = sum(p.numel() for p in parts["model"].parameters())
    return {"peak": peak, "seconds": seconds, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    import platform

    import torch

    sc = Scenario(batch=args.batch, seq=args.seq, steps=args.steps)
    print(
        f"BERT-base-sized MAML meta-iteration: {json.dumps(asdict(sc))}\ndevice {args.device}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    results = {}
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--device", args.device]
        cmd += ["--repeats", str(args.repeats), "--config", json.dumps(asdict(sc))]
        env = {**os.environ, **_common.MMAP_ENV}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[mode]
        print(f"{mode:>10}: peak {r['peak'] / 2**20:9.1f} MiB, {r['seconds']:7.1f} s", flush=True)
    print(f"parameters: {next(iter(results.values()))['params'] / 1e6:.1f} M")
    print("| setting | peak MiB | / none | seconds | / none |")
    print("| --- | --- | --- | --- | --- |")
    base = results.get("none")
    for mode, r in results.items():
        rel_m = f"{r['peak'] / base['peak']:.2f}" if base else "-"
        rel_t = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
        print(f"| {mode} | {r['peak'] / 2**20:.0f} | {rel_m} | {r['seconds']:.1f} | {rel_t} |")
    if "both" in results and "fomaml" in results:
        ratio = results["both"]["peak"] / results["fomaml"]["peak"]
        print(f"second order with both / first order with per-layer: {ratio:.2f} (target <= 2)")


if __name__ == "__main__":
    main()
