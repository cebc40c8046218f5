"""What TF32 does to second-order meta-gradients on a GPU, and where the task-batched conv path's
float32 gap comes from.

conv4 with BatchNorm (64 filters, 5-way 1-shot, 28x28 inputs), second-order MAML, 5 SGD steps,
T tasks: the meta-gradient (every parameter's, concatenated) under several settings, each
compared with the float64 per-task loop (the exact value), as a relative 2-norm:

- ``loop`` and ``loop again``: the per-task loop of ``fm.adapt``, twice (its run-to-run
  spread: cuDNN may pick other algorithms on a second run);
- ``batched``: ``fm.adapt_tasks`` (per-task weights as one grouped convolution);
- each with TF32 as torch leaves it (cuDNN's convolutions in TF32), inside
  ``fm.exact_float32()``, with ``torch.backends.cudnn.deterministic = True`` as well, and with
  cuDNN off (torch's own convolution kernels);
- ``float64``: the batched path in float64 (exactness of the computation itself).

    python benchmarks/checks/tf32.py [--tasks 8] [--steps 5] [--max-exact-error 1e-3]

With ``--max-exact-error E`` it judges ``fm.exact_float32``: its last line is ``RESULT PASS``
when the exact row's three errors (loop, loop again, batched) are all at most ``E``, else
``RESULT FAIL`` and exit status 1. Without a CUDA device it says so and exits (0; with
``--max-exact-error``, ``RESULT SKIP (no CUDA device)`` and exit status 3: nothing judged).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import platform
import sys
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F

import funcmeta as fm

EXACT = "exact (fm.exact_float32)"
#: the exit status of a run that judged nothing (no CUDA device): scripts/gpu_judge.py
NOT_JUDGED = 3


def conv4(channels: int = 64) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i in range(4):
        layers += [
            torch.nn.Conv2d(1 if i == 0 else channels, channels, 3, padding=1),
            torch.nn.BatchNorm2d(channels),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        ]
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(channels, 5))


def meta_gradient(net: torch.nn.Module, data: tuple, batched: bool, steps: int) -> torch.Tensor:
    xs, ys, xq, yq = (
        t.to(next(net.parameters()).dtype) if t.is_floating_point() else t for t in data
    )
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.4)
    tasks = xs.shape[0]
    if batched:
        r = fm.adapt_tasks(
            fmodel, fmodel.params, F.cross_entropy, (xs, ys), opt, steps=steps, task_chunk=None
        )
        loss = fm.task_losses(fmodel, r.params, F.cross_entropy, (xq, yq), task_chunk=r.chunk)[
            0
        ].mean()
    else:
        loss = 0
        for t in range(tasks):
            r = fm.adapt(fmodel, fmodel.params, F.cross_entropy, (xs[t], ys[t]), opt, steps=steps)
            loss = loss + F.cross_entropy(fmodel(r.params, xq[t]), yq[t]) / tasks
    grads = torch.autograd.grad(loss, list(fmodel.params.values()))
    return torch.cat([g.double().flatten() for g in grads])


@contextlib.contextmanager
def cudnn_set(name: str, value: bool) -> Iterator[None]:
    """One cuDNN flag for the block (``torch.backends.cudnn.flags`` would reset the others,
    TF32 among them, to its defaults)."""
    before = getattr(torch.backends.cudnn, name)
    setattr(torch.backends.cudnn, name, value)
    try:
        yield
    finally:
        setattr(torch.backends.cudnn, name, before)


@contextlib.contextmanager
def setting(name: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if name != "TF32 default":
            stack.enter_context(fm.exact_float32())
        if name == "exact, deterministic":
            stack.enter_context(cudnn_set("deterministic", True))
        if name == "exact, no cuDNN":
            stack.enter_context(cudnn_set("enabled", False))
        yield


def judge_exact(errors: Mapping[str, float], target: float) -> tuple[bool, str]:
    """Whether every error of ``fm.exact_float32``'s row (relative to the float64 loop) is at
    most ``target`` (a NaN is not), and the ``RESULT`` line that says so."""
    values = list(errors.values())
    ok = bool(values) and all(e <= target for e in values)
    worst = math.nan if not values or any(math.isnan(e) for e in values) else max(values)
    listed = ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
    verdict = "PASS" if ok else "FAIL"
    sign = "<=" if ok else ">"
    return ok, (
        f"RESULT {verdict}: fm.exact_float32 vs float64, largest {worst:.1e} {sign} "
        f"{target:.0e} ({listed})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--max-exact-error",
        type=float,
        default=None,
        metavar="E",
        help="judge: fm.exact_float32's errors (loop and batched) at most E, else exit 1",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tf32.py: no CUDA device here; TF32 is a GPU matter, nothing to measure")
        if args.max_exact_error is None:
            return 0
        print("RESULT SKIP (no CUDA device): fm.exact_float32 not measured, nothing judged")
        return NOT_JUDGED
    torch.manual_seed(0)
    net = conv4().cuda()
    g = torch.Generator().manual_seed(1)
    t = args.tasks
    data = (
        torch.randn(t, 5, 1, 28, 28, generator=g).cuda(),
        torch.arange(5).repeat(t, 1).cuda(),
        torch.randn(t, 75, 1, 28, 28, generator=g).cuda(),
        torch.arange(5).repeat_interleave(15).repeat(t, 1).cuda(),
    )
    exact = meta_gradient(copy.deepcopy(net).double(), data, False, args.steps)
    batched64 = meta_gradient(copy.deepcopy(net).double(), data, True, args.steps)

    def rel(a: torch.Tensor) -> float:
        return float((a - exact).norm() / exact.norm())

    print(
        f"second-order MAML meta-gradient, conv4 + BatchNorm, T = {t}, {args.steps} steps, "
        f"float32 on {torch.cuda.get_device_name()}; torch {torch.__version__}, Python "
        f"{platform.python_version()}; relative 2-norm from the float64 loop"
    )
    print("| setting | loop | loop again | batched |")
    print("| --- | --- | --- | --- |")
    exact_errors: dict[str, float] = {}
    for name in ("TF32 default", EXACT, "exact, deterministic", "exact, no cuDNN"):
        with setting(name):
            row = [meta_gradient(net, data, b, args.steps) for b in (False, False, True)]
        errors = dict(zip(("loop", "loop again", "batched"), map(rel, row), strict=True))
        if name == EXACT:
            exact_errors = errors
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errors.values()) + " |", flush=True)
    print(f"| float64, batched | | | {rel(batched64):.1e} |")
    if args.max_exact_error is None:
        return 0
    ok, line = judge_exact(exact_errors, args.max_exact_error)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
