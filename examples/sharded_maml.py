"""Second-order MAML on a model sharded across processes: every rank holds a shard of each
parameter, and a layer's full parameters exist only while that layer runs.

The model is a residual MLP (``--blocks`` blocks of ``--width``; each block ``x + W2
tanh(W1 x)``) on sinusoid-like regression tasks lifted to ``--width`` features.
``fm.distributed.shard_model`` splits its parameters across the ranks (``Shard(0)`` on a
1-D ``DeviceMesh``), and ``checkpoint_layers="sequential"`` checkpoints each block, so a
rank holds its shards and one block's gathered parameters at a time. Every rank adapts the
same tasks (``fm.adapt``, one task at a time: task batching does not take a sharded model),
the meta-gradients land in the shards' ``.grad``, and Adam steps the shards.
``--save DIR`` writes the run with ``torch.distributed.checkpoint`` at the end and
``--resume DIR`` loads it first, on any number of ranks.

    torchrun --nproc_per_node 2 examples/sharded_maml.py                      # CPU, gloo
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/sharded_maml.py --backend nccl --width 4096 --blocks 32       # 2 machines of 8 GPUs

The last line rank 0 prints reports the parameters each rank holds against the whole model,
and the most gathered bytes alive at once (``fm.distributed.gathered_bytes``) against one
block's.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _threads import add_threads_option, use_threads
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import funcmeta as fm


class Block(nn.Module):
    """``x + W2 tanh(W1 x)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


def model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Linear(1, width), *(Block(width) for _ in range(blocks)), nn.Linear(width, 1)
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", default="gloo", help="gloo on CPU, nccl on one GPU per rank")
    p.add_argument("--width", type=int, default=64, help="the blocks' width")
    p.add_argument("--blocks", type=int, default=4, help="residual blocks")
    p.add_argument("--iterations", type=int, default=20, help="meta-iterations")
    p.add_argument("--meta-batch", type=int, default=4, help="tasks per meta-iteration")
    p.add_argument("--steps", type=int, default=2, help="inner SGD steps per task")
    p.add_argument("--inner-lr", type=float, default=0.01, help="inner SGD learning rate")
    p.add_argument("--save", help="a folder: save the run there at the end (all ranks)")
    p.add_argument("--resume", help="a folder: resume the run saved there")
    add_threads_option(p, 1, "one per rank: the ranks share the cores")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    use_threads(args)
    dist.init_process_group(args.backend)
    rank, world = fm.distributed.world()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    net = fm.distributed.shard_model(model(args.width, args.blocks).to(device), mesh)
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    outer = torch.optim.Adam(net.parameters(), lr=1e-3)
    start = 0
    if args.resume:
        model_state, optim_state = get_state_dict(net, outer)
        state = {"model": model_state, "optim": optim_state, "iteration": torch.zeros(())}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(net, outer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["iteration"])
    block = sum(p.numel() * p.element_size() for p in model(args.width, 1)[1].parameters())
    most = 0

    def note(module: nn.Module, inputs: object) -> None:
        nonlocal most
        most = max(most, fm.distributed.gathered_bytes())

    for layer in net.modules():  # after each layer's own gather (registered before)
        if any(True for _ in layer.parameters(recurse=False)):
            layer.register_forward_pre_hook(note)
    tasks = fm.data.Sinusoid()
    for it in range(start, start + args.iterations):
        rng = torch.Generator().manual_seed(it)  # the same tasks on every rank, and on resuming
        b = tasks.sample(args.meta_batch, 10, 10, generator=rng, device=device)
        outer.zero_grad()
        total = 0.0
        for t in range(args.meta_batch):  # one task at a time: a sharded model takes fm.adapt
            opt = fm.optim.sgd(lr=args.inner_lr)
            support = (b.x_support[t], b.y_support[t])
            result = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, opt, steps=args.steps)
            loss = F.mse_loss(fmodel(result.params, b.x_query[t]), b.y_query[t])
            (loss / args.meta_batch).backward()
            total += loss.item() / args.meta_batch
        outer.step()
        if rank == 0 and (it + 1) % 5 == 0:
            print(f"iteration {it + 1}: query MSE {total:.3f}")
    if args.save:
        model_state, optim_state = get_state_dict(net, outer)
        state = {
            "model": model_state,
            "optim": optim_state,
            "iteration": torch.tensor(start + args.iterations),
        }
        dcp.save(state, checkpoint_id=args.save)
    held = sum(p.to_local().numel() for p in net.parameters())
    whole = sum(p.numel() for p in net.parameters())
    if rank == 0:
        print(
            f"{world} ranks: each holds {held:,} of {whole:,} parameters; gathered at most "
            f"{most:,} bytes at once (one block: {block:,})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
