"""R2D2 (Bertinetto et al., 2019): a closed-form ridge-regression head on a learned embedding.

Each task's support and query inputs go through the embedding network in one forward (as in
:func:`funcmeta.recipes.protonet`). The head (:class:`funcmeta.heads.RidgeHead`) regresses the
one-hot support labels on the support embeddings in closed form, and scores the queries with
the solution, scaled and shifted by learnable scalars. There is no inner loop: the
meta-gradient flows through the ridge solution, exactly (differentiating the closed form) or
implicitly (:func:`funcmeta.implicit.root`), into the embedding and the head's regulariser.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = fm.models.conv4_omniglot(None, hidden=8)          # an embedding: no head
    >>> fmodel = fm.functional_model(net)
    >>> head = fm.heads.RidgeHead(lam=1.0, scale=10.0)
    >>> outer = torch.optim.Adam([*net.parameters(), *head.parameters()], lr=1e-3)
    >>> ys = torch.arange(5).repeat(4, 1)                          # 4 tasks, 5-way 1-shot
    >>> support, query = (torch.rand(4, 5, 1, 28, 28), ys), (torch.rand(4, 5, 1, 28, 28), ys)
    >>> out = fm.recipes.r2d2(fmodel, fmodel.params, F.cross_entropy, support, query, head=head)
    >>> out.loss.backward()
    >>> outer.step()
    >>> out.logits.shape
    torch.Size([4, 5, 5])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import LossFn
from funcmeta._src.heads.ridge import RidgeHead
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.module.task_protocol import check_task_chunk
from funcmeta._src.recipes.protonet import classify_embeddings
from funcmeta._src.recipes.results import RecipeResult

__all__ = ["r2d2"]


@exposed_in("funcmeta.recipes")
def r2d2(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    head: RidgeHead,
    ways: int | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    task_chunk: int | str | None = "auto",
) -> RecipeResult:
    """R2D2 on a batch of tasks: ``loss`` is the mean over tasks of ``loss_fn(logits,
    y_query)`` (use ``F.cross_entropy``), with ``logits = head(z_support, y_support, z_query,
    ways)``.

    ``fmodel`` is the embedding network (its output is flattened after the example axis),
    ``head`` a :class:`funcmeta.heads.RidgeHead` (its ``method`` picks exact or implicit
    differentiation; put its parameters in the outer optimizer). ``support`` and ``query`` are
    ``(inputs, labels)`` with a leading task axis and labels in ``0 .. ways-1`` (``ways``
    defaults to the largest support label plus one). Like Prototypical Networks, it takes no
    ``steps`` and no inner-loop options; ``result.logits`` holds the query logits and
    ``result.adapted`` is ``None``. ``task_chunk`` is as in
    :func:`funcmeta.recipes.protonet`.
    """
    if not isinstance(head, RidgeHead):
        raise TypeError(f"head must be a funcmeta.heads.RidgeHead, got {type(head).__name__}")
    check_task_chunk(task_chunk, "fm.recipes.r2d2", inner_loop=False, follows=False)
    return classify_embeddings(
        head, fmodel, params, loss_fn, support, query, ways, buffers, task_chunk
    )
