"""Task batching speed and memory: a second-order MAML meta-iteration batched
(``fm.adapt_tasks``) against a Python loop over the tasks (``fm.adapt``), and, for the MLP, a
hand-batched ``torch.bmm`` implementation of the same meta-iteration (the eager floor).

Batched runs three times: all tasks in one vmapped computation ("batched", ``task_chunk=None``),
with the fastest chunk size ``fm.tune_task_chunk`` measures on the workload before timing
("tuned", passed as ``task_chunk``), and as a user gets it, with the default
``task_chunk="auto"`` ("default": a fresh functional model per row; its chunk is a rule of the
shapes, chosen on its first call). Each query pass runs on its inner loop's chunk
(``task_chunk=result.chunk``). ``--default-chunk tune`` times ``task_chunk="tune"`` in that
column instead, which measures its candidates on its first calls: its measuring calls (the
agreement check's call is its warm-up, then the trials) run before the timed rounds, so
"default ms" is the time per meta-iteration once it has chosen. "default chose" gives the
choice and what it cost: the number of calls until the choice (none for the rule: the
agreement check's call chose), and the seconds they took beyond as many calls at "default
ms".

Workloads: the sinusoid MLP (1-40-40-1 ReLU, 10-shot support and query, 5 SGD steps) and
conv4 (4 x conv3x3-64 + BatchNorm + ReLU + max-pool, linear head; 5-way 1-shot 28x28, 5 query
images per class, 1 and 5 SGD steps). The implementations of one workload are timed
interleaved in one process, each round in a rotated order; the table gives medians. Before
timing, the script checks that the implementations give the same meta-gradients. Then, for conv4 at 5 steps, it measures
each implementation's peak memory (resident set above the start of the meta-iteration,
fresh process each, glibc's mmap threshold fixed so that freed memory leaves the process).

    python benchmarks/speed/tasks.py [--device cpu] [--repeats 9] [--meta-batch 4 16 32 64]
        [--conv-steps 1 5] [--memory-tasks 16 32] [--skip-memory] [--keep-freed-memory]
        [--default-chunk auto|tune]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

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


def loop_meta(fmodel, loss_fn, support, query, steps=STEPS):
    opt = fm.optim.sgd(lr=LR)
    losses = []
    for t in range(support[0].shape[0]):
        task = (support[0][t], support[1][t])
        result = fm.adapt(fmodel, fmodel.params, loss_fn, task, opt, steps=steps)
        out, _ = fmodel.run(result.params, result.buffers, query[0][t])
        losses.append(loss_fn(out, query[1][t]))
    return torch.stack(losses).mean()


def batched_meta(fmodel, loss_fn, support, query, steps=STEPS, *, task_chunk="auto"):
    opt = fm.optim.sgd(lr=LR)
    result = fm.adapt_tasks(
        fmodel, fmodel.params, loss_fn, support, opt, steps=steps, task_chunk=task_chunk
    )
    out, _ = fm.apply_tasks(
        fmodel, result.params, query[0], buffers=result.buffers, task_chunk=result.chunk
    )
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


def tuned_model(net, loss_fn, support, query, steps) -> tuple[fm.FunctionalModel, int | None]:
    """A functional model and the chunk ``fm.tune_task_chunk`` measured fastest on this
    workload for it (``None``: all tasks at once), to pass as ``task_chunk``."""
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=LR)
    times = fm.tune_task_chunk(
        fmodel, fmodel.params, loss_fn, support, opt, steps=steps, query=query, repeats=3
    )
    best = min(times, key=times.__getitem__)
    return fmodel, None if best >= support[0].shape[0] else best


def memory_worker(impl: str, tasks: int, steps: int, chunk: int | None) -> None:
    torch.manual_seed(0)
    net = conv4()
    support, query, loss_fn = make_data("conv4", tasks, torch.device("cpu"))
    fmodel = fm.functional_model(net)
    meta = loop_meta if impl == "loop" else functools.partial(batched_meta, task_chunk=chunk)
    params = list(net.parameters())
    torch.autograd.grad(meta(fmodel, loss_fn, support, query, 1), params)  # warm-up
    meter = _common.Meter(torch.device("cpu"))
    meter.start()
    torch.autograd.grad(meta(fmodel, loss_fn, support, query, steps), params)
    print(json.dumps({"peak": meter.peak()}))


def peak_memory(impl: str, tasks: int, steps: int, chunk: int | None) -> float:
    """MiB, in a fresh process (see the module docstring)."""
    env = {**os.environ, **_common.MMAP_ENV}
    command = [sys.executable, __file__, "--memory-worker", impl, str(tasks), str(steps)]
    out = subprocess.run(
        [*command, str(chunk or 0)], check=True, capture_output=True, text=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"] / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--meta-batch", type=int, nargs="+", default=[4, 16, 32, 64])
    parser.add_argument("--workloads", nargs="+", default=["sinusoid", "conv4"])
    parser.add_argument("--conv-steps", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--memory-tasks", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--skip-tuned", action="store_true", help="no fm.tune_task_chunk column (it is slow)"
    )
    parser.add_argument(
        "--default-chunk",
        choices=["auto", "tune"],
        default="auto",
        help='the "default" column\'s task_chunk: "auto" (the default rule) or "tune" (measured)',
    )
    parser.add_argument("--memory-worker", nargs=4, default=None, help=argparse.SUPPRESS)
    _common.add_allocator_option(parser, False, _common.ALLOCATOR_WHY)
    args = parser.parse_args()
    if args.memory_worker:
        impl, tasks, steps, chunk = args.memory_worker
        memory_worker(impl, int(tasks), int(steps), int(chunk) or None)
        return
    device = torch.device(args.device)
    name = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else (platform.processor() or platform.machine())
    )
    allocator = _common.use_allocator(args)
    print(
        f"device: {device} ({name}); torch {torch.__version__}; threads {torch.get_num_threads()}"
        f"; {allocator}"
    )
    print(f"second-order MAML meta-iteration, SGD steps K; median ms of {args.repeats}")
    print("agree: meta-gradients within 1% of each tensor's largest entry (float32)")
    print("chunk: the task_chunk fm.tune_task_chunk measured fastest (all: every task at once)")
    print(
        f'default: task_chunk="{args.default_chunk}"; default chose: its chunk (its calls '
        "until the choice, and the seconds they took beyond as many at its speed)"
    )
    print(
        f"{'workload':<9} {'K':>2} {'T':>3} {'agree':>5} {'loop ms':>9} {'batched ms':>11} "
        f"{'tuned ms':>9} {'chunk':>5} {'default ms':>10} {'default chose':>22} {'bmm ms':>8} "
        f"{'loop/batched':>13} {'loop/tuned':>11} {'loop/default':>13} {'batched/bmm':>12}"
    )
    chunks: dict[tuple[int, int], int | None] = {}
    for workload in args.workloads:
        torch.manual_seed(0)
        net = (sinusoid_mlp() if workload == "sinusoid" else conv4()).to(device)
        fmodel = fm.functional_model(net)
        params = list(net.parameters())
        for steps in args.conv_steps if workload == "conv4" else [STEPS]:
            for tasks in args.meta_batch:
                support, query, loss_fn = make_data(workload, tasks, device)
                tuned, tuned_chunk = (
                    (fm.functional_model(net), None)
                    if args.skip_tuned
                    else tuned_model(net, loss_fn, support, query, steps)
                )
                chunks[(tasks, steps)] = tuned_chunk
                impls = {
                    "loop": functools.partial(loop_meta, fmodel, loss_fn, support, query, steps),
                    "batched": functools.partial(
                        batched_meta, fmodel, loss_fn, support, query, steps, task_chunk=None
                    ),
                    "tuned": functools.partial(
                        batched_meta, tuned, loss_fn, support, query, steps, task_chunk=tuned_chunk
                    ),
                    "default": functools.partial(
                        batched_meta,
                        fm.functional_model(net),
                        loss_fn,
                        support,
                        query,
                        steps,
                        task_chunk=args.default_chunk,
                    ),
                }
                if args.skip_tuned:
                    del impls["tuned"]
                if workload == "sinusoid":
                    impls["bmm"] = functools.partial(bmm_meta, net, support, query)
                grads = {k: _common.timed_grad(f, params, device)[1] for k, f in impls.items()}
                ok = all(_common.agree(g, grads["loop"]) for g in grads.values())
                default = impls["default"].args[0]
                tuning = (
                    _common.until_chosen(
                        functools.partial(_common.timed_grad, impls["default"], params, device),
                        default,
                    )
                    if device.type == "cpu" or args.default_chunk == "auto"
                    else []
                )
                calls = {
                    k: functools.partial(_common.timed_grad, f, params, device)
                    for k, f in impls.items()
                }
                med = _common.medians(_common.rounds(calls, args.repeats))
                bmm = med.get("bmm")
                ratio_bmm = med["batched"] / bmm if bmm else None
                chunk = "-" if args.skip_tuned else tuned_chunk or "all"
                choice = _common.default_choice(default, tuning, med["default"])
                tuned_ms = med.get("tuned")
                print(
                    f"{workload:<9} {steps:>2} {tasks:>3} {'yes' if ok else 'NO':>5} "
                    f"{med['loop']:9.1f} {med['batched']:11.1f} {_common.fmt(tuned_ms, 9, 1)} "
                    f"{chunk!s:>5} {med['default']:10.1f} {choice:>22} {_common.fmt(bmm, 8, 1)} "
                    f"{med['loop'] / med['batched']:13.2f} "
                    f"{_common.fmt(tuned_ms and med['loop'] / tuned_ms, 11, 2)} "
                    f"{med['loop'] / med['default']:13.2f} {_common.fmt(ratio_bmm, 12, 2)}",
                    flush=True,
                )
    if args.skip_memory or "conv4" not in args.workloads or device.type != "cpu":
        return
    steps = max(args.conv_steps)
    print(f"peak memory, conv4 K={steps}, MiB above the start (fresh process each)")
    print(
        f"{'T':>3} {'loop':>8} {'batched':>8} {'tuned':>8} {'chunk':>5} {'batched/loop':>13} "
        f"{'tuned/loop':>11}"
    )
    for tasks in args.memory_tasks:
        chunk = chunks.get((tasks, steps))
        loop = peak_memory("loop", tasks, steps, None)
        batched = peak_memory("batched", tasks, steps, None)
        tuned = peak_memory("batched", tasks, steps, chunk)
        print(
            f"{tasks:>3} {loop:8.1f} {batched:8.1f} {tuned:8.1f} {chunk or 'all'!s:>5} "
            f"{batched / loop:13.2f} {tuned / loop:11.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
