"""MAML on a model that checkpoints its own layers, with learnable per-module softplus rates and
mixed precision: the researcher's code of the forum post "Double backward with checkpointed
model and learnable inner loop learning rates", with funcmeta in place of the hand-made
inner loop.

The model is written as the post writes it: its ``forward`` runs each of its 40 modules
(pre-norm residual blocks: a LayerNorm and two linear layers) under
``torch.utils.checkpoint.checkpoint``. funcmeta runs those checkpoints itself, with the
adapted parameters, keeping only each module's input, in second order too (docs/memory.md,
"Bring your checkpointed model"). The inner loop adapts the last modules, the final
LayerNorm and the head only, with one learnable softplus rate per layer and clipped inner
gradients; the outer loop is Adam with the scaler's unscale, clipping, step and update.

Precision (``--precision auto``, ``fm.choose_autocast``; the choice and its reason are printed):
fp16 autocast with ``torch.amp.GradScaler`` on CUDA (``loss_scale=scaler``: an inner overflow
makes the meta-iteration a skipped step for the scaler); bf16 autocast, which needs no scaler,
on a CPU that computes bf16 natively (AVX-512 BF16, AMX, Arm BF16); float32 on any other CPU,
where bf16 is emulated (a 768-wide bf16 product ran 50 to 110 times slower than float32 on
AVX2 CPUs). ``--precision fp16`` runs fp16 with ``GradScaler("cpu")`` on CPU too, and
``--precision bf16`` / ``fp32`` force either.

The tasks: 5-way classification of random inputs whose classes come from one hidden linear
map, each task with its own permutation of the class labels (so a task is learnt by adapting
the head, and the features are what meta-training improves). The inputs are not normalised
(standard deviation 5), as raw features often are, and the residual stream grows from them
through the blocks.

Width. Two things keep the same defaults learning at width 768 as at 64:

- the head reads the stream through a final LayerNorm, as GPT-2's does (its ``ln_f``), and
  each block's last layer starts at GPT-2's standard deviation ``0.02 / sqrt(2 * modules)``:
  the logits' scale no longer follows the stream's;
- both rates are given for width 64 (``--base-width``) and scaled by 64 / width: an SGD step
  moves a layer's outputs about fan-in times as far as the weights it moves, and Adam moves
  every weight by about its rate whatever the gradient. At width 768 the defaults become
  0.042 (the inner rates' start) and 8.3e-5 (Adam).

Without them (the head on the raw stream, an inner rate of 0.1 and Adam at 1e-3 whatever the
width), at width 768 in fp32 with 64 rows the stream's root mean square at the head went 3.1,
4.4, 6.1, 8.8 over the first three outer steps, the logits' standard deviation 1.8, 16, 28,
49, and the query loss 4.27 -> 112 over 10 iterations (on an H200 in fp16 with 4096 rows:
0.19 -> 100.5, 7 of the 10 skipped by the scaler). Now the head's fp16 gradients stay in range
at GradScaler's initial scale (65536): on a CPU no iteration was skipped at width 64 (30
iterations, 512 rows) nor at 768 (2 blocks, 16 rows, 5 iterations); ``--init-scale 16777216``
shows the scaler backing off from too high a scale.

The verdict. The run passes when the mean query loss of the last ``--window`` (3) kept
iterations (not skipped by the scaler, finite) is at least ``--min-fall`` (5%) below that of
the first ``--window``, and the scaler skipped at most ``--max-skipped`` (2) iterations;
``--max-memory-ratio`` and ``--max-time-ratio`` add targets for the checkpointed model's peak
memory and time over the unchecked model's (a ``PASS``/``FAIL`` line each). The last line
is ``RESULT PASS: ...`` or ``RESULT FAIL (the reasons): ...`` with the query loss (first ->
last window), the skipped count and the two ratios; the exit status is 0 or 1.

After the meta-training curve (every tenth iteration) it prints one meta-iteration's peak
memory and time with the model's own checkpoints and without them (the same model,
``checkpointed=False``), the largest difference of their meta-gradients, and the ``RESULT``
line. Measured on this project's 2-core AMD EPYC, which has AVX-512 BF16, idle and with one
other single-threaded job running (2026-11-28), wall time with CPU time in brackets:

    python examples/checkpointed_maml.py
        # width 64, bf16: query loss 0.93 -> 0.15 over 30 iterations (RESULT: 0.872 -> 0.155),
        # memory 0.32x the unchecked model's, time 1.93x, RESULT PASS; idle 55 s (92 s), with
        # the other job 56 s (51 s) on the one thread --threads then takes, 208 s (251 s) on
        # two: a thread on the other job's core makes every parallel region wait for it;
        # measured again later that day, idle: 62 to 70 s (103 to 117 s) on two threads in
        # four runs, 56 and 67 s (52 and 62 s) on one
    python examples/checkpointed_maml.py --width 768 --rows 64 --iterations 10 --no-measure
        # the GPU's width, few rows: 1.20 -> 0.78 (RESULT: 1.134 -> 0.920), RESULT PASS; in
        # bf16 35 s (64 s); on a CPU without bf16 instructions (torch capped to AVX2 with
        # ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), where auto runs float32: idle
        # 50 s (93 s), with the other job 80 s (77 s) on one thread, 184 s (231 s) on two;
        # measured again later that day, idle: 63 s (117 s) on two threads, 74 s (72 s) on one
    python examples/checkpointed_maml.py --precision fp16
        # fp16 + GradScaler("cpu"): 0.93 -> 0.15 (RESULT: 0.869 -> 0.155), none of the 30
        # skipped, memory 0.27x, RESULT PASS; 1523 s (1044 s) on the same machine loaded by
        # several other jobs (load average about 5, 2026-11-26): CPU fp16 products are slow
    python examples/checkpointed_maml.py --device cuda --width 768 --rows 4096 --iterations 10 \
        --repeats 3 --max-memory-ratio 0.4 --max-time-ratio 2.5
        # the GPU check (fp16 + GradScaler): the same lines, a PASS or FAIL line for each
        # ratio against its target, and RESULT; it needs CUDA, so it has no CPU time
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from _threads import add_threads_option, idle_cores, use_threads
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
    ``torch.utils.checkpoint.checkpoint`` by the model itself, a final LayerNorm and a head.

    As GPT-2 does, the head reads the residual stream through a LayerNorm (its ``ln_f``), so
    the logits' scale does not follow the stream's, which grows with the inputs' scale and
    through the blocks; and each block's last layer starts at the standard deviation
    ``0.02 / sqrt(2 * modules)``, so the 40 blocks start near the identity."""

    def __init__(
        self, inputs: int, width: int, modules: int = 40, checkpointed: bool = True
    ) -> None:
        super().__init__()
        self.stem = nn.Linear(inputs, width)
        self.mods = nn.ModuleList([Block(width) for _ in range(modules)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)
        self.checkpointed = checkpointed
        for m in self.mods:
            nn.init.normal_(m.fc2.weight, std=0.02 / (2 * modules) ** 0.5)
            nn.init.zeros_(m.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for m in self.mods:
            x = checkpoint(m, x, use_reentrant=False) if self.checkpointed else m(x)
        return self.head(self.norm(x))


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


def precision_of(args: argparse.Namespace) -> fm.AutocastChoice:
    """``--precision``, with ``auto`` (or ``None``) as ``fm.choose_autocast`` picks it: fp16 on
    CUDA, bf16 on a CPU that computes it natively, fp32 on any other CPU."""
    return fm.choose_autocast(args.device, args.precision or "auto")


def build(args: argparse.Namespace, checkpointed: bool = True) -> Setup:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = MyModel(args.inputs, args.width, args.modules, checkpointed).to(device)
    fmodel = fm.functional_model(model)
    # the last `adapt` modules, the final norm and the head, as the post's
    # `list(m.modules())[-40:]` picks the last modules
    first = args.modules - args.adapt
    trainable = (*(f"mods.{i}" for i in range(first, args.modules)), "norm", "head")
    adapted = {
        k: v
        for k, v in fmodel.params.items()
        if k.split(".")[0] in ("norm", "head") or ".".join(k.split(".")[:2]) in trainable
    }
    # a step of either optimizer moves a layer's outputs about fan-in times as far: the rates
    # are given for a width of `base_width` and scaled by base_width / width
    scale = args.base_width / args.width
    inner_lr = args.inner_lr * scale
    rates = fm.hyper.per_layer(adapted, inner_lr, parameterization="softplus").to(device)
    outer_lr = args.outer_lr * scale
    outer = torch.optim.Adam([*model.parameters(), *rates.parameters()], lr=outer_lr)
    precision = precision_of(args)
    scaler = (
        torch.amp.GradScaler(device.type, init_scale=args.init_scale) if precision.scaler else None
    )
    autocast = precision.autocast(device)
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


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The checkpointed model's peak memory and time over the unchecked model's, and the
    relative difference of their meta-gradients."""
    plain, ours = results["unchecked"], results["checkpointed"]
    a, b = torch.tensor(plain["grad"]), torch.tensor(ours["grad"])
    return {
        "memory": ours["peak"] / max(plain["peak"], 1),
        "time": ours["seconds"] / plain["seconds"],
        "grad_difference": float((a - b).norm() / a.norm()),
    }


def report(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Print the comparison; return :func:`ratios`."""
    r = ratios(results)
    print("\none meta-iteration     peak MiB   seconds")
    for name, res in results.items():
        print(f"{name:>20}  {res['peak'] / 2**20:9.1f}  {res['seconds']:8.3f}")
    print(f"{'checkpointed / unchecked':>20}  {r['memory']:9.2f}  {r['time']:8.2f}")
    print(f"meta-gradients: largest relative difference {r['grad_difference']:.1e}")
    return r


# --- the verdict ------------------------------------------------------------------------------


def judge(history: dict[str, list], args: argparse.Namespace) -> dict[str, Any]:
    """Whether meta-training learnt: the mean query loss of the first ``args.window``
    iterations against that of the last ``args.window``, over the iterations that the scaler
    did not skip and whose loss is finite (``window`` shrinks to half of them when there are
    fewer than twice as many); it must fall by at least ``args.min_fall`` of the first, and at
    most ``args.max_skipped`` iterations may be skipped. ``failures`` says what went wrong."""
    kept = [
        loss
        for loss, skipped in zip(history["loss"], history["skipped"], strict=True)
        if not skipped and math.isfinite(loss)
    ]
    skipped = sum(history["skipped"])
    window = min(args.window, len(kept) // 2)
    failures = []
    first = last = math.nan
    if window < 1:
        failures.append(f"{len(kept)} kept iterations, too few to judge: 2 at least")
    else:
        first = statistics.fmean(kept[:window])
        last = statistics.fmean(kept[-window:])
        if not last <= (1 - args.min_fall) * first:
            failures.append(f"the query loss did not fall by {args.min_fall:.0%}")
    if skipped > args.max_skipped:
        failures.append(
            f"{skipped} of {len(history['loss'])} iterations skipped by the scaler, more than "
            f"{args.max_skipped}"
        )
    return {
        "first": first,
        "last": last,
        "window": window,
        "skipped": skipped,
        "iterations": len(history["loss"]),
        "failures": failures,
    }


def against(ratio: float, target: float | None) -> str:
    """``0.23x``, or with a target ``0.23x <= 0.4x`` / ``2.69x > 2.5x``."""
    if target is None:
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x {'<=' if ratio <= target else '>'} {target:g}x"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu or cuda")
    p.add_argument(
        "--precision",
        choices=["auto", "fp16", "bf16", "fp32"],
        default="auto",
        help="autocast precision (auto: fp16 on CUDA; bf16 on a CPU with native bf16, "
        "AVX-512 BF16, AMX or Arm BF16; fp32 on other CPUs, where bf16 is emulated and slow; "
        "the choice and its reason are printed); fp16 runs with a "
        "GradScaler on either device",
    )
    p.add_argument(
        "--init-scale",
        type=float,
        default=2.0**16,
        help="GradScaler's initial scale (fp16 only; torch's default)",
    )
    add_threads_option(
        p,
        idle_cores(),
        "the cores the load average leaves idle: the blocks' products gain from more threads, "
        "and a thread on a core another job holds makes every parallel region wait for it (the "
        "768-wide run took 184 s with 2 threads beside another job, 80 s with 1)",
    )
    p.add_argument("--width", type=int, default=64, help="the residual stream's width")
    p.add_argument("--inputs", type=int, default=32, help="input features")
    p.add_argument("--modules", type=int, default=40, help="residual blocks, each checkpointed")
    p.add_argument("--adapt", type=int, default=4, help="blocks adapted (the last ones)")
    p.add_argument("--rows", type=int, default=512, help="support (and query) rows per task")
    p.add_argument("--input-scale", type=float, default=5.0, help="the inputs' standard deviation")
    p.add_argument("--tasks", type=int, default=2, help="tasks per meta-iteration")
    p.add_argument("--steps", type=int, default=5, help="inner steps")
    p.add_argument("--iterations", type=int, default=30, help="meta-iterations")
    p.add_argument(
        "--inner-lr",
        type=float,
        default=0.5,
        help="the softplus rates' initial value at --base-width (scaled by base width / width)",
    )
    p.add_argument(
        "--outer-lr",
        type=float,
        default=1e-3,
        help="Adam's rate at --base-width (scaled by base width / width)",
    )
    p.add_argument(
        "--base-width",
        type=int,
        default=64,
        help="the width the two rates are given for: at width W both are multiplied by "
        "base width / W (give W itself to use them as they are)",
    )
    p.add_argument("--inner-clip", type=float, default=10.0, help="inner gradient-norm clip")
    p.add_argument("--outer-clip", type=float, default=1.0, help="outer gradient-norm clip")
    p.add_argument("--first-order", action="store_true", help="first-order MAML")
    p.add_argument(
        "--repeats", type=int, default=3, help="measured meta-iterations per model (median time)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--no-measure", action="store_true", help="skip the memory comparison")
    p.add_argument(
        "--window",
        type=int,
        default=3,
        help="iterations averaged at each end of the run to judge whether the query loss fell",
    )
    p.add_argument(
        "--min-fall",
        type=float,
        default=0.05,
        help="the least fall of the mean query loss, as a fraction of the first window's",
    )
    p.add_argument(
        "--max-skipped",
        type=int,
        default=2,
        help="the most meta-iterations the scaler may skip",
    )
    p.add_argument(
        "--max-memory-ratio",
        type=float,
        default=None,
        help="target for the checkpointed over the unchecked peak memory, FAIL above it "
        "(None: no target)",
    )
    p.add_argument(
        "--max-time-ratio",
        type=float,
        default=None,
        help="target for the checkpointed over the unchecked meta-iteration time, FAIL above "
        "it (None: no target)",
    )
    p.add_argument(
        "--measure-worker", choices=["unchecked", "checkpointed"], help=argparse.SUPPRESS
    )
    p.add_argument("--settings", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Meta-train, judge, measure; the exit status: 0 when everything passed, 1 otherwise."""
    p = parser()
    args = p.parse_args(argv)
    if args.measure_worker:
        settings = argparse.Namespace(**json.loads(args.settings))
        use_threads(settings)  # the parent's choice, not this process's own reading
        print(json.dumps(measure_one(settings, args.measure_worker == "checkpointed")))
        return 0
    use_threads(args)
    targets = args.max_memory_ratio is not None or args.max_time_ratio is not None
    if args.no_measure and targets:
        p.error("--max-memory-ratio and --max-time-ratio need the measurement (no --no-measure)")
    precision = precision_of(args)
    scale = args.base_width / args.width
    print(
        f"{args.modules} self-checkpointed modules of width {args.width}, the last {args.adapt}, "
        f"the final norm and the head adapted; {args.tasks} tasks of {args.rows} rows, "
        f"{args.steps} {'first' if args.first_order else 'second'}-order steps; {precision.name} on "
        f"{args.device}; inner rates from {args.inner_lr * scale:.3g}, Adam "
        f"{args.outer_lr * scale:.3g}"
    )
    print(f"precision: {precision.name} ({precision.reason}); {args.threads} thread(s)")
    start = time.perf_counter()
    history = train(args)
    print(f"meta-training: {time.perf_counter() - start:.1f} s")
    verdict = judge(history, args)
    failures = list(verdict["failures"])
    numbers = [
        f"query loss {verdict['first']:.3f} -> {verdict['last']:.3f} "
        f"(means of the first and last {verdict['window']} kept iterations)",
        f"skipped {verdict['skipped']} of {verdict['iterations']}",
    ]
    if not args.no_measure:
        r = report(measure(args))
        for name, target in (("memory", args.max_memory_ratio), ("time", args.max_time_ratio)):
            if target is not None:
                ok = r[name] <= target
                print(
                    f"{'PASS' if ok else 'FAIL'} {name}: checkpointed / unchecked {against(r[name], target)}"
                )
                if not ok:
                    failures.append(f"the {name} ratio is above its target")
            numbers.append(f"{name} {against(r[name], target)}")
    if failures:
        print(f"RESULT FAIL ({'; '.join(failures)}): {'; '.join(numbers)}")
        return 1
    print(f"RESULT PASS: {'; '.join(numbers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
