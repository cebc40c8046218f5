"""Choosing how many tasks run at once, by measurement: :func:`tune_task_chunk`.

Task batching runs the tasks' forward and backward as one computation. That pays where one
task leaves the hardware idle (small models; GPUs), and can lose where one task's
activations already keep the device busy and the batched ones are too large for its caches
(conv nets on a CPU): see docs/tasks.md. The ``task_chunk`` of a task-batched call runs its
tasks in chunks; its default, ``"auto"``, is a rule of the shapes (no timing). This function
times a second-order meta-iteration for each candidate chunk size on the caller's own
workload up front, for the caller to pass the fastest as ``task_chunk``
(``task_chunk="tune"`` measures the same way on the first calls instead).

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> fmodel = fm.functional_model(torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    >>> b = fm.data.Sinusoid().sample(8, 5, 5)
    >>> times = fm.tune_task_chunk(fmodel, fmodel.params, F.mse_loss, b.support, fm.optim.sgd(lr=0.01), steps=2, query=b.query, repeats=1)
    >>> sorted(times)
    [1, 4, 8]
    >>> best = min(times, key=times.__getitem__)   # the fastest
    >>> r = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support, fm.optim.sgd(lr=0.01),
    ...                    steps=2, task_chunk=best)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.batching.chunks import candidate_chunks
from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.inputs import split_batch, task_count
from funcmeta._src.inner.options import AdaptKeywords
from funcmeta._src.inner.tasks import adapt_tasks, task_losses
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation

__all__ = ["tune_task_chunk"]


@exposed_in("funcmeta")
def tune_task_chunk(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    opt: GradientTransformation,
    *,
    steps: int,
    query: tuple[Any, Any] | None = None,
    candidates: Sequence[int] | None = None,
    repeats: int = 3,
    buffers: Mapping[str, Tensor] | None = None,
    **options: Unpack[AdaptKeywords],
) -> dict[int, float]:
    """Time a meta-iteration for each chunk size: pass the fastest as ``task_chunk``.

    The meta-iteration is :func:`funcmeta.adapt_tasks` on ``batch`` (the support sets) with
    ``opt``, ``steps`` and ``options``, then the gradient of the adapted parameters' summed
    losses on ``query`` (default: ``batch`` again) with respect to the entries of ``params``
    that require grad: the second-order backward, unless ``first_order=True`` is among the
    options. Pass the query sets when they are larger than the support sets: the query pass
    is then much of the work. Candidates (default: the grid ``task_chunk="tune"`` measures,
    1, 4, 16, ... below the number of tasks T, and T) are timed interleaved, each round in a
    rotated order, ``repeats`` times each after one warm-up run, on the device and data given.

    Returns:
        The median milliseconds per meta-iteration, by chunk size (T: all tasks at once).
        Nothing is set: the chunk is an argument of each call (``task_chunk=`` of
        :func:`funcmeta.adapt_tasks`, :func:`funcmeta.task_losses` and the recipes).
    """
    tasks = task_count(split_batch(batch))
    sizes = (
        sorted(c or tasks for c in candidate_chunks(tasks))
        if candidates is None
        else sorted(set(candidates))
    )
    if not sizes:
        raise ValueError(f"candidates must be positive ints, got {candidates!r}")
    for c in sizes:
        check_int(c, "candidates", low=1, what=f"positive ints (all of {candidates!r})")
    check_int(repeats, "repeats", low=1, what="a positive int")
    fmodel.runtime.for_params(params).refuse(
        "fm.tune_task_chunk",
        "a sharded model's task-batched calls run one task at a time (a DTensor does not run "
        "under vmap), so there is no chunk to choose",
    )
    leaves = [v for v in params.values() if v.requires_grad]
    devices = {v.device for v in params.values()}

    def sync() -> None:
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def iteration(chunk: int) -> float:
        sync()
        start = time.perf_counter()
        result = adapt_tasks(
            fmodel,
            params,
            loss_fn,
            batch,
            opt,
            steps=steps,
            buffers=buffers,
            task_chunk=chunk,
            **options,
        )
        target = batch if query is None else query
        losses = task_losses(
            fmodel, result.params, loss_fn, target, buffers=result.buffers, task_chunk=result.chunk
        ).losses
        if leaves and losses.requires_grad:
            torch.autograd.grad(losses.sum(), leaves, allow_unused=True)
        sync()
        return (time.perf_counter() - start) * 1e3

    times: dict[int, list[float]] = {c: [] for c in sizes}
    for round_ in range(repeats + 1):
        for i in range(len(sizes)):
            c = sizes[(i + round_) % len(sizes)]  # rotated: no size always runs first
            ms = iteration(c)
            if round_:
                times[c].append(ms)
    return {c: statistics.median(v) for c, v in times.items()}
