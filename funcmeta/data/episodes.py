"""N-way K-shot episodes over any labelled tensors, and class splits.

Example:
    >>> import torch, funcmeta as fm
    >>> images, labels = torch.randn(200, 1, 8, 8), torch.arange(20).repeat_interleave(10)
    >>> train, test = fm.data.split_classes(labels, [15, 5], generator=torch.Generator().manual_seed(0))
    >>> episodes = fm.data.Episodes(images, labels, ways=5, shots=1, query=3, classes=train)
    >>> b = episodes.sample(4, generator=torch.Generator().manual_seed(1))
    >>> b.x_support.shape, b.y_support[0].tolist(), b.x_query.shape
    (torch.Size([4, 5, 1, 8, 8]), [0, 1, 2, 3, 4], torch.Size([4, 15, 1, 8, 8]))
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from funcmeta._src.core.checks import check_int

__all__ = ["EpisodeBatch", "Episodes", "omniglot_characters", "split_classes"]


class EpisodeBatch(NamedTuple):
    """A batch of N-way K-shot episodes; every tensor has a leading task axis ``T``.

    ``x_support``: ``(T, ways * shots, ...)``; ``y_support``: ``(T, ways * shots)`` with labels
    relabelled to ``0 .. ways-1`` (support ordered class by class); ``x_query``/``y_query``:
    ``(T, ways * query, ...)``; ``classes``: ``(T, ways)``, the original label of each way.
    """

    x_support: Tensor
    y_support: Tensor
    x_query: Tensor
    y_query: Tensor
    classes: Tensor

    @property
    def support(self) -> tuple[Tensor, Tensor]:
        """``(x_support, y_support)``: the support batch, as the recipes and
        :func:`funcmeta.adapt_tasks` take it."""
        return (self.x_support, self.y_support)

    @property
    def query(self) -> tuple[Tensor, Tensor]:
        """``(x_query, y_query)``: the query batch."""
        return (self.x_query, self.y_query)


def split_classes(
    labels: Tensor,
    sizes: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    groups: Sequence[Hashable] | Mapping[int, Hashable] | None = None,
) -> list[list[int]]:
    """Split the distinct labels of ``labels`` into disjoint random groups of ``sizes``
    (meta-train / meta-validation / meta-test classes). The sizes may sum to less than the
    number of classes; more raises ``ValueError``.

    ``groups`` keeps related classes together: a key per class (indexed by the class label,
    a sequence or a mapping), and classes with the same key always land in the same split.
    Omniglot loaded with ``rotations=True`` has four classes per character; split it with
    ``groups=fm.data.omniglot_characters(class_names)``, or every held-out class may be a
    rotation of a character that is trained on. Each size must then be met by whole groups
    (``ValueError`` otherwise, naming the group sizes).

    Example:
        >>> import torch, funcmeta as fm
        >>> names = [f"a/character0{i}{r}" for i in range(1, 6) for r in ("", "/rot90")]
        >>> labels = torch.arange(10).repeat_interleave(2)
        >>> train, test = fm.data.split_classes(
        ...     labels, [6, 4], groups=fm.data.omniglot_characters(names),
        ...     generator=torch.Generator().manual_seed(0))
        >>> sorted({names[c].split("/")[1] for c in train} & {names[c].split("/")[1] for c in test})
        []
    """
    classes = torch.unique(labels)
    if any(s < 0 for s in sizes) or sum(sizes) > len(classes):
        raise ValueError(f"cannot split {len(classes)} classes into groups of {list(sizes)}")
    order = classes[torch.randperm(len(classes), generator=generator)].tolist()
    if groups is not None:
        return _split_groups(order, sizes, groups)
    out, start = [], 0
    for size in sizes:
        out.append(sorted(order[start : start + size]))
        start += size
    return out


def _split_groups(
    order: list[int], sizes: Sequence[int], groups: Sequence[Hashable] | Mapping[int, Hashable]
) -> list[list[int]]:
    """Whole groups of classes, in the random order of their first class, into splits of
    ``sizes`` classes each."""
    try:
        keys = {c: groups[c] for c in order}
    except (IndexError, KeyError) as e:
        raise ValueError(
            f"groups has no key for class {e.args[0]}: one key per class label"
        ) from None
    members: dict[Hashable, list[int]] = {}
    for c in order:
        members.setdefault(keys[c], []).append(c)
    out: list[list[int]] = []
    queue = list(members.values())
    for size in sizes:
        split: list[int] = []
        while len(split) < size and queue:
            split += queue.pop(0)
        if len(split) != size:
            counts = sorted({len(m) for m in members.values()})
            raise ValueError(
                f"cannot split {len(members)} groups of classes (of {counts} classes each) into "
                f"splits of {list(sizes)} classes: each split must hold whole groups"
            )
        out.append(sorted(split))
    return out


def omniglot_characters(class_names: Sequence[str]) -> list[str]:
    """The character of each Omniglot class (``"alphabet/characterNN"``, its rotations'
    ``"/rot90"`` ... suffix dropped): the ``groups`` for :func:`split_classes`."""
    return ["/".join(name.split("/")[:2]) for name in class_names]


class Episodes:
    """Draws N-way K-shot episodes from ``inputs`` (N, ...) with integer ``labels`` (N,).

    Each episode picks ``ways`` distinct classes from ``classes`` (default: every label),
    relabels them ``0 .. ways-1`` in random order, and draws ``shots`` support and ``query``
    query examples per class, without overlap. Draws are seeded by ``generator``.

    Raises ``ValueError`` early: more ways than classes, a class with fewer than
    ``shots + query`` examples (named), classes not in the labels, non-integer labels.
    """

    def __init__(
        self,
        inputs: Tensor,
        labels: Tensor,
        *,
        ways: int,
        shots: int,
        query: int,
        classes: Sequence[int] | None = None,
    ) -> None:
        if labels.dim() != 1 or labels.is_floating_point() or labels.is_complex():
            raise ValueError("labels must be a 1-d integer tensor")
        if inputs.shape[0] != labels.shape[0]:
            raise ValueError(
                f"inputs has {inputs.shape[0]} examples but labels has {labels.shape[0]}"
            )
        for name, n, low in (("ways", ways, 1), ("shots", shots, 1), ("query", query, 0)):
            check_int(n, name, low=low)
        present = set(torch.unique(labels).tolist())
        chosen = sorted(present) if classes is None else [int(c) for c in classes]
        missing = sorted(set(chosen) - present)
        if missing:
            raise ValueError(f"classes {missing} have no examples in labels")
        if ways > len(chosen):
            raise ValueError(
                f"{ways}-way episodes need at least {ways} classes; there are {len(chosen)}"
            )
        self.index = {c: torch.nonzero(labels == c).flatten() for c in chosen}
        need = shots + query
        short = {c: len(i) for c, i in self.index.items() if len(i) < need}
        if short:
            raise ValueError(
                f"{shots} shots + {query} queries need {need} examples per class; these classes "
                f"have fewer (class: count): {short}"
            )
        self.inputs, self.labels = inputs, labels
        self.classes = torch.tensor(chosen)
        self.ways, self.shots, self.query = ways, shots, query

    def sample(self, num_tasks: int, *, generator: torch.Generator | None = None) -> EpisodeBatch:
        """Draw ``num_tasks`` episodes."""
        check_int(num_tasks, "num_tasks", low=1, what="a positive int")
        support, query, ways_of = [], [], []
        for _ in range(num_tasks):
            picked = self.classes[
                torch.randperm(len(self.classes), generator=generator)[: self.ways]
            ]
            s_idx, q_idx = [], []
            for c in picked.tolist():
                idx = self.index[c]
                order = idx[torch.randperm(len(idx), generator=generator)]
                s_idx.append(order[: self.shots])
                q_idx.append(order[self.shots : self.shots + self.query])
            support.append(torch.cat(s_idx))
            query.append(torch.cat(q_idx))
            ways_of.append(picked)
        s, q = torch.stack(support), torch.stack(query)
        y_s = torch.arange(self.ways).repeat_interleave(self.shots).repeat(num_tasks, 1)
        y_q = torch.arange(self.ways).repeat_interleave(self.query).repeat(num_tasks, 1)
        return EpisodeBatch(self.inputs[s], y_s, self.inputs[q], y_q, torch.stack(ways_of))
