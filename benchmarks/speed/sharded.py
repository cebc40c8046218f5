"""A meta-step's time with the model sharded and the tasks split across the ranks
(``fm.distributed.shard_model`` and ``fm.distributed.gather_params``), against one process
running every task on one thread; the bytes each rank sends per meta-step, beside the formula.

A residual MLP (``--blocks`` blocks ``x + W2 tanh(W1 x)`` of ``--width``, a linear head),
``--tasks`` tasks of ``--rows`` support and query rows, ``--steps`` SGD steps, second order,
all tasks at once (``fm.adapt_tasks``), float32, each way in fresh processes under
``torchrun``, each rank on one thread:

- ``one process``: the whole model and every task (the reference);
- ``sharded``: ``--ranks`` gloo ranks, the parameters sharded over them, each rank adapting
  its share of the tasks on the whole parameters gathered once (``gather_params``: one
  all-gather per parameter), the meta-gradient reduce-scattered into the shards in the
  backward, Adam's state on the shards;
- ``tasks only``: the same ranks, each holding the whole model (``fm.distributed.shard`` and
  ``average_gradients``: one all-reduce), for what the sharding itself costs;
- ``checks`` and ``checks off``: what the sharded runtime's same-data checks cost per
  meta-step. The model sharded over the ranks, every rank running the same ``--check-tasks``
  tasks in the docs' pattern (``fm.adapt`` on the shards, the query loss through a direct
  call of the model): per task one comparison of the support batch, one per inner step of
  its loss, one of the query inputs and, in the backward, one of the gradient reaching the
  outputs (8-byte all-gathers). ``checks off`` is the same run with those comparisons
  replaced by nothing (the benchmark patches them out: the baseline only); its ratio is
  the checks' cost.

The ways run in turn, ``--rounds`` times (fresh processes each time, so that a slow spell
of the machine falls on every way alike), each timing ``--repeats`` meta-iterations
(zero_grad, inner loop, backward, the collectives, the outer Adam step) after a first one;
a way's time is the median of all its timed iterations. The sharded run's meta-gradient is
checked against the reference's (relative difference). Traffic: rank 0's bytes in the
collectives as torch dispatches them, against ``(ranks - 1) / ranks x 2 x model bytes``
(the all-gather sends this rank's shard to every other rank; the reduce-scatter sends every
other rank its part of this rank's gradient; padded shards of uneven parameters counted).

Target (issue "sharded second-order meta-learning"): on 2 ranks with half the tasks each,
the sharded meta-step at most 0.75x the one-process step. The last line is ``RESULT PASS``
or ``RESULT FAIL`` (exit status 1).

    python benchmarks/speed/sharded.py [--ranks 2] [--width 512] [--blocks 8] [--tasks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

MODES = ("single", "sharded", "tasks", "checks", "unchecked")


def model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(_common.residual_block(width) for _ in range(blocks)), nn.Linear(width, 1)
    )


def batch(tasks: int, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """``tasks`` regression tasks: a random linear map of the inputs per task."""
    g = torch.Generator().manual_seed(1)
    xs, xq = (torch.randn(tasks, rows, width, generator=g) for _ in range(2))
    w = torch.randn(tasks, width, 1, generator=g) / width**0.5
    return xs, xs @ w, xq, xq @ w


class Sent:
    """Counts the bytes this rank sends in the collectives, as torch dispatches them."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "compare": 0}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                first = args[0] if args else None
                if name.startswith("_c10d_functional.all_gather_into_tensor"):
                    counts["all_gather"] += first.nbytes * (int(args[1]) - 1)
                elif name.startswith("_c10d_functional.reduce_scatter_tensor"):
                    n = int(args[2])
                    counts["reduce_scatter"] += first.nbytes * (n - 1) // n
                elif name.startswith("c10d.allreduce_"):  # the tensors, as a list
                    counts["all_reduce"] += sum(t.nbytes for t in first)
                elif name.startswith("c10d.allgather_"):  # the checks' comparisons
                    counts["compare"] += sum(t.nbytes for t in args[1]) * (len(first[0]) - 1)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def rank_main(args: argparse.Namespace) -> None:
    """One rank's run (under torchrun): its row as JSON on stdout (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    net = model(args.width, args.blocks)
    checking = args.mode in ("checks", "unchecked")
    if args.mode == "sharded" or checking:
        net = fm.distributed.shard_model(net, init_device_mesh("cpu", (world,)))
    if args.mode == "unchecked":  # the baseline of the checks' cost: comparisons patched out
        from funcmeta._src.distributed.runtime import ShardedRuntime

        ShardedRuntime.check_batch = lambda *a, **k: None  # type: ignore[method-assign]
        ShardedRuntime.check_result = lambda *a, **k: None  # type: ignore[method-assign]
        ShardedRuntime.outputs = lambda self, out: out  # type: ignore[method-assign]
    fmodel = fm.functional_model(net)
    outer = torch.optim.Adam(net.parameters(), lr=1e-4)
    share, count = fm.distributed.shard(batch(args.tasks, args.rows, args.width))
    xs, ys, xq, yq = share
    if checking:  # every rank the same tasks
        count = args.check_tasks
        xs, ys, xq, yq = (t[:count] for t in batch(args.tasks, args.rows, args.width))

    def checked_iteration() -> None:
        outer.zero_grad(set_to_none=True)
        for t in range(count):
            result = fm.adapt(
                fmodel,
                fmodel.params,
                F.mse_loss,
                (xs[t], ys[t]),
                fm.optim.sgd(lr=0.01),
                steps=args.steps,
            )
            (F.mse_loss(fmodel(result.params, xq[t]), yq[t]) / count).backward()

    def meta_iteration() -> None:
        if checking:
            checked_iteration()
            return
        outer.zero_grad(set_to_none=True)
        params = fmodel.params
        if args.mode == "sharded":
            params = fm.distributed.gather_params(params, count)
        result = fm.adapt_tasks(
            fmodel, params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.01), steps=args.steps
        )
        fm.task_losses(
            fmodel, result.params, F.mse_loss, (xq, yq), task_chunk=result.chunk
        ).losses.mean().backward()
        if args.mode == "tasks":
            fm.distributed.average_gradients(list(net.parameters()), count)

    meta_iteration()
    grads = [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in net.parameters()
    ]
    if dist.get_rank() == 0:
        torch.save(grads, args.out)
    outer.step()
    seconds = []
    for _ in range(args.repeats):
        dist.barrier()
        started = time.perf_counter()
        meta_iteration()
        outer.step()
        seconds.append(time.perf_counter() - started)
    sent = Sent()
    with sent.mode:
        meta_iteration()
    row = {
        "seconds": seconds,
        "sent": sent.counts,
        "count": count,
        "held": sum(
            (p.to_local() if hasattr(p, "to_local") else p).nbytes for p in net.parameters()
        ),
    }
    if dist.get_rank() == 0:
        print(json.dumps(row))
    # no rank tears the group down while a peer's last collective is in flight
    dist.barrier()
    dist.destroy_process_group()


def run(mode: str, ranks: int, args: argparse.Namespace, out: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), __file__, "--rank-run", "--mode", mode]
    command += ["--width", str(args.width), "--blocks", str(args.blocks), "--rows", str(args.rows)]
    command += ["--tasks", str(args.tasks), "--repeats", str(args.repeats)]
    command += ["--steps", str(args.steps), "--check-tasks", str(args.check_tasks), "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        # torchrun --standalone picks a free port and binds it later: another job may take it;
        # on a loaded machine gloo may abort a rank at teardown ("terminate called without an
        # active exception"): both are run again once
        again = ("address already in use", "terminate called without an active exception")
        if done.returncode == 0 or not any(a in done.stderr.lower() for a in again):
            break
    if done.returncode != 0:
        raise SystemExit(f"{mode} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=8, help="tasks per meta-step, in all")
    parser.add_argument("--rows", type=int, default=64, help="support (and query) rows per task")
    parser.add_argument("--repeats", type=int, default=3, help="timed meta-iterations a run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way, in turn")
    parser.add_argument("--steps", type=int, default=3, help="inner SGD steps")
    parser.add_argument("--max-ratio", type=float, default=0.75)
    parser.add_argument(
        "--check-tasks", type=int, default=2, help="tasks of the checks rows (same on every rank)"
    )
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        rank_main(args)
        return 0
    whole = sum(p.numel() * p.element_size() for p in model(args.width, args.blocks).parameters())
    print(
        f"workload: second-order MAML, residual MLP {args.blocks} blocks of width {args.width} "
        f"(parameters {whole / 2**20:.1f} MiB), {args.tasks} tasks of {args.rows} rows, "
        f"{args.steps} SGD steps, fm.adapt_tasks, float32, one thread per process; "
        f"torch {torch.__version__}"
    )
    folder = Path(tempfile.mkdtemp())
    ranks = {m: 1 if m == "single" else args.ranks for m in MODES}
    rows: dict[str, dict] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            row = run(mode, ranks[mode], args, str(folder / f"{mode}.pt"))
            if mode in rows:
                rows[mode]["seconds"] += row["seconds"]
            else:
                rows[mode] = row
    for row in rows.values():
        row["seconds"] = statistics.median(row["seconds"])
    reference = torch.load(folder / "single.pt")
    base = rows["single"]["seconds"]
    print(
        f"{'way':<12} {'ranks':>5} {'tasks/rank':>10} {'params MiB/rank':>15} "
        f"{'median s':>9} {'ratio':>6}"
    )
    names = {
        "single": "one process",
        "sharded": "sharded",
        "tasks": "tasks only",
        "checks": "checks",
        "unchecked": "checks off",
    }
    for mode, row in rows.items():
        ranks = 1 if mode == "single" else args.ranks
        against = rows["unchecked"]["seconds"] if mode == "checks" else base
        print(
            f"{names[mode]:<12} {ranks:>5} {row['count']:>10} {row['held'] / 2**20:15.2f} "
            f"{row['seconds']:9.3f} {row['seconds'] / against:6.2f}"
            + (" (against checks off)" if mode == "checks" else "")
        )
    checks = rows["checks"]
    compared = checks["sent"]["compare"]
    print(
        f"checks: {args.check_tasks} tasks on every rank, fm.adapt ({args.steps} steps) and a "
        f"direct call's query loss; per meta-step {checks['seconds'] - rows['unchecked']['seconds']:+.3f} s "
        f"({checks['seconds'] / rows['unchecked']['seconds']:.3f}x checks off), "
        f"{compared:,} bytes of comparisons sent by rank 0"
    )
    missed = []
    for mode in ("sharded", "tasks"):
        grads = torch.load(folder / f"{mode}.pt")
        worst = max(
            float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            for a, b in zip(grads, reference, strict=True)
        )
        print(
            f"{names[mode]}: meta-gradient's largest relative difference from one process's "
            f"{worst:.1e}"
        )
        if worst > 1e-4:
            missed.append(f"{names[mode]}'s meta-gradient differs by {worst:.1e} (float32: 1e-4)")
    n = args.ranks
    sent = rows["sharded"]["sent"]
    padded = sum(
        -(-p.shape[0] // n) * n * p[0].numel() * p.element_size() if p.dim() else p.element_size()
        for p in model(args.width, args.blocks).parameters()
    )
    formula = (n - 1) / n * 2 * padded
    total = sent["all_gather"] + sent["reduce_scatter"]
    print(
        f"bytes rank 0 sends per meta-step, sharded: all-gather {sent['all_gather']:,} + "
        f"reduce-scatter {sent['reduce_scatter']:,} = {total:,}; formula (ranks - 1) / ranks "
        f"x 2 x model bytes (shards padded) = {n - 1}/{n} x 2 x {padded:,} = {formula:,.0f}; "
        f"the counts' all-reduce {sent['all_reduce']:,}; tasks only: all-reduce "
        f"{rows['tasks']['sent']['all_reduce']:,}"
    )
    if abs(total - formula) > 0.01 * formula:
        missed.append("the sharded traffic differs from the formula by more than 1%")
    ratio = rows["sharded"]["seconds"] / base
    if ratio > args.max_ratio:
        missed.append(f"sharded {ratio:.2f}x the one-process step (target {args.max_ratio}x)")
    print(
        f"RESULT FAIL: {'; '.join(missed)}"
        if missed
        else f"RESULT PASS: sharded {ratio:.2f}x the one-process step (target {args.max_ratio}x)"
    )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
