"""The task chunk chosen by measurement: ``task_chunk="auto"``, the default.

Running all tasks as one vmapped computation is not always the fastest way. On a CPU,
second-order MAML through conv4 at 20 ways ran 2.3x slower batched than task by task
(``benchmarks/RESULTS.md``), while a small MLP runs 8-26x faster batched. So a task-batched
call (:func:`funcmeta.adapt_tasks`) with ``task_chunk="auto"`` measures: per kind of call
(the number of tasks, the shapes of the batch, steps, order, whether a backward follows), its
first call runs all tasks at once (a warm-up, the call that probes the model), the next
calls try all at once, one at a time and, from 8 tasks, a quarter of them at a time, and
every later call takes the fastest.

What is measured is the inner loop's own time: its forward, and its share of the backward
that follows (from the moment the backward reaches the adapted parameters to the moment it
has passed the initial ones, marked by identity nodes in the graph). The user's own code in
between is not counted. A trial whose backward never comes (a call whose graph is dropped)
is tried again; after three such calls that kind of call keeps all tasks at once. Calls
without a graph (evaluation under ``torch.no_grad()``) are timed by their forward alone.

Only CPU calls are measured: on an accelerator all tasks run at once (one launch per
operation is what batching is for there, and timing it would need synchronisation).

The choice depends on timing, so two float32 runs may take different chunks and differ by
rounding (the results are otherwise the same; see :func:`funcmeta.functional_model`): pin
``task_chunk`` (``None`` or a number) for runs that must repeat bit for bit.

Example:
    >>> from funcmeta.batching.auto import ChunkTuner
    >>> tuner = ChunkTuner()
    >>> tuner.hint is None     # all tasks at once until a choice is made
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["ChunkTuner", "Trial"]

_WARMUP = "warm-up"
_ABANDON_AFTER = 8  # calls of the same kind before an unfinished trial counts as dropped
_RETRIES = 3


@dataclass
class Trial:
    """One measured call: its chunk and the times it took."""

    chunk: int | None
    expect_backward: bool
    forward: float = 0.0
    started: float = 0.0
    backward_out: float | None = None  # the backward reached the adapted parameters
    backward_in: float | None = None  # the backward passed the initial parameters
    calls_since: int = 0
    ran: bool = False  # its forward finished (a call that raised never does)

    def done(self) -> bool:
        return self.ran and (not self.expect_backward or self.backward_in is not None)

    def seconds(self) -> float:
        if not self.expect_backward:
            return self.forward
        assert self.backward_in is not None and self.backward_out is not None
        return self.forward + max(self.backward_in - self.backward_out, 0.0)


@dataclass
class _Kind:
    """The tuning state of one kind of call."""

    candidates: list[int | None]
    measured: dict[int | None, float] = field(default_factory=dict)
    pending: list[Trial] = field(default_factory=list)
    warmed: bool = False
    retries: int = 0
    chosen: int | str | None = _WARMUP  # a chunk once decided; _WARMUP until then
    label: str = ""


class _Stamp(torch.autograd.Function):
    """The identity, noting the time when the backward passes it."""

    @staticmethod
    def forward(ctx: Any, trial: Trial, which: str, x: Tensor) -> Tensor:
        ctx.trial, ctx.which = trial, which
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor]:
        now = time.perf_counter()
        trial = ctx.trial
        if ctx.which == "out":  # the latest: the backward has passed every adapted parameter
            trial.backward_out = now
        else:  # the latest: the backward has passed every initial parameter
            trial.backward_in = now
        return None, None, grad


class ChunkTuner:
    """The measured chunk choices of one :class:`funcmeta.FunctionalModel`.

    Attributes:
        hint: the chunk of the latest task-batched call (``None``: all tasks), which
            :func:`funcmeta.task_losses` and :func:`funcmeta.apply_tasks` follow.
        choices: per kind of call, the chunk chosen and the seconds measured for each
            candidate (see :attr:`funcmeta.FunctionalModel.task_chunk_choices`).
    """

    def __init__(self) -> None:
        self.kinds: dict[Any, _Kind] = {}
        self.hint: int | None = None
        self.choices: dict[Any, dict[str, Any]] = {}

    def start(
        self, key: Any, label: str, tasks: int, device: torch.device, expect_backward: bool
    ) -> Trial:
        """The chunk for this call, as a :class:`Trial` (timed if it is one); ``key`` tells
        kinds of calls apart, ``label`` names the kind in :attr:`choices`."""
        kind = self.kinds.get(key)
        if kind is None:
            quarter = tasks // 4
            candidates: list[int | None] = [None]
            if tasks > 1 and device.type == "cpu":
                candidates += [1] + ([quarter] if tasks >= 8 and quarter > 1 else [])
            kind = self.kinds[key] = _Kind(candidates, label=label)
            if len(candidates) == 1:
                kind.chosen = None
        self._collect(kind)
        trial = Trial(_WARMUP, expect_backward)  # type: ignore[arg-type]
        if kind.chosen != _WARMUP:
            trial.chunk = kind.chosen  # type: ignore[assignment]
            trial.expect_backward = False
            trial.started = -1.0  # not timed
        elif not kind.warmed:  # all at once, as without measuring (the first call probes)
            kind.warmed = True
            trial.chunk = None
            trial.started = -1.0
        else:
            issued = {t.chunk for t in kind.pending}
            todo = [c for c in kind.candidates if c not in kind.measured and c not in issued]
            if todo:
                trial.chunk = todo[0]
                trial.started = time.perf_counter()
                kind.pending.append(trial)
            else:  # every candidate is measured or on its way: all at once meanwhile
                trial.chunk = None
                trial.started = -1.0
        self.hint = trial.chunk
        return trial

    def timed(self, trial: Trial) -> bool:
        return trial.started >= 0

    def mark_inputs(self, trial: Trial, x: Tensor) -> Tensor:
        """``x`` (an initial parameter) behind an identity that notes the backward's end."""
        return _Stamp.apply(trial, "in", x)

    def mark_outputs(self, trial: Trial, x: Tensor) -> Tensor:
        """``x`` (an adapted parameter) behind an identity that notes the backward's start."""
        return _Stamp.apply(trial, "out", x)

    def finish_forward(self, trial: Trial) -> None:
        trial.forward = time.perf_counter() - trial.started
        trial.ran = True

    def _collect(self, kind: _Kind) -> None:
        """Take the finished trials' times; drop the abandoned ones; decide when complete."""
        still = []
        for t in kind.pending:
            t.calls_since += 1
            if t.done() and (not t.expect_backward or t.backward_out is not None):
                kind.measured[t.chunk] = t.seconds()
            elif t.calls_since > _ABANDON_AFTER:
                kind.retries += 1
            else:
                still.append(t)
        kind.pending = still
        if kind.retries > _RETRIES and kind.chosen == _WARMUP:
            kind.chosen = None
            self.choices[kind.label] = {
                "chunk": None,
                "seconds": dict(kind.measured),
                "note": "its backward did not come: all tasks at once",
            }
            return
        if kind.chosen == _WARMUP and all(c in kind.measured for c in kind.candidates):
            best = min(kind.candidates, key=lambda c: kind.measured[c])
            kind.chosen = best
            self.choices[kind.label] = {"chunk": best, "seconds": dict(kind.measured)}
