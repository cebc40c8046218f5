"""Sinusoid regression: MAML against Meta-SGD at 5, 10 and 20 shots, one inner step.

The setting of Finn et al. (2017) and Li et al. (2017): a 1-40-40-1 ReLU network, tasks
``y = A sin(x - phase)`` with A ~ U[0.1, 5], phase ~ U[0, pi], x ~ U[-5, 5]. MAML's inner
step is SGD with learning rate 0.01. Meta-SGD learns one rate per parameter element,
initialised from U[0.005, 0.1]. Both are meta-trained with second-order meta-gradients and
Adam (1e-3). They are evaluated on the same held-out tasks (K-shot support, 100 query
points): the query MSE before and after one inner step, mean and 95% interval.

    python examples/sinusoid.py --iterations 4000     # the run of `make demo`
    python examples/sinusoid.py                       # full length, 20000 iterations

The run of ``make demo`` (4000 iterations for each of the six method and shot settings,
with ``--plot examples/out/sinusoid_demo.png``) runs on one thread. From a fresh clone on this
project's 2-core AMD EPYC (2026-11-28), the script took 73 s on the idle machine and 79 s
with another single-threaded job running; ``make demo`` in all (its installs included) took
83 s and 90 s. Measured again later that day: the script 82 s idle, 90 and 114 s beside the
other job (two runs); ``make demo`` 94 s, and 103 and 126 s. On 2 cores loaded by several other jobs (load average about 5, 2026-11-26) it
took 214 s, the process getting half a core. The time grows with the iterations: the full
length, for the comparison with the published 10-shot figures, runs five times as many and
takes about five times as long.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _threads import add_threads_option, use_threads
from torch import nn

import funcmeta as fm

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None

# Li et al. (2017), Table 1: sinusoid regression MSE after one step, 10-shot.
PUBLISHED_10_SHOT = {"MAML": "0.77 ± 0.11", "Meta-SGD": "0.53 ± 0.09"}
METHODS = ("MAML", "Meta-SGD")


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the normal 95% interval."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, 1.96 * math.sqrt(var / n)


def train(method: str, shots: int, args: argparse.Namespace) -> tuple[fm.FunctionalModel, object]:
    """Meta-train one method; returns the functional model and its inner learning rate."""
    torch.manual_seed(args.seed)
    net = build_model()
    fmodel = fm.functional_model(net)
    if method == "MAML":
        lr: object = args.inner_lr
        learnable = list(net.parameters())
    else:
        gen = torch.Generator().manual_seed(args.seed)
        lr = fm.recipes.metasgd_rates(fmodel.params, generator=gen)
        learnable = [*net.parameters(), *lr.parameters()]
    outer = torch.optim.Adam(learnable, lr=args.meta_lr)
    tasks = fm.data.Sinusoid()
    rng = torch.Generator().manual_seed(args.seed + shots)
    steps = range(args.iterations)
    bar = None
    if tqdm is not None and not args.no_progress and sys.stderr.isatty():
        steps = bar = tqdm(steps, desc=f"{method:>8} {shots:>2}-shot", unit="it", leave=False)
    running = None
    compiled = None
    if args.compiled:  # the same meta-gradients as the recipes, as one compiled graph
        hyper = [] if method == "MAML" else [lr]
        opt = fm.optim.sgd(lr=lr)
        compiled = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, hyper=hyper)
    for i in steps:
        b = tasks.sample(args.meta_batch, shots, shots, generator=rng)
        outer.zero_grad()
        if compiled is not None:
            loss = compiled(b.support, b.query)
        else:
            recipe = fm.recipes.maml if method == "MAML" else fm.recipes.metasgd
            loss = recipe(
                fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=1, lr=lr
            ).loss
            loss.backward()
        outer.step()
        value = loss.item()
        running = value if running is None else 0.98 * running + 0.02 * value
        if bar is not None and i % 50 == 0:
            bar.set_postfix(query_mse=f"{running:.3f}")
    if bar is not None:
        bar.close()
    return fmodel, lr


def evaluate(fmodel: fm.FunctionalModel, lr: object, batch: object) -> dict[str, list[float]]:
    """Per-task query MSE before and after one inner step."""
    with torch.no_grad():
        opt = fm.optim.sgd(lr=lr)
        adapted = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, batch.support, opt, steps=1)
        before = fm.task_losses(fmodel, fmodel.params, F.mse_loss, batch.query).losses
        after = fm.task_losses(
            fmodel, adapted.params, F.mse_loss, batch.query, task_chunk=adapted.chunk
        ).losses
    return {"before": before.tolist(), "after": after.tolist()}


def plot(results: dict, shots: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[examples])")
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for method, marker in zip(METHODS, ("o", "s"), strict=True):
        means = [results[(method, k)]["after"][0] for k in shots]
        errs = [results[(method, k)]["after"][1] for k in shots]
        ax.errorbar(shots, means, yerr=errs, marker=marker, capsize=4, label=method)
    ax.set_xlabel("shots (support points per task)")
    ax.set_ylabel("query MSE after one step")
    ax.set_xticks(shots)
    ax.set_title("Sinusoid regression, held-out tasks (95% intervals)")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="MAML vs Meta-SGD on sinusoid regression.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--shots",
        type=int,
        nargs="+",
        default=[5, 10, 20],
        help="support points per task (K); each value trains MAML and Meta-SGD afresh",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=20000,
        help="meta-training iterations of each (method, shots) run",
    )
    p.add_argument("--meta-batch", type=int, default=25, help="tasks per meta-iteration")
    p.add_argument(
        "--inner-lr",
        type=float,
        default=0.01,
        help="MAML's inner SGD learning rate (Meta-SGD learns its own rates)",
    )
    p.add_argument("--meta-lr", type=float, default=1e-3, help="Adam's outer learning rate")
    p.add_argument(
        "--eval-tasks",
        type=int,
        default=600,
        help="held-out tasks scored after meta-training, 100 query points each",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial weights and the training tasks (the held-out tasks are fixed)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=Path("examples/out/sinusoid.png"),
        help="where to save the plot of the query MSE after one step (needs matplotlib)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none when stderr is not a terminal)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="meta-train with fm.compile_meta_step: each (method, shots) compiles once "
        "(seconds), then runs its iterations faster; pays for long runs",
    )
    add_threads_option(
        p,
        1,
        "a 1-40-40-1 MLP: tiny operations, which more threads only slow down, most of all "
        "when another process holds a core",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    use_threads(args)

    print(
        f"MAML vs Meta-SGD, sinusoid regression: {args.iterations} iterations, meta-batch "
        f"{args.meta_batch}, one inner step, {args.eval_tasks} held-out tasks x 100 query points"
    )
    results: dict = {}
    start = time.perf_counter()
    for shots in args.shots:
        test = fm.data.Sinusoid().sample(
            args.eval_tasks, shots, 100, generator=torch.Generator().manual_seed(10_000 + shots)
        )
        for method in METHODS:
            fmodel, lr = train(method, shots, args)
            scores = evaluate(fmodel, lr, test)
            results[(method, shots)] = {k: mean_ci(v) for k, v in scores.items()}
    print(f"took {time.perf_counter() - start:.0f} s")
    print(
        f"{'shots':>5} {'method':>9} {'before adaptation':>19} {'after 1 step':>15} {'published':>12}"
    )
    for shots in args.shots:
        for method in METHODS:
            before, after = results[(method, shots)]["before"], results[(method, shots)]["after"]
            published = PUBLISHED_10_SHOT[method] if shots == 10 else "-"
            print(
                f"{shots:>5} {method:>9} {before[0]:>11.3f} ± {before[1]:.3f} "
                f"{after[0]:>7.3f} ± {after[1]:.3f} {published:>12}"
            )
    plot(results, args.shots, args.plot)
    return results


if __name__ == "__main__":
    main()
