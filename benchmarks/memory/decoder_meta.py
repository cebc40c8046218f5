"""MAML on the LoRA adapters of a Llama-style decoder of about 100 M parameters, in bf16: peak
memory and time by checkpointing, and the task batch against the loop.

The scenario: a HuggingFace ``LlamaForCausalLM`` built from a config (hidden 640, 10 layers,
10 heads, intermediate 1728, vocabulary 32000: 91 M parameters; random init, nothing
downloaded) in bf16, as ``from_pretrained(..., dtype=torch.bfloat16)`` gives it (rotary
frequencies in float32); peft LoRA adapters (rank 16, float32) on the attention's query and
value projections, the only parameters adapted and meta-trained; learnable per-layer
softplus inner rates; 5 SGD steps of next-token loss on 4 sequences of 128 tokens per task;
bf16 autocast.

Settings, one task (``fm.adapt``), second order unless said:

- ``none``;
- ``per-layer``: ``functional_model(checkpoint_layers=...)`` on the decoder layers;
- ``model's own``: the model's ``gradient_checkpointing_enable()``, which funcmeta runs;
- ``step``: ``checkpoint_steps=True``;
- ``first order``: ``first_order=True``, per-layer checkpointing.

Then the task batch against the loop (``fm.adapt_tasks`` against ``fm.adapt`` per task, both
with per-layer checkpointing) at T = 4 and 16, time only. Each point runs in a fresh process
after a warm-up meta-iteration (one step); memory as in ``benchmarks/memory/memory.py`` (peak RSS
above the start on CPU with glibc's mmap threshold fixed; peak allocated bytes on CUDA).

    python benchmarks/memory/decoder_meta.py [--device cpu] [--steps 5] [--tasks 4 16] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

MODES = ("none", "per-layer", "model's own", "step", "first order")


def build(small: bool, device: Any, gradient_checkpointing: bool = False) -> Any:
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    size = (
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 512,
        }
        if small
        else {
            "hidden_size": 640,
            "num_hidden_layers": 10,
            "num_attention_heads": 10,
            "intermediate_size": 1728,
            "vocab_size": 32000,
        }
    )
    config = transformers.LlamaConfig(
        **size,
        num_key_value_heads=size["num_attention_heads"],
        max_position_embeddings=256,
        use_cache=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            base = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        if gradient_checkpointing:
            base.gradient_checkpointing_enable()
        lora = peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
        model = peft.get_peft_model(base, lora)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    return model.to(device).train()


def loss_fn(out: Any, ids: Any) -> Any:
    import torch.nn.functional as F

    logits = out.logits[..., :-1, :].flatten(0, -2).float()
    return F.cross_entropy(logits, ids[..., 1:].flatten())


def worker(args: argparse.Namespace) -> dict:

    import torch

    import funcmeta as fm

    device = torch.device(args.device)
    model = build(args.small, device, gradient_checkpointing=args.mode == "model's own")
    layers = [n for n, _ in model.named_modules() if n.endswith("layers") and n.count(".") <= 3]
    per_layer = args.mode in ("per-layer", "first order") or args.tasks_one
    names = None
    if per_layer:
        root = model.get_submodule(layers[0])
        names = [f"{layers[0]}.{c}" for c, _ in root.named_children()]
    fmodel = fm.functional_model(model, checkpoint_layers=names)
    adapters = {k: v for k, v in fmodel.params.items() if v.requires_grad}
    rates = fm.hyper.per_layer(adapters, 1e-3, parameterization="softplus").to(device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    tasks = args.tasks_one or 1
    ids = torch.randint(0, vocab, (tasks, 4, args.length), generator=g).to(device)
    query = torch.randint(0, vocab, (tasks, 4, args.length), generator=g).to(device)
    options = {
        "first_order": args.mode == "first order",
        "checkpoint_steps": args.mode == "step",
    }
    dtype = torch.bfloat16

    def meta_iteration(steps: int) -> None:
        for t in (adapters.values(), rates.parameters()):
            for p in t:
                p.grad = None
        with torch.autocast(device.type, dtype=dtype):
            if args.tasks_one and args.batched:
                r = fm.adapt_tasks(
                    fmodel,
                    fmodel.params,
                    loss_fn,
                    ({"input_ids": ids}, ids),
                    fm.optim.sgd(lr=rates),
                    steps=steps,
                    task_chunk=None,
                    **options,
                )
                loss = fm.task_losses(
                    fmodel, r.params, loss_fn, ({"input_ids": query}, query), task_chunk=r.chunk
                )[0].mean()
            else:
                loss = 0
                for t in range(tasks):
                    r = fm.adapt(
                        fmodel,
                        fmodel.params,
                        loss_fn,
                        ({"input_ids": ids[t]}, ids[t]),
                        fm.optim.sgd(lr=rates),
                        steps=steps,
                        **options,
                    )
                    loss = loss + loss_fn(fmodel(r.params, input_ids=query[t]), query[t]) / tasks
        loss.backward()

    meta_iteration(1)  # warm-up
    peak, seconds = _common.measure(lambda: meta_iteration(args.steps), device, args.repeats)
    grad = torch.cat([p.grad.double().flatten() for p in adapters.values()])
    return {
        "peak": peak,
        "seconds": seconds,
        "grad_norm": float(grad.norm()),
        "params": sum(p.numel() for p in model.parameters()),
        "adapters": sum(p.numel() for p in adapters.values()),
    }


def run_point(args: argparse.Namespace, mode: str, tasks: int = 0, batched: bool = False) -> dict:
    cmd = (
        [
            sys.executable,
            __file__,
            "--worker",
            "--mode",
            mode,
            "--device",
            args.device,
            "--steps",
            str(args.steps),
            "--repeats",
            str(args.repeats),
            "--length",
            str(args.length),
            "--tasks-one",
            str(tasks),
        ]
        + (["--batched"] if batched else [])
        + (["--small"] if args.small else [])
    )
    env = {**os.environ, **_common.MMAP_ENV}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--tasks", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--small", action="store_true", help="a tiny decoder (tests)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--tasks-one", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batched", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    import platform

    import torch

    print(
        f"LoRA MAML on a bf16 Llama decoder; device {args.device}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs; {args.steps} steps, "
        f"4 sequences of {args.length} tokens per task"
    )
    results = {m: run_point(args, m) for m in MODES}
    first = results["none"]
    print(f"parameters {first['params'] / 1e6:.1f} M, adapters {first['adapters'] / 1e6:.2f} M")
    print("| setting | peak MiB | / none | seconds | / none | meta-gradient norm |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m, r in results.items():
        print(
            f"| {m} | {r['peak'] / 2**20:.0f} | {r['peak'] / first['peak']:.2f} | "
            f"{r['seconds']:.2f} | {r['seconds'] / first['seconds']:.2f} | "
            f"{r['grad_norm']:.6e} |",
            flush=True,
        )
    if args.tasks:
        print("| tasks | loop s | batched s | loop / batched |")
        print("| --- | --- | --- | --- |")
        for t in args.tasks:
            loop = run_point(args, "per-layer", t, batched=False)
            batched = run_point(args, "per-layer", t, batched=True)
            print(
                f"| {t} | {loop['seconds']:.2f} | {batched['seconds']:.2f} | "
                f"{loop['seconds'] / batched['seconds']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
