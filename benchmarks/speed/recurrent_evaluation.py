"""Evaluating many tasks with a recurrent model whose weights the tasks share: ``fm.apply_tasks``
under ``torch.no_grad()`` against a Python loop over the tasks.

With the weights shared and no graph to build, the task-batched call runs the recurrent layer
once, as torch computes it (oneDNN's fused LSTM on CPU in float32), on the tasks joined to its
batch (``funcmeta._src.batching.recurrent``). Each model: the recurrent classifier of ``sequence_tasks.py`` (an
embedding, an ``nn.LSTM`` or ``nn.GRU`` with hidden 128, batch first, and a linear head), on
T tasks of 25 sequences of 32 tokens. Medians of ``--repeats`` rounds, the two implementations interleaved in one process;
"agree": the outputs within float32 rounding (1e-5 relative).

    python benchmarks/speed/recurrent_evaluation.py [--tasks 4 16 64] [--repeats 9] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

SEQUENCES, LENGTH, VOCAB, HIDDEN, WAYS = 25, 32, 1000, 128, 5  # per task, as in sequence_tasks.py


class RecurrentClassifier(nn.Module):
    """Embedding, LSTM or GRU, and a head on the last real token's output (the unpacked
    classifier of ``sequence_tasks.py``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(HIDDEN, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, WAYS)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(input_ids))
        last = attention_mask.sum(1) - 1  # the last real token of each sequence
        return self.head(out[torch.arange(out.shape[0]), last])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=9)
    _common.add_threads_option(
        parser, _common.available_cores(), "every core: large matrix products"
    )
    args = parser.parse_args()
    threads = _common.use_threads(args)
    print(
        f"CPU: {platform.machine()}, {threads} threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(f"{'model':5s} {'T':>3s}  agree  {'loop ms':>8s}  {'batched ms':>10s}  loop/batched")
    for kind in ("lstm", "gru"):
        torch.manual_seed(0)
        fmodel = fm.functional_model(RecurrentClassifier(kind).eval())
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
                return fm.apply_tasks(f, f.params, fm.Args(ids, mask), task_chunk=None)[0]

            with torch.no_grad():
                ref, out = loop(), batched()  # warm-up
                agree = torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
                calls = {
                    k: functools.partial(_common.timed, f)
                    for k, f in [("loop", loop), ("batched", batched)]
                }
                med = _common.medians(_common.rounds(calls, args.repeats))
            loop_ms, batched_ms = med["loop"], med["batched"]
            print(
                f"{kind:5s} {tasks:3d}  {'yes' if agree else 'NO':5s}  {loop_ms:8.1f}  "
                f"{batched_ms:10.1f}  {loop_ms / batched_ms:12.2f}"
            )


if __name__ == "__main__":
    main()
