"""The BatchNorm pitfall of ``vmap(torch.func.grad(...))`` second-order MAML, measured.

The torch.func recipe takes inner gradients with ``torch.func.grad`` inside ``vmap`` over
tasks, with BatchNorm patched by ``torch.func.replace_all_batch_norm_modules_``. With BatchNorm
in train mode, its second-order meta-gradients differ from an exact per-task loop. The script measures that difference and the one of
``fm.adapt_tasks`` on the same network, tasks and weights (float64).

    python benchmarks/checks/vmap_grad_pitfall.py
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import funcmeta as fm

T, STEPS, LR = 4, 2, 0.1


def networks() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))

    def block(cin: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2)
        )

    conv4 = nn.Sequential(block(1), block(64), block(64), block(64), nn.Flatten(), nn.Linear(64, 5))
    return {"Linear-BatchNorm1d MLP": mlp.double(), "conv4 (Omniglot)": conv4.double()}


def data(name: str) -> tuple:
    g = torch.Generator().manual_seed(1)
    if name.startswith("conv4"):
        xs, xq = (torch.randn(T, 5, 1, 28, 28, generator=g, dtype=torch.float64) for _ in range(2))
    else:
        xs, xq = (torch.randn(T, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    y = torch.arange(5).repeat(T, 1)
    return xs, y, xq, y.clone()


def exact(net, xs, ys, xq, yq):
    fmodel = fm.functional_model(net)
    total = 0
    for t in range(T):
        r = fm.adapt(
            fmodel, fmodel.params, F.cross_entropy, (xs[t], ys[t]), fm.optim.sgd(lr=LR), steps=STEPS
        )
        total = total + F.cross_entropy(fmodel.run(r.params, r.buffers, xq[t])[0], yq[t])
    return torch.autograd.grad(total / T, list(net.parameters()))


def vmap_of_grad(net, xs, ys, xq, yq):
    # The torch.func way to run BatchNorm under grad/vmap: stop tracking running statistics
    # (train-mode outputs do not depend on them, so the exact loop is the same function).
    net = copy.deepcopy(net)
    torch.func.replace_all_batch_norm_modules_(net)
    params = dict(net.named_parameters())
    buffers = dict(net.named_buffers())

    def inner_loss(p, x, y):
        return F.cross_entropy(functional_call(net, (p, buffers), (x,)), y)

    def task(x, y, xq_, yq_):
        p = params
        for _ in range(STEPS):
            g = grad(inner_loss)(p, x, y)
            p = {k: v - LR * g[k] for k, v in p.items()}
        return F.cross_entropy(functional_call(net, (p, buffers), (xq_,)), yq_)

    losses = vmap(task, randomness="different")(xs, ys, xq, yq)
    return torch.autograd.grad(losses.mean(), list(params.values()))


def batched(net, xs, ys, xq, yq):
    fmodel = fm.functional_model(net)
    r = fm.adapt_tasks(
        fmodel, fmodel.params, F.cross_entropy, (xs, ys), fm.optim.sgd(lr=LR), steps=STEPS
    )
    out, _ = fm.apply_tasks(fmodel, r.params, xq, buffers=r.buffers, task_chunk=r.chunk)
    loss = torch.stack([F.cross_entropy(out[t], yq[t]) for t in range(T)]).mean()
    return torch.autograd.grad(loss, list(net.parameters()))


def max_error(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def main() -> None:
    print(
        f"second-order meta-gradients, {T} tasks, {STEPS} SGD steps, BatchNorm in train mode, float64"
    )
    print(f"max abs difference from the exact per-task loop (torch {torch.__version__})")
    for name, net in networks().items():
        xs, ys, xq, yq = data(name)
        reference = exact(net, xs, ys, xq, yq)
        try:
            pitfall = f"{max_error(vmap_of_grad(net, xs, ys, xq, yq), reference):.2e}"
        except RuntimeError as e:  # a torch release may refuse the recipe outright
            pitfall = f"fails: {str(e).splitlines()[0][:80]}"
        ours = max_error(batched(net, xs, ys, xq, yq), reference)
        scale = max(float(g.abs().max()) for g in reference)
        print(
            f"  {name:<24} vmap(grad): {pitfall:<12} fm.adapt_tasks: {ours:.2e}   (largest entry {scale:.2e})"
        )


if __name__ == "__main__":
    main()
