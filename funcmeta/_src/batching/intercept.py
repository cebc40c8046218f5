"""What ``vmap`` refuses or runs slowly in a task-batched forward, done for all tasks at once.

:class:`TaskMode` is a ``torch.overrides.TorchFunctionMode`` that funcmeta enters around a
model's forward under task batching, only for models that need it (the first task-batched
call finds out). It changes three things, each exactly what a loop over the tasks computes:

- **Python values of batched tensors.** ``bool(t)``, ``t.item()``, ``int(t)``, ``float(t)``,
  ``t.tolist()`` on a tensor batched over the tasks is what ``vmap`` refuses ("data-dependent
  control flow"): one Python value cannot stand for T of them. When every task gives the same
  value, that value is the answer: each task of a loop would take the same branch or read the
  same number. HuggingFace's mask code asks such questions (``mask.all()``: is there padding
  at all?), and with padding in every task they all agree. When tasks disagree, the mode
  refuses as ``vmap`` does, and the model runs once per task.
- **Fused attention.** ``F.scaled_dot_product_attention`` has no batching rule for its fused
  CPU kernels; under ``vmap`` torch runs it once per example. Attention has no parameters, so
  the task axis joins the batch axis: one call on ``(T * B, H, L, E)``, on whichever kernel the
  context allows (fused in first-order steps, query passes and evaluation; the math kernel
  inside :func:`funcmeta.checkpoint.kernels.twice_differentiable`).
- **Marking a batched tensor as requiring grad.** ``t.requires_grad_()`` on a task-batched
  tensor is refused under ``vmap``. HuggingFace calls it on the input embeddings' output
  when gradient checkpointing is enabled (``enable_input_require_grads``), so that torch's
  reentrant checkpoint passes gradients on. funcmeta's checkpointing of those
  checkpoints needs no such mark, and marking changes no parameter's gradient: the call
  returns the tensor as it is.
- **Packed sequences.** ``pack_padded_sequence`` on task-batched tensors, whose tasks' packed
  data differ in size, keeps them padded with each task's lengths
  (``funcmeta._src.batching.packed``), for the recurrent layers and ``pad_packed_sequence``;
  any other use of such a sequence is refused as ``vmap`` refuses. ``invert_permutation``'s
  ``scatter_`` on the sorted indices runs on the tensors under the tasks (no batching rule),
  and so does the sort's ``index_select`` of each task's batch (vmap's rule gathers, and its
  backward keeps the whole input for all tasks).

Example:
    >>> import torch
    >>> from funcmeta._src.batching.intercept import TaskMode
    >>> def f(x, mask):
    ...     return x * 2 if bool(mask.all()) else x + mask.sum()
    >>> x, mask = torch.ones(3, 4), torch.zeros(3, 4)    # three tasks, padding in each
    >>> with TaskMode():
    ...     torch.func.vmap(f)(x, mask).tolist()
    [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from funcmeta._src.batching import packed
from funcmeta._src.core.fence import add_batch_dim, caller_frame, pack_padded_op
from funcmeta._src.core.kernels import entered_again
from funcmeta._src.core.vmap import (
    is_batched,
    maybe_get_level,
    outside_level,
    physical,
    uniform_value,
)

__all__ = ["TaskMode", "task_mode"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

_PACK = pack_padded_op

_INDEX_SELECT = (Tensor.index_select, torch.index_select)

_VALUE_METHODS: dict[Callable[..., Any], Callable[[Tensor], Any]] = {
    Tensor.__bool__: bool,
    Tensor.item: Tensor.item,
    Tensor.__int__: int,
    Tensor.__float__: float,
    Tensor.__index__: Tensor.__index__,
    Tensor.tolist: Tensor.tolist,
}


class TaskMode(TorchFunctionMode):
    """Answers uniform Python questions about task-batched tensors and runs fused attention
    with the task axis in the batch, and packs task-batched sequences (see the module
    docstring). ``used`` counts what it did: ``"values"``, ``"attention"``, ``"packed"``,
    ``"index"`` and ``"requires_grad"``; :meth:`needed` says whether it did anything."""

    def __init__(self) -> None:
        super().__init__()
        self.used: dict[str, int] = {
            "values": 0,
            "attention": 0,
            "packed": 0,
            "index": 0,
            "requires_grad": 0,
        }

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if packed.made and packed.token_in(args, kwargs):
            return packed.on_token(func, args, kwargs, caller_frame(1))
        if func is _PACK:
            tokens = packed.pack(*args, **kwargs)
            if tokens is not None:
                self.used["packed"] += 1
                return tokens
        elif func in _VALUE_METHODS and args and _batched_here(args[0]):
            value = uniform_value(args[0])  # None: tasks disagree, refused as vmap does
            if value is not None:
                self.used["values"] += 1
                return _VALUE_METHODS[func](value)
        elif func in _INDEX_SELECT and not kwargs and len(args) == 3:
            out = _index_select(*args)
            if out is not None:
                self.used["index"] += 1
                return out
        elif func is Tensor.scatter_ and not kwargs and len(args) == 4:
            if _scatter_(*args):
                self.used["packed"] += 1
                return args[0]
        elif func is Tensor.requires_grad_ and args and _batched_here(args[0]):
            if bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True)):
                self.used["requires_grad"] += 1
                return args[0]
        elif func is F.scaled_dot_product_attention:
            out = _attention(args, kwargs)
            if out is not None:
                self.used["attention"] += 1
                return out
        return func(*args, **kwargs)

    def needed(self) -> bool:
        """Whether the mode changed anything (a model that needs it under task batching)."""
        return any(self.used.values())


@contextlib.contextmanager
def task_mode(mode: TaskMode | None = None) -> Iterator[TaskMode]:
    """Enter ``mode`` (a new :class:`TaskMode` by default) for a task-batched forward, marked
    so that recomputations of what it runs (checkpointed layers and steps) enter a new one."""
    mode = TaskMode() if mode is None else mode
    with entered_again(TaskMode), mode:
        yield mode


def _batched_here(x: Any) -> bool:
    return isinstance(x, Tensor) and is_batched(x)


def _attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """``F.scaled_dot_product_attention`` for all tasks in one call with the task axis merged
    into the batch axis, or None when the call is not task-batched (or not at one level)."""
    if len(args) > len(_SDPA_ARGS):
        return None
    given = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
    tensors = {k: given.pop(k) for k in ("query", "key", "value", "attn_mask") if k in given}
    if tensors.get("attn_mask") is None:
        tensors.pop("attn_mask", None)
    if not all(isinstance(tensors.get(k), Tensor) for k in ("query", "key", "value")):
        return None
    if not all(isinstance(v, Tensor) for v in tensors.values()):
        return None
    batched = [v for v in tensors.values() if is_batched(v)]
    levels = {maybe_get_level(v) for v in batched}
    if not batched or len(levels) != 1:
        return None
    (level,) = levels
    query = tensors["query"]
    rank = query.dim()  # one task's rank
    tasks = physical(batched[0], level).shape[0]

    def task_first(v: Tensor) -> Tensor:
        p = physical(v, level) if is_batched(v) else v.expand(tasks, *v.shape)
        if is_batched(p):
            raise _Unbatched
        p = p.reshape(tasks, *([1] * (rank - v.dim())), *p.shape[1:])
        if rank > 2:  # merge the tasks into the first batch axis
            p = p.expand(tasks, query.shape[0], *p.shape[2:]).flatten(0, 1)
        return p

    try:
        # tensors; Any, as mypy matches a ** dict's values against every parameter
        merged: dict[str, Any] = {k: task_first(v) for k, v in tensors.items()}
    except _Unbatched:
        return None
    if given.get("dropout_p", 0.0):
        # dropout draws T * B masks outside the task level: one per task and row, as vmap's
        # "different" randomness would; a checkpoint's recomputation restores the generator
        with outside_level(level):
            out = F.scaled_dot_product_attention(**merged, **given)
    else:
        out = F.scaled_dot_product_attention(**merged, **given)
    if rank > 2:
        out = out.unflatten(0, (tasks, -1))
    return add_batch_dim(out, 0, level)


def _index_select(source: Any, dim: Any, index: Any) -> Tensor | None:
    """``source.index_select(dim, index)`` with both task-batched (each task its own
    indices, as ``pack_padded_sequence`` sorts each task's batch) as one advanced index on
    the tensors under them. vmap's rule gathers, and its backward saves the whole source
    for all tasks (an activation-sized tensor a loop's ``index_select`` never keeps); the
    index's backward keeps the indices only. None where vmap's rule is left to it."""
    if not (isinstance(source, Tensor) and isinstance(index, Tensor) and isinstance(dim, int)):
        return None
    if not (_batched_here(source) and _batched_here(index)) or index.dim() != 1:
        return None
    level = maybe_get_level(source)
    if maybe_get_level(index) != level or source.dim() == 0:
        return None
    values, where = physical(source, level), physical(index, level)
    if is_batched(values) or is_batched(where):
        return None  # batched at an outer level too
    axis = dim % source.dim() + 1
    tasks = torch.arange(values.shape[0], device=where.device).view(-1, 1)
    out = values.movedim(axis, 1)[tasks, where].movedim(1, axis)
    return add_batch_dim(out, 0, level)


def _scatter_(out: Tensor, dim: int, index: Tensor, src: Any) -> bool:
    """``out.scatter_(dim, index, src)`` on the tensors under a task-batched ``out`` and
    ``index``, where neither ``out`` nor ``src`` needs gradients: what
    ``invert_permutation`` does to a packed sequence's sorted indices, for which vmap has no
    batching rule. False (nothing done) otherwise."""
    if not (isinstance(src, Tensor) and _batched_here(out) and _batched_here(index)):
        return False
    level = maybe_get_level(out)
    if maybe_get_level(index) != level or (is_batched(src) and maybe_get_level(src) != level):
        return False
    target, where = physical(out, level), physical(index, level)
    tasks = target.shape[0]
    values = physical(src, level) if is_batched(src) else src.expand(tasks, *src.shape)
    if any(is_batched(t) or t.requires_grad for t in (target, where, values)):
        return False
    if not isinstance(dim, int) or where.dim() != target.dim() or values.dim() != target.dim():
        return False
    target.scatter_(dim % out.dim() + 1, where, values)
    return True


class _Unbatched(Exception):
    """A tensor batched at an outer vmap level too: leave the call to vmap."""
