"""The compiled meta-step on a model built with ``checkpoint_layers=``, against the eager
checkpointed run and the compiled step without checkpointing: memory, time and meta-gradients.

One second-order MAML meta-iteration of a 16-block residual MLP (each block ``x + W2 tanh(W1
x)``, width 256, a linear head), ``--tasks`` tasks of 512 support and 512 query rows, 5 SGD
inner steps, the mean query loss's gradient with respect to the initial parameters. Four
ways, each in a process of its own (a clean high-water mark of the resident set, freed
memory returned to the system), float32:

- ``eager``: :func:`funcmeta.adapt_tasks`, :func:`funcmeta.task_losses`, ``backward``;
- ``eager checkpointed``: the same on the model built with ``checkpoint_layers="sequential"``
  (each block);
- ``compiled``: :func:`funcmeta.compile_meta_step` on the model without checkpointing;
- ``compiled checkpointed``: :func:`funcmeta.compile_meta_step` on the checkpointed model, as
  it chooses (on torch 2.13 and newer the autograd graph, which recomputes the checkpointed
  layers' forwards and inner gradients; its ``eager_reason`` is printed when it does not
  compile).

``--backend aot_eager`` compiles with torch's ``aot_eager`` backend instead of the step's
plan (the graph as AOTAutograd partitions it, activation checkpointing's recomputation
included, without inductor's C++ build: minutes less on a small CPU, the same memory
decisions).

Each row, for one meta-iteration after a first call (which compiles): the most tensor bytes
alive at once above its start (``peak MB``: on a CPU the profiler's count of what torch's
allocator has handed out; on CUDA ``max_memory_allocated`` over the call that records the
CUDA graph), the peak resident set above its start (``RSS MB``, CPU only; shown, not judged), the median seconds of ``--repeats`` calls, and
the largest difference of its float64 meta-gradients from ``eager``'s in float64 (the same
weights and data). The resident set can read low for a way whose process compiled just
before (the compiled checkpointed step read 0.0 MB above its start after a cold compile,
likely glibc serving new blocks from the free chunks the compile left in its heap). The
tensor bytes are the working set.

Targets (issue "a compiled step that checkpoints"): ``compiled checkpointed``'s float64
meta-gradients equal ``eager``'s to 1e-10; its tensor peak at most ``eager checkpointed``'s
and at most 0.5x ``compiled``'s; its median time at most 0.8x ``eager checkpointed``'s and at
most 1.3x ``compiled``'s. The last line is ``RESULT PASS`` or ``RESULT FAIL`` (exit status
1), naming each target missed.

    python benchmarks/memory/compiled_checkpoint.py [--tasks 1] [--repeats 5]
        [--device cpu|cuda] [--threads 1] [--backend plan|aot_eager]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

WAYS = ("eager", "eager checkpointed", "compiled", "compiled checkpointed")
WIDTH, BLOCKS, ROWS, STEPS, LR = 256, 16, 512, 5, 0.01


def data(tasks: int, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    """``tasks`` tasks of ``ROWS`` support and ``ROWS`` query rows (a fixed seed)."""
    g = torch.Generator().manual_seed(1)

    def part() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(tasks, ROWS, WIDTH, generator=g, dtype=dtype)
        y = torch.randn(tasks, ROWS, 1, generator=g, dtype=dtype)
        return x.to(device), y.to(device)

    return part(), part()


def meta_iteration(way: str, dtype: torch.dtype, device: str, tasks: int) -> tuple[Any, Any]:
    """The model and a function running one meta-iteration the ``way`` named (its
    meta-gradients land in the model's ``.grad``)."""
    torch.manual_seed(0)
    net = _common.residual_mlp(WIDTH, BLOCKS).to(device=device, dtype=dtype)
    checkpointed = way.endswith("checkpointed")
    fmodel = fm.functional_model(net, checkpoint_layers="sequential" if checkpointed else None)
    opt = fm.optim.sgd(lr=LR)
    support, query = data(tasks, dtype, device)
    if way.startswith("compiled"):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            if os.environ.get("COMPILED_CHECKPOINT_BACKEND", "plan") != "plan":
                backend = os.environ["COMPILED_CHECKPOINT_BACKEND"]
                compile_ = torch.compile
                torch.compile = lambda fn, **kw: compile_(  # type: ignore[assignment]
                    fn, fullgraph=True, dynamic=False, backend=backend
                )
            step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=STEPS)
        return net, (lambda: step(support, query)), step.eager_reason

    def run() -> torch.Tensor:
        result = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, opt, steps=STEPS)
        losses = fm.task_losses(
            fmodel,
            result.params,
            F.mse_loss,
            query,
            buffers=result.buffers,
            task_chunk=result.chunk,
        )
        loss = losses.losses.mean()
        loss.backward()
        return loss.detach()

    return net, run, None


def one_way(way: str, device: str, tasks: int, repeats: int) -> dict[str, Any]:
    """One way's row, run in this process: float64 meta-gradients, then float32 memory and
    time."""
    net, run, reason = meta_iteration(way, torch.float64, device, tasks)
    run()
    grads = {k: p.grad.detach().cpu() for k, p in net.named_parameters()}
    net, run, reason = meta_iteration(way, torch.float32, device, tasks)
    run()  # compiles, where it does; the allocator's pools warmed
    net.zero_grad()
    meter = _common.Meter(torch.device(device))
    meter.start()
    run()
    resident = meter.peak()
    net.zero_grad()
    if device == "cpu":  # the allocator's count: tensor bytes alive at once
        activities = [torch.profiler.ProfilerActivity.CPU]
        with (
            torch.profiler.profile(activities=activities, profile_memory=True) as prof,
            torch.profiler.record_function("measured"),
        ):
            run()
        peak = _common.peak_allocated(prof, "measured")
    else:  # the Meter counts allocated bytes on CUDA: the run above, which records a CUDA
        # graph where the step replays one (a replay allocates nothing from the allocator)
        peak, resident = resident, 0
    seconds = []
    for _ in range(repeats):
        net.zero_grad()
        started = time.perf_counter()
        run()
        _common.sync(torch.device(device))
        seconds.append(time.perf_counter() - started)
    seconds.sort()
    path = Path(os.environ["COMPILED_CHECKPOINT_GRADS"])
    torch.save(grads, path)
    return {
        "peak": peak,
        "rss": resident,
        "seconds": seconds[len(seconds) // 2],
        "reason": reason,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", choices=("plan", "aot_eager"), default="plan")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a row's own process
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.way is not None:
        print(json.dumps(one_way(args.way, args.device, args.tasks, args.repeats)))
        return 0
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    print(
        f"device: {args.device} ({name or platform.machine()}); torch {torch.__version__}; "
        f"threads {args.threads}"
    )
    print(
        f"workload: second-order MAML, residual MLP {BLOCKS} blocks of width {WIDTH}, "
        f"{args.tasks} task(s) of {ROWS} support and {ROWS} query rows, {STEPS} SGD steps"
    )
    rows: dict[str, dict[str, Any]] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(args.threads)}
    env["COMPILED_CHECKPOINT_BACKEND"] = args.backend
    print(
        f"compiled with: {'the step plan (inductor)' if args.backend == 'plan' else args.backend}"
    )
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    for way in WAYS:
        path = folder / f"compiled_checkpoint_{os.getpid()}_{way.replace(' ', '_')}.pt"
        command = [sys.executable, __file__, "--way", way, "--device", args.device]
        command += ["--tasks", str(args.tasks), "--repeats", str(args.repeats)]
        command += ["--threads", str(args.threads)]
        done = subprocess.run(
            command,
            env={**env, "COMPILED_CHECKPOINT_GRADS": str(path)},
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            print(f"RESULT FAIL ({way} did not run)")
            return 1
        rows[way] = json.loads(done.stdout.strip().splitlines()[-1])
        grads[way] = torch.load(path)
        path.unlink()
    print(f"{'way':<22} {'peak MB':>9} {'RSS MB':>9} {'median s':>9} {'float64 diff':>13}")
    for way, row in rows.items():
        diff = max(float((grads[way][k] - g).abs().max()) for k, g in grads["eager"].items())
        row["diff"] = diff
        print(
            f"{way:<22} {row['peak'] / 2**20:9.1f} {row['rss'] / 2**20:9.1f} "
            f"{row['seconds']:9.3f} {diff:13.2e}"
        )
    ours, ck, plain = rows["compiled checkpointed"], rows["eager checkpointed"], rows["compiled"]
    if ours["reason"]:
        print(f"compiled checkpointed runs eagerly: {ours['reason']}")
    missed = []
    if ours["diff"] > 1e-10:
        missed.append(f"float64 meta-gradients {ours['diff']:.2e} from eager's (target 1e-10)")
    if ours["peak"] > ck["peak"]:
        missed.append(
            f"tensor peak {ours['peak'] / ck['peak']:.2f}x the eager checkpointed run's (target 1x)"
        )
    if ours["peak"] > 0.5 * plain["peak"]:
        missed.append(
            f"peak {ours['peak'] / plain['peak']:.2f}x the compiled unchecked step's (target 0.5x)"
        )
    if ours["seconds"] > 0.8 * ck["seconds"]:
        missed.append(
            f"time {ours['seconds'] / ck['seconds']:.2f}x the eager checkpointed run's "
            "(target 0.8x)"
        )
    if ours["seconds"] > 1.3 * plain["seconds"]:
        missed.append(
            f"time {ours['seconds'] / plain['seconds']:.2f}x the compiled unchecked step's "
            "(target 1.3x)"
        )
    print(f"RESULT FAIL: {'; '.join(missed)}" if missed else "RESULT PASS")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
