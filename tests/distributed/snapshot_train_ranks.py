"""Two-rank Meta-SGD training that snapshots every step and resumes from the snapshots.

Used by tests/distributed/test_distributed_failures.py:
    python tests/distributed/snapshot_train_ranks.py RANK RENDEZVOUS FOLDER STEPS [KILL_AT]
Each rank keeps its own snapshot ``FOLDER/state{RANK}.pt`` (its random states differ). With
KILL_AT, rank 1 kills itself with SIGKILL during that step, before averaging; rank 0 then
fails with fm.distributed.PeerError.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers
from helpers import init_gloo

import funcmeta as fm


def main(rank: int, rendezvous: str, folder: Path, steps: int, kill_at: int | None) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, rendezvous)
    torch.manual_seed(0)  # the same initialisation on every rank
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    fmodel = fm.functional_model(net)
    rates = fm.recipes.metasgd_rates(fmodel.params, generator=torch.Generator().manual_seed(1))
    outer = torch.optim.Adam([*net.parameters(), *rates.parameters()], lr=1e-3)
    tasks_rng = torch.Generator().manual_seed(2)  # the same meta-batches on every rank
    torch.manual_seed(100 + rank)  # each rank's own noise
    names = dict(
        modules={"net": net, "rates": rates},
        optimizers={"outer": outer},
        generators={"tasks": tasks_rng},
    )
    state = folder / f"state{rank}.pt"
    step = fm.snapshot.load(state, **names).step if state.exists() else 0
    # every rank must resume from the same step
    low, high = torch.tensor([step]), torch.tensor([step])
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low != high:
        raise RuntimeError(f"ranks resume from different steps ({int(low)}..{int(high)})")
    tensors = {
        **dict(net.named_parameters()),
        **{f"rates.{k}": v for k, v in rates.named_parameters()},
    }
    while step < steps:
        b = fm.data.Sinusoid().sample(6, 5, 5, generator=tasks_rng)
        (xs, ys, xq, yq), count = fm.distributed.shard(b.support + b.query)
        ys = ys + 0.05 * torch.randn_like(ys)  # the global random state, per rank
        outer.zero_grad()
        fm.recipes.metasgd(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (xs, ys),
            (xq, yq),
            steps=1,
            lr=rates,
            task_chunk=None,  # pinned: a resumed run repeats bit for bit
        ).loss.backward()
        if kill_at is not None and step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        fm.distributed.average_gradients(tensors, count, timeout=20.0)
        outer.step()
        step += 1
        fm.snapshot.save(state, step=step, **names)
    torch.save({k: v.detach() for k, v in tensors.items()}, folder / f"final{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    kill = int(sys.argv[5]) if len(sys.argv) > 5 else None
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), kill)
