"""The few-shot evaluation protocol: the implementation of :mod:`funcmeta.evaluation`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import NonFiniteError
from funcmeta._src.data.episodes import EpisodeBatch, Episodes
from funcmeta._src.inner.adapt import adapt
from funcmeta._src.inner.inputs import check_model
from funcmeta._src.inner.options import AdaptKeywords
from funcmeta._src.inner.tasks import adapt_tasks, apply_tasks
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.module.task_protocol import check_task_chunk
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.recipes.protonet import embed_episodes, prototype_logits

__all__ = ["Evaluation", "evaluate", "mean_ci"]

METHODS = ("adapt", "prototypes")


def _t_quantile(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (Cornish-Fisher
    expansion around the normal 1.959964: within 0.025 of the exact value for dof >= 3,
    3e-3 for dof >= 5 and 1e-3 for dof >= 10)."""
    z = 1.959963984540054
    if dof <= 0:
        return math.inf
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3


@exposed_in("funcmeta.evaluation")
def mean_ci(values: Tensor) -> tuple[float, float]:
    """``(mean, half-width)`` of the 95% confidence interval of the mean of ``values``
    (Student's t with ``n - 1`` degrees of freedom; 1.96 standard errors for large ``n``,
    the convention of few-shot papers). One value has an infinite interval."""
    v = values.detach().double().flatten()
    if v.numel() == 0:
        raise ValueError("no values to average")
    mean = v.mean().item()
    if v.numel() == 1:
        return mean, math.inf
    sem = v.std(unbiased=True).item() / math.sqrt(v.numel())
    return mean, _t_quantile(v.numel() - 1) * sem


@exposed_in("funcmeta")
class Evaluation(NamedTuple):
    """What :func:`evaluate` returns: ``accuracy`` (mean over episodes), ``ci95`` (the
    half-width of its 95% confidence interval) and ``per_episode`` accuracies ``(N,)``."""

    accuracy: float
    ci95: float
    per_episode: Tensor

    @property
    def error(self) -> float:
        """``1 - accuracy``: the mean error rate (its interval is the same ``ci95``)."""
        return 1.0 - self.accuracy

    def __str__(self) -> str:
        return f"{100 * self.accuracy:.2f}% ± {100 * self.ci95:.2f}% ({len(self.per_episode)} episodes)"


def _chunks(
    episodes: Episodes | EpisodeBatch, num_episodes: int, batch_tasks: int, seed: int
) -> Iterator[EpisodeBatch]:
    if isinstance(episodes, Episodes):
        generator = torch.Generator().manual_seed(seed)
        left = num_episodes
        while left > 0:
            yield episodes.sample(min(batch_tasks, left), generator=generator)
            left -= batch_tasks
    elif isinstance(episodes, EpisodeBatch):
        total = episodes.x_support.shape[0]
        for start in range(0, total, batch_tasks):
            yield EpisodeBatch(*(t[start : start + batch_tasks] for t in episodes))
    else:
        raise TypeError(
            "episodes must be a funcmeta.data.Episodes sampler or an EpisodeBatch (such as "
            f"load_omniglot_runs' runs), got {type(episodes).__name__}"
        )


def _first_columns(loss_fn: Callable[..., Tensor], ways: int) -> Callable[..., Tensor]:
    def sliced(out: Tensor, target: Any) -> Tensor:
        return loss_fn(out[..., :ways], target)

    return sliced


def _adapted_logits(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: Callable[..., Tensor],
    batch: EpisodeBatch,
    opt: GradientTransformation,
    steps: int,
    buffers: Mapping[str, Tensor] | None,
    batched: bool,
    task_chunk: int | str | None,
    options: Mapping[str, Any],
) -> Tensor:
    if batched:
        result = adapt_tasks(
            fmodel,
            params,
            loss_fn,
            batch.support,
            opt,
            steps=steps,
            buffers=buffers,
            task_chunk=task_chunk,
            **options,
        )
        out, _ = apply_tasks(
            fmodel, result.params, batch.x_query, buffers=result.buffers, task_chunk=result.chunk
        )
        return out
    outs = []
    for t in range(batch.x_support.shape[0]):
        one = adapt(
            fmodel,
            params,
            loss_fn,
            (batch.x_support[t], batch.y_support[t]),
            opt,
            steps=steps,
            buffers=buffers,
            **options,
        )
        outs.append(fmodel.run(one.params, one.buffers, batch.x_query[t])[0])
    return torch.stack(outs)


@exposed_in("funcmeta")
def evaluate(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: Callable[..., Tensor],
    episodes: Episodes | EpisodeBatch,
    opt: GradientTransformation | None = None,
    *,
    steps: int | None = None,
    method: str | Callable[[Tensor, Tensor, Tensor, int], Tensor] = "adapt",
    num_episodes: int = 600,
    batch_tasks: int = 32,
    seed: int = 0,
    buffers: Mapping[str, Tensor] | None = None,
    task_chunk: int | str | None = "auto",
    **options: Unpack[AdaptKeywords],
) -> Evaluation:
    """Few-shot classification accuracy over episodes, with its 95% confidence interval.

    ``episodes`` is an :class:`funcmeta.data.Episodes` sampler, from which ``num_episodes``
    episodes (600 is the convention) are drawn with a generator seeded by ``seed`` (the same
    seed, the same episodes), or an :class:`funcmeta.data.EpisodeBatch` of fixed episodes
    (such as :func:`funcmeta.data.load_omniglot_runs`), all of which are scored.

    ``method="adapt"`` (MAML and its family): ``steps`` steps (required, as everywhere; 0
    scores the unadapted model) of ``opt`` on each episode's
    support set from ``params``, as in :func:`funcmeta.adapt_tasks` (``options`` are its
    inner-loop options: ``trainable=`` for ANIL, ...), then the query set's predictions are
    the adapted model's argmax. ``method="prototypes"`` (Prototypical Networks): the model is
    an embedding and a query's class is its nearest support prototype; ``opt`` and ``steps``
    are not used. ``method`` may also be a head called as ``method(z_support, y_support,
    z_query, ways) -> logits`` on the embeddings (a :class:`funcmeta.heads.RidgeHead` for
    R2D2), with the model as the embedding, as for prototypes. A model whose output has more columns than an episode has ways (a head
    trained 20-way, scored on 5-way episodes) is adapted and scored on its first ``ways``
    columns. Episodes go ``batch_tasks`` at a time through the task-batched calls;
    ``batch_tasks=1`` runs them one by one through :func:`funcmeta.adapt` (models that
    cannot be batched); ``task_chunk`` is how many of a batch's tasks run at once, as
    :func:`funcmeta.adapt_tasks` takes it (``"tune"``: for the inner loop, whose chunk the
    query pass then takes). No graph is kept: everything runs under ``torch.no_grad``, the inner
    steps first order (as they are under ``no_grad`` anyway). Non-finite query logits raise
    :class:`funcmeta.NonFiniteError`: an argmax of NaN would score as chance.
    """
    check_model(fmodel)
    check_task_chunk(task_chunk, "fm.evaluate", inner_loop=method == "adapt", follows=False)
    head = method if callable(method) else None
    if head is None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or a head, got {method!r}")
    check_int(num_episodes, "num_episodes", low=1)
    check_int(batch_tasks, "batch_tasks", low=1)
    if method == "adapt":
        if opt is None:
            raise TypeError("method='adapt' needs the inner optimizer opt")
        if steps is None:
            raise TypeError(
                "method='adapt' needs steps=, the number of inner steps on each support set "
                "(steps=0 scores the unadapted model)"
            )
        check_int(steps, "steps")
    elif opt is not None or steps is not None or options:
        what = "a head" if head is not None else "method='prototypes'"
        raise TypeError(f"{what} adapts nothing: it takes no opt, steps or options")
    scores = []
    with torch.no_grad():
        for batch in _chunks(episodes, num_episodes, batch_tasks, seed):
            ways = batch.classes.shape[1]
            if method != "adapt":
                z_s, z_q = embed_episodes(
                    fmodel,
                    params,
                    batch.x_support,
                    batch.x_query,
                    buffers,
                    task_chunk,
                )
                logits = (head or prototype_logits)(z_s, batch.y_support, z_q, ways)
            else:
                assert opt is not None and steps is not None  # checked above for "adapt"
                logits = _adapted_logits(
                    fmodel,
                    params,
                    _first_columns(loss_fn, ways),
                    batch,
                    opt,
                    steps,
                    buffers,
                    batch_tasks > 1,
                    task_chunk,
                    options,
                )[..., :ways]
            if not bool(torch.isfinite(logits).all()):
                bad = (~torch.isfinite(logits)).flatten(1).any(1).nonzero().flatten()
                raise NonFiniteError(
                    f"the query logits of {len(bad)} of {len(logits)} episodes in this batch "
                    f"are NaN or infinite (episodes {bad.tolist()[:10]} of the batch): an "
                    "argmax of them is no score. Check the model and params (and the inner "
                    "steps' learning rate)"
                )
            scores.append((logits.argmax(-1) == batch.y_query).double().mean(-1))
    per_episode = torch.cat(scores)
    mean, half = mean_ci(per_episode)
    return Evaluation(mean, half, per_episode)
