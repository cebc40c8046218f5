"""What the recipes share: their result type, the inner optimizer they default to, and the
query loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from torch import Tensor

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import AdaptResult, LossFn
from funcmeta._src.inner.inputs import check_model, split_batch, task_count
from funcmeta._src.inner.place import at
from funcmeta._src.inner.tasks import task_losses
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.optim.sgd import sgd

__all__ = ["RecipeResult", "check_recipe", "query_loss", "resolve_opt"]


@exposed_in("funcmeta.recipes")
class RecipeResult(NamedTuple):
    """What every recipe returns.

    Attributes:
        loss: the outer objective: call ``.backward()`` on it; its gradient is the method's
            meta-gradient, for the parameters and any learnable hyperparameters. For MAML,
            FOMAML, Meta-SGD and ANIL it is the mean query loss after adaptation, for MAML++
            the weighted multi-step query loss; for Reptile and iMAML, which are not
            loss-based, a surrogate whose gradient is the method's update direction.
        query_loss: the mean query loss after adaptation, detached, for logging (``None``
            when Reptile is given no query set).
        adapted: the inner loop's :class:`funcmeta.AdaptResult`, with a task axis (MAML++:
            that of the last step); ``None`` for Prototypical Networks, which have none.
        step_buffers: MAML++ only: each inner step's BatchNorm statistics, to pass back as
            ``step_buffers`` in the next call.
        residual: iMAML only: ``||rhs - (I + H/lam) x|| / ||rhs||`` of the returned
            solution, one per task.
        curvature_stop: iMAML only: the tasks whose conjugate gradient met non-positive
            curvature and stopped there.
        logits: the model's outputs on the query set, with a task axis: ``(T, Q, ways)``
            logits for a classifier, from the forward pass that gave ``query_loss`` (after
            adaptation; MAML++: after the last step), to compute accuracy without a second
            pass. Still part of the graph where ``loss`` is (MAML, ANIL, Meta-SGD, MAML++,
            ProtoNets, R2D2); detach before keeping them. ``None`` for Reptile without a
            query set.
    """

    loss: Tensor
    query_loss: Tensor | None
    adapted: AdaptResult | None
    step_buffers: list[dict[str, Tensor]] | None = None
    residual: Tensor | None = None
    curvature_stop: Tensor | None = None
    logits: Tensor | None = None


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
) -> tuple[Tensor, Any]:
    """The mean over tasks of each task's query loss, and the query outputs it was computed
    from (with a task axis)."""
    with at("the query batch"):
        losses, _, outputs = task_losses(
            fmodel, params, loss_fn, query, buffers=buffers, return_outputs=True
        )
    return losses.mean(), outputs
