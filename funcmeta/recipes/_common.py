"""Helpers shared by the recipes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from funcmeta.functional import FunctionalModel
from funcmeta.inner import LossFn
from funcmeta.optim.base import GradientTransformation
from funcmeta.optim.sgd import sgd
from funcmeta.tasks import task_losses

__all__ = ["query_loss", "resolve_opt"]


def resolve_opt(opt: GradientTransformation | None, lr: Any) -> GradientTransformation:
    """``opt`` if given, else plain SGD with learning rate ``lr`` (MAML's inner step)."""
    return sgd(lr=lr) if opt is None else opt


def query_loss(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor] | None,
    loss_fn: LossFn,
    query: tuple[Any, Any],
) -> Tensor:
    """The mean over tasks of each task's query loss."""
    losses, _ = task_losses(fmodel, params, buffers, loss_fn, query)
    return losses.mean()
