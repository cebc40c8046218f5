"""The compiled meta-step's own work per call, without its graph: splitting the batch, the
kind of input, detaching the parameters, the chunks, the saved-tensor-hooks switch, adding
the gradients to ``.grad``. The graph is replaced by a function that returns fixed
gradients, so what is timed is the wrapper alone (the sinusoid MLP, T = 32, K = 5).

    python benchmarks/compiled_overhead.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
    b = fm.data.Sinusoid().sample(32, 10, 10, generator=torch.Generator().manual_seed(1))
    fmodel = fm.functional_model(net)
    step = fm.compile_meta_step(fmodel, F.mse_loss, fm.optim.sgd(lr=0.01), steps=5)
    fixed = ({k: torch.zeros_like(v) for k, v in fmodel.params.items()}, [])
    out = (fixed, torch.tensor(0.0))
    step._compiled = lambda *a: out  # the wrapper alone
    times = []
    for _ in range(args.calls):
        started = time.perf_counter()
        step(b.support, b.query)
        times.append(time.perf_counter() - started)
    print(f"compile_meta_step wrapper per call: {statistics.median(times[500:]) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
