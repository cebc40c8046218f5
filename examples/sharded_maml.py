"""Second-order MAML on a small decoder sharded across processes: every rank holds a shard of
each parameter, and a layer's full parameters exist only while that layer runs.

The model is a causal transformer decoder (``--blocks`` pre-norm blocks of ``--width``, each
causal self-attention and an MLP, on tokens ``0..--vocab-1``). A task is a hidden rule of
the next token: a permutation of the vocabulary, drawn per task, that each sequence follows
from a random first token; the support sequences show the rule, the query sequences are
scored on it. ``fm.distributed.shard_model`` splits the decoder's parameters across the
ranks (``Shard(0)`` on a 1-D ``DeviceMesh``), and ``checkpoint_layers`` checkpoints each
block, the embeddings and the head, so a rank holds its shards and about one block's
gathered parameters at a time: the final norm's stay gathered (a layer not checkpointed keeps
them in the graph until the backward reaches it; a LayerNorm checkpointed on its own is
refused: torch's DTensor cannot differentiate it twice), and in the outer backward a layer's
recomputation can overlap its neighbour's. Every rank
runs the same tasks (``fm.recipes.maml``: a sharded model's tasks run one at a time), the
meta-gradients land in the shards' ``.grad``, and Adam steps the shards. With
``--own-tasks`` the ranks split the work as well: each takes its share of the meta-batch
(``fm.distributed.shard``) and adapts it on the whole parameters, gathered once per
meta-iteration (``fm.distributed.gather_params``; its tasks batched with ``vmap``), and the
backward reduce-scatters the mean meta-gradient into the shards; a rank then holds the
whole parameters during a meta-iteration, its shards between them. ``--save DIR``
writes the run with ``torch.distributed.checkpoint`` at the end and ``--resume DIR`` loads
it first, on any number of ranks.

    torchrun --nproc_per_node 4 examples/sharded_maml.py                     # CPU, gloo
    torchrun --nproc_per_node 2 examples/sharded_maml.py --own-tasks         # tasks split too
    torchrun --nproc_per_node 1 examples/sharded_maml.py --backend nccl      # one GPU
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/sharded_maml.py --backend nccl --width 1024 --blocks 24      # 2 machines of 8 GPUs

Rank 0 prints the mean query loss before and after adaptation every 5 iterations, then what
each rank holds against the whole model and the most gathered bytes alive at once
(``fm.distributed.gathered_bytes``) against the bound above. With ``--check`` its last line is
``RESULT PASS`` or ``RESULT FAIL`` (exit status 1): the adapted query loss fell from the
first iterations to the last, each rank holds at most its share of the parameters plus one
block's, and no more gathered bytes were alive at once than one block's, the final norm's and
one other layer's (with ``--own-tasks``, where the layers gather nothing, the loss and what
a rank holds between meta-iterations).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _threads import add_threads_option, use_threads
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import funcmeta as fm


class Attention(nn.Module):
    """Causal multi-head self-attention; its projections are layers of their own (each
    gathers its own weights: ``nn.MultiheadAttention`` reads its output projection's weight
    without calling it, which a sharded model refuses)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, width = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(n, length, width))


class Block(nn.Module):
    """A pre-norm decoder block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    """Token and position embeddings, ``blocks`` blocks, a final norm and the logits."""

    def __init__(self, vocab: int, width: int, blocks: int, heads: int, length: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(ids.shape[-1], device=ids.device)
        x = self.tokens(ids) + self.positions(where)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def decoder(args: argparse.Namespace) -> Decoder:
    torch.manual_seed(0)  # the same initial weights on every rank
    return Decoder(args.vocab, args.width, args.blocks, args.heads, args.length)


def tasks(args: argparse.Namespace, count: int, generator: torch.Generator, device: torch.device):
    """``count`` tasks, each a permutation of the vocabulary that its sequences follow:
    ``((support inputs, support targets), (query inputs, query targets))``, token ids of
    shape ``(count, sequences, length)``, the targets the inputs shifted by one."""
    rules = torch.stack([torch.randperm(args.vocab, generator=generator) for _ in range(count)])

    def sequences(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.empty(count, n, args.length + 1, dtype=torch.long)
        ids[..., 0] = torch.randint(0, args.vocab, (count, n), generator=generator)
        for i in range(args.length):
            ids[..., i + 1] = torch.gather(rules, 1, ids[..., i])
        return ids[..., :-1].to(device), ids[..., 1:].to(device)

    return sequences(args.shots), sequences(args.shots)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", default="gloo", help="gloo on CPU, nccl on one GPU per rank")
    p.add_argument("--vocab", type=int, default=16, help="tokens")
    p.add_argument("--width", type=int, default=64, help="the blocks' width")
    p.add_argument("--blocks", type=int, default=2, help="decoder blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--length", type=int, default=12, help="tokens per sequence")
    p.add_argument("--shots", type=int, default=4, help="support (and query) sequences per task")
    p.add_argument("--iterations", type=int, default=30, help="meta-iterations")
    p.add_argument("--meta-batch", type=int, default=4, help="tasks per meta-iteration")
    p.add_argument("--steps", type=int, default=2, help="inner SGD steps per task")
    p.add_argument("--inner-lr", type=float, default=0.5, help="inner SGD learning rate")
    p.add_argument("--lr", type=float, default=3e-3, help="outer Adam learning rate")
    p.add_argument("--save", help="a folder: save the run there at the end (all ranks)")
    p.add_argument("--resume", help="a folder: resume the run saved there")
    p.add_argument(
        "--own-tasks",
        action="store_true",
        help="each rank adapts its share of the tasks on whole parameters gathered once per "
        "meta-iteration (fm.distributed.gather_params)",
    )
    p.add_argument("--check", action="store_true", help="end with RESULT PASS or RESULT FAIL")
    add_threads_option(p, 1, "one per rank: the ranks share the cores")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    use_threads(args)
    dist.init_process_group(args.backend)
    rank, world = fm.distributed.world()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    net = fm.distributed.shard_model(decoder(args).to(device), mesh)
    # the layers that own parameters checkpointed: each block, the embeddings and the head (a
    # layer left out keeps its gathered parameters in the graph until the backward reaches it:
    # here the final norm, a LayerNorm, which torch's DTensor cannot differentiate twice when it
    # is checkpointed on its own)
    layers = ["tokens", "positions", *(f"blocks.{i}" for i in range(args.blocks)), "head"]
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    outer = torch.optim.Adam(net.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        model_state, optim_state = get_state_dict(net, outer)
        state = {"model": model_state, "optim": optim_state, "iteration": torch.zeros(())}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(net, outer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["iteration"])
    # the bound on gathered bytes alive at once: one block's parameters, the final norm's (not
    # checkpointed: they stay gathered), and the largest other checkpointed layer's (in the
    # outer backward a layer's recomputation can overlap its neighbour's)
    plain = decoder(args)
    others = [plain.tokens, plain.positions, plain.head]
    block = sum(
        p.numel() * p.element_size()
        for p in [*plain.blocks[0].parameters(), *plain.norm.parameters()]
    )
    block += max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in others)
    most = 0

    def note(module: nn.Module, inputs: object) -> None:
        nonlocal most
        now = fm.distributed.gathered_bytes()
        if now > block:  # garbage the collector has not reached yet is not memory held
            gc.collect()
            now = fm.distributed.gathered_bytes()
        most = max(most, now)

    for layer in net.modules():  # after each layer's own gather (registered before)
        if any(True for _ in layer.parameters(recurse=False)):
            layer.register_forward_pre_hook(note)
    adapted_losses = []
    for it in range(start, start + args.iterations):
        rng = torch.Generator().manual_seed(it)  # the same tasks on every rank, and on resuming
        support, query = tasks(args, args.meta_batch, rng, device)
        params = fmodel.params
        if args.own_tasks:  # this rank's share of the tasks, on the whole parameters
            (support, query), count = fm.distributed.shard((support, query))
            params = fm.distributed.gather_params(fmodel.params, count)
        outer.zero_grad()
        out = fm.recipes.maml(
            fmodel,
            params,
            next_token_loss,
            support,
            query,
            steps=args.steps,
            lr=args.inner_lr,
        )
        out.loss.backward()
        outer.step()
        adapted_losses.append(out.loss.item())
        if (it + 1) % 5 == 0:  # every rank: a sharded model's calls gather on all of them
            with torch.no_grad():
                before = fm.task_losses(fmodel, params, next_token_loss, query).losses
        if rank == 0 and (it + 1) % 5 == 0:
            print(
                f"iteration {it + 1}: query loss {before.mean().item():.3f} before adapting, "
                f"{out.loss.item():.3f} after"
            )
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
    status = 0
    if rank == 0 and args.own_tasks:
        print(
            f"{world} ranks, each with its own tasks: each holds {held:,} of {whole:,} "
            "parameters between meta-iterations, all of them during one"
        )
    elif rank == 0:
        print(
            f"{world} ranks: each holds {held:,} of {whole:,} parameters; gathered at most "
            f"{most:,} bytes at once (one block, the final norm and one other layer: {block:,})"
        )
    if rank == 0 and args.check:
        status = _check(adapted_losses, held, whole, world, most, block)
    # no rank tears the group down while a peer's last collective is in flight (gloo aborts
    # the process: "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return status


def _check(losses: list[float], held: int, whole: int, world: int, most: int, block: int) -> int:
    """``RESULT PASS`` or ``RESULT FAIL`` naming each target missed; the exit status."""
    fifth = max(len(losses) // 5, 1)
    first, last = sum(losses[:fifth]) / fifth, sum(losses[-fifth:]) / fifth
    element = 4  # float32
    missed = []
    if not last < first:
        missed.append(f"the adapted query loss did not fall ({first:.3f} -> {last:.3f})")
    if held * element > whole * element / world + block:
        missed.append(f"a rank holds {held:,} parameters of {whole:,} on {world} ranks")
    if most > block:
        missed.append(f"{most:,} gathered bytes alive at once, above the bound {block:,}")
    measured = f"adapted query loss {first:.3f} -> {last:.3f}"
    print(f"RESULT PASS: {measured}" if not missed else f"RESULT FAIL: {'; '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
