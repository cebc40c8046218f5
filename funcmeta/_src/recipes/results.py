"""What the recipes return: :class:`RecipeResult`, the fields every recipe has, and one
subclass per recipe with diagnostics of its own, holding only those."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NoReturn

from torch import Tensor

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import AdaptResult

__all__ = ["ImamlResult", "MamlppResult", "RecipeResult"]


@exposed_in("funcmeta.recipes")
@dataclass(frozen=True)
class RecipeResult:
    """What every recipe returns; MAML++ and iMAML return a subclass with their own extras
    (:class:`MamlppResult`, :class:`ImamlResult`).

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
        logits: the model's outputs on the query set, with a task axis: ``(T, Q, ways)``
            logits for a classifier, from the forward pass that gave ``query_loss`` (after
            adaptation; MAML++: after the last step), to compute accuracy without a second
            pass. Still part of the graph where ``loss`` is (MAML, ANIL, Meta-SGD, MAML++,
            ProtoNets, R2D2); detach before keeping them. ``None`` for Reptile without a
            query set.

    Example:
        >>> import torch, funcmeta as fm
        >>> out = fm.recipes.RecipeResult(torch.tensor(1.0), torch.tensor(1.0), None)
        >>> out.logits is None, isinstance(out, fm.recipes.RecipeResult)
        (True, True)
    """

    loss: Tensor
    query_loss: Tensor | None
    adapted: AdaptResult | None
    logits: Tensor | None = None

    def __iter__(self) -> NoReturn:
        raise TypeError(_NOT_A_TUPLE.format(what="unpacked", fields=_fields(self)))

    def __getitem__(self, index: object) -> NoReturn:
        old = _TUPLE_ORDER[index] if isinstance(index, int) and -7 <= index < 7 else None
        was = f" (out[{index}] was {old}: write out.{old})" if old else ""
        raise TypeError(_NOT_A_TUPLE.format(what=f"indexed{was}", fields=_fields(self)))


#: The order of the fields when recipe results were tuples (before 96e8464).
_TUPLE_ORDER = (
    "loss",
    "query_loss",
    "adapted",
    "step_buffers",
    "residual",
    "curvature_stop",
    "logits",
)
_NOT_A_TUPLE = (
    "a recipe's result is no longer a tuple and cannot be {what}: name its fields, {fields} "
    "(CHANGELOG.md, 96e8464: one result type per recipe)"
)


def _fields(result: RecipeResult) -> str:
    return ", ".join(f"out.{f.name}" for f in dataclasses.fields(result))


@exposed_in("funcmeta.recipes")
@dataclass(frozen=True, kw_only=True)
class MamlppResult(RecipeResult):
    """What :func:`funcmeta.recipes.mamlpp` returns: a :class:`RecipeResult` and

    Attributes:
        step_buffers: each inner step's BatchNorm statistics, to pass back as
            ``step_buffers`` in the next call.
    """

    step_buffers: list[dict[str, Tensor]]


@exposed_in("funcmeta.recipes")
@dataclass(frozen=True, kw_only=True)
class ImamlResult(RecipeResult):
    """What :func:`funcmeta.recipes.imaml` returns: a :class:`RecipeResult` and

    Attributes:
        residual: ``||rhs - (I + H/lam) x|| / ||rhs||`` of the returned solution, one per
            task.
        curvature_stop: the tasks whose conjugate gradient met non-positive curvature and
            stopped there.
    """

    residual: Tensor
    curvature_stop: Tensor
