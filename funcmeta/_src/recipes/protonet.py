"""Prototypical Networks (Snell et al., 2017): classify by distance to class means.

Each task's support and query inputs go through the embedding network in one forward (as in
the authors' code; BatchNorm batch statistics then cover both). A class's prototype is the
mean embedding of its support examples; a query's logits are the negative squared Euclidean
distances to the prototypes. There is no inner loop: the meta-gradient is the ordinary
gradient of the query loss. Tasks run batched, through :func:`funcmeta.apply_tasks`.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = fm.models.conv4_omniglot(None, hidden=8)          # an embedding: no head
    >>> fmodel = fm.functional_model(net)
    >>> ys = torch.arange(5).repeat(4, 1)                          # 4 tasks, 5-way 1-shot
    >>> support, query = (torch.rand(4, 5, 1, 28, 28), ys), (torch.rand(4, 5, 1, 28, 28), ys)
    >>> out = fm.recipes.protonet(fmodel, fmodel.params, F.cross_entropy, support, query)
    >>> out.loss.backward()
    >>> out.logits.shape                                           # (tasks, queries, ways)
    torch.Size([4, 5, 5])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.inputs import check_model
from funcmeta._src.inner.tasks import apply_tasks
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.module.task_protocol import check_task_chunk
from funcmeta._src.recipes.results import RecipeResult
from funcmeta._src.runtime.place import at

__all__ = ["prototype_logits", "protonet"]


def _labels(y: Any, what: str) -> Tensor:
    if not isinstance(y, Tensor) or y.dim() != 2 or y.is_floating_point() or y.is_complex():
        raise ValueError(f"{what} targets must be integer class labels of shape (tasks, examples)")
    return y


@exposed_in("funcmeta.recipes")
def prototype_logits(
    support_embeddings: Tensor, support_labels: Tensor, query_embeddings: Tensor, ways: int
) -> Tensor:
    """``(T, Q, ways)`` negative squared distances from each query embedding ``(T, Q, D)`` to
    each class's mean support embedding (from ``(T, S, D)`` and labels ``(T, S)`` in
    ``0 .. ways-1``). A class without support examples raises ``ValueError``."""
    onehot = torch.nn.functional.one_hot(support_labels, ways).to(support_embeddings.dtype)
    counts = onehot.sum(1)  # (T, ways)
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero()[0].tolist()
        raise ValueError(f"task {empty[0]} has no support example of class {empty[1]}")
    prototypes = torch.einsum("tsw,tsd->twd", onehot, support_embeddings) / counts.unsqueeze(-1)
    return -(query_embeddings.unsqueeze(2) - prototypes.unsqueeze(1)).pow(2).sum(-1)


def embed_episodes(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    x_support: Tensor,
    x_query: Tensor,
    buffers: Mapping[str, Tensor] | None,
    task_chunk: int | str | None = "auto",
) -> tuple[Tensor, Tensor]:
    """Support and query embeddings ``(T, S, D)``, ``(T, Q, D)``: one task-batched forward of
    both (``task_chunk`` tasks at a time, as :func:`funcmeta.apply_tasks` takes it), flattened
    after the example axis."""
    if not (isinstance(x_support, Tensor) and isinstance(x_query, Tensor)):
        raise TypeError("protonet takes tensor inputs: (T, examples, ...) for support and query")
    if x_support.shape[0] != x_query.shape[0]:
        raise ValueError(f"support has {x_support.shape[0]} tasks but query has {x_query.shape[0]}")
    both = torch.cat([x_support, x_query], dim=1)
    with at("the support and query batches (concatenated along the example axis)"):
        out, _ = apply_tasks(fmodel, params, both, buffers=buffers, task_chunk=task_chunk)
    out = out.flatten(2)
    return out[:, : x_support.shape[1]], out[:, x_support.shape[1] :]


@exposed_in("funcmeta.recipes")
def protonet(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    ways: int | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    task_chunk: int | str | None = "auto",
) -> RecipeResult:
    """Prototypical Networks on a batch of tasks: ``loss`` is the mean over tasks of
    ``loss_fn(logits, y_query)`` (use ``F.cross_entropy``), with ``logits`` the negative
    squared distances of the query embeddings to the support prototypes.

    ``fmodel`` is the embedding network (its output is flattened after the example axis);
    ``support`` and ``query`` are ``(inputs, labels)`` with a leading task axis and labels in
    ``0 .. ways-1`` (``ways`` defaults to the largest support label plus one). There are no
    inner steps, so the recipe takes no ``steps`` and no inner-loop options; ``result.logits``
    holds the query logits, ``result.adapted`` is ``None``. ``task_chunk`` is how many tasks
    the embedding pass runs at once (``"auto"``, ``None`` or a number, as
    :func:`funcmeta.apply_tasks` takes it).
    """
    check_task_chunk(task_chunk, "fm.recipes.protonet", inner_loop=False, follows=False)
    return classify_embeddings(
        prototype_logits, fmodel, params, loss_fn, support, query, ways, buffers, task_chunk
    )


def classify_embeddings(
    head: Callable[[Tensor, Tensor, Tensor, int], Tensor],
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    ways: int | None,
    buffers: Mapping[str, Tensor] | None,
    task_chunk: int | str | None,
) -> RecipeResult:
    """The recipes without an inner loop: embed the episodes, classify the queries with
    ``head(z_support, y_support, z_query, ways) -> logits``, and average ``loss_fn`` over
    the tasks."""
    check_model(fmodel)
    y_s, y_q = _labels(support[1], "support"), _labels(query[1], "query")
    for (x, y), what in ((support, "support"), (query, "query")):
        if isinstance(x, Tensor) and tuple(x.shape[:2]) != tuple(y.shape):
            raise ValueError(
                f"{what} labels have shape {tuple(y.shape)} but its inputs {tuple(x.shape)}: "
                "one label per example, (tasks, examples), with the inputs' two first axes"
            )
    if ways is not None:
        check_int(ways, "ways", low=1)
    high = int(y_s.max()) + 1 if y_s.numel() else 0
    ways = high if ways is None else ways
    for y, what in ((y_s, "support"), (y_q, "query")):
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= ways):
            raise ValueError(
                f"{what} labels must lie in [0, {ways}) (ways={ways}), got labels from "
                f"{int(y.min())} to "
                f"{int(y.max())}: relabel each task's classes 0 .. ways-1 (fm.data.Episodes "
                "does), or pass ways="
            )
    z_s, z_q = embed_episodes(fmodel, params, support[0], query[0], buffers, task_chunk)
    logits = head(z_s, y_s, z_q, ways)
    loss = torch.stack([loss_fn(lg, y) for lg, y in zip(logits, y_q, strict=True)]).mean()
    return RecipeResult(loss, loss.detach(), None, logits=logits)
