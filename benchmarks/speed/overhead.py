"""Overhead of fm.adapt against a hand-written functional_call + autograd.grad inner loop.

One second-order MAML meta-iteration (inner loop over the tasks of a meta-batch, query loss,
backward to the initial parameters) written twice: with funcmeta and by hand. The script
first checks that both give the same meta-gradients, then times them interleaved in one
process and prints the median milliseconds and the ratio funcmeta / hand-written.

    python benchmarks/speed/overhead.py [--repeats 30] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common


def sinusoid_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def hand_sgd(model, params, batch, steps, lr):
    losses = []
    for t in range(batch.x_support.shape[0]):
        p = params
        for _ in range(steps):
            loss = F.mse_loss(functional_call(model, p, (batch.x_support[t],)), batch.y_support[t])
            grads = torch.autograd.grad(loss, list(p.values()), create_graph=True)
            p = {k: v - lr * g for (k, v), g in zip(p.items(), grads, strict=True)}
        losses.append(F.mse_loss(functional_call(model, p, (batch.x_query[t],)), batch.y_query[t]))
    return torch.stack(losses).mean()


def safe_sqrt(x):
    """``sqrt(x)`` with finite derivatives of every order at 0, written as funcmeta's Adam
    computes it (a double ``where``), so that the two do the same work."""
    positive = x > 0
    return torch.where(positive, torch.where(positive, x, 1.0).sqrt(), 0.0)


def hand_adam(model, params, batch, steps, lr, b1=0.9, b2=0.999, eps=1e-8):
    losses = []
    for t in range(batch.x_support.shape[0]):
        p = params
        m = {k: torch.zeros_like(v) for k, v in p.items()}
        v2 = {k: torch.zeros_like(v) for k, v in p.items()}
        for step in range(1, steps + 1):
            loss = F.mse_loss(functional_call(model, p, (batch.x_support[t],)), batch.y_support[t])
            grads = torch.autograd.grad(loss, list(p.values()), create_graph=True)
            new = {}
            for (k, v), g in zip(p.items(), grads, strict=True):
                m[k] = m[k].lerp(g, 1 - b1)
                v2[k] = torch.addcmul(v2[k].mul(b2), g, g, value=1 - b2)
                denom = safe_sqrt(v2[k]) / (1 - b2**step) ** 0.5 + eps
                new[k] = v - lr * (m[k] / denom / (1 - b1**step))
            p = new
        losses.append(F.mse_loss(functional_call(model, p, (batch.x_query[t],)), batch.y_query[t]))
    return torch.stack(losses).mean()


def ours(fmodel, opt, batch, steps):
    losses = []
    for t in range(batch.x_support.shape[0]):
        support = (batch.x_support[t], batch.y_support[t])
        result = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, opt, steps=steps)
        losses.append(F.mse_loss(fmodel(result.params, batch.x_query[t]), batch.y_query[t]))
    return torch.stack(losses).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--meta-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = args.device
    torch.manual_seed(0)
    model = sinusoid_mlp().to(device)
    fmodel = fm.functional_model(model)
    params = list(model.parameters())
    batch = fm.data.Sinusoid().sample(
        args.meta_batch, 10, 10, generator=torch.Generator().manual_seed(0), device=device
    )
    workloads = {
        "sgd": (
            lambda: hand_sgd(model, fmodel.params, batch, args.steps, 0.01),
            lambda: ours(fmodel, fm.optim.sgd(lr=0.01), batch, args.steps),
        ),
        "adam": (
            lambda: hand_adam(model, fmodel.params, batch, args.steps, 0.01),
            lambda: ours(fmodel, fm.optim.adam(lr=0.01), batch, args.steps),
        ),
    }
    name = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else (platform.processor() or platform.machine())
    )
    print(
        f"device: {device} ({name}); torch {torch.__version__}; threads {torch.get_num_threads()}"
    )
    print(
        f"workload: second-order MAML meta-iteration, sinusoid MLP 40-40, 10-shot, "
        f"{args.steps} inner steps, meta-batch {args.meta_batch} (task loop)"
    )
    print(f"{'inner opt':<10} {'agree':<6} {'hand ms':>9} {'funcmeta ms':>12} {'ratio':>7}")
    for label, (hand, mine) in workloads.items():
        _, g_hand = _common.timed_grad(hand, params, device)
        _, g_ours = _common.timed_grad(mine, params, device)
        agree = all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g_hand, g_ours, strict=True)
        )
        for _ in range(3):  # warm-up
            _common.timed_grad(hand, params, device)
            _common.timed_grad(mine, params, device)
        t_hand, t_ours = [], []
        for _ in range(args.repeats):
            t_hand.append(_common.timed_grad(hand, params, device)[0])
            t_ours.append(_common.timed_grad(mine, params, device)[0])
        mh, mo = statistics.median(t_hand), statistics.median(t_ours)
        print(f"{label:<10} {'yes' if agree else 'NO':<6} {mh:9.2f} {mo:12.2f} {mo / mh:7.3f}")


if __name__ == "__main__":
    main()
