"""Where a module becomes a :class:`~funcmeta.FunctionalModel`: the
checkpointed layers chosen (``funcmeta._src.checkpoint``) and the task executor given
(``funcmeta._src.batching``); the one place that knows both.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fm.functional_model(net, checkpoint_layers="sequential").checkpointed
    ['0', '2']
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from funcmeta._src.batching.executor import TaskExecutor
from funcmeta._src.batching.recurrent import recurrent_layers
from funcmeta._src.checkpoint import takeover
from funcmeta._src.checkpoint.layers import CheckpointSpec, checkpointed_runner, select
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.sharding import sharding_of
from funcmeta._src.module.functional import FunctionalModel, check_layers
from funcmeta._src.runtime import EAGER

__all__ = ["functional_model"]

assert (
    takeover.dispatch is not None
)  # checkpoints a model takes itself go to funcmeta (see the module)


_MOVED: Any = object()  # functional_model's task_chunk= moved to the task-batched calls


@exposed_in("funcmeta")
def functional_model(
    module: nn.Module,
    *,
    checkpoint_layers: CheckpointSpec = None,
    task_chunk: Any = _MOVED,
) -> FunctionalModel:
    """Turn ``module`` into a :class:`FunctionalModel`: a pure function of a parameter dict.

    ``checkpoint_layers`` chooses layers to run under per-layer activation checkpointing
    (see :mod:`funcmeta.checkpoint`): ``None``; a preset name (``"sequential"``: the
    children of every ``nn.Sequential``/``nn.ModuleList``; ``"leaves"``); a list of
    submodule names; or a predicate ``(name, module) -> bool``. A checkpointed layer keeps its
    inputs instead of its activations, in first and in second order (the graph of a
    ``create_graph`` backward keeps the layer's inputs and incoming gradients only). Outputs
    and gradients, second order included, are those of the unchecked model (to float
    round-off). Unknown names, or a predicate that
    matches nothing, raise ``ValueError``. (Step-level checkpointing is the inner-loop option
    ``checkpoint_steps``: :class:`funcmeta.AdaptOptions`.)

    How many tasks a task-batched call runs at once is an argument of that call
    (``task_chunk=`` of :func:`funcmeta.adapt_tasks`, :func:`funcmeta.task_losses`,
    :func:`funcmeta.apply_tasks` and the recipes), never a setting of the model.

    A module sharded by :func:`funcmeta.distributed.shard_model` is sharded first, then
    made functional: the model takes that sharding's runtime (its gathers, checks and
    collectives). A module sharded later is refused by name at the model's next use.

    Example:
        >>> import torch, funcmeta as fm
        >>> fmodel = fm.functional_model(torch.nn.Linear(2, 1))
        >>> params = {k: torch.zeros_like(v) for k, v in fmodel.params.items()}
        >>> fmodel(params, torch.ones(1, 2)).item()
        0.0
    """
    if task_chunk is not _MOVED:
        raise TypeError(
            "fm.functional_model takes no task_chunk: the chunk of tasks is an argument of each "
            f"task-batched call now: fm.adapt_tasks(..., task_chunk={task_chunk!r}), "
            "fm.task_losses and fm.apply_tasks (task_chunk=result.chunk to follow the inner "
            "loop), and the recipes (see CHANGELOG.md)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"functional_model expects an nn.Module, got {type(module).__name__}")
    check_layers(module)
    sharding = sharding_of(module)  # the runtime of fm.distributed.shard_model, if it ran
    if sharding is not None:
        sharding.watch(module)  # its direct calls checked, also for a part of a sharded model
    checkpointed = select(module, checkpoint_layers)
    runner, copies = checkpointed_runner(module, checkpointed, recurrent_layers(module))
    build = functools.partial(checkpointed_runner, module, checkpointed)
    return FunctionalModel(
        module,
        runner=runner,
        copies=copies,
        checkpointed=checkpointed,
        executor=TaskExecutor(module, build),
        runtime=EAGER if sharding is None else sharding,
        sharded=sharding is not None,
    )
