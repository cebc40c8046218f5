"""Second-order MAML on sinusoid regression (Finn et al., 2017), end to end on CPU.

A 1-40-40-1 ReLU network is meta-trained so that one SGD step on 10 points of a new sine
wave fits it; the script then reports the query MSE on held-out tasks before and after
adaptation (mean and 95% interval). Each meta-batch is adapted at once (``fm.adapt_tasks``).

    python examples/sinusoid_maml.py                  # the demo (under a minute on CPU)
    python examples/sinusoid_maml.py --iterations 70000 --inner-steps 5
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def meta_loss(fmodel, opt, batch, steps: int) -> torch.Tensor:
    """Mean query loss over the tasks of ``batch`` after ``steps`` second-order inner steps,
    all tasks adapted at once."""
    support = (batch.x_support, batch.y_support)
    adapted = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, opt, steps=steps)
    out, _ = fm.apply_tasks(fmodel, adapted.params, adapted.buffers, batch.x_query)
    return F.mse_loss(out, batch.y_query)  # equal task sizes: the mean of the task losses


def evaluate(fmodel, opt, batch, steps: int) -> list[float]:
    """Query MSE per task after ``steps`` inner steps (0: the meta-learned initialisation)."""
    with torch.no_grad():
        params = fmodel.params
        if steps:
            support = (batch.x_support, batch.y_support)
            params = fm.adapt_tasks(fmodel, params, F.mse_loss, support, opt, steps=steps).params
        out, _ = fm.apply_tasks(fmodel, params, None, batch.x_query)
        return (out - batch.y_query).pow(2).mean(dim=(1, 2)).tolist()


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the normal 95% interval."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, 1.96 * math.sqrt(var / n)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="Second-order MAML on sinusoid regression.")
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--meta-batch", type=int, default=25)
    parser.add_argument("--shots", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--inner-lr", type=float, default=0.01)
    parser.add_argument("--meta-lr", type=float, default=1e-3)
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    tasks = fm.data.Sinusoid()
    train_rng = torch.Generator().manual_seed(args.seed)
    test_rng = torch.Generator().manual_seed(10_000 + args.seed)
    test_batch = tasks.sample(args.eval_tasks, args.shots, 100, generator=test_rng)

    model = build_model()
    fmodel = fm.functionalize(model)
    inner = fm.optim.sgd(lr=args.inner_lr)
    outer = torch.optim.Adam(model.parameters(), lr=args.meta_lr)

    print(
        f"MAML (second order) on sinusoids: {args.shots}-shot, {args.inner_steps} inner "
        f"step(s) of SGD lr={args.inner_lr}, meta-batch {args.meta_batch}, "
        f"{args.iterations} iterations"
    )
    random_init = mean_ci(evaluate(fmodel, inner, test_batch, args.inner_steps))
    start = time.perf_counter()
    bar = None
    iterator = range(args.iterations)
    if tqdm is not None and not args.no_progress:
        iterator = bar = tqdm(iterator, desc="meta-training", unit="it")
    running = None
    for i in iterator:
        batch = tasks.sample(args.meta_batch, args.shots, args.shots, generator=train_rng)
        loss = meta_loss(fmodel, inner, batch, args.inner_steps)
        outer.zero_grad()
        loss.backward()
        outer.step()
        value = loss.item()
        running = value if running is None else 0.98 * running + 0.02 * value
        if bar is not None and i % 25 == 0:
            bar.set_postfix(query_mse=f"{running:.3f}")
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start

    pre = mean_ci(evaluate(fmodel, inner, test_batch, 0))
    post = mean_ci(evaluate(fmodel, inner, test_batch, args.inner_steps))
    post10 = mean_ci(evaluate(fmodel, inner, test_batch, 10))
    k = args.inner_steps
    print(f"meta-training took {elapsed:.1f} s")
    print(f"held-out: {args.eval_tasks} tasks, {args.shots}-shot support, 100 query points each")
    print(f"  random init, after {k} step(s):   MSE {random_init[0]:.3f} ± {random_init[1]:.3f}")
    print(f"  MAML init, before adaptation:    MSE {pre[0]:.3f} ± {pre[1]:.3f}")
    print(f"  MAML init, after {k} step(s):     MSE {post[0]:.3f} ± {post[1]:.3f}")
    print(f"  MAML init, after 10 steps:       MSE {post10[0]:.3f} ± {post10[1]:.3f}")
    return {"random_init": random_init[0], "pre": pre[0], "post": post[0], "post10": post10[0]}


if __name__ == "__main__":
    main()
