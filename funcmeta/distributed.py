"""Meta-training over ``torch.distributed``: tasks split across ranks, and a model's
parameters sharded across them.

Each rank adapts its share of the meta-batch and calls ``.backward()`` on the mean outer loss
of its tasks. :func:`average_gradients` then averages the ``.grad`` of the initial
parameters *and* of every learnable hyperparameter across ranks, weighted by the ranks'
task counts. That equals the gradient of the mean over the whole meta-batch. It uses plain
collectives (one ``all_reduce`` of one flat buffer): DDP does not support
``torch.autograd.grad``, and calling ``functional_call`` on ``ddp.module`` silently skips its
all-reduce. Works with gloo (CPU) and NCCL (CUDA); launch with ``torchrun``.

Failures are loud and the same on every rank. Before averaging, the ranks compare a
signature of what they average (names, shapes, dtypes, count; one 8-byte collective): a
disagreement raises :class:`MismatchError` on every rank, naming the first difference,
instead of an abort inside the backend or a silently wrong average. Every collective waits at
most ``timeout`` seconds (:data:`DEFAULT_TIMEOUT`): a peer that died or stalled raises
:class:`PeerError` on the survivors instead of hanging them.

:func:`shard_model` splits a model's parameters instead: each becomes a ``DTensor`` shard
over a ``DeviceMesh``, gathered a layer at a time while that layer runs (with per-layer
checkpointing, again when it is recomputed), so that a rank holds its shards and one layer's
full parameters; :func:`funcmeta.adapt` runs on it, second order, and the meta-gradients land
in the shards' ``.grad`` (docs/distributed.md, "Sharded parameters"). :func:`shard_hyper`
places learnable inner rates beside them (per-element rates sharded, the others replicated).
:func:`gather_params` splits the tasks across the same ranks instead: the whole parameters
gathered once per meta-step for this rank's own tasks, the meta-gradient reduce-scattered
into the shards in the backward.

Example (one process; under ``torchrun`` every rank runs the same code):
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10, generator=torch.Generator().manual_seed(0))
    >>> (xs, ys, xq, yq), count = fm.distributed.shard((b.x_support, b.y_support, b.x_query, b.y_query))
    >>> fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, (xs, ys), (xq, yq), steps=1, lr=0.01).loss.backward()
    >>> fm.distributed.average_gradients(net.parameters(), count)   # a no-op without a process group
"""

from funcmeta._src.core.sharding import DEFAULT_TIMEOUT, PeerError, ShardingError
from funcmeta._src.distributed.collectives import (
    MismatchError,
    average_gradients,
    shard,
    world,
)
from funcmeta._src.distributed.runtime import gathered_bytes
from funcmeta._src.distributed.sharded import shard_hyper, shard_model
from funcmeta._src.distributed.split import gather_params

__all__ = [
    "DEFAULT_TIMEOUT",
    "MismatchError",
    "PeerError",
    "ShardingError",
    "average_gradients",
    "gather_params",
    "gathered_bytes",
    "shard",
    "shard_hyper",
    "shard_model",
    "world",
]
