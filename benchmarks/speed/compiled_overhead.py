"""The compiled meta-step's own work per call, without its graph: splitting the batch, the
kind of input, detaching the parameters, the chunks, the saved-tensor-hooks switch, adding
the gradients to ``.grad``. The graph is replaced by a function that returns fixed
gradients, so what is timed is the wrapper alone (the sinusoid MLP, T = 32, K = 5). Then a
tiny compiled ``grad_and_value`` called as it is and behind ``fence.with_own_code_object``, the frame
that gives each step its own compiled code.

    python benchmarks/speed/compiled_overhead.py [--calls 3000]
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
    own_code_row(args.calls)


def own_code_row(calls: int) -> None:
    """A compiled call of a tiny ``grad_and_value`` graph, compiled as it is and behind
    ``fence.with_own_code_object`` (the step's own code object), alternating: the cost of the extra
    frame."""
    from funcmeta._src.core.fence import with_own_code_object

    fn = torch.func.grad_and_value(lambda w, x: (w * x).sum())
    ways = {
        "as it is": torch.compile(fn, fullgraph=True, dynamic=False),
        "with_own_code_object": torch.compile(
            with_own_code_object(fn), fullgraph=True, dynamic=False
        ),
    }
    w, x = torch.ones(4), torch.ones(4)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for f in ways.values():
        f(w, x)  # compiles
    for i in range(calls):
        for name, f in ways.items() if i % 2 else reversed(ways.items()):
            started = time.perf_counter()
            f(w, x)
            times[name].append(time.perf_counter() - started)
    row = ", ".join(f"{k} {statistics.median(v[500:]) * 1e6:.1f} us" for k, v in times.items())
    print(f"a tiny compiled grad_and_value per call: {row}")


if __name__ == "__main__":
    main()
