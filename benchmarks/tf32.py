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

    python benchmarks/tf32.py [--tasks 8] [--steps 5]

Without a CUDA device it says so and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import funcmeta as fm


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
    fmodel = fm.functional_model(net, task_chunk=None)
    opt = fm.optim.sgd(lr=0.4)
    tasks = xs.shape[0]
    if batched:
        r = fm.adapt_tasks(fmodel, fmodel.params, F.cross_entropy, (xs, ys), opt, steps=steps)
        loss = fm.task_losses(fmodel, r.params, F.cross_entropy, (xq, yq))[0].mean()
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tf32.py: no CUDA device here; TF32 is a GPU matter, nothing to measure")
        return
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

    def rel(a: torch.Tensor) -> str:
        return f"{float((a - exact).norm() / exact.norm()):.1e}"

    print(
        f"second-order MAML meta-gradient, conv4 + BatchNorm, T = {t}, {args.steps} steps, "
        f"float32 on {torch.cuda.get_device_name()}; torch {torch.__version__}, Python "
        f"{platform.python_version()}; relative 2-norm from the float64 loop"
    )
    print("| setting | loop | loop again | batched |")
    print("| --- | --- | --- | --- |")
    for name in (
        "TF32 default",
        "exact (fm.exact_float32)",
        "exact, deterministic",
        "exact, no cuDNN",
    ):
        with setting(name):
            row = [meta_gradient(net, data, b, args.steps) for b in (False, False, True)]
        print(f"| {name} | " + " | ".join(rel(r) for r in row) + " |")
    print(f"| float64, batched | | | {rel(batched64)} |")


if __name__ == "__main__":
    main()
