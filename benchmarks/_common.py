"""What the benchmark scripts share: timing, devices, memory, tables, and the examples' options.

The scripts live in ``benchmarks/<purpose>/`` (``speed``, ``memory``, ``peers``, ``checks``) and
run as ``python benchmarks/<purpose>/<name>.py``. Python puts the script's own folder on
``sys.path``, not ``benchmarks/``, so each script makes this module importable with the same
two lines, the only path edit a benchmark makes::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
    import _common

No benchmark imports another one: what two of them share is here (or, for a peer's stand-in,
in a support module of ``peers/`` whose name starts with an underscore). Nothing here imports
torch at import time: the parents of the memory benchmarks' fresh worker processes stay light.

- Timing: :func:`timed` (milliseconds of one call, the device synchronized around it),
  :func:`timed_grad` (the same for a loss and its gradient), :func:`rounds` (interleaved
  rounds, each in a rotated order) and :func:`medians`.
- Devices: :func:`sync`, :func:`pin_one_core`; the examples' ``--threads`` and
  ``--keep-freed-memory`` options (:func:`add_threads_option`, :func:`use_threads`,
  :func:`available_cores`, :func:`add_allocator_option`, :func:`use_allocator`, the same
  code as ``examples/_threads.py``'s, so that an example and a benchmark run alike).
- Memory: :class:`Meter` and :func:`measure` (peak resident set above the start on a CPU,
  peak allocated bytes on CUDA), :data:`MMAP_ENV` (the workers' glibc setting),
  :func:`peak_allocated` (the profiler's count of tensor bytes), :func:`tensor_peak` (the
  tensors alive at the peak of a block, grouped by the operation that made them).
- Tables: :func:`fmt`, :func:`ratio`, :func:`agree` (the float32 sanity check of
  meta-gradients printed beside the times).
- Task chunks: :func:`until_chosen`, :func:`default_choice`.
- Models: :func:`residual_mlp` (blocks ``x + W2 tanh(W1 x)`` and a linear head: the compiled
  step's speed, compile-time and memory benchmarks).
- Examples: :func:`examples_importable` (``peers/omniglot_peers.py`` trains through
  ``examples/omniglot.py``, the shared Omniglot example module).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# glibc serves every allocation of 64 KiB or more with its own mmap and unmaps it when freed,
# so that a process's resident set follows its live tensors (the memory workers' environment)
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

# the allocator setting the speed benchmarks default to, and why
ALLOCATOR_WHY = "the C library's defaults, as a process gets them"


# --- devices ------------------------------------------------------------------------------


def sync(device: Any) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU. ``device``: a
    :class:`torch.device`, its name, or ``None``."""
    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return
    import torch

    torch.cuda.synchronize()


def pin_one_core() -> str:
    """Pin the process to one core (the last it may run on); which core, or why not.

    For single-threaded timings: some runtimes (XLA's CPU runtime) run part of a program on a
    second thread whatever their flags say, which a pinned process cannot."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity here)"
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f"pinned to core {core}"


def examples_importable() -> None:
    """Put ``examples/`` on ``sys.path``, as it is for a script run from there: its shared
    modules (``omniglot.py``, ``_threads.py``) then import as the examples import them."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def _threads() -> Any:
    examples_importable()
    import _threads

    return _threads


def available_cores() -> int:
    """The cores this process may run on (``examples/_threads.py``)."""
    return _threads().available_cores()


def add_threads_option(parser: argparse.ArgumentParser, default: int, workload: str) -> None:
    """The examples' ``--threads N`` (``examples/_threads.py``)."""
    _threads().add_threads_option(parser, default, workload)


def use_threads(args: argparse.Namespace) -> int:
    """Set torch's intra-op threads from ``args.threads`` (``examples/_threads.py``)."""
    return _threads().use_threads(args)


def add_allocator_option(parser: argparse.ArgumentParser, default: bool, workload: str) -> None:
    """The examples' ``--keep-freed-memory`` option (``examples/_threads.py``)."""
    _threads().add_allocator_option(parser, default, workload)


def use_allocator(args: argparse.Namespace) -> str:
    """Apply ``args.keep_freed_memory``; the setting in words (``examples/_threads.py``)."""
    return _threads().use_allocator(args)


# --- timing -------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], device: Any = None) -> tuple[float, Any]:
    """Milliseconds of ``fn()``, the device synchronized before and after, and its result."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3, out


def timed_grad(
    fn: Callable[[], Any], params: Sequence[Any], device: Any = None, allow_unused: bool = False
) -> tuple[float, list[Any]]:
    """Milliseconds of ``fn()`` (a loss) and its gradient with respect to ``params``, and the
    gradient (zeros for an unused tensor where ``allow_unused``)."""
    import torch

    ms, grads = timed(
        lambda: torch.autograd.grad(fn(), list(params), allow_unused=allow_unused), device
    )
    return ms, [g if g is not None else torch.zeros(()) for g in grads]


def medians(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of each entry."""
    return {k: statistics.median(v) for k, v in times.items()}


def rounds(calls: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Each call's times over ``repeats`` interleaved rounds (``call()`` returns its time in ms
    first, as :func:`timed` and :func:`timed_grad` do).
    Each round runs them in a rotated order: what runs right after another call (after its
    memory was freed) is not always the same one."""
    names = list(calls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        for i in range(len(names)):
            k = names[(i + r) % len(names)]
            times[k].append(calls[k]()[0])
    return times


# --- memory -------------------------------------------------------------------------------


def rss_bytes() -> int:
    """The process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of the resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The kernel's high-water mark of the resident set (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class Meter:
    """Peak memory above the start of a block: RSS on CPU, allocated bytes on CUDA."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = rss_bytes()
            reset_peak_rss()

    def peak(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return peak_rss_bytes() - self.base


def measure(run: Callable[[], Any], device: Any, repeats: int) -> tuple[int, float]:
    """Run ``run()`` ``repeats`` times: the peak memory of the first run above its start, and
    the median seconds."""
    meter = Meter(device)
    seconds = []
    peak = 0
    for r in range(repeats):
        if r == 0:
            meter.start()
        start = time.perf_counter()
        run()
        sync(device)
        seconds.append(time.perf_counter() - start)
        if r == 0:
            peak = meter.peak()
    return peak, statistics.median(seconds)


def tensor_peak(run: Callable[[], Any], top: int = 15, step: int = 2**20) -> dict[str, Any]:
    """Run ``run()`` under a dispatch mode that follows every tensor storage made in it: the
    bytes alive at their peak, and at that peak the largest groups of storages by what made
    them (the pass, ``forward`` or ``backward`` (the graph task of any backward, a checkpoint's
    recomputation in it included), the aten operation, the shape and the dtype). Storages made
    before ``run()`` (weights, inputs) are not counted, nor the views and in-place results of
    an operation (its schema's aliased returns); a storage counts once. A wrapper subclass
    (a ``DTensor``) has no storage of its own and is passed over, and what its own dispatch
    makes runs outside this mode: a sharded model's plain tensors and collectives are
    counted, a ``DTensor``'s local results are not. Holds no reference to a tensor, so it keeps alive what ``run()`` keeps alive, no
    more; its cost is Python per operation. The snapshot of the groups is taken each time the
    bytes alive pass the last one's by ``step``, so the groups' sum can read up to ``step``
    below the peak.

    Example:
        >>> import torch
        >>> def work():
        ...     a = torch.ones(2**18)  # 1 MiB
        ...     b = a * 2
        ...     del a
        ...     return (b + 1).sum()
        >>> found = tensor_peak(work)
        >>> found["peak"] // 2**20
        2
        >>> sorted((g["what"], g["bytes"] // 2**20) for g in found["groups"])
        [('forward mul (262144,) float32', 1), ('forward ones (262144,) float32', 1)]
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live: dict[int, tuple[int, str]] = {}
    state: dict[str, Any] = {"bytes": 0, "peak": 0, "shot": -step, "groups": []}

    def gone(address: int) -> None:
        entry = live.pop(address, None)
        if entry is not None:
            state["bytes"] -= entry[0]

    class Follow(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            returns = func._schema.returns
            for i, t in enumerate(tree_leaves(out)):
                if not isinstance(t, torch.Tensor):
                    continue
                if i < len(returns) and returns[i].alias_info is not None:
                    continue  # a view or an in-place result: an input's storage
                try:
                    storage = t.untyped_storage()
                    address = storage.data_ptr()
                except RuntimeError:  # a wrapper subclass (DTensor's kind): no storage of its own
                    continue
                if address == 0 or address in live:
                    continue
                size = storage.nbytes()
                task = torch._C._current_graph_task_id()
                what = (
                    f"{'forward' if task == -1 else 'backward'} {func.__name__.split('.')[0]} "
                    f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                )
                live[address] = (size, what)
                weakref.finalize(storage, gone, address)
                state["bytes"] += size
                state["peak"] = max(state["peak"], state["bytes"])
                if state["bytes"] >= state["shot"] + step:
                    state["shot"] = state["bytes"]
                    state["groups"] = list(live.values())
            return out

    with Follow():
        run()
    groups: dict[str, list[int]] = {}
    for size, what in state["groups"]:
        entry = groups.setdefault(what, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak": state["peak"],
        "at_snapshot": state["shot"],
        "groups": [{"what": w, "bytes": b, "count": n} for w, (b, n) in ranked[:top]],
    }


def peak_allocated(prof: Any, window: str) -> int:
    """The most bytes allocated at once inside the range ``window`` of a
    :class:`torch.profiler.profile` (``profile_memory=True``) above the amount at its start,
    from the profiler's ``[memory]`` events ("Total Allocated": the bytes the allocator has
    handed out at that moment)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    (span,) = [e for e in events if e.get("name") == window and e.get("ph") == "X"]
    begin, end = span["ts"], span["ts"] + span["dur"]
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and begin <= e["ts"] <= end),
        key=lambda e: e["ts"],
    )
    if not memory:
        return 0
    first = memory[0]["args"]
    start = first["Total Allocated"] - first["Bytes"]  # before the first event in the window
    return max(e["args"]["Total Allocated"] for e in memory) - start


# --- tables -------------------------------------------------------------------------------


def fmt(value: float | None, width: int, digits: int) -> str:
    """``value`` right-aligned in ``width`` with ``digits`` decimals, or ``-`` for none."""
    return f"{value:{width}.{digits}f}" if value is not None else " " * (width - 1) + "-"


def ratio(value: float, reference: float, width: int = 0, digits: int = 2) -> str:
    """``value / reference`` as a table cell (``-`` where the reference is zero)."""
    return fmt(value / reference if reference else None, width, digits)


def agree(grads: Sequence[Any], ref: Sequence[Any]) -> bool:
    """Whether float32 meta-gradients agree with the reference's, tensor by tensor, within 1%
    of the largest entry: a sanity check printed beside the times (second order through conv
    and BatchNorm amplifies float32 rounding: up to 0.6% seen for conv4 at 4 tasks).
    Exactness is checked in float64 by the test suite."""
    return all(
        float((a - b).abs().max()) <= 1e-2 * float(b.abs().max()) + 1e-6
        for a, b in zip(grads, ref, strict=True)
    )


# --- task chunks --------------------------------------------------------------------------


def until_chosen(call: Callable[[], Any], fmodel: Any, limit: int = 40) -> list[float]:
    """The times in ms of the calls (``call()``: one timed meta-iteration with
    ``task_chunk="tune"`` or ``"auto"``, returning its ms first) that a fresh model makes
    until it has chosen its chunk (``"tune"`` on an accelerator measures nothing and reports
    no choice: do not call it there)."""
    times: list[float] = []
    while not fmodel.task_chunk_choices and len(times) < limit:
        times.append(call()[0])
    return times


def default_choice(fmodel: Any, tuning: list[float], ms: float) -> str:
    """What the default chose and what the choice cost: ``"4 (9 calls, +0.9 s)"``, the extra
    seconds those calls took beyond as many at ``ms``, its time once chosen."""
    chosen = [c["chunk"] for c in fmodel.task_chunk_choices.values()]
    chunk = (chosen[0] or "all") if chosen else "all"
    return f"{chunk} ({len(tuning)} calls, {(sum(tuning) - len(tuning) * ms) / 1e3:+.1f} s)"


def residual_mlp(width: int, blocks: int) -> Any:
    """``blocks`` residual blocks ``x + W2 tanh(W1 x)`` of ``width`` (``.blocks``, an
    ``nn.Sequential``: ``blocks.0.inner``, ``blocks.0.outer``, ...) and a linear head to one
    output (``.head``), freshly initialised from torch's generator."""
    return _residual_classes()[1](width, blocks)


def residual_block(width: int) -> Any:
    """One residual block ``x + W2 tanh(W1 x)`` of ``width`` (``.inner``, ``.outer``), the
    block of :func:`residual_mlp`."""
    return _residual_classes()[0](width)


@functools.cache
def _residual_classes() -> tuple[type, type]:
    import torch
    from torch import nn

    class Block(nn.Module):
        """``x + W2 tanh(W1 x)``."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.inner = nn.Linear(width, width)
            self.outer = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.outer(torch.tanh(self.inner(x)))

    class ResidualMLP(nn.Module):
        """Residual blocks (an ``nn.Sequential``) and a linear head to one output."""

        def __init__(self, width: int, blocks: int) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))
            self.head = nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

    return Block, ResidualMLP
