"""fm.distributed.gather_params(..., keep_frozen=True): the whole tensors of frozen shards kept
from one meta-step to the next, on 2 and 4 gloo ranks with uneven shares of the tasks. The
kept tensors give the meta-gradients of gathering at every step (float64, to the bit); a
frozen parameter is gathered again on every rank as soon as one rank's shard is written in
place (through the DTensor, through its local tensor), or the kept whole tensor is; learnt
parameters are gathered at every call; ``keep_frozen=False`` drops what was kept; a bad value
is refused. A peer gone before a call: tests/distributed/test_sharded.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import NEEDS_SHARDED, spawn_gloo
from torch import nn

import funcmeta as fm
from funcmeta._src.distributed import comm

pytestmark = NEEDS_SHARDED

FROZEN = ["0.weight", "0.bias", "2.weight", "2.bias"]  # the head, 4.*, is learnt


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)
    ).double()


def _batch(seed: int) -> tuple[torch.Tensor, ...]:
    """5 tasks: uneven shares on 2 ranks (3, 2) and on 4 (2, 1, 1, 1)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(5, 5, n, generator=g, dtype=torch.float64) for n in (3, 2, 3, 2))


def _meta(fmodel, params, batch) -> None:
    """Second-order MAML over the rank's tasks (the head adapted and meta-learnt)."""
    xs, ys, xq, yq = batch
    result = fm.adapt_tasks(
        fmodel,
        params,
        F.mse_loss,
        (xs, ys),
        fm.optim.sgd(lr=0.3),
        steps=2,
        trainable=["4.weight", "4.bias"],
    )
    fm.task_losses(fmodel, result.params, F.mse_loss, (xq, yq)).losses.mean().backward()


def _case_keep_frozen(world: int) -> dict:
    """Three meta-steps each way; in-place writes between calls; what each call gathered."""
    from torch.distributed.device_mesh import init_device_mesh

    gathered: list[str] = []
    gather_whole = comm.gather_whole

    def counted(shard, what):
        gathered.append(what.split("'")[1])
        return gather_whole(shard, what)

    comm.gather_whole = counted
    mesh = init_device_mesh("cpu", (world,))
    said: dict = {}
    for keep in (False, True):
        net = fm.distributed.shard_model(_net(), mesh)
        for name, p in net.named_parameters():
            p.requires_grad_(name not in FROZEN)
        fmodel = fm.functional_model(net)
        grads, calls = [], []
        for step in range(3):
            share, count = fm.distributed.shard(_batch(step))
            gathered.clear()
            whole = fm.distributed.gather_params(fmodel.params, count, keep_frozen=keep)
            calls.append(sorted(gathered))
            for p in net.parameters():
                p.grad = None
            _meta(fmodel, whole, share)
            grads.append([p.grad.full_tensor() for p in net.parameters() if p.requires_grad])
        said[keep] = {"grads": grads, "calls": calls}
    params = dict(net.named_parameters())

    def regathered(write=None) -> tuple[list[str], bool]:
        """Write, then call again: what was gathered, and whether every whole tensor equals a
        fresh gather of its shard."""
        if write is not None:
            write()
        gathered.clear()
        whole = fm.distributed.gather_params(fmodel.params, 1, keep_frozen=True)
        fresh = all(torch.equal(whole[n], p.full_tensor()) for n, p in params.items())
        return sorted(gathered), fresh

    rank = dist.get_rank()
    weight = params["2.weight"]

    def on_rank_one_local():  # one rank's local rows, no collective
        if rank == 1:
            weight.to_local().mul_(2.0)

    def through_the_dtensor():
        with torch.no_grad():
            params["0.bias"].add_(1.0)

    kept_whole = fm.distributed.gather_params(fmodel.params, 1, keep_frozen=True)

    def on_the_kept_whole():
        kept_whole["0.weight"].zero_()

    said["untouched"] = regathered()
    said["local write on rank 1"] = regathered(on_rank_one_local)
    said["through the DTensor"] = regathered(through_the_dtensor)
    said["on the kept whole"] = regathered(on_the_kept_whole)
    fm.distributed.gather_params(fmodel.params, 1)  # keep_frozen=False drops what was kept
    said["after a call that keeps nothing"] = regathered()
    try:
        fm.distributed.gather_params(fmodel.params, 1, keep_frozen="yes")
    except TypeError as error:
        said["bad value"] = str(error)
    comm.gather_whole = gather_whole
    return said


@pytest.mark.parametrize("world", [2, 4])
def test_kept_frozen_shards_give_the_same_meta_gradients_and_are_gathered_again_when_written(
    world,
):
    learnt = ["4.bias", "4.weight"]
    everything = sorted(FROZEN + learnt)
    for said in spawn_gloo(world, _case_keep_frozen):
        # the same meta-gradients, step after step, to the bit
        for a, b in zip(said[False]["grads"], said[True]["grads"], strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
        assert said[False]["calls"] == [everything] * 3
        assert said[True]["calls"] == [everything, learnt, learnt]
        assert said["untouched"] == (learnt, True)
        # every rank gathers what one rank's write made stale, and only that
        assert said["local write on rank 1"] == (sorted(["2.weight", *learnt]), True)
        assert said["through the DTensor"] == (sorted(["0.bias", *learnt]), True)
        assert said["on the kept whole"] == (sorted(["0.weight", *learnt]), True)
        assert said["after a call that keeps nothing"] == (everything, True)
        assert "keep_frozen must be True or False, got str" in said["bad value"]
