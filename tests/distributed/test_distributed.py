"""Two gloo processes on one CPU give the meta-gradients of one process on the whole
meta-batch (float64, to round-off), for MAML and Meta-SGD."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import init_gloo
from torch import nn

import funcmeta as fm

T = 5  # uneven on purpose: the ranks get 3 and 2 tasks


def setup(recipe):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    fmodel = fm.functional_model(net)
    rates = None
    if recipe == "metasgd":
        rates = fm.recipes.metasgd_rates(fmodel.params, generator=torch.Generator().manual_seed(1))
    b = fm.data.Sinusoid().sample(
        T, 5, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    return net, fmodel, rates, (b.x_support, b.y_support, b.x_query, b.y_query)


def meta_gradients(recipe, batch):
    net, fmodel, rates, full = setup(recipe)
    xs, ys, xq, yq = batch(full)
    if recipe == "maml":
        loss = fm.recipes.maml(
            fmodel, fmodel.params, F.mse_loss, (xs, ys), (xq, yq), lr=0.1, steps=2
        ).loss
        tensors = list(net.parameters())
    else:
        loss = fm.recipes.metasgd(
            fmodel, fmodel.params, F.mse_loss, (xs, ys), (xq, yq), lr=rates, steps=2
        ).loss
        tensors = [*net.parameters(), *rates.parameters()]
    loss.backward()
    return tensors


def worker(rank, world_size, init_file, out_dir, recipe):
    init_gloo(rank, init_file, world_size)
    try:
        counts = {}

        def my_share(full):
            share, counts["n"] = fm.distributed.shard(full)
            return share

        tensors = meta_gradients(recipe, my_share)
        fm.distributed.average_gradients(tensors, counts["n"])
        torch.save([t.grad for t in tensors], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe", ["maml", "metasgd"])
def test_two_gloo_processes_equal_one_process(recipe, tmp_path):
    mp.spawn(
        worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path), recipe), nprocs=2, join=True
    )
    reference = [t.grad for t in meta_gradients(recipe, lambda full: full)]
    for rank in range(2):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(grads) == len(reference)
        for a, b in zip(grads, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # the shards really differ: each rank alone is not the reference
    single = [t.grad for t in meta_gradients(recipe, lambda full: tuple(x[:3] for x in full))]
    assert not torch.allclose(single[0], reference[0])


def test_shard_without_a_process_group_and_errors():
    batch = (torch.zeros(4, 2), torch.zeros(4))
    share, count = fm.distributed.shard(batch)
    assert count == 4 and share[0].shape == (4, 2)
    assert fm.distributed.world() == (0, 1)
    with pytest.raises(ValueError, match="same leading task axis"):
        fm.distributed.shard((torch.zeros(4, 2), torch.zeros(3)))
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    fm.distributed.average_gradients([p], 4)  # no process group: unchanged
    assert torch.equal(p.grad, torch.full((2,), 3.0))
