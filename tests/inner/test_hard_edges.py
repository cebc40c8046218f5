"""Hard edges: in-place operations and non-tensor outputs under checkpointing (one task and
task batching), and 200 meta-iterations in constant memory."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

DTYPE = torch.float64


class Block(nn.Module):
    """In-place operations and a non-tensor output (a dict with an int)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        h = self.lin(x)
        h += x  # in-place residual into the linear output
        h.relu_()  # in-place activation
        return {"out": self.norm(h), "width": h.shape[-1], "tag": "block"}


class Net(nn.Module):
    def __init__(self, width=6):
        super().__init__()
        self.inp = nn.Linear(1, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            result = block(h)
            assert result["width"] == h.shape[-1] and result["tag"] == "block"
            h = result["out"]
        return self.head(h)


def meta_grads(checkpoint, tasks, checkpoint_steps=False):
    torch.manual_seed(0)
    net = Net().to(DTYPE)
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint)
    b = fm.data.Sinusoid().sample(3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    opt = fm.optim.adam(lr=0.05)
    if tasks:
        r = fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (b.x_support, b.y_support),
            opt,
            steps=2,
            checkpoint_steps=checkpoint_steps,
        )
        loss = fm.task_losses(fmodel, r.params, F.mse_loss, (b.x_query, b.y_query))[0].mean()
    else:
        r = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (b.x_support[0], b.y_support[0]),
            opt,
            steps=2,
            checkpoint_steps=checkpoint_steps,
        )
        loss = F.mse_loss(fmodel(r.params, b.x_query[0]), b.y_query[0])
    return torch.autograd.grad(loss, list(net.parameters()))


@pytest.mark.parametrize("tasks", [False, True], ids=["one-task", "task-batched"])
@pytest.mark.parametrize("setting", ["sequential", "steps", "both"])
def test_inplace_ops_and_non_tensor_outputs_under_checkpointing(setting, tasks):
    reference = meta_grads(None, tasks)
    checkpoint = None if setting == "steps" else "sequential"
    ours = meta_grads(checkpoint, tasks, checkpoint_steps=setting in ("steps", "both"))
    assert fm.functional_model(Net(), checkpoint_layers="sequential").checkpointed == [
        "blocks.0",
        "blocks.1",
    ]
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read RSS")
def test_two_hundred_meta_iterations_in_constant_memory():
    """Task-batched Meta-SGD with step checkpointing: no graph, state or statistics kept
    from one meta-iteration to the next."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    rates = fm.recipes.metasgd_rates(fmodel.params)
    outer = torch.optim.Adam([*net.parameters(), *rates.parameters()], lr=1e-3)
    rng = torch.Generator().manual_seed(0)
    alive, rss = [], []
    for i in range(200):
        b = fm.data.Sinusoid().sample(8, 64, 64, generator=rng)
        loss = fm.recipes.metasgd(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (b.x_support, b.y_support),
            (b.x_query, b.y_query),
            lr=rates,
            steps=2,
            checkpoint_steps=True,
        ).loss
        outer.zero_grad()
        loss.backward()
        outer.step()
        alive.append(weakref.ref(loss))
        del loss
        if i % 20 == 19:  # a full collection costs more than a meta-iteration in a big process
            gc.collect()
            rss.append(rss_bytes())
    assert [i for i, ref in enumerate(alive) if ref() is not None] == []
    growth = rss[-1] - rss[0]
    assert growth < 16 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 180 meta-iterations"
