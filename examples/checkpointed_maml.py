"""MAML on a model that checkpoints its own layers, with learnable per-module softplus rates and
mixed precision: the researcher's code of the forum post "Double backward with checkpointed
model and learnable inner loop learning rates", with funcmeta in place of the hand-made
inner loop.

The model is written as the post writes it: its ``forward`` runs each of its 40 modules
(pre-norm residual blocks: a LayerNorm and two linear layers) under
``torch.utils.checkpoint.checkpoint``. funcmeta runs those checkpoints itself, with the
adapted parameters, keeping only each module's input, in second order too (docs/memory.md,
"Bring your checkpointed model"). The inner loop adapts the last modules and the head only,
with one learnable softplus rate per module and clipped inner gradients; the outer loop is
Adam with the scaler's unscale, clipping, step and update.

Precision: fp16 autocast with ``torch.amp.GradScaler`` on CUDA (``loss_scale=scaler``: an
inner overflow makes the meta-iteration a skipped step for the scaler); bf16 autocast on CPU,
which needs no scaler; ``--precision fp16`` runs fp16 with ``GradScaler("cpu")`` on CPU too.

The tasks: 5-way classification of random inputs whose classes come from one hidden linear
map, each task with its own permutation of the class labels (so a task is learnt by adapting
the head, and the features are what meta-training improves). The inputs are not normalised
(standard deviation 5), as raw features often are: the residual stream grows through the
blocks, and at GradScaler's initial scale (65536) the head's fp16 gradients overflow in the
first iterations, until the scaler has backed off.

    python examples/checkpointed_maml.py                      # CPU, width 64: under a minute
    python examples/checkpointed_maml.py --precision fp16     # fp16 + GradScaler("cpu")
    python examples/checkpointed_maml.py --device cuda --width 768 --rows 4096

It prints the meta-training curve, then one meta-iteration's peak memory and time with the
model's own checkpoints and without them (the same model, ``checkpointed=False``), and the
largest difference of their meta-gradients.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import funcmeta as fm

CLASSES = 5


class Block(nn.Module):
    """A pre-norm residual block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MyModel(nn.Module):
    """A stem, ``modules`` residual blocks, each run under
    ``torch.utils.checkpoint.checkpoint`` by the model itself, and a head on the residual
    stream."""

    def __init__(self, inputs: int, width: int, modules: int = 40, checkpointed: bool = True):
        super().__init__()
        self.stem = nn.Linear(inputs, width)
        self.mods = nn.ModuleList([Block(width) for _ in range(modules)])
        self.head = nn.Linear(width, CLASSES)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for m in self.mods:
            x = checkpoint(m, x, use_reentrant=False) if self.checkpointed else m(x)
        return self.head(x)


class Setup(NamedTuple):
    """Everything one meta-iteration needs."""

    model: MyModel
    fmodel: fm.FunctionalModel
    rates: fm.hyper.HyperTree
    trainable: tuple[str, ...]
    outer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    autocast: Any
    device: torch.device


def build(args: argparse.Namespace, checkpointed: bool = True) -> Setup:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = MyModel(args.inputs, args.width, args.modules, checkpointed).to(device)
    fmodel = fm.functional_model(model)
    # the last `adapt` modules and the head, as the post's `list(m.modules())[-40:]` picks
    first = args.modules - args.adapt
    trainable = (*(f"mods.{i}" for i in range(first, args.modules)), "head")
    adapted = {
        k: v
        for k, v in fmodel.params.items()
        if k.split(".")[0] == "head" or ".".join(k.split(".")[:2]) in trainable
    }
    rates = fm.hyper.per_layer(adapted, args.inner_lr, parameterization="softplus").to(device)
    outer = torch.optim.Adam([*model.parameters(), *rates.parameters()], lr=args.outer_lr)
    precision = args.precision or ("fp16" if device.type == "cuda" else "bf16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[precision]
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    autocast = (
        torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    )
    return Setup(model, fmodel, rates, trainable, outer, scaler, autocast, device)


def sample_tasks(
    args: argparse.Namespace, teacher: torch.Tensor, g: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """``(x, y, xq, yq)`` for ``args.tasks`` tasks of ``args.rows`` support and query rows."""
    shape = (args.tasks, args.rows, args.inputs)
    x = torch.randn(*shape, generator=g) * args.input_scale
    xq = torch.randn(*shape, generator=g) * args.input_scale
    perm = torch.stack([torch.randperm(CLASSES, generator=g) for _ in range(args.tasks)])

    def labels(inputs: torch.Tensor) -> torch.Tensor:
        return torch.gather(perm, 1, (inputs @ teacher).argmax(-1))

    dev = args.device
    return x.to(dev), labels(x).to(dev), xq.to(dev), labels(xq).to(dev)


def meta_iteration(
    s: Setup, args: argparse.Namespace, data: tuple[torch.Tensor, ...]
) -> tuple[float, bool]:
    """One outer step on a batch of tasks: ``(query loss, skipped by the scaler)``."""
    x, y, xq, yq = data
    loss_scale = s.scaler if s.scaler is not None else None
    query = 0.0
    overflowed = False
    with s.autocast:
        for t in range(x.shape[0]):
            result = fm.adapt(
                s.fmodel,
                s.fmodel.params,
                F.cross_entropy,
                (x[t], y[t]),
                fm.optim.sgd(lr=s.rates),
                steps=args.steps,
                trainable=s.trainable,
                clip_grad_norm=args.inner_clip,
                loss_scale=loss_scale,
                first_order=args.first_order,
            )
            overflowed |= result.overflowed
            query = query + F.cross_entropy(s.fmodel(result.params, xq[t]), yq[t]) / x.shape[0]
    s.outer.zero_grad(set_to_none=True)
    params = [*s.model.parameters(), *s.rates.parameters()]
    if s.scaler is None:
        query.backward()
        torch.nn.utils.clip_grad_norm_(params, args.outer_clip)
        s.outer.step()
        return float(query.detach()), False
    s.scaler.scale(query).backward()
    s.scaler.unscale_(s.outer)
    torch.nn.utils.clip_grad_norm_(params, args.outer_clip)
    scale = s.scaler.get_scale()
    s.scaler.step(s.outer)  # skipped when the gradients are not finite
    s.scaler.update()  # and then the scale is lowered
    return float(query.detach()), overflowed or s.scaler.get_scale() < scale


def train(args: argparse.Namespace) -> dict[str, list]:
    """Meta-train: the query loss, the scaler's scale and whether each iteration was skipped."""
    s = build(args)
    g = torch.Generator().manual_seed(args.seed + 1)
    teacher = torch.randn(args.inputs, CLASSES, generator=g)
    history: dict[str, list] = {"loss": [], "scale": [], "skipped": []}
    for it in range(args.iterations):
        loss, skipped = meta_iteration(s, args, sample_tasks(args, teacher, g))
        scale = s.scaler.get_scale() if s.scaler is not None else None
        history["loss"].append(loss)
        history["scale"].append(scale)
        history["skipped"].append(skipped)
        if it % max(1, args.iterations // 10) == 0 or it == args.iterations - 1:
            extra = f"  scale {scale:g}{'  (skipped)' if skipped else ''}" if scale else ""
            print(f"iteration {it:4d}  query loss {loss:.4f}{extra}", flush=True)
    return history


# --- memory and time against the unchecked model ---------------------------------------------


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_one(args: argparse.Namespace, checkpointed: bool) -> dict[str, Any]:
    """One warm-up and ``args.repeats`` measured meta-iterations (fp32 weights, the precision
    chosen): the peak memory of the first above its start, the median seconds, and the
    meta-gradient."""
    s = build(args, checkpointed)
    g = torch.Generator().manual_seed(args.seed + 1)
    teacher = torch.randn(args.inputs, CLASSES, generator=g)
    data = sample_tasks(args, teacher, g)
    cuda = s.device.type == "cuda"
    s.outer.param_groups[0]["lr"] = 0.0  # the same parameters every time
    meta_iteration(s, args, data)  # warm-up
    seconds, peak = [], 0
    for r in range(args.repeats):
        if r == 0:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            else:
                base = _rss()
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
        start = time.perf_counter()
        meta_iteration(s, args, data)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if r == 0:
            peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) - base
    grad = torch.cat([p.grad.double().flatten() for p in s.model.parameters()])
    return {"peak": peak, "seconds": statistics.median(seconds), "grad": grad.tolist()}


def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both models, each in a fresh process on CPU (glibc then returns each freed tensor, so
    resident memory follows the live tensors), in this one on CUDA."""
    out = {}
    for name, checkpointed in (("unchecked", False), ("checkpointed", True)):
        if args.device.startswith("cuda"):
            out[name] = measure_one(args, checkpointed)
            continue
        settings = json.dumps({**vars(args), "measure_worker": name})
        cmd = [sys.executable, __file__, "--measure-worker", name, "--settings", settings]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def report(results: dict[str, dict[str, Any]]) -> None:
    plain, ours = results["unchecked"], results["checkpointed"]
    a, b = torch.tensor(plain["grad"]), torch.tensor(ours["grad"])
    print("\none meta-iteration     peak MiB   seconds")
    for name, r in results.items():
        print(f"{name:>20}  {r['peak'] / 2**20:9.1f}  {r['seconds']:8.3f}")
    print(
        f"{'checkpointed / unchecked':>20}  {ours['peak'] / max(plain['peak'], 1):9.2f}  "
        f"{ours['seconds'] / plain['seconds']:8.2f}"
    )
    print(f"meta-gradients: largest relative difference {float((a - b).norm() / a.norm()):.1e}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default=None)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--inputs", type=int, default=32)
    p.add_argument("--modules", type=int, default=40)
    p.add_argument("--adapt", type=int, default=4, help="modules adapted (the last ones)")
    p.add_argument("--rows", type=int, default=512, help="support (and query) rows per task")
    p.add_argument("--input-scale", type=float, default=5.0, help="the inputs' standard deviation")
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--inner-lr", type=float, default=0.1)
    p.add_argument("--outer-lr", type=float, default=1e-3)
    p.add_argument("--inner-clip", type=float, default=10.0)
    p.add_argument("--outer-clip", type=float, default=1.0)
    p.add_argument("--first-order", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-measure", action="store_true", help="skip the memory comparison")
    p.add_argument(
        "--measure-worker", choices=["unchecked", "checkpointed"], help=argparse.SUPPRESS
    )
    p.add_argument("--settings", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.measure_worker:
        settings = argparse.Namespace(**json.loads(args.settings))
        print(json.dumps(measure_one(settings, args.measure_worker == "checkpointed")))
        return
    precision = args.precision or ("fp16" if args.device.startswith("cuda") else "bf16")
    print(
        f"{args.modules} self-checkpointed modules of width {args.width}, the last {args.adapt} "
        f"and the head adapted; {args.tasks} tasks of {args.rows} rows, {args.steps} "
        f"{'first' if args.first_order else 'second'}-order steps; {precision} on {args.device}"
    )
    start = time.perf_counter()
    train(args)
    print(f"meta-training: {time.perf_counter() - start:.1f} s")
    if not args.no_measure:
        report(measure(args))


if __name__ == "__main__":
    main()
