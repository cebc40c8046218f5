"""Peak memory of one second-order MAML meta-iteration against the number of inner steps.

Four settings: no checkpointing, per-layer checkpointing (``functional_model(checkpoint_layers=...)``),
step-level checkpointing (``adapt(checkpoint_steps=True)``) and both. The model is a deep
tanh MLP on a large batch, so activations dominate. The inner loop is SGD with learnable
per-layer softplus rates.

Each point runs in a fresh process, which first runs one warm-up meta-iteration (one inner
step) so that code, kernels and thread pools are loaded. On CPU the figure is then the peak
resident set size during the measured meta-iteration minus the resident size just before it
(the kernel's high-water mark, reset through ``/proc/self/clear_refs``). The workers run
with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves every tensor of 64 KiB or more with
its own mmap and returns it to the system when freed, so RSS follows live tensor memory.
With glibc's default dynamic threshold, freed tensors stay in the heap and RSS
overstates what is live. On CUDA the figure is ``torch.cuda.max_memory_allocated`` minus the
bytes allocated before.

    python benchmarks/memory.py [--device cpu] [--width 512] [--depth 6] [--batch 1024]
        [--steps 1 2 4 8 16] [--plot benchmarks/out/memory.png]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

MODES = ("none", "per-layer", "per-step", "both")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of the resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import funcmeta as fm

    torch.manual_seed(0)
    device = torch.device(args.device)
    layers: list[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(args.width, 1)).to(device)
    per_layer = args.mode in ("per-layer", "both")
    fmodel = fm.functional_model(net, checkpoint_layers="sequential" if per_layer else None)
    lrs = fm.hyper.per_layer(fmodel.params, 1e-3, parameterization="softplus")
    g = torch.Generator().manual_seed(1)
    xs, xq = (torch.randn(args.batch, args.width, generator=g).to(device) for _ in range(2))
    ys, yq = (torch.randn(args.batch, 1, generator=g).to(device) for _ in range(2))
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

    def meta_iteration(steps: int) -> None:
        net.zero_grad(set_to_none=True)
        result = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (xs, ys),
            fm.optim.sgd(lr=lrs),
            steps=steps,
            checkpoint_steps=args.mode in ("per-step", "both"),
        )
        F.mse_loss(fmodel(result.params, xq), yq).backward()

    # A warm-up iteration first: code paths, kernels and thread pools are then in memory
    # and do not count as the meta-iteration's.
    meta_iteration(1)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
        reset_peak_rss()
    start = time.perf_counter()
    meta_iteration(args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss_bytes() - base
    seconds = time.perf_counter() - start
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in net.parameters())))
    return {"peak": peak, "seconds": seconds, "param_bytes": param_bytes, "grad_norm": grad_norm}


def run_point(args: argparse.Namespace, mode: str, steps: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--mode",
        mode,
        "--steps-one",
        str(steps),
        "--device",
        args.device,
        "--width",
        str(args.width),
        "--depth",
        str(args.depth),
        "--batch",
        str(args.batch),
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--plot", default="benchmarks/out/memory.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--steps-one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.steps = args.steps_one
        print(json.dumps(worker(args)))
        return

    import torch

    print(
        f"peak memory of one second-order meta-iteration (MiB above the start); device "
        f"{args.device}, torch {torch.__version__}; {args.depth}x{args.width} tanh MLP, "
        f"batch {args.batch}, fp32, SGD with learnable per-layer rates"
    )
    results: dict[str, dict[int, dict]] = {m: {} for m in MODES}
    for steps in args.steps:
        for mode in MODES:
            results[mode][steps] = run_point(args, mode, steps)
    param_bytes = results["none"][args.steps[0]]["param_bytes"]
    print(f"parameters: {param_bytes / 2**20:.1f} MiB")
    print(f"{'steps':>5} " + " ".join(f"{m:>10}" for m in MODES) + "   per-step/none")
    for steps in args.steps:
        row = [results[m][steps]["peak"] for m in MODES]
        print(
            f"{steps:>5} " + " ".join(f"{mib(v):>10}" for v in row) + f"   {row[2] / row[0]:8.2f}"
        )
    print("seconds per meta-iteration")
    for steps in args.steps:
        print(f"{steps:>5} " + " ".join(f"{results[m][steps]['seconds']:10.2f}" for m in MODES))
    norms = {m: results[m][args.steps[-1]]["grad_norm"] for m in MODES}
    spread = max(norms.values()) - min(norms.values())
    print(f"meta-gradient norm at {args.steps[-1]} steps, spread across settings: {spread:.2e}")
    s = args.steps
    growth = [
        (results["per-step"][b]["peak"] - results["per-step"][a]["peak"]) / (b - a)
        for a, b in itertools.pairwise(s)
    ]
    print(
        "per-step growth with step-level checkpointing (MiB per extra step): "
        + ", ".join(f"{g / 2**20:.1f}" for g in growth)
        + f"; bound 2 x (parameters + state) = {2 * param_bytes / 2**20:.1f}"
    )
    if 8 in s:
        ratio = results["per-step"][8]["peak"] / results["none"][8]["peak"]
        print(f"at 8 steps, step-level / unchecked = {ratio:.2f} (target <= 0.35)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[bench])")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in MODES:
        ax.plot(s, [results[m][k]["peak"] / 2**20 for k in s], marker="o", label=m)
    ax.set_xlabel("inner steps (second order)")
    ax.set_ylabel("peak memory above start (MiB)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(s, [str(k) for k in s])
    ax.set_title(f"{args.depth}x{args.width} tanh MLP, batch {args.batch}, {args.device}")
    ax.legend()
    ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
