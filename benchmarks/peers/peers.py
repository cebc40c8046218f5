"""funcmeta against higher and TorchOpt on the same second-order MAML meta-iteration.

Implementations:
- **reference:** hand-written ``functional_call`` + ``torch.autograd.grad``, a loop over tasks.
- **funcmeta loop:** ``fm.adapt`` per task.
- **funcmeta batched:** ``fm.recipes.maml`` (``fm.adapt_tasks``) on a functional model as a
  user makes it, with the default ``task_chunk="auto"`` (a rule of the shapes: no measuring
  calls); the row below the table says what it chose.
- **funcmeta tuned:** ``fm.recipes.maml`` with ``task_chunk=`` the chunk that
  ``fm.tune_task_chunk`` measured fastest on the workload (tuned once, before timing).
- **higher:** ``innerloop_ctx`` per task.
- **torchopt:** ``MetaSGD`` per task, with ``extract_state_dict``/``recover_state_dict``.
- **learn2learn:** ``MAML(first_order=False)`` (``MetaSGD`` for per-element rates),
  ``clone()`` and ``adapt()`` per task.

The peers are optional: ``pip install -e .[bench]`` brings higher and torchopt;
learn2learn 0.2.0 needs a build (``bash benchmarks/peers/build_learn2learn.sh``: its published C
files predate Python 3.11). A peer that does not import is reported and skipped.

Workloads: conv4 5-way 1-shot 28x28 (meta-batch 4 and 32, 1 and 5 inner SGD steps), the
sinusoid MLP 40-40 10-shot (meta-batch 32, 5 steps), and Meta-SGD on the sinusoid MLP (per-element
learnable rates, 1 step; every implementation but torchopt). Every implementation gets the
same initial weights and data. The script first checks that each one's meta-gradients agree
with the reference (float32: within 1% of each tensor's largest entry). It then times them
interleaved in one process, each round in a rotated order (median ms), and gives the ratio
to the reference. Finally it measures peak memory per implementation for conv4 at 5 steps,
a fresh process each.

    python benchmarks/peers/peers.py [--repeats 5] [--device cpu] [--skip-memory] [--keep-freed-memory]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common
import _peer_maml  # beside this script

LR = _peer_maml.LR
PEERS = _peer_maml.PEERS
NO_PER_ELEMENT_RATES = _peer_maml.NO_PER_ELEMENT_RATES


def sinusoid_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def conv4() -> nn.Module:
    def block(cin: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2)
        )

    return nn.Sequential(block(1), block(64), block(64), block(64), nn.Flatten(), nn.Linear(64, 5))


def workload_data(name: str, tasks: int) -> tuple:
    g = torch.Generator().manual_seed(tasks)
    if name.startswith("conv4"):
        xs = torch.randn(tasks, 5, 1, 28, 28, generator=g)
        xq = torch.randn(tasks, 25, 1, 28, 28, generator=g)
        ys = torch.arange(5).repeat(tasks, 1)
        yq = torch.arange(5).repeat_interleave(5).repeat(tasks, 1)
        return (xs, ys), (xq, yq), F.cross_entropy
    b = fm.data.Sinusoid().sample(tasks, 10, 10, generator=g)
    return (b.x_support, b.y_support), (b.x_query, b.y_query), F.mse_loss


# --- implementations: each returns the mean query loss over the tasks ------------------


def reference(net, rates, support, query, loss_fn, steps):
    losses = []
    params = dict(net.named_parameters())
    buffers = dict(net.named_buffers())
    for t in range(support[0].shape[0]):
        p = params
        for _ in range(steps):
            out = functional_call(
                net, (p, {k: v.clone() for k, v in buffers.items()}), (support[0][t],)
            )
            grads = torch.autograd.grad(
                loss_fn(out, support[1][t]), list(p.values()), create_graph=True
            )
            lr = rates or {k: LR for k in p}
            p = {k: v - lr[k] * g for (k, v), g in zip(p.items(), grads, strict=True)}
        out = functional_call(net, (p, {k: v.clone() for k, v in buffers.items()}), (query[0][t],))
        losses.append(loss_fn(out, query[1][t]))
    return torch.stack(losses).mean()


@functools.cache
def functional_model_of(net: nn.Module) -> fm.FunctionalModel:
    """Made once per model, outside the timed meta-iterations, as a user would."""
    return fm.functional_model(net)


def funcmeta_loop(net, rates, support, query, loss_fn, steps):
    fmodel = functional_model_of(net)
    opt = fm.optim.sgd(lr=rates or LR)
    losses = []
    for t in range(support[0].shape[0]):
        r = fm.adapt(
            fmodel, fmodel.params, loss_fn, (support[0][t], support[1][t]), opt, steps=steps
        )
        losses.append(loss_fn(fmodel.run(r.params, r.buffers, query[0][t])[0], query[1][t]))
    return torch.stack(losses).mean()


def funcmeta_batched(net, rates, support, query, loss_fn, steps):
    fmodel = functional_model_of(net)
    return fm.recipes.maml(
        fmodel, fmodel.params, loss_fn, support, query, lr=rates or LR, steps=steps
    ).loss


_TUNED: dict[tuple[int, int, int], tuple[fm.FunctionalModel, int | None]] = {}


def funcmeta_tuned(net, rates, support, query, loss_fn, steps):
    """Tuned on its first call for a workload (the agreement check, before timing): the
    fastest chunk ``fm.tune_task_chunk`` measures, passed as ``task_chunk``."""
    tasks = support[0].shape[0]
    key = (id(net), tasks, steps)
    if key not in _TUNED:
        fmodel = fm.functional_model(net)
        opt = fm.optim.sgd(lr=rates or LR)
        times = fm.tune_task_chunk(
            fmodel, fmodel.params, loss_fn, support, opt, steps=steps, query=query, repeats=3
        )
        best = min(times, key=times.__getitem__)
        _TUNED[key] = fmodel, None if best >= tasks else best
    fmodel, chunk = _TUNED[key]
    return fm.recipes.maml(
        fmodel,
        fmodel.params,
        loss_fn,
        support,
        query,
        lr=rates or LR,
        steps=steps,
        task_chunk=chunk,
    ).loss


IMPLEMENTATIONS = {
    "reference": reference,
    "funcmeta loop": funcmeta_loop,
    "funcmeta batched": funcmeta_batched,
    "funcmeta tuned": funcmeta_tuned,
    **_peer_maml.IMPLEMENTATIONS,
}


def available() -> dict:
    return {
        k: f
        for k, f in IMPLEMENTATIONS.items()
        if k not in _peer_maml.IMPLEMENTATIONS or k in _peer_maml.PEERS
    }


WORKLOADS = [
    ("conv4", 4, 1),
    ("conv4", 4, 5),
    ("conv4", 32, 1),
    ("conv4", 32, 5),
    ("sinusoid", 32, 5),
    ("metasgd-sinusoid", 32, 1),
]


DEVICE = [torch.device("cpu")]  # --device


def setup(name: str, tasks: int):
    device = DEVICE[0]
    torch.manual_seed(0)
    net = (conv4() if name.startswith("conv4") else sinusoid_mlp()).to(device)
    rates = None
    if name == "metasgd-sinusoid":
        gen = torch.Generator().manual_seed(1)
        rates = {
            k: nn.Parameter((torch.rand(p.shape, generator=gen) * 0.095 + 0.005).to(device))
            for k, p in net.named_parameters()
        }
    support, query, loss_fn = workload_data(name, tasks)
    support, query = (tuple(t.to(device) for t in pair) for pair in (support, query))
    return net, rates, support, query, loss_fn


def run(impl, net, rates, support, query, loss_fn, steps):
    tensors = [*net.parameters(), *(rates.values() if rates else [])]
    return _common.timed_grad(
        lambda: impl(net, rates, support, query, loss_fn, steps), tensors, DEVICE[0]
    )


def peak_memory(impl_name: str) -> float:
    env = {**os.environ, **_common.MMAP_ENV}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-worker", impl_name],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def memory_worker(impl_name: str) -> None:
    net, rates, support, query, loss_fn = setup("conv4", 4)
    impl = available()[impl_name]
    run(impl, copy.deepcopy(net), rates, support, query, loss_fn, 1)  # warm-up
    meter = _common.Meter(DEVICE[0])
    meter.start()
    run(impl, net, rates, support, query, loss_fn, 5)
    print(json.dumps({"peak": meter.peak()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cuda: time on the GPU (no memory)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--workloads", nargs="+", default=None, help="e.g. conv4 sinusoid")
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    _common.add_allocator_option(parser, False, _common.ALLOCATOR_WHY)
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker)
        return
    DEVICE[0] = torch.device(args.device)
    allocator = _common.use_allocator(args)
    impls = available()
    versions = {"torch": torch.__version__, "funcmeta": fm.__version__}
    versions.update({k: getattr(m, "__version__", "?") for k, m in PEERS.items()})
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    where = (
        f"device {torch.cuda.get_device_name()}"
        if DEVICE[0].type == "cuda"
        else f"CPU threads {torch.get_num_threads()}"
    )
    print(f"{where}; median ms of {args.repeats} interleaved repeats; {allocator}")
    header = f"{'workload':<22} " + " ".join(f"{k:>17}" for k in impls)
    print(header)
    for name, tasks, steps in WORKLOADS:
        if args.workloads and name not in args.workloads:
            continue
        net, rates, support, query, loss_fn = setup(name, tasks)
        nets = {k: copy.deepcopy(net) for k in impls}
        calls = {}
        tuning: list[float] = []
        for k, impl in impls.items():
            if rates is not None and k in NO_PER_ELEMENT_RATES:
                calls[k] = None
                continue
            fn = functools.partial(run, impl, nets[k], rates, support, query, loss_fn, steps)
            calls[k] = (fn, fn()[1])
            if k == "funcmeta batched":  # the default's measuring calls, until it chooses
                tuning = _common.until_chosen(fn, functional_model_of(nets[k]))
        ref = calls["reference"][1]
        times = _common.rounds({k: c[0] for k, c in calls.items() if c}, args.repeats)
        ref_ms = statistics.median(times["reference"])
        cells = []
        for k in impls:
            if calls[k] is None:
                cells.append(f"{'n/a':>17}")
                continue
            ms = statistics.median(times[k])
            mark = "" if _common.agree(calls[k][1], ref) else " DISAGREE"
            cells.append(f"{ms:8.1f} ({ms / ref_ms:4.2f}x){mark}".rjust(17))
        print(f"{f'{name} T={tasks} K={steps}':<22} " + " ".join(cells))
        if "funcmeta batched" in times:
            ms = statistics.median(times["funcmeta batched"])
            choice = _common.default_choice(
                functional_model_of(nets["funcmeta batched"]), tuning, ms
            )
            print(f"{'':<22} funcmeta batched (the default) chose {choice}")
    if args.skip_memory or DEVICE[0].type == "cuda":
        return
    print("peak memory, conv4 5-way 1-shot, 4 tasks, 5 steps (MiB above the start, fresh process):")
    for k in impls:
        print(f"  {k:<17} {peak_memory(k) / 2**20:8.1f}")


if __name__ == "__main__":
    main()
