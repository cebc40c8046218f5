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

import copy
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in

__all__ = ["ClassLabels", "EpisodeBatch", "Episodes", "omniglot_characters", "split_classes"]


@exposed_in("funcmeta.data")
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


@exposed_in("funcmeta.data")
class ClassLabels(Tensor):
    """Integer class labels that carry the group of each class: classes made from one source
    (the four rotations of an Omniglot character) share a group, and :func:`split_classes`
    keeps a group on one side of a split by default.

    ``ClassLabels(labels, groups)``: ``groups[c]`` is the key (any hashable) of class ``c``,
    one per class label from 0 to the largest. :func:`funcmeta.data.load_omniglot` returns its labels as
    these, the character (``"alphabet/characterNN"``) as the key. Selections and copies keep
    the groups (indexing, ``index_select``, ``masked_select``, ``clone``, ``detach``, ``to``,
    ``cpu``, ``cuda``, ``contiguous``, ``long``, ``reshape``, ``view``, ``flatten``); any other
    operation (arithmetic, comparisons, ``cat``, ``unique``) gives a plain tensor, which
    carries none. Raises ``ValueError`` for labels that are not non-negative integers, or
    without a key for some label; ``TypeError`` for a key that is not hashable.

    Example:
        >>> import torch, funcmeta as fm
        >>> labels = fm.data.ClassLabels(torch.arange(6).repeat_interleave(2), "aabbcc")
        >>> labels
        ClassLabels([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
        >>> labels[4:].groups
        ('a', 'a', 'b', 'b', 'c', 'c')
        >>> train, test = fm.data.split_classes(labels, [4, 2], generator=torch.Generator().manual_seed(0))
        >>> [labels.groups[c] for c in test]
        ['a', 'a']
    """

    groups: tuple[Hashable, ...]

    @staticmethod
    def __new__(cls, labels: Tensor, groups: Sequence[Hashable]) -> ClassLabels:
        if not isinstance(labels, Tensor):
            raise TypeError(f"labels must be a tensor, got {type(labels).__name__}")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
        keys = tuple(groups)
        for key in keys:
            try:
                hash(key)
            except TypeError:
                raise TypeError(
                    f"a group key must be hashable (a name, a number), got {type(key).__name__}"
                ) from None
        if labels.numel():
            low, high = int(labels.min()), int(labels.max())
            if low < 0:
                raise ValueError(f"labels must be non-negative class indices, got {low}")
            if high >= len(keys):
                raise ValueError(
                    f"groups has {len(keys)} keys but the labels go up to {high}: one key per "
                    "class label, from 0 to the largest"
                )
        out = Tensor.__torch_function__(Tensor.as_subclass, (Tensor,), (labels, cls))
        out.groups = keys
        return cast(ClassLabels, out)

    def __init__(self, labels: Tensor, groups: Sequence[Hashable]) -> None:
        pass  # made by __new__; Tensor.__init__ takes no arguments

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        # torch's own handling, producing plain tensors; selections and copies get the groups
        out = Tensor.__torch_function__(func, (Tensor,), args, kwargs)
        source = args[0] if args else None
        if (
            func in _KEEPS_LABELS
            and isinstance(source, ClassLabels)
            and type(out) is Tensor
            and not (out.is_floating_point() or out.is_complex() or out.dtype == torch.bool)
        ):
            kept = Tensor.__torch_function__(Tensor.as_subclass, (Tensor,), (out, ClassLabels))
            kept.groups = source.groups
            return kept
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> ClassLabels:
        plain = Tensor.__torch_function__(Tensor.as_subclass, (Tensor,), (self, Tensor))
        return ClassLabels(copy.deepcopy(plain, memo), self.groups)


# the operations that give labels of the same classes: they keep the groups
_KEEPS_LABELS = frozenset(
    [
        Tensor.__getitem__,
        Tensor.index_select,
        torch.index_select,
        Tensor.masked_select,
        torch.masked_select,
        Tensor.clone,
        torch.clone,
        Tensor.detach,
        torch.detach,
        Tensor.to,
        Tensor.cpu,
        Tensor.cuda,
        Tensor.contiguous,
        Tensor.long,
        Tensor.reshape,
        torch.reshape,
        Tensor.view,
        Tensor.flatten,
        torch.flatten,
    ]
)

# labels saved with torch.save load back with torch.load's default (weights_only=True)
torch.serialization.add_safe_globals([ClassLabels])


@exposed_in("funcmeta.data")
def split_classes(
    labels: Tensor,
    sizes: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    groups: Sequence[Hashable] | Mapping[int, Hashable] | None = None,
    split_rotations_apart: bool = False,
) -> list[list[int]]:
    """Split the distinct labels of ``labels`` into disjoint random groups of ``sizes``
    (meta-train / meta-validation / meta-test classes). The sizes may sum to less than the
    number of classes; more raises ``ValueError``.

    Classes of one group always land in the same split. Labels that carry their groups
    (:class:`ClassLabels`: :func:`funcmeta.data.load_omniglot`'s, where the four rotations of a character
    are one group) are split by them, so a held-out class is never a rotation of a character
    trained on; each size must then be met by whole groups (multiples of 4 for Omniglot
    with rotations; ``ValueError`` otherwise, naming the group sizes).
    ``split_rotations_apart=True`` ignores the groups the labels carry: the rotations of a
    character may then land on both sides (the held-out classes are not held out).

    ``groups`` gives the key of each class (indexed by the class label, a sequence or a
    mapping) for labels without their own, e.g. ``fm.data.omniglot_characters(class_names)``.
    For labels that carry groups, it must keep each of their groups together (it may join
    groups: by alphabet, say); else ``ValueError``, as for keys that are missing or that
    number otherwise than the labels' groups.

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
    carried = labels.groups if isinstance(labels, ClassLabels) else None
    if carried is not None and not split_rotations_apart:
        if groups is None:
            return _split_groups(order, sizes, carried, carried=True)
        _check_joins(order, groups, carried)
    if groups is not None:
        return _split_groups(order, sizes, groups)
    out, start = [], 0
    for size in sizes:
        out.append(sorted(order[start : start + size]))
        start += size
    return out


def _keys(
    order: list[int], groups: Sequence[Hashable] | Mapping[int, Hashable]
) -> dict[int, Hashable]:
    """The key of each class of ``order``, each one checked to be there."""
    if not isinstance(groups, Mapping) and any(c < 0 for c in order):
        raise ValueError(
            f"groups is a sequence, indexed by class label, but there are negative labels "
            f"({min(order)}): give a mapping from label to key"
        )
    if isinstance(groups, Mapping):
        missing = [c for c in order if c not in groups]
    else:
        missing = [c for c in order if c >= len(groups)]
    if missing:
        raise ValueError(f"groups has no key for class {min(missing)}: one key per class label")
    return {c: groups[c] for c in order}


def _check_joins(
    order: list[int],
    groups: Sequence[Hashable] | Mapping[int, Hashable],
    carried: tuple[Hashable, ...],
) -> None:
    """``groups`` must keep each group the labels carry in one piece."""
    if not isinstance(groups, Mapping) and len(groups) != len(carried):
        raise ValueError(
            f"groups has {len(groups)} keys, but the labels carry the groups of "
            f"{len(carried)} classes (labels.groups): the groups of another data set?"
        )
    keys = _keys(order, groups)
    seen: dict[Hashable, tuple[int, Hashable]] = {}
    for c in order:
        first = seen.setdefault(carried[c], (c, keys[c]))
        if first[1] != keys[c]:
            raise ValueError(
                f"groups puts classes {first[0]} and {c} under different keys ({first[1]!r}, "
                f"{keys[c]!r}), but the labels keep them together (group {carried[c]!r}: "
                "rotations of one character): pass split_rotations_apart=True to split them "
                "apart anyway"
            )


def _split_groups(
    order: list[int],
    sizes: Sequence[int],
    groups: Sequence[Hashable] | Mapping[int, Hashable],
    carried: bool = False,
) -> list[list[int]]:
    """Whole groups of classes, in the random order of their first class, into splits of
    ``sizes`` classes each."""
    keys = _keys(order, groups)
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
            whose = (
                "the labels carry their groups (labels.groups: an Omniglot character's "
                "rotations are one group), and "
                if carried
                else ""
            )
            fix = (
                "; or split_rotations_apart=True, which lets a character's rotations land on "
                "both sides"
                if carried
                else ""
            )
            raise ValueError(
                f"cannot split {len(members)} groups of classes (of {counts} classes each) into "
                f"splits of {list(sizes)} classes: {whose}each split must hold whole groups "
                f"(give sizes that are sums of group sizes{fix})"
            )
        out.append(sorted(split))
    return out


@exposed_in("funcmeta.data")
def omniglot_characters(class_names: Sequence[str]) -> list[str]:
    """The character of each Omniglot class (``"alphabet/characterNN"``, its rotations'
    ``"/rot90"`` ... suffix dropped): the ``groups`` :func:`funcmeta.data.load_omniglot`'s labels carry.

    Example:
        >>> import funcmeta as fm
        >>> fm.data.omniglot_characters(["Greek/character01", "Greek/character01/rot90"])
        ['Greek/character01', 'Greek/character01']
    """
    return ["/".join(name.split("/")[:2]) for name in class_names]


@exposed_in("funcmeta.data")
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
