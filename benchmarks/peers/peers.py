"""funcmeta against higher and TorchOpt on the same second-order MAML meta-iteration.

Implementations:
- **reference:** hand-written ``functional_call`` + ``torch.autograd.grad``, a loop over tasks.
- **funcmeta loop:** ``fm.adapt`` per task.
- **funcmeta batched:** ``fm.recipes.maml`` (``fm.adapt_tasks``) on a functional model as a
  user makes it, with the default ``task_chunk="auto"`` (a rule of the shapes: no measuring
  calls); the row below the table says what it chose.
- **funcmeta tuned:** ``fm.adapt_tasks`` with the ``task_chunk`` that ``fm.tune_task_chunk``
  chose on the workload (tuned once, before timing).
- **higher:** ``innerloop_ctx`` per task.
- **torchopt:** ``MetaSGD`` per task, with ``extract_state_dict``/``recover_state_dict``.
- **learn2learn:** ``MAML(first_order=False)`` (``MetaSGD`` for per-element rates),
  ``clone()`` and ``adapt()`` per task.

The peers are optional: ``pip install -e .[bench]`` brings higher and torchopt;
learn2learn 0.2.0 needs a build (``bash benchmarks/build_learn2learn.sh``: its published C
files predate Python 3.11). A peer that does not import is reported and skipped.

Workloads: conv4 5-way 1-shot 28x28 (meta-batch 4 and 32, 1 and 5 inner SGD steps), the
sinusoid MLP 40-40 10-shot (meta-batch 32, 5 steps), and Meta-SGD on the sinusoid MLP (per-element
learnable rates, 1 step; every implementation but torchopt). Every implementation gets the
same initial weights and data. The script first checks that each one's meta-gradients agree
with the reference (float32: within 1% of each tensor's largest entry). It then times them
interleaved in one process, each round in a rotated order (median ms), and gives the ratio
to the reference. Finally it measures peak memory per implementation for conv4 at 5 steps,
a fresh process each.

    python benchmarks/peers.py [--repeats 5] [--device cpu] [--skip-memory] [--keep-freed-memory]
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
import time

import torch
import torch.nn.functional as F
from tasks import ALLOCATOR_WHY, add_allocator_option, default_choice, until_chosen, use_allocator
from torch import nn
from torch.func import functional_call

import funcmeta as fm

LR = 0.01
PEERS = {}
try:
    import higher

    PEERS["higher"] = higher
except ImportError as e:  # pragma: no cover - optional
    print(f"higher is not available: {e}")
try:
    import torchopt

    PEERS["torchopt"] = torchopt
except ImportError as e:  # pragma: no cover - optional
    print(f"torchopt is not available: {e}")
try:
    # learn2learn imports torchvision and gym at import time; the MAML code needs neither
    from learn2learn_shim import install as _shim

    _shimmed = _shim(["torchvision", "gym"])
    import learn2learn

    PEERS["learn2learn"] = learn2learn
    if _shimmed:
        print(f"learn2learn: stand-ins for {', '.join(_shimmed)} (not installed, not used)")
except ImportError as e:  # pragma: no cover - optional
    print(f"learn2learn is not available: {e} (bash benchmarks/build_learn2learn.sh)")


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


_TUNED: dict[tuple[int, int, int], fm.FunctionalModel] = {}


def funcmeta_tuned(net, rates, support, query, loss_fn, steps):
    """Tuned on its first call for a workload (the agreement check, before timing)."""
    key = (id(net), support[0].shape[0], steps)
    if key not in _TUNED:
        fmodel = fm.functional_model(net)
        opt = fm.optim.sgd(lr=rates or LR)
        fm.tune_task_chunk(
            fmodel, fmodel.params, loss_fn, support, opt, steps=steps, query=query, repeats=3
        )
        _TUNED[key] = fmodel
    fmodel = _TUNED[key]
    return fm.recipes.maml(
        fmodel, fmodel.params, loss_fn, support, query, lr=rates or LR, steps=steps
    ).loss


def with_higher(net, rates, support, query, loss_fn, steps, lr=LR):
    # one parameter group per tensor, so that a per-element rate can be given to each
    opt = torch.optim.SGD([{"params": [p]} for p in net.parameters()], lr=lr)
    losses = []
    for t in range(support[0].shape[0]):
        with higher.innerloop_ctx(net, opt, copy_initial_weights=False) as (fnet, diffopt):
            override = None
            if rates is not None:
                override = {"lr": [rates[k] for k, _ in net.named_parameters()]}
            for _ in range(steps):
                diffopt.step(loss_fn(fnet(support[0][t]), support[1][t]), override=override)
            losses.append(loss_fn(fnet(query[0][t]), query[1][t]))
    return torch.stack(losses).mean()


def with_torchopt(net, rates, support, query, loss_fn, steps, lr=LR):
    state = torchopt.extract_state_dict(net)
    losses = []
    for t in range(support[0].shape[0]):
        inner = torchopt.MetaSGD(net, lr=lr)
        for _ in range(steps):
            inner.step(loss_fn(net(support[0][t]), support[1][t]))
        losses.append(loss_fn(net(query[0][t]), query[1][t]))
        torchopt.recover_state_dict(net, state)
    return torch.stack(losses).mean()


def with_learn2learn(net, rates, support, query, loss_fn, steps, lr=LR):
    l2l = learn2learn.algorithms
    if rates is None:
        meta = l2l.MAML(net, lr=lr, first_order=False)
    else:
        meta = l2l.MetaSGD(net, lr=lr, first_order=False)
        meta.lrs = nn.ParameterList([rates[k] for k, _ in net.named_parameters()])
    losses = []
    for t in range(support[0].shape[0]):
        learner = meta.clone()
        for _ in range(steps):
            learner.adapt(loss_fn(learner(support[0][t]), support[1][t]))
        losses.append(loss_fn(learner(query[0][t]), query[1][t]))
    return torch.stack(losses).mean()


IMPLEMENTATIONS = {
    "reference": reference,
    "funcmeta loop": funcmeta_loop,
    "funcmeta batched": funcmeta_batched,
    "funcmeta tuned": funcmeta_tuned,
    "higher": with_higher,
    "torchopt": with_torchopt,
    "learn2learn": with_learn2learn,
}


# Meta-SGD needs per-element learning rates: torchopt's MetaSGD takes one scalar rate.
NO_PER_ELEMENT_RATES = {"torchopt"}


def available() -> dict:
    return {
        k: f
        for k, f in IMPLEMENTATIONS.items()
        if k not in ("higher", "torchopt", "learn2learn") or k in PEERS
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
    cuda = DEVICE[0].type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = impl(net, rates, support, query, loss_fn, steps)
    grads = torch.autograd.grad(loss, tensors)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, grads


def agree(grads, ref) -> bool:
    return all(
        float((a - b).abs().max()) <= 1e-2 * float(b.abs().max()) + 1e-6
        for a, b in zip(grads, ref, strict=True)
    )


def peak_memory(impl_name: str) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
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
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    run(impl, net, rates, support, query, loss_fn, 5)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"peak": hwm - base}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cuda: time on the GPU (no memory)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--workloads", nargs="+", default=None, help="e.g. conv4 sinusoid")
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    add_allocator_option(parser, False, ALLOCATOR_WHY)
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker)
        return
    DEVICE[0] = torch.device(args.device)
    allocator = use_allocator(args)
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
                tuning = until_chosen(fn, functional_model_of(nets[k]))
        ref = calls["reference"][1]
        times = {k: [] for k, c in calls.items() if c}
        names = [k for k, c in calls.items() if c]
        for r in range(args.repeats):
            # each round in a rotated order: what runs right after another implementation
            # (after its memory was freed) is not always the same one
            for i in range(len(names)):
                k = names[(i + r) % len(names)]
                times[k].append(calls[k][0]()[0])
        ref_ms = statistics.median(times["reference"])
        cells = []
        for k in impls:
            if calls[k] is None:
                cells.append(f"{'n/a':>17}")
                continue
            ms = statistics.median(times[k])
            mark = "" if agree(calls[k][1], ref) else " DISAGREE"
            cells.append(f"{ms:8.1f} ({ms / ref_ms:4.2f}x){mark}".rjust(17))
        print(f"{f'{name} T={tasks} K={steps}':<22} " + " ".join(cells))
        if "funcmeta batched" in times:
            ms = statistics.median(times["funcmeta batched"])
            choice = default_choice(functional_model_of(nets["funcmeta batched"]), tuning, ms)
            print(f"{'':<22} funcmeta batched (the default) chose {choice}")
    if args.skip_memory or DEVICE[0].type == "cuda":
        return
    print("peak memory, conv4 5-way 1-shot, 4 tasks, 5 steps (MiB above the start, fresh process):")
    for k in impls:
        print(f"  {k:<17} {peak_memory(k) / 2**20:8.1f}")


if __name__ == "__main__":
    main()
