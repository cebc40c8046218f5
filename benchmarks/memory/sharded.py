"""Each rank's memory with the model sharded (``fm.distributed.shard_model``) against one
process holding the whole model: second-order MAML, per-layer checkpointing (or none:
``--checkpoint none``).

A residual MLP (``--blocks`` blocks ``x + W2 tanh(W1 x)`` of ``--width``, a linear head),
one task of ``--rows`` support and query rows, ``--steps`` SGD steps, float32, run with ``torchrun``
on 1 rank (the reference) and on ``--ranks`` gloo ranks, each in fresh processes. Per rank:

- ``parameters``: the bytes of the parameters the rank holds (its shards) plus the most
  gathered bytes alive at once (``fm.distributed.gathered_bytes``, sampled at every layer's
  forward and, in the meta-iteration that counts the traffic, at every all-gather: a
  backward gathers a saved parameter again);
- ``peak``: the high-water mark of the resident set during one meta-iteration, above its
  start (after a first meta-iteration, freed memory returned to the system);
- ``median s``: the median time of ``--repeats`` meta-iterations after it (no target: every
  rank does the whole work, the ranks split the memory).

Targets (issue "sharded second-order meta-learning"): on ``--ranks`` ranks, ``parameters``
at most 1/ranks of the whole model's plus one block's, and ``peak`` at most 0.35x the single
process's. The last line is ``RESULT PASS`` or ``RESULT FAIL`` (exit status 1).

    python benchmarks/memory/sharded.py [--ranks 4] [--width 512] [--blocks 8] [--rows 64]
        [--checkpoint layers|none] [--reshard on|off] [--split on|off]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common


def model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(_common.residual_block(width) for _ in range(blocks)), nn.Linear(width, 1)
    )


class Sent:
    """Counts the bytes this rank sends in all-gathers, as torch dispatches them: DTensor's
    gathers of the parameters (``_c10d_functional.all_gather_into_tensor``: this rank's
    shard to each of the other ranks) and the checkpointed layers' gathers of their saved
    activations (``c10d._allgather_base_``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {"parameters": 0, "activations": 0}
        most = self.most = [0]  # the most gathered bytes alive at an all-gather

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if name.startswith("_c10d_functional.all_gather_into_tensor"):
                    counts["parameters"] += tensors[0].nbytes * (int(args[1]) - 1)
                elif name.startswith("c10d._allgather_base_"):
                    out, piece = tensors[0], tensors[1]
                    counts["activations"] += piece.nbytes * (out.numel() // piece.numel() - 1)
                if name.startswith("_c10d_functional.all_gather_into_tensor"):
                    most[0] = max(most[0], fm.distributed.gathered_bytes())
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def rank_main(args: argparse.Namespace) -> None:
    """One rank's run (under torchrun): its row as JSON on stdout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    net = fm.distributed.shard_model(
        model(args.width, args.blocks),
        init_device_mesh("cpu", (world,)),
        reshard_after_forward=args.reshard == "on",
        split_activations=args.split == "on",
    )
    layers = "sequential" if args.checkpoint == "layers" else None
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    most = [0]
    runs = [0]  # layer runs (each gathers its parameters once)
    full = 0  # bytes of the parameters gathered by one run of every layer

    def note(module: nn.Module, inputs: object) -> None:
        most[0] = max(most[0], fm.distributed.gathered_bytes())
        runs[0] += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))

    for layer in net.modules():
        if any(True for _ in layer.parameters(recurse=False)):
            layer.register_forward_pre_hook(note)
    g = torch.Generator().manual_seed(1)
    xs, xq = (torch.randn(args.rows, args.width, generator=g) for _ in range(2))
    ys, yq = xs[:, :1].sin(), xq[:, :1].sin()

    def meta_iteration() -> None:
        net.zero_grad(set_to_none=True)
        result = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.01), steps=args.steps
        )
        F.mse_loss(fmodel(result.params, xq), yq).backward()

    meta_iteration()
    dist.barrier()
    meter = _common.Meter(torch.device("cpu"))
    meter.start()
    meta_iteration()
    peak = meter.peak()
    seconds = []
    for _ in range(args.repeats):
        dist.barrier()
        started = time.perf_counter()
        meta_iteration()
        seconds.append(time.perf_counter() - started)
    sent = Sent()
    runs[0] = 0
    with sent.mode:
        meta_iteration()
    full = sum(p.numel() * p.element_size() for p in net.parameters())
    held = sum(p.to_local().numel() * p.element_size() for p in net.parameters())
    rows = [None] * world
    median = sorted(seconds)[len(seconds) // 2]
    dist.all_gather_object(
        rows,
        {
            "peak": peak,
            "held": held,
            "gathered": max(most[0], sent.most[0]),
            "seconds": median,
            "sent": sent.counts,
            "gathered_per_step": runs[0],
            "parameter_bytes": full,
        },
    )
    if dist.get_rank() == 0:
        print(json.dumps(rows))
    # no rank tears the group down while a peer's last collective is in flight (gloo aborts
    # the process: "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


def run(ranks: int, args: argparse.Namespace) -> list[dict[str, int]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), __file__, "--rank-run"]
    command += ["--width", str(args.width), "--blocks", str(args.blocks), "--rows", str(args.rows)]
    command += ["--repeats", str(args.repeats), "--steps", str(args.steps)]
    command += ["--checkpoint", args.checkpoint, "--reshard", args.reshard, "--split", args.split]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    for _attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        # torchrun --standalone picks a free port and binds it later: another job may take it
        if done.returncode == 0 or "address already in use" not in done.stderr.lower():
            break
    if done.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed meta-iterations")
    parser.add_argument("--steps", type=int, default=3, help="inner SGD steps")
    parser.add_argument(
        "--checkpoint",
        choices=["layers", "none"],
        default="layers",
        help="checkpoint_layers='sequential' (the default), or none (the plain mode)",
    )
    parser.add_argument(
        "--reshard",
        choices=["on", "off"],
        default="on",
        help="shard_model(reshard_after_forward=): on (the default) or off",
    )
    parser.add_argument(
        "--split",
        choices=["on", "off"],
        default="on",
        help="shard_model(split_activations=): on (the default) or off",
    )
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        rank_main(args)
        return 0
    whole = sum(p.numel() * p.element_size() for p in model(args.width, args.blocks).parameters())
    block = sum(
        p.numel() * p.element_size() for p in _common.residual_block(args.width).parameters()
    )
    print(
        f"workload: second-order MAML, residual MLP {args.blocks} blocks of width {args.width} "
        f"(parameters {whole / 2**20:.1f} MiB, one block {block / 2**20:.2f} MiB), "
        f"{args.rows} rows, {args.steps} SGD steps, float32, "
        f"{'checkpoint_layers' if args.checkpoint == 'layers' else 'no checkpointing'}, "
        f"reshard_after_forward={args.reshard == 'on'}, "
        f"split_activations={args.split == 'on'}; "
        f"torch {torch.__version__}"
    )
    single = run(1, args)[0]
    sharded = run(args.ranks, args)
    print(f"{'run':<10} {'rank':>4} {'parameters MiB':>15} {'peak MiB':>9} {'median s':>9}")
    for name, rows in (("1 rank", [single]), (f"{args.ranks} ranks", sharded)):
        for r, row in enumerate(rows):
            params = (row["held"] + row["gathered"]) / 2**20
            print(
                f"{name:<10} {r:>4} {params:15.2f} {row['peak'] / 2**20:9.1f} {row['seconds']:9.3f}"
            )
    missed = []
    limit = whole / args.ranks + block
    worst = max(sharded, key=lambda row: row["held"] + row["gathered"])
    if worst["held"] + worst["gathered"] > limit:
        missed.append(
            f"parameters {(worst['held'] + worst['gathered']) / 2**20:.2f} MiB on a rank > "
            f"{limit / 2**20:.2f} MiB (1/{args.ranks} of the model plus one block)"
        )
    # traffic: every run of a layer gathers its parameters, and every inner step's recorded
    # VJP gathers its parameters' cotangents once in the outer backward (the double backward
    # of full_tensor's backward); each gather sends this rank's shard to the other ranks:
    # (ranks - 1) / ranks of the bytes gathered
    row = sharded[0]
    n, whole_bytes = args.ranks, row["parameter_bytes"]
    runs = row["gathered_per_step"] / whole_bytes
    formula = (n - 1) / n * (row["gathered_per_step"] + args.steps * whole_bytes)
    sent = row["sent"]
    print(
        f"bytes rank 0 sends per meta-step: parameters {sent['parameters']:,}; formula "
        f"(ranks - 1) / ranks x (runs + steps) x model bytes = {n - 1}/{n} x ({runs:.1f} + "
        f"{args.steps}) x {whole_bytes:,} = {formula:,.0f}; activations "
        f"{sent['activations']:,}"
    )
    if args.checkpoint == "layers" and abs(sent["parameters"] - formula) > 0.01 * formula:
        missed.append("the parameters' traffic differs from the formula by more than 1%")
    ratio = max(row["peak"] for row in sharded) / single["peak"]
    print(f"largest peak of a rank / the single process's: {ratio:.2f}")
    if ratio > 0.35:
        missed.append(f"peak {ratio:.2f}x the single process's (target 0.35x)")
    print(f"RESULT FAIL: {'; '.join(missed)}" if missed else "RESULT PASS")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
