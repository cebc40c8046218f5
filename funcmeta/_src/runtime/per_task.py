"""The per-task runtime: :data:`PER_TASK`, the eager runtime with the tasks of a call run one
at a time, without ``vmap``, and :func:`runtime_for`, which chooses it.

A model whose parameters are ``DTensor`` shards (``fm.distributed.shard_model``) runs under
no ``torch.func`` transform (``full_tensor()``, the per-layer gather, has no vmap rule), so
its task-batched calls (:func:`funcmeta.adapt_tasks`, :func:`funcmeta.task_losses`,
:func:`funcmeta.apply_tasks`, the recipes) map the tasks with a loop
(``funcmeta._src.core.vmap.loop_flat``): each task's slice of the parameters with a task axis
(a ``DTensor`` sharded behind that axis), the model's own run, the outputs stacked. The rest
is :data:`funcmeta._src.runtime.EAGER`'s: ``torch.autograd.grad``, the step frames, the
kernel choice. The chunk a call is given does not apply: one task at a time.

Example:
    >>> import torch
    >>> from funcmeta._src.runtime import EAGER, PER_TASK, runtime_for
    >>> runtime_for({"w": torch.ones(2)}) is EAGER
    True
    >>> PER_TASK.over_tasks(lambda x: x.sum(), (torch.ones(3, 2),), (0,), None).shape
    torch.Size([3])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from funcmeta._src.core.sharding import is_sharded
from funcmeta._src.core.vmap import loop_flat
from funcmeta._src.runtime.base import Runtime
from funcmeta._src.runtime.eager import EAGER, EagerRuntime

__all__ = ["PER_TASK", "PerTaskRuntime", "runtime_for"]


class PerTaskRuntime(EagerRuntime):
    """The per-task runtime (see the module docstring); :data:`PER_TASK` is the one instance."""

    def over_tasks(
        self,
        one_task: Callable[..., Any],
        trees: tuple[Any, ...],
        in_dims: tuple[Any, ...],
        chunk: int | None,
    ) -> Any:
        return loop_flat(one_task, trees, in_dims)


#: The per-task runtime.
PER_TASK = PerTaskRuntime()


def runtime_for(params: Mapping[str, Any]) -> Runtime:
    """The runtime of an eager task-batched call on ``params``: :data:`PER_TASK` when one is a
    ``DTensor`` (a sharded model), else :data:`funcmeta._src.runtime.EAGER`."""
    return PER_TASK if any(is_sharded(v) for v in params.values()) else EAGER
