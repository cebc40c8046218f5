"""Task-parallel meta-training over ``torch.distributed``.

Each rank adapts its share of the meta-batch and calls ``.backward()`` on the mean outer loss
of its tasks. :func:`average_gradients` then averages the ``.grad`` of the initial
parameters *and* of every learnable hyperparameter across ranks, weighted by the ranks'
task counts. That equals the gradient of the mean over the whole meta-batch. It uses plain
collectives (one ``all_reduce`` of one flat buffer): DDP does not support
``torch.autograd.grad``, and calling ``functional_call`` on ``ddp.module`` silently skips its
all-reduce. Works with gloo (CPU) and NCCL (CUDA); launch with ``torchrun``.

Example (one process; under ``torchrun`` every rank runs the same code):
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10, generator=torch.Generator().manual_seed(0))
    >>> (xs, ys, xq, yq), count = fm.distributed.shard((b.x_support, b.y_support, b.x_query, b.y_query))
    >>> fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, (xs, ys), (xq, yq), steps=1).loss.backward()
    >>> fm.distributed.average_gradients(net.parameters(), count)   # a no-op without a process group
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["average_gradients", "shard", "world"]


def world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``, or ``(0, 1)`` without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard(batch: Any, *, group: Any = None) -> tuple[Any, int]:
    """This rank's contiguous share of the leading task axis of every tensor in ``batch``.

    Returns ``(share, count)``, where ``count`` is the number of tasks in the share. Shares
    differ by at most one task. A rank may get none when there are fewer tasks than ranks;
    its ``count`` is then 0. Raises ``ValueError`` when the tensors disagree on the number of
    tasks.
    """
    leaves = [x for x in optree.tree_leaves(batch) if isinstance(x, Tensor)]
    if not leaves:
        raise ValueError("the batch holds no tensors to shard")
    tasks = leaves[0].shape[0]
    if any(x.dim() == 0 or x.shape[0] != tasks for x in leaves):
        raise ValueError(
            f"every batch tensor needs the same leading task axis ({tasks} tasks expected); "
            f"got leading sizes {[tuple(x.shape)[:1] for x in leaves]}"
        )
    rank, size = world(group)
    base, extra = divmod(tasks, size)
    start = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    share = optree.tree_map(
        lambda x: x[start : start + count] if isinstance(x, Tensor) else x, batch
    )
    return share, count


def average_gradients(
    tensors: Iterable[Tensor], count: int | float = 1, *, group: Any = None
) -> None:
    """Replace each tensor's ``.grad`` by the task-weighted mean over the ranks, in place.

    Call it on every rank, with the same tensors in the same order (the model's parameters,
    then the hyperparameters' parameters), after ``.backward()`` on the mean loss over this
    rank's ``count`` tasks. The result is ``sum_r count_r * grad_r / sum_r count_r``: the
    gradient of the mean over all tasks. A missing ``.grad`` counts as zeros (and is set). A
    rank whose share is empty skips ``.backward()`` and passes ``count=0``. Without an
    initialised process group it does nothing.
    """
    tensors = list(tensors)
    if world(group)[1] == 1 or not tensors:
        return
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in tensors]
    flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_ones(1)]) * float(count)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    total = flat[-1]
    if float(total) == 0:
        raise ValueError("no rank had any task: nothing to average")
    flat = flat[:-1] / total
    offset = 0
    for t, g in zip(tensors, grads, strict=True):
        n = g.numel()
        t.grad = flat[offset : offset + n].reshape(g.shape).to(g.dtype).clone()
        offset += n
