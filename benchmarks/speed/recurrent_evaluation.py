"""Evaluating many tasks with a recurrent model whose weights the tasks share: ``fm.apply_tasks``
under ``torch.no_grad()`` against a Python loop over the tasks.

With the weights shared and no graph to build, the task-batched call runs the recurrent layer
once, as torch computes it (oneDNN's fused LSTM on CPU in float32), on the tasks joined to its
batch (``funcmeta._src.batching.recurrent``). Each model: ``sequence_tasks.py``'s classifier (an
embedding, an ``nn.LSTM`` or ``nn.GRU`` with hidden 128, batch first, and a linear head), on
T tasks of 25 sequences of 32 tokens. Medians of ``--repeats`` rounds, the two implementations interleaved in one process;
"agree": the outputs within float32 rounding (1e-5 relative).

    python benchmarks/recurrent_evaluation.py [--tasks 4 16 64] [--repeats 9] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from sequence_tasks import LENGTH, VOCAB, RecurrentClassifier

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _threads import add_threads_option, available_cores, use_threads

SEQUENCES = 25  # per task, of sequence_tasks.LENGTH tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=9)
    add_threads_option(parser, available_cores(), "every core: large matrix products")
    args = parser.parse_args()
    threads = use_threads(args)
    print(
        f"CPU: {platform.machine()}, {threads} threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(f"{'model':5s} {'T':>3s}  agree  {'loop ms':>8s}  {'batched ms':>10s}  loop/batched")
    for kind in ("lstm", "gru"):
        torch.manual_seed(0)
        fmodel = fm.functional_model(RecurrentClassifier(kind).eval(), task_chunk=None)
        for tasks in args.tasks:
            ids = torch.randint(0, VOCAB, (tasks, SEQUENCES, LENGTH))
            mask = torch.ones_like(ids)  # the classifier reads the last token

            def loop(
                ids: torch.Tensor = ids, mask: torch.Tensor = mask, f: Any = fmodel
            ) -> torch.Tensor:
                return torch.stack([f(f.params, ids[t], mask[t]) for t in range(len(ids))])

            def batched(
                ids: torch.Tensor = ids, mask: torch.Tensor = mask, f: Any = fmodel
            ) -> torch.Tensor:
                return fm.apply_tasks(f, f.params, fm.Args(ids, mask))[0]

            times: dict[str, list[float]] = {"loop": [], "batched": []}
            with torch.no_grad():
                ref, out = loop(), batched()  # warm-up
                agree = torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
                for r in range(args.repeats):
                    order = [("loop", loop), ("batched", batched)][:: 1 if r % 2 else -1]
                    for name, fn in order:
                        start = time.perf_counter()
                        fn()
                        times[name].append((time.perf_counter() - start) * 1e3)
            loop_ms, batched_ms = (statistics.median(times[k]) for k in ("loop", "batched"))
            print(
                f"{kind:5s} {tasks:3d}  {'yes' if agree else 'NO':5s}  {loop_ms:8.1f}  "
                f"{batched_ms:10.1f}  {loop_ms / batched_ms:12.2f}"
            )


if __name__ == "__main__":
    main()
