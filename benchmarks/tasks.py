"""Task batching speed: milliseconds per second-order MAML meta-iteration, batched
(``fm.adapt_tasks``) against a Python loop over the tasks (``fm.adapt``), and, for the MLP, a
hand-batched ``torch.bmm`` implementation of the same meta-iteration (the eager floor).

Workloads: the sinusoid MLP (1-40-40-1 ReLU, 10-shot support and query, 5 SGD steps) and
conv4 (4 x conv3x3-64 + BatchNorm + ReLU + max-pool, linear head; 5-way 1-shot 28x28, 5 query
images per class, 5 SGD steps). The implementations of one workload are timed interleaved in
one process; the table gives medians. Before timing, the script checks that the
implementations give the same meta-gradients.

    python benchmarks/tasks.py [--device cpu] [--repeats 9] [--meta-batch 4 16 32 64]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

STEPS, LR = 5, 0.01


def sinusoid_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def conv4(ways: int = 5) -> nn.Module:
    def block(cin: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2)
        )

    return nn.Sequential(
        block(1), block(64), block(64), block(64), nn.Flatten(), nn.Linear(64, ways)
    )


def loop_meta(fmodel, loss_fn, support, query):
    opt = fm.optim.sgd(lr=LR)
    losses = []
    for t in range(support[0].shape[0]):
        task = (support[0][t], support[1][t])
        result = fm.adapt(fmodel, fmodel.params, loss_fn, task, opt, steps=STEPS)
        out, _ = fmodel.apply(result.params, result.buffers, query[0][t])
        losses.append(loss_fn(out, query[1][t]))
    return torch.stack(losses).mean()


def batched_meta(fmodel, loss_fn, support, query):
    opt = fm.optim.sgd(lr=LR)
    result = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, opt, steps=STEPS)
    out, _ = fm.apply_tasks(fmodel, result.params, query[0], buffers=result.buffers)
    # every task has as many query points: the mean over all is the mean of task means
    return loss_fn(out.flatten(0, 1), query[1].flatten(0, 1))


def bmm_meta(net, support, query):
    """The sinusoid MLP meta-iteration batched by hand with torch.baddbmm."""
    xs, ys = support
    tasks = xs.shape[0]
    params = [w.expand(tasks, *w.shape) for w in net.parameters()]

    def forward(p, x):
        h = torch.relu(torch.baddbmm(p[1].unsqueeze(1), x, p[0].transpose(1, 2)))
        h = torch.relu(torch.baddbmm(p[3].unsqueeze(1), h, p[2].transpose(1, 2)))
        return torch.baddbmm(p[5].unsqueeze(1), h, p[4].transpose(1, 2))

    for _ in range(STEPS):
        per_task = (forward(params, xs) - ys).pow(2).mean(dim=(1, 2))
        grads = torch.autograd.grad(per_task.sum(), params, create_graph=True)
        params = [p - LR * g for p, g in zip(params, grads, strict=True)]
    return (forward(params, query[0]) - query[1]).pow(2).mean()


def timed(fn, params, device) -> tuple[float, list[torch.Tensor]]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    grads = torch.autograd.grad(fn(), params)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, list(grads)


def make_data(workload: str, tasks: int, device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(tasks)
    if workload == "sinusoid":
        b = fm.data.Sinusoid().sample(tasks, 10, 10, generator=g, device=device)
        return (b.x_support, b.y_support), (b.x_query, b.y_query), F.mse_loss
    xs = torch.randn(tasks, 5, 1, 28, 28, generator=g).to(device)
    xq = torch.randn(tasks, 25, 1, 28, 28, generator=g).to(device)
    ys = torch.arange(5).repeat(tasks, 1).to(device)
    yq = torch.arange(5).repeat_interleave(5).repeat(tasks, 1).to(device)
    return (xs, ys), (xq, yq), F.cross_entropy


def fmt(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else " " * (width - 1) + "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--meta-batch", type=int, nargs="+", default=[4, 16, 32, 64])
    parser.add_argument("--workloads", nargs="+", default=["sinusoid", "conv4"])
    args = parser.parse_args()
    device = torch.device(args.device)
    name = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else (platform.processor() or platform.machine())
    )
    print(
        f"device: {device} ({name}); torch {torch.__version__}; threads {torch.get_num_threads()}"
    )
    print(f"second-order MAML meta-iteration, {STEPS} SGD steps; median ms of {args.repeats}")
    print("agree: meta-gradients within 1% of each tensor's largest entry (float32)")
    print(
        f"{'workload':<9} {'T':>3} {'agree':>5} {'loop ms':>9} {'batched ms':>11} "
        f"{'bmm ms':>8} {'loop/batched':>13} {'batched/bmm':>12}"
    )
    for workload in args.workloads:
        torch.manual_seed(0)
        net = (sinusoid_mlp() if workload == "sinusoid" else conv4()).to(device)
        fmodel = fm.functional_model(net)
        params = list(net.parameters())
        for tasks in args.meta_batch:
            support, query, loss_fn = make_data(workload, tasks, device)
            impls = {
                "loop": functools.partial(loop_meta, fmodel, loss_fn, support, query),
                "batched": functools.partial(batched_meta, fmodel, loss_fn, support, query),
            }
            if workload == "sinusoid":
                impls["bmm"] = functools.partial(bmm_meta, net, support, query)
            grads = {k: timed(f, params, device)[1] for k, f in impls.items()}
            # A float32 sanity check, relative to each tensor's largest entry: second order
            # through conv and BatchNorm amplifies float32 rounding (up to 0.6% seen for conv4
            # at 4 tasks). Exactness is checked in float64 by tests/test_tasks.py (1e-12).
            agree = all(
                float((a - b).abs().max()) <= 1e-2 * float(b.abs().max()) + 1e-6
                for other in grads.values()
                for a, b in zip(other, grads["loop"], strict=True)
            )
            times: dict[str, list[float]] = {k: [] for k in impls}
            for _ in range(args.repeats):
                for k, f in impls.items():
                    times[k].append(timed(f, params, device)[0])
            med = {k: statistics.median(v) for k, v in times.items()}
            bmm = med.get("bmm")
            ratio_bmm = med["batched"] / bmm if bmm else None
            print(
                f"{workload:<9} {tasks:>3} {'yes' if agree else 'NO':>5} {med['loop']:9.1f} "
                f"{med['batched']:11.1f} {fmt(bmm, 8, 1)} "
                f"{med['loop'] / med['batched']:13.2f} {fmt(ratio_bmm, 12, 2)}"
            )


if __name__ == "__main__":
    main()
