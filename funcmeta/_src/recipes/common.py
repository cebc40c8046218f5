"""What the recipes share: the check of their call, the inner optimizer they default to, and
the query loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from funcmeta._src.core.types import LossFn, TaskChunk
from funcmeta._src.inner.inputs import check_model, split_batch, task_count
from funcmeta._src.inner.tasks import task_losses
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.optim.sgd import sgd
from funcmeta._src.runtime.place import at

__all__ = ["check_recipe", "query_loss", "resolve_opt"]


def check_recipe(fmodel: Any, support: Any, query: Any) -> None:
    """Check a recipe's model and that its support and query sets hold the same tasks (the
    same size of leading task axis), before any computation."""
    check_model(fmodel)
    if query is None:
        return
    tasks = task_count(split_batch(support))
    queries = task_count(split_batch(query))
    if tasks != queries:
        raise ValueError(
            f"support has {tasks} tasks but query has {queries}: the query set of task t is "
            "query[...][t], so both need the same leading task axis"
        )


def resolve_opt(opt: GradientTransformation | None, lr: Any) -> GradientTransformation:
    """``opt`` if given, else SGD with learning rate ``lr``. Neither, or both at once, is an
    error, not a silent choice: no learning rate is guessed, as no number of steps is."""
    if opt is not None and lr is not None:
        raise TypeError("pass the inner optimizer as opt= or its learning rate as lr=, not both")
    if opt is not None:
        return opt
    if lr is None:
        raise TypeError(
            "no inner learning rate: pass lr= (plain SGD's rate: a number, a tensor, or a "
            "learnable tree from fm.hyper) or opt= (any inner optimizer, e.g. "
            "fm.optim.adam(lr=1e-3)); a recipe guesses no learning rate"
        )
    return sgd(lr=lr)


def query_loss(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    query: tuple[Any, Any],
    buffers: Mapping[str, Tensor] | None,
    chunk: TaskChunk | None,
) -> tuple[Tensor, Any]:
    """The mean over tasks of each task's query loss, and the query outputs it was computed
    from (with a task axis), on ``chunk``, the chunk of the inner loop that adapted
    ``params``."""
    with at("the query batch"):
        losses, _, outputs = task_losses(
            fmodel,
            params,
            loss_fn,
            query,
            buffers=buffers,
            return_outputs=True,
            task_chunk="auto" if chunk is None else chunk,
        )
    return losses.mean(), outputs
