"""Packed sequences under task batching: ``pack_padded_sequence``, a recurrent layer and
``pad_packed_sequence`` for all tasks at once, tasks whose sequences differ in length included.

A ``PackedSequence`` holds one row per valid time step, so two tasks whose sequences differ in
length have data of different sizes: ``vmap`` has no batching rule for
``aten::_pack_padded_sequence``, and its per-task fallback cannot stack the tasks' results.
Under ``funcmeta._src.batching.intercept.TaskMode``, packing a task-batched tensor keeps the
padded tensor instead, time first and in the order the pack sorts it, with each task's lengths:
a :class:`TaskPacked`. The ``PackedSequence`` that torch builds around the result carries two
tokens, ``data`` and ``batch_sizes``, that stand for it.

- ``funcmeta._src.batching.recurrent.TaskRecurrent`` runs a token sequence for all tasks in one
  pass, each sequence's steps past its length masked (its state carried unchanged), and returns
  one; a layer that runs once per task gets each task's own packed sequence.
- ``pad_packed_sequence`` gives back what each task's own would: the padding value past each
  length, the lengths, the original order. Where the tasks' longest sequences differ and no
  ``total_length`` is given, a loop's outputs would differ in length: that is refused.
- Anything else done with the tokens (reading ``data`` directly, ``.to()``, a layer funcmeta
  does not know) is refused as ``vmap`` refuses: the model then runs once per task, exactly,
  and says so once.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> from torch.nn.utils.rnn import pack_padded_sequence
    >>> class Reader(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.rnn, self.out = torch.nn.GRU(3, 4), torch.nn.Linear(4, 2)
    ...     def forward(self, x, lengths):
    ...         packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    ...         return self.out(self.rnn(packed)[1][-1])
    >>> fmodel = fm.functional_model(Reader())
    >>> x, y = torch.randn(5, 6, 7, 3), torch.randint(0, 2, (5, 6))   # 5 tasks
    >>> lengths = torch.randint(1, 8, (5, 6))                          # ragged across tasks
    >>> r = fm.adapt_tasks(fmodel, fmodel.params, F.cross_entropy, ((x, lengths), y),
    ...                    fm.optim.sgd(lr=0.1), steps=2)
    >>> r.losses.shape, fmodel.per_task
    (torch.Size([2, 5]), False)
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.nn.utils.rnn as rnn_utils
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from funcmeta._src.core import tree
from funcmeta._src.core.fence import (
    add_batch_dim,
    frame_executes,
    frame_local,
    pack_padded_op,
    pad_packed_op,
)
from funcmeta._src.core.vmap import (
    PACKED_TOKEN,
    is_batched,
    maybe_get_level,
    outside_level,
    physical,
)

__all__ = [
    "TaskPacked",
    "check_output",
    "on_token",
    "pack",
    "packed_of",
    "sequence",
    "token_in",
]

_TOKEN = PACKED_TOKEN
#: Whether a token was ever made: until then no call needs looking at for one.
made = False
_PACK = pack_padded_op
_PAD = pad_packed_op
_METADATA = (Tensor.device, Tensor.dtype, Tensor.is_cuda)


class TaskPacked:
    """The tasks' packed sequences as one padded tensor ``padded`` ``(T, L, N, *)``, time
    first and in the pack's order, rows past a sequence's length undefined; ``lengths``
    ``(T, N)`` (int64, descending in each task); ``level`` the vmap level of the tasks.
    ``padded`` may be given as a function that makes it, with its ``shape`` and a tensor
    ``like`` it (dtype, device): a recurrent layer's outputs, stacked only when read (most
    classifiers read the final state alone)."""

    def __init__(
        self,
        padded: Tensor | Callable[[], Tensor],
        lengths: Tensor,
        level: int,
        shape: tuple[int, ...] | None = None,
        like: Tensor | None = None,
    ) -> None:
        self._padded = padded
        self.lengths, self.level = lengths, level
        if isinstance(padded, Tensor):
            shape, like = tuple(padded.shape), padded
        assert shape is not None and like is not None
        self.shape, self.dtype, self.device = shape, like.dtype, like.device

    @property
    def padded(self) -> Tensor:
        if not isinstance(self._padded, Tensor):
            self._padded = self._padded()
        return self._padded

    def empty(self, shape: tuple[int, ...]) -> Tensor:
        """A tensor of ``shape`` with the steps' dtype and device that holds no values (an
        expanded scalar)."""
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(shape)

    def valid(self) -> Tensor:
        """``(T, L, N)``: whether each step is within its sequence."""
        steps = torch.arange(self.shape[1], device=self.device)
        return steps.view(1, -1, 1) < self.lengths.to(self.device).unsqueeze(1)

    def batch_sizes(self) -> Tensor:
        """``(T, L)``: each task's ``batch_sizes`` (zeros past its longest sequence)."""
        steps = torch.arange(self.shape[1])
        return (self.lengths.unsqueeze(1) > steps.view(1, -1, 1)).sum(-1)

    def longest_agree(self) -> bool:
        """Whether every task's longest sequence has the same length."""
        longest = self.lengths[:, 0]
        return bool((longest == longest[0]).all())


def sequence(
    packed: TaskPacked, sorted_indices: Tensor | None, unsorted_indices: Tensor | None
) -> PackedSequence:
    """A ``PackedSequence`` standing for ``packed``: its ``data`` and ``batch_sizes`` are
    tokens batched at ``packed.level``."""
    level, shape = packed.level, packed.shape
    # a token holds no values (flattening the padded steps would copy them, and the token
    # lives as long as the sequence does)
    data = add_batch_dim(packed.empty((shape[0], shape[1] * shape[2], *shape[3:])), 0, level)
    batch_sizes = add_batch_dim(packed.batch_sizes(), 0, level)
    global made
    made = True
    setattr(data, _TOKEN, packed)
    setattr(batch_sizes, _TOKEN, packed)
    return PackedSequence(data, batch_sizes, sorted_indices, unsorted_indices)


def packed_of(x: Any) -> TaskPacked | None:
    """The :class:`TaskPacked` that ``x`` (a ``PackedSequence`` or one of its tensors) stands
    for, or None."""
    if isinstance(x, PackedSequence):
        x = x[0]
    return getattr(x, _TOKEN, None) if isinstance(x, Tensor) else None


def token_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a token is among ``args`` and ``kwargs`` (or in a list or tuple among them)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            if hasattr(a, _TOKEN):
                return True
        elif isinstance(a, list | tuple) and any(
            isinstance(b, Tensor) and hasattr(b, _TOKEN) for b in a
        ):
            return True
    return False


def check_output(out: Any) -> Any:
    """``out`` (a model's output under task batching), refused if it holds a task-batched
    packed sequence: leaving the vmap, its tokens would pass for each task's packed data."""
    if made and any(hasattr(t, _TOKEN) for t in tree.flatten_registered(out)[0]):
        raise refuse("a packed sequence in the model's output (each task's has its own size)")
    return out


class PackedRefusal(RuntimeError):
    """A use of a task-batched packed sequence that cannot be batched; it reads as vmap's
    refusal, so that the model runs once per task."""


def refuse(what: str) -> PackedRefusal:
    """The refusal of ``what``, worded as vmap's (so that the model runs once per task)."""
    return PackedRefusal(f"vmap: task batching cannot batch {what}")


def pack(input: Tensor, lengths: Tensor, batch_first: bool) -> tuple[Tensor, Tensor] | None:
    """``torch._VF._pack_padded_sequence`` on task-batched arguments: the tokens ``(data,
    batch_sizes)`` of a :class:`TaskPacked`, or None when no argument is task-batched."""
    batched = [v for v in (input, lengths) if is_batched(v)]
    if not batched:
        return None
    levels = {maybe_get_level(v) for v in batched}
    if len(levels) > 1:
        raise refuse("packing tensors batched at different vmap levels")
    (level,) = levels
    x = physical(input, level) if is_batched(input) else input.expand(1, *input.shape)
    lens = physical(lengths, level) if is_batched(lengths) else lengths.expand(1, *lengths.shape)
    if is_batched(x) or is_batched(lens):
        raise refuse("packing tensors batched at an outer vmap level too (two task axes)")
    tasks = max(x.shape[0], lens.shape[0])
    x, lens = x.expand(tasks, *x.shape[1:]), lens.expand(tasks, *lens.shape[1:])
    if x.dim() >= 3 and batch_first:
        x = x.transpose(1, 2)  # (T, L, N, *)
    _check_pack(x, lens, input, lengths, batch_first, level)
    longest = int(lens.max())
    return _tokens(sequence(TaskPacked(x[:, :longest], lens, level), None, None))


def _tokens(seq: PackedSequence) -> tuple[Tensor, Tensor]:
    return seq.data, seq.batch_sizes


def _check_pack(
    x: Tensor, lens: Tensor, input: Tensor, lengths: Tensor, batch_first: bool, level: int
) -> None:
    """torch's own error for a task whose pack it refuses (a length below 1 or out of order,
    a lengths tensor of the wrong kind): the op is run on that task. A length beyond the
    input's steps, which torch does not check (it reads past the input's end), is an error
    here."""
    fine = (
        x.dim() >= 3
        and lens.dim() == 2
        and lens.device.type == "cpu"
        and lens.dtype == torch.int64
        and lens.shape[1] == x.shape[2]
    )
    if fine and lens.numel():
        ordered = bool((lens[:, 1:] <= lens[:, :-1]).all())
        fine = ordered and int(lens.min()) >= 1 and int(lens.max()) <= x.shape[1]
    if fine:
        return
    bad = 0
    if lens.dim() == 2 and x.dim() >= 3 and lens.shape[1] == x.shape[2]:
        per_task = (lens < 1) | (lens > x.shape[1])
        per_task[:, 1:] |= lens[:, 1:] > lens[:, :-1]
        bad = int(per_task.any(1).int().argmax())
        if int(lens[bad].max()) > x.shape[1]:  # torch reads past the input's end for these
            raise ValueError(
                f"pack_padded_sequence: task {bad}'s lengths {lens[bad].tolist()} exceed the "
                f"input's {x.shape[1]} time steps"
            )
    one = x[bad].transpose(0, 1) if batch_first and x.dim() >= 3 else x[bad]
    with outside_level(level):
        _PACK(one, lens[bad], batch_first)
    raise ValueError(  # pragma: no cover - torch refuses every other case above
        f"pack_padded_sequence: task {bad}'s lengths {lens[bad].tolist()} do not fit an input "
        f"of shape {tuple(one.shape)}"
    )


def on_token(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], caller: FrameType | None
) -> Any:
    """``func`` called by ``caller`` on a token: padding, the metadata torch's own packing
    code reads, or a refusal."""
    if func is _PAD:
        # the op's own arguments never include caller; mypy cannot know it of a dict
        return _pad(*args, **kwargs, caller=caller)  # type: ignore[misc]
    if getattr(func, "__self__", None) in _METADATA:
        return func(*args, **kwargs)
    if func is Tensor.size or getattr(func, "__self__", None) is Tensor.shape:
        packed = packed_of(args[0])
        # the token is a packed sequence's batch_sizes (1-D)
        if (
            packed is not None
            and args[0].dim() == 1
            and (_is_pad(caller) or packed.longest_agree())
        ):
            return func(*args, **kwargs)  # the longest sequence, as pad_packed_sequence reads it
    name = getattr(func, "__name__", repr(func))
    raise refuse(f"{name} on a packed sequence's data or batch_sizes (each task's has its size)")


def _is_pad(frame: FrameType | None) -> bool:
    return frame_executes(frame, rnn_utils.pad_packed_sequence)


def _pad(
    data: Tensor,
    batch_sizes: Tensor,
    batch_first: bool,
    padding_value: float,
    total_length: int,
    caller: FrameType | None = None,
) -> tuple[Tensor, Tensor]:
    """``torch._VF._pad_packed_sequence`` on tokens: ``(padded, lengths)`` in the pack's
    order, as each task's own."""
    packed = packed_of(data)
    if packed is None or packed_of(batch_sizes) is not packed:
        raise refuse("pad_packed_sequence on parts of different packed sequences")
    given = frame_local(caller, "total_length", total_length) if _is_pad(caller) else total_length
    steps = packed.shape[1]
    if given is None and not packed.longest_agree():
        raise refuse(
            "pad_packed_sequence without total_length where the tasks' longest sequences differ "
            "(each task's output would be as long as its own longest)"
        )
    length = steps if given is None else int(given)
    if length < steps:
        raise ValueError(
            "Expected total_length to be at least the length of the longest sequence in input, "
            f"but got total_length={length} and max sequence length being {steps}"
        )
    out = packed.padded
    valid = packed.valid()
    mask = valid.view(*valid.shape, *([1] * (out.dim() - 3)))
    out = torch.where(mask, out, torch.full((), padding_value, dtype=out.dtype, device=out.device))
    if length > steps:
        tail = out.new_full((out.shape[0], length - steps, *out.shape[2:]), padding_value)
        out = torch.cat([out, tail], dim=1)
    if batch_first:
        out = out.transpose(1, 2)
    level = packed.level
    return add_batch_dim(out, 0, level), add_batch_dim(packed.lengths, 0, level)
