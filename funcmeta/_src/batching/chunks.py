"""The task chunk a task-batched call runs with under ``task_chunk="auto"`` (the default: a
rule, :func:`rule_chunk`) or ``task_chunk="tune"`` (measured on the first calls:
:class:`ChunkTuner`).

``"auto"`` reads the chunk off the call's shapes, the model's size and the device, never off
a clock, so the same program takes the same chunks on every run and float32 results repeat
bit for bit. On a CPU, one task's work is estimated as the model's parameter count times the
number of input elements per task (the elements of every tensor of the model's inputs,
divided by the task count; the targets do not count); the chunk is the largest power of two
whose work stays within :data:`CPU_BUDGET` (2**31), at least 1, and all tasks at once where
that is the task count or more. On any other device (CUDA) all tasks run at once: one launch
per operation is what batching is for there. The budget is fitted to what the measuring
tuner chose on ``benchmarks/speed/tasks.py`` (``benchmarks/RESULTS.md``): all at once for the
sinusoid MLP (1,761 parameters x 10 inputs per task) at 4 to 64 tasks; all at once at 4
tasks and chunks of 4 at 16 to 64 tasks for conv4 5-way 1-shot (112,261 x 3,920); one task
at a time for conv4 20-way 1-shot, 16 tasks (113,236 x 15,680).

Why a CPU wants chunks: running all tasks as one vmapped computation is not always the fastest
way. A conv net whose one task already keeps the cores busy can run slower batched than task
by task (the batched activations outgrow the caches), while a small MLP runs much faster
batched.

``"tune"`` measures instead: per kind of call (the number of tasks, the shapes of the batch,
steps, order, whether a backward follows), its first call runs all tasks at once (a warm-up,
the call that probes the model), the next calls try each candidate twice
(:func:`candidate_chunks`: all at once, then 1, 4, 16, ... tasks at a time; the second round
in reverse order), and every later call takes the candidate with the least time.

What is measured is the call's own time and that of the task-batched passes that follow it
on the same chunk (:func:`funcmeta.apply_tasks` and :func:`funcmeta.task_losses`: the query
pass of the recipes): their forwards, and the backward from the moment it reaches the
outputs of those passes (or, without them, the adapted parameters) to the moment it has
passed the initial parameters, noted by gradient hooks on those tensors. The user's own code in
between is not counted. The query pass matters: a chunk that makes the inner loop faster can
make the whole meta-iteration slower. A trial whose backward never comes (a call whose graph is dropped) is tried again;
after three such calls that kind of call keeps all tasks at once. Calls without a graph
(evaluation under ``torch.no_grad()``) are timed by their forwards alone. Only CPU calls are
measured: on an accelerator all tasks run at once (timing there would need synchronisation).
The choice depends on timing, so two float32 runs may take different chunks and differ by
rounding.

A pass that follows an inner loop (:func:`funcmeta.apply_tasks`, :func:`funcmeta.task_losses`)
runs on that loop's chunk when it is given it (``task_chunk=result.chunk``, as the recipes
do), and its time then counts with the loop's trial; under ``"auto"`` it takes the rule on
its own shapes. A call inside a ``torch.func`` transform runs all tasks at once.

Example:
    >>> rule_chunk(32, inputs_per_task=5 * 28 * 28, parameters=112_261, device="cpu")  # conv4
    4
    >>> rule_chunk(32, inputs_per_task=10, parameters=1_761, device="cpu") is None  # an MLP
    True
    >>> ChunkTuner().choices   # nothing chosen before the first calls
    {}
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.module.task_protocol import TaskCall, TaskChunk

__all__ = [
    "CPU_BUDGET",
    "ChunkRule",
    "ChunkTuner",
    "TimedRun",
    "Trial",
    "candidate_chunks",
    "rule_chunk",
]

CPU_BUDGET = 2**31
"""On a CPU, the most work one chunk of ``task_chunk="auto"`` takes: its tasks' parameter
count times input elements per task, summed (see the module docstring)."""

_WARMUP = "warm-up"
_ABANDON_AFTER = 8  # calls of the same kind before an unfinished trial counts as dropped
_RETRIES = 3
_ROUNDS = 2  # trials per candidate; the least time counts


def rule_chunk(
    tasks: int, *, inputs_per_task: int, parameters: int, device: torch.device | str
) -> int | None:
    """The chunk ``task_chunk="auto"`` takes for ``tasks`` tasks of a model with ``parameters``
    parameters, each task's inputs ``inputs_per_task`` elements, on ``device``: on a CPU the
    largest power of two ``c`` with ``c * parameters * inputs_per_task <= CPU_BUDGET`` (at
    least 1), ``None`` (all tasks at once) where ``c >= tasks`` or on any other device.

    Example:
        >>> [rule_chunk(t, inputs_per_task=3920, parameters=112_261, device="cpu") for t in (4, 16, 64)]
        [None, 4, 4]
        >>> rule_chunk(16, inputs_per_task=20 * 784, parameters=113_236, device="cpu")
        1
        >>> rule_chunk(16, inputs_per_task=3920, parameters=112_261, device="cuda") is None
        True
    """
    if torch.device(device).type != "cpu" or tasks <= 1:
        return None
    work = max(parameters * inputs_per_task, 1)
    chunk = 1
    while chunk < tasks and 2 * chunk * work <= CPU_BUDGET:
        chunk *= 2
    return None if chunk >= tasks else chunk


def _device_of(call: TaskCall) -> torch.device:
    tensors = call.inputs + call.targets
    return tensors[0].device if tensors else torch.device("cpu")


class ChunkRule:
    """The chunks of ``task_chunk="auto"`` for one :class:`funcmeta.FunctionalModel`: the
    rule (:func:`rule_chunk`) applied to each inner loop, and what it chose, per kind of call.

    Attributes:
        choices: per kind of call (the task count, the inputs' shapes, the device), the chunk
            and what the rule read: ``{"chunk": c, "parameters": p, "inputs_per_task": n}``.
    """

    def __init__(self) -> None:
        self.choices: dict[Any, dict[str, Any]] = {}

    def chunk_for(self, call: TaskCall, parameters: int) -> TaskChunk:
        """The chunk of ``call``, a call of a model with ``parameters`` parameters."""
        device = _device_of(call)
        inputs = sum(x.numel() for x in call.inputs) // max(call.tasks, 1)
        chunk = rule_chunk(call.tasks, inputs_per_task=inputs, parameters=parameters, device=device)
        shapes = ", ".join(str(tuple(x.shape)) for x in call.inputs)
        label = f"{call.tasks} tasks, inputs {shapes}, {device}"
        self.choices[label] = {"chunk": chunk, "parameters": parameters, "inputs_per_task": inputs}
        return TaskChunk(chunk)


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
        choices: per kind of call, the chunk chosen and the seconds measured for each
            candidate (see :attr:`funcmeta.FunctionalModel.task_chunk_choices`).
    """

    def __init__(self) -> None:
        self.kinds: dict[Any, _Kind] = {}
        self.choices: dict[Any, dict[str, Any]] = {}

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
        return trial

    def chunk_for(self, call: TaskCall) -> TaskChunk:
        """The chunk of the inner loop ``call``: a :class:`TimedRun` when the call is a trial."""
        device = _device_of(call)
        tensors = call.inputs + call.targets
        key = (
            call.tasks,
            tuple((tuple(x.shape), x.dtype) for x in tensors),
            call.steps,
            call.details,
            call.expect_backward,
            str(device),
        )
        shapes = ", ".join(str(tuple(x.shape)) for x in tensors)
        label = (
            f"{call.tasks} tasks, {call.steps} steps, batch {shapes}, "
            f"{'with' if call.expect_backward else 'without'} backward, {device}"
        )
        trial = self.start(key, label, call.tasks, device, call.expect_backward)
        return TimedRun(self, trial) if self.timed(trial) else TaskChunk(trial.chunk)

    def count_with(
        self, trial: Trial, run: Callable[[], tuple[Any, dict[str, Tensor]]]
    ) -> tuple[Any, dict[str, Tensor]]:
        """``run()``, a task-batched pass (:func:`funcmeta.apply_tasks`,
        :func:`funcmeta.task_losses`) given the chunk of the measured inner loop ``trial``,
        timed as part of that trial while it is open (its forward has finished, its backward
        has not begun): its forward, and hooks on its outputs that note when the backward
        begins on them."""
        if not trial.ran or trial.backward_query is not None or trial.backward_out is not None:
            return run()
        started = time.perf_counter()
        out, new_buffers = run()
        seconds = time.perf_counter() - started
        if not trial.expect_backward:
            trial.query_forward += seconds
            return out, new_buffers
        hooked = [x for x in tree.leaves(out) if isinstance(x, Tensor) and x.requires_grad]
        for x in hooked:  # the outputs stay as they are: a hook notes the backward's start
            self.mark(trial, "query", x)
        if hooked:  # its backward is timed too: count its forward with it
            trial.query_forward += seconds
        return out, new_buffers

    def timed(self, trial: Trial) -> bool:
        return trial.started >= 0

    def mark(self, trial: Trial, which: str, x: Tensor) -> None:
        """Note on ``trial`` when the backward reaches ``x``: ``"in"`` an initial parameter
        (the backward's end), ``"out"`` an adapted one, ``"query"`` an output of a pass that
        follows (its start). A gradient hook, so ``x`` stays the tensor it was: no new graph
        node, and in-place changes to it remain allowed. ``x`` must require grad and be a
        tensor this call made (a hook stays on its tensor)."""
        x.register_hook(_noting(trial, which))

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


class TimedRun(TaskChunk):
    """A measured inner loop of ``task_chunk="tune"``: its trial's chunk, and gradient hooks
    that note when the backward reaches the tensors the loop shows it (see
    :meth:`ChunkTuner.mark`)."""

    def __init__(self, tuner: ChunkTuner, trial: Trial) -> None:
        super().__init__(trial.chunk)
        self.tuner = tuner
        self.trial = trial
        self.marked: list[str] = []  # the adapted parameters whose backward is timed

    def watch_initial(self, adapted: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
        if not self.trial.expect_backward:
            return adapted
        watched = dict(adapted)
        for k, v in adapted.items():
            if v is not None and v.requires_grad:
                watched[k] = view = v.view_as(v)  # a tensor of this call's own to hook
                self.tuner.mark(self.trial, "in", view)
                self.marked.append(k)
        return watched

    def watch_adapted(self, adapted: Mapping[str, Tensor]) -> None:
        self.tuner.finish_forward(self.trial)
        for k in self.marked:  # this call's own tensors: the loop's results, or the views
            if adapted[k].requires_grad:
                self.tuner.mark(self.trial, "out", adapted[k])
