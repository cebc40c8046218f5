"""The task chunk chosen by measurement: ``task_chunk="auto"``, the default.

Running all tasks as one vmapped computation is not always the fastest way: on a CPU, a
conv net whose one task already keeps the cores busy can run slower batched than task by
task, while a small MLP runs much faster batched (``benchmarks/RESULTS.md``). So a task-batched
call (:func:`funcmeta.adapt_tasks`) with ``task_chunk="auto"`` measures: per kind of call
(the number of tasks, the shapes of the batch, steps, order, whether a backward follows), its
first call runs all tasks at once (a warm-up, the call that probes the model), the next
calls try each candidate twice (:func:`candidate_chunks`: all at once, then 1, 4, 16, ...
tasks at a time; the second round in reverse order), and every later call takes the
candidate with the least time.

What is measured is the call's own time and that of the task-batched passes that follow it
on the same chunk (:func:`funcmeta.apply_tasks` and :func:`funcmeta.task_losses`: the query
pass of the recipes): their forwards, and the backward from the moment it reaches the
outputs of those passes (or, without them, the adapted parameters) to the moment it has
passed the initial parameters, noted by gradient hooks on those tensors. The user's own code in
between is not counted. The query pass matters: a chunk that makes the inner loop faster can
make the whole meta-iteration slower. A trial whose backward never comes (a call whose graph is dropped) is tried again;
after three such calls that kind of call keeps all tasks at once. Calls without a graph
(evaluation under ``torch.no_grad()``) are timed by their forwards alone.

Only CPU calls are measured: on an accelerator all tasks run at once (one launch per
operation is what batching is for there, and timing it would need synchronisation).

The choice depends on timing, so two float32 runs may take different chunks and differ by
rounding (the results are otherwise the same; see :func:`funcmeta.functional_model`): pin
``task_chunk`` (``None`` or a number) for runs that must repeat bit for bit.

Example:
    >>> from funcmeta._src.batching.chunks import ChunkTuner
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

__all__ = ["ChunkTuner", "Trial", "candidate_chunks"]

_WARMUP = "warm-up"
_ABANDON_AFTER = 8  # calls of the same kind before an unfinished trial counts as dropped
_RETRIES = 3
_ROUNDS = 2  # trials per candidate; the least time counts


@dataclass
class Trial:
    """One measured call: its chunk and the times it took."""

    chunk: int | None
    expect_backward: bool
    forward: float = 0.0
    started: float = 0.0
    backward_out: float | None = None  # the backward reached the adapted parameters
    backward_in: float | None = None  # the backward passed the initial parameters
    query_forward: float = 0.0  # the task-batched passes that followed (fm.apply_tasks ...)
    backward_query: float | None = None  # the backward reached their outputs
    calls_since: int = 0
    ran: bool = False  # its forward finished (a call that raised never does)

    def done(self) -> bool:
        return self.ran and (not self.expect_backward or self.backward_in is not None)

    def seconds(self) -> float:
        if not self.expect_backward:
            return self.forward
        assert self.backward_in is not None and self.backward_out is not None
        begun = self.backward_out if self.backward_query is None else self.backward_query
        return self.forward + self.query_forward + max(self.backward_in - begun, 0.0)


@dataclass
class _Kind:
    """The tuning state of one kind of call."""

    candidates: list[int | None]
    measured: dict[int | None, list[float]] = field(default_factory=dict)
    pending: list[Trial] = field(default_factory=list)
    warmed: bool = False
    retries: int = 0
    chosen: int | str | None = _WARMUP  # a chunk once decided; _WARMUP until then
    label: str = ""

    def next_candidate(self) -> int | str | None:
        """The chunk the next trial runs: the first round in the candidates' order, the
        second in reverse (so that drift over the trials favours none); a candidate is not
        issued while a trial of it waits for its backward. ``_WARMUP`` when none is due."""
        issued = [t.chunk for t in self.pending]
        for r in range(_ROUNDS):
            order = self.candidates if r % 2 == 0 else self.candidates[::-1]
            for c in order:
                if c not in issued and len(self.measured.get(c, [])) <= r:
                    return c
        return _WARMUP

    def complete(self) -> bool:
        return all(len(self.measured.get(c, [])) >= _ROUNDS for c in self.candidates)

    def best_seconds(self) -> dict[int | None, float]:
        """Per candidate measured, the least of its times (the others met more noise)."""
        return {c: min(times) for c, times in self.measured.items()}


def candidate_chunks(tasks: int) -> list[int | None]:
    """The chunks tried for ``tasks`` tasks: all at once (``None``), then 1, 4, 16, ...
    below ``tasks``: a grid a factor of 4 apart, so the chunk chosen is within 2x of the
    best size on the grid's scale at a cost of ``log4(tasks) + 2`` trials per round.

    Example:
        >>> candidate_chunks(32)
        [None, 1, 4, 16]
        >>> candidate_chunks(1)
        [None]
    """
    candidates: list[int | None] = [None]
    chunk = 1
    while chunk < tasks:
        candidates.append(chunk)
        chunk *= 4
    return candidates


def _noting(trial: Trial, which: str) -> Any:
    """A gradient hook that notes on ``trial`` when the backward reaches its tensor: the
    first time for ``"query"`` (the backward has begun on the passes that followed), the
    latest for ``"out"`` (it has passed every adapted parameter) and ``"in"`` (every
    initial parameter). A tensor's hook runs once its gradient is summed over all its uses."""

    def hook(grad: Tensor) -> None:
        now = time.perf_counter()
        if which == "query":
            if trial.backward_query is None:
                trial.backward_query = now
        elif which == "out":
            trial.backward_out = now
        else:
            trial.backward_in = now

    return hook


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
        self.latest: Trial | None = None  # the latest call's trial, if it was timed

    def start(
        self, key: Any, label: str, tasks: int, device: torch.device, expect_backward: bool
    ) -> Trial:
        """The chunk for this call, as a :class:`Trial` (timed if it is one); ``key`` tells
        kinds of calls apart, ``label`` names the kind in :attr:`choices`."""
        kind = self.kinds.get(key)
        if kind is None:
            candidates: list[int | None] = (
                candidate_chunks(tasks) if device.type == "cpu" else [None]
            )
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
            todo = kind.next_candidate()
            if todo is not _WARMUP:
                trial.chunk = todo  # type: ignore[assignment]
                trial.started = time.perf_counter()
                kind.pending.append(trial)
            else:  # every candidate is measured or on its way: all at once meanwhile
                trial.chunk = None
                trial.started = -1.0
        self.hint = trial.chunk
        self.latest = trial if self.timed(trial) else None
        return trial

    def timed(self, trial: Trial) -> bool:
        return trial.started >= 0

    def mark(self, trial: Trial, which: str, x: Tensor) -> None:
        """Note on ``trial`` when the backward reaches ``x``: ``"in"`` an initial parameter
        (the backward's end), ``"out"`` an adapted one, ``"query"`` an output of a pass that
        follows (its start). A gradient hook, so ``x`` stays the tensor it was: no new graph
        node, and in-place changes to it remain allowed. ``x`` must require grad and be a
        tensor this call made (a hook stays on its tensor)."""
        x.register_hook(_noting(trial, which))

    def following(self) -> Trial | None:
        """The trial that a task-batched pass run now belongs to (the query pass after a timed
        call, on the same chunk): the latest call's, when it was timed, its forward has
        finished and its backward has not begun; else ``None``."""
        trial = self.latest
        if trial is None or not trial.ran:
            return None
        if trial.backward_query is not None or trial.backward_out is not None:
            return None
        return trial

    def finish_forward(self, trial: Trial) -> None:
        trial.forward = time.perf_counter() - trial.started
        trial.ran = True

    def _collect(self, kind: _Kind) -> None:
        """Take the finished trials' times; drop the abandoned ones; decide when complete."""
        still = []
        for t in kind.pending:
            t.calls_since += 1
            if t.done() and (not t.expect_backward or t.backward_out is not None):
                kind.measured.setdefault(t.chunk, []).append(t.seconds())
            elif t.calls_since > _ABANDON_AFTER:
                kind.retries += 1
            else:
                still.append(t)
        kind.pending = still
        if kind.retries > _RETRIES and kind.chosen == _WARMUP:
            kind.chosen = None
            self.choices[kind.label] = {
                "chunk": None,
                "seconds": kind.best_seconds(),
                "note": "its backward did not come: all tasks at once",
            }
            return
        if kind.chosen == _WARMUP and kind.complete():
            seconds = kind.best_seconds()
            best = min(kind.candidates, key=lambda c: seconds[c])
            kind.chosen = best
            self.choices[kind.label] = {"chunk": best, "seconds": seconds}
