"""Peak memory and time of one MAML meta-iteration, by checkpointing setting and workload.

Settings: ``none``; ``per-layer`` (``functional_model(checkpoint_layers="sequential")``);
``self`` (the same layers checkpointed by the model's own ``forward`` with
``torch.utils.checkpoint.checkpoint``, which funcmeta recomputes itself); ``step`` (``adapt(checkpoint_steps=True)``); ``both``; and ``fomaml``: a first-order
iteration with per-layer checkpointing, the floor that second order is compared with.

Workloads (SGD inner loop with learnable per-layer softplus rates, fp32):

- ``residual``: residual MLP blocks (LayerNorm, Linear to 4x width, GELU, Linear back), the
  layer of a transformer's feed-forward half. Default 8 blocks of width 256, batch 2048.
- ``encoder``: a pre-norm transformer encoder (``nn.TransformerEncoderLayer``, 4 heads,
  feed-forward 4x), hidden 256, sequence 128, batch 8, 4 layers. Second-order steps run on the
  math attention kernel (the only one with a double backward).
- ``tanh``: a deep tanh MLP (Linear + Tanh per layer), default 6x512, batch 1024: layers
  with almost nothing inside them, where per-layer checkpointing has nothing to save.

Each point runs in a fresh process, which first runs one warm-up meta-iteration (one inner
step) so that code, kernels and thread pools are loaded. On CPU the figure is then the peak
resident set size during the measured meta-iteration minus the resident size just before it
(the kernel's high-water mark, reset through ``/proc/self/clear_refs``). The workers run
with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves every tensor of 64 KiB or more with
its own mmap and returns it to the system when freed, so RSS follows live tensor memory.
On CUDA the figure is ``torch.cuda.max_memory_allocated`` minus the bytes allocated before.
Time is the median over ``--repeats`` meta-iterations in the same process (the first of them
is the one whose peak is taken).

    python benchmarks/memory/memory.py [--workloads residual encoder tanh] [--device cpu]
        [--steps 1 3 8] [--repeats 3] [--plot docs/img/memory_cpu.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

MODES = ("none", "per-layer", "self", "step", "both", "fomaml")
WORKLOADS = {
    "residual": {"width": 256, "depth": 8, "batch": 2048, "steps": [1, 3, 8]},
    "encoder": {"width": 256, "depth": 4, "batch": 8, "seq": 128, "steps": [1, 3]},
    "tanh": {"width": 512, "depth": 6, "batch": 1024, "steps": [1, 3, 8]},
}


def build(workload: str, cfg: dict[str, int]) -> tuple[Any, Any, Any]:
    """The network, a support and a query batch of ``workload``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    width, depth, batch = cfg["width"], cfg["depth"], cfg["batch"]

    class ResidualBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if workload == "residual":
        net = nn.Sequential(*[ResidualBlock() for _ in range(depth)], nn.Linear(width, 1))
        shape = (batch, width)
    elif workload == "encoder":
        layers = [
            nn.TransformerEncoderLayer(
                width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(depth)
        ]
        net = nn.Sequential(*layers, nn.Linear(width, 1))
        shape = (batch, cfg["seq"], width)
    else:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        net = nn.Sequential(*layers, nn.Linear(width, 1))
        shape = (batch, width)
    support = (torch.randn(*shape, generator=g), torch.randn(*shape[:-1], 1, generator=g))
    query = (torch.randn(*shape, generator=g), torch.randn(*shape[:-1], 1, generator=g))
    return net, support, query


def SelfCheckpointing(net: Any) -> Any:
    """``net`` (an ``nn.Sequential``) with a forward that checkpoints each child holding
    parameters itself, as a model written for ``torch.utils.checkpoint`` does."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class _SelfCheckpointing(nn.Module):
        def __init__(self, seq: nn.Sequential) -> None:
            super().__init__()
            self.seq = seq

        def forward(self, x: Any) -> Any:
            for layer in self.seq:
                has_params = any(True for _ in layer.parameters())
                x = checkpoint(layer, x, use_reentrant=False) if has_params else layer(x)
            return x

    return _SelfCheckpointing(net)


def worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import funcmeta as fm

    device = torch.device(args.device)
    cfg = json.loads(args.config)
    net, support, query = build(args.workload, cfg)
    net = net.to(device)
    (xs, ys), (xq, yq) = ((a.to(device), b.to(device)) for a, b in (support, query))
    per_layer = args.mode in ("per-layer", "both", "fomaml")
    if args.mode == "self":
        net = SelfCheckpointing(net)
    fmodel = fm.functional_model(net, checkpoint_layers="sequential" if per_layer else None)
    lrs = fm.hyper.per_layer(fmodel.params, 1e-3, parameterization="softplus").to(device)
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

    def meta_iteration(steps: int) -> None:
        net.zero_grad(set_to_none=True)
        lrs.zero_grad(set_to_none=True)
        result = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (xs, ys),
            fm.optim.sgd(lr=lrs),
            steps=steps,
            first_order=args.mode == "fomaml",
            checkpoint_steps=args.mode in ("step", "both"),
        )
        F.mse_loss(fmodel(result.params, xq), yq).backward()

    meta_iteration(1)  # warm-up: code paths, kernels and thread pools
    peak, seconds = _common.measure(lambda: meta_iteration(args.steps_one), device, args.repeats)
    grads = [p.grad for p in net.parameters()]
    grad_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    return {
        "peak": peak,
        "seconds": seconds,
        "param_bytes": param_bytes,
        "grad_norm": grad_norm,
    }


def run_point(args: argparse.Namespace, workload: str, mode: str, steps: int) -> dict:
    cfg = {k: v for k, v in WORKLOADS[workload].items() if k != "steps"}
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--workload",
        workload,
        "--mode",
        mode,
        "--steps-one",
        str(steps),
        "--device",
        args.device,
        "--repeats",
        str(args.repeats),
        "--config",
        json.dumps(cfg),
    ]
    env = {**os.environ, **_common.MMAP_ENV}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(workload: str, results: dict[str, dict[int, dict]], steps: list[int]) -> None:
    cfg = WORKLOADS[workload]
    shape = ", ".join(f"{k} {v}" for k, v in cfg.items() if k != "steps")
    param = results["none"][steps[0]]["param_bytes"]
    print(f"\n## {workload} ({shape}; parameters {mib(param)} MiB)")
    print("MiB above the start of the meta-iteration (second order unless fomaml)")
    print(
        "| inner steps | "
        + " | ".join(MODES)
        + " | per-layer / none | self / per-layer | both / none |"
    )
    print("| --- " * (len(MODES) + 4) + "|")
    for k in steps:
        peak = {m: results[m][k]["peak"] for m in MODES}
        print(
            f"| {k} | "
            + " | ".join(mib(peak[m]) for m in MODES)
            + f" | {peak['per-layer'] / peak['none']:.2f} | {peak['self'] / peak['per-layer']:.2f}"
            + f" | {peak['both'] / peak['none']:.2f} |"
        )
    print("seconds per meta-iteration (median)")
    print("| inner steps | " + " | ".join(MODES) + " | per-layer / none |")
    print("| --- " * (len(MODES) + 2) + "|")
    for k in steps:
        row = [results[m][k]["seconds"] for m in MODES]
        print(f"| {k} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {row[1] / row[0]:.2f} |")
    k = steps[-1]
    norms = [results[m][k]["grad_norm"] for m in MODES if m != "fomaml"]
    print(
        f"meta-gradient norm at {k} steps: {norms[0]:.6e}; largest relative spread across "
        f"second-order settings {(max(norms) - min(norms)) / norms[0]:.1e}"
    )


def plot(path: str, workloads: list[str], all_results: dict, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[bench])")
        return
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.8))
    axes = [axes] if len(workloads) == 1 else list(axes)
    for ax, w in zip(axes, workloads, strict=True):
        results, steps = all_results[w]
        for m in MODES:
            ax.plot(steps, [results[m][k]["peak"] / 2**20 for k in steps], marker="o", label=m)
        ax.set_xlabel("inner steps")
        ax.set_ylabel("peak MiB above start")
        ax.set_xticks(steps, [str(k) for k in steps])
        ax.set_title(f"{w} ({device})")
        ax.grid(alpha=0.3)
    axes[0].legend()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="all workloads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", default="benchmarks/out/memory.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--steps-one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    import platform

    import torch

    print(
        f"peak memory and time of one MAML meta-iteration; device {args.device}, torch "
        f"{torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
        "fp32, SGD with learnable per-layer softplus rates"
    )
    all_results = {}
    for w in args.workloads:
        steps = args.steps or WORKLOADS[w]["steps"]
        results: dict[str, dict[int, dict]] = {m: {} for m in MODES}
        for k in steps:
            for m in MODES:
                results[m][k] = run_point(args, w, m, k)
        report(w, results, steps)
        all_results[w] = (results, steps)
    plot(args.plot, args.workloads, all_results, args.device)


if __name__ == "__main__":
    main()
