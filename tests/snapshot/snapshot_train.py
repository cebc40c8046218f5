"""A small Meta-SGD training run that saves its state after every step and resumes from it.

Used by tests/snapshot/test_snapshot.py: python tests/snapshot/snapshot_train.py STATE OUT STEPS [--slow]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm


def main(state: Path, out: Path, steps: int, slow: bool) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1))
    fmodel = fm.functional_model(net)
    rates = fm.recipes.metasgd_rates(fmodel.params, generator=torch.Generator().manual_seed(1))
    outer = torch.optim.Adam([*net.parameters(), *rates.parameters()], lr=1e-3)
    tasks_rng = torch.Generator().manual_seed(2)
    names = dict(
        modules={"net": net, "rates": rates},
        optimizers={"outer": outer},
        generators={"tasks": tasks_rng},
    )
    step = fm.snapshot.load(state, **names).step if state.exists() else 0
    while step < steps:
        b = fm.data.Sinusoid().sample(8, 5, 5, generator=tasks_rng)
        noisy = b.y_support + 0.05 * torch.randn_like(b.y_support)  # the global RNG too
        loss = fm.recipes.metasgd(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (b.x_support, noisy),
            (b.x_query, b.y_query),
            lr=rates,
            steps=1,
            task_chunk=None,  # pinned: a resumed run repeats bit for bit
        ).loss
        outer.zero_grad()
        loss.backward()
        outer.step()
        step += 1
        fm.snapshot.save(state, step=step, extra={"loss": loss.item()}, **names)
        if slow:
            time.sleep(0.05)
    torch.save(
        {**net.state_dict(), **{f"rates.{k}": v for k, v in rates.state_dict().items()}}, out
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), "--slow" in sys.argv)
