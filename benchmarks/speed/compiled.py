"""The compiled meta-step (``fm.compile_meta_step``) against the per-task loop,
``fm.adapt_tasks`` and, where ``jax`` is installed, JAX's ``jit(grad(vmap(...)))`` of the same
meta-iteration.

One second-order MAML meta-iteration (SGD inner loop, learning rate 0.01 for the sinusoid
and 0.4 for conv4, the query loss averaged over the tasks, its gradient with respect to the
initial parameters), float32:

- ``sinusoid``: the MLP 1-40-40-1 (ReLU), 10-shot support and query;
- ``conv4``: conv4 (64 filters, BatchNorm with batch statistics), 5-way 1-shot, 15 queries
  per class, 28x28 images.

For each workload, number of tasks T and inner steps K: the median milliseconds of each way
(interleaved rounds, after a warm-up), the compiled step's first call (compile and run), and
each way's error: the largest difference of its float32 meta-gradient from the float64 one
(``fm.adapt_tasks`` in float64 on the CPU, from the same weights and data), relative to the
largest entry. JAX's parameters are the torch model's, so its meta-gradient is measured
too. ``--threads`` sets torch's and XLA's CPU threads (default 1: the figures of one core);
``--keep-freed-memory`` calls :func:`funcmeta.keep_freed_memory` first (``docs/tasks.md``);
``--task-chunk C`` builds the compiled step with ``task_chunk=C``; ``--block N`` calls each
way N times in a row per round and times all but the first (as a training loop calls one way
over and over, with its data in the caches), where the default times each call right after
another way's; ``--no-loop`` leaves the per-task loop out (the slowest way, by far). The
float64 reference runs on all the CPU cores the process may use, whatever ``--threads`` says
(it is not timed).

Targets (``make gpu-check``): with ``--max-jax-ratio R`` the compiled step's median time must be
at most R times JAX's, with ``--max-compile-seconds S`` its first call (compiling and running
once, :attr:`funcmeta.MetaStep.compile_seconds` printed beside it) at most S seconds, and the
step must run compiled. A first call over S ends that row untimed. The last line is then
``RESULT PASS``, ``RESULT FAIL`` (exit status 1) or, where JAX is missing or has no backend for
the device and nothing failed, ``RESULT SKIP (no JAX)`` (exit status 3: not judged).

    python benchmarks/speed/compiled.py [--workloads sinusoid conv4] [--tasks 8 32] [--steps 1 5]
        [--repeats 20] [--device cpu|cuda] [--threads 1] [--no-jax] [--no-loop]
        [--keep-freed-memory] [--task-chunk C] [--block N] [--max-jax-ratio R]
        [--max-compile-seconds S]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

THREADS = ("--threads" in sys.argv and sys.argv[sys.argv.index("--threads") + 1]) or "1"
os.environ.setdefault(
    "XLA_FLAGS",
    f"--xla_cpu_multi_thread_eigen={'true' if THREADS != '1' else 'false'} "
    f"intra_op_parallelism_threads={THREADS}",
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import funcmeta as fm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common  # noqa: E402

try:  # the reference, where installed (the bench extra)
    import jax
    import jax.numpy as jnp
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    jax = None

#: the exit status of a run that could not judge its target (no JAX): scripts/gpu_judge.py
NOT_JUDGED = 3


def sinusoid_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def workload(name: str, tasks: int, device: str) -> tuple[nn.Module, Any, Any, Any, float]:
    """``(net, loss_fn, support, query, lr)``, seeded."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "sinusoid":
        b = fm.data.Sinusoid().sample(tasks, 10, 10, generator=g)
        net, loss_fn, lr = sinusoid_net(), F.mse_loss, 0.01
        support, query = b.support, b.query
    else:
        net, loss_fn, lr = fm.models.conv4(5), F.cross_entropy, 0.4
        support = (torch.randn(tasks, 5, 1, 28, 28, generator=g), torch.arange(5).repeat(tasks, 1))
        query = (torch.randn(tasks, 75, 1, 28, 28, generator=g), torch.arange(5).repeat(tasks, 15))
    move = lambda pair: tuple(t.to(device) for t in pair)  # noqa: E731
    return net.to(device), loss_fn, move(support), move(query), lr


def grads_of(net: nn.Module, run: Callable[[], Any]) -> list[torch.Tensor]:
    for p in net.parameters():
        p.grad = None
    run()
    return [p.grad.detach().clone() for p in net.parameters()]


# ------------------------------------------------------------------ JAX's meta-iteration


def jax_step(name: str, net: nn.Module, lr: float, steps: int) -> Callable[..., Any]:
    """``jit(grad(meta_loss))``: the mean over ``vmap``-ed tasks of the query loss after
    ``steps`` inner ``grad`` steps (the JAX idiom), for the same network."""

    def mlp(p, x):
        h = jax.nn.relu(x @ p["0.weight"].T + p["0.bias"])
        h = jax.nn.relu(h @ p["2.weight"].T + p["2.bias"])
        return h @ p["4.weight"].T + p["4.bias"]

    def conv4(p, x):
        for i in range(4):
            pre = f"features.{i}."
            x = (
                jax.lax.conv_general_dilated(
                    x,
                    p[pre + "conv.weight"],
                    (1, 1),
                    ((1, 1), (1, 1)),
                    dimension_numbers=("NCHW", "OIHW", "NCHW"),
                )
                + p[pre + "conv.bias"][None, :, None, None]
            )
            mean = x.mean(axis=(0, 2, 3), keepdims=True)
            var = x.var(axis=(0, 2, 3), keepdims=True)
            x = (x - mean) / jnp.sqrt(var + 1e-5)
            x = (
                x * p[pre + "norm.weight"][None, :, None, None]
                + p[pre + "norm.bias"][None, :, None, None]
            )
            x = jax.nn.relu(x)
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        return x.reshape(x.shape[0], -1) @ p["head.weight"].T + p["head.bias"]

    forward = mlp if name == "sinusoid" else conv4

    def loss(p, x, y):
        out = forward(p, x)
        if name == "sinusoid":
            return ((out - y) ** 2).mean()
        return -jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], axis=1).mean()

    def task(p, xs, ys, xq, yq):
        for _ in range(steps):
            g = jax.grad(loss)(p, xs, ys)
            p = jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g)
        return loss(p, xq, yq)

    def meta(p, xs, ys, xq, yq):
        return jax.vmap(task, in_axes=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).mean()

    return jax.jit(jax.grad(meta))


def to_jax(x: torch.Tensor) -> Any:
    return jnp.asarray(x.detach().cpu().numpy())


# ------------------------------------------------------------------ one row


@contextlib.contextmanager
def all_threads() -> Iterator[None]:
    """torch on every CPU core this process may use, for the block (then as before)."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(before, cores or 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def float64_truth(
    net: nn.Module, loss_fn: Any, support: Any, query: Any, lr: float, steps: int
) -> list[torch.Tensor]:
    """The meta-gradient of ``fm.adapt_tasks`` in float64 on the CPU, from the same weights
    and data: what every float32 way is measured against."""
    net64 = copy.deepcopy(net).cpu().double()
    up = lambda pair: tuple(t.cpu().double() if t.is_floating_point() else t.cpu() for t in pair)  # noqa: E731
    fmodel = fm.functional_model(net64)
    r = fm.adapt_tasks(
        fmodel,
        fmodel.params,
        loss_fn,
        up(support),
        fm.optim.sgd(lr=lr),
        steps=steps,
        task_chunk=None,
    )
    losses = fm.task_losses(fmodel, r.params, loss_fn, up(query), task_chunk=r.chunk).losses
    losses.mean().backward()
    return [p.grad.detach() for p in net64.parameters()]


def measure(
    name: str,
    tasks: int,
    steps: int,
    repeats: int,
    device: str,
    use_jax: bool = True,
    task_chunk: int | None = None,
    block: int = 1,
    loop_too: bool = True,
    max_compile_seconds: float | None = None,
) -> dict[str, Any]:
    """One row: ``ms`` (each way's median milliseconds), ``compile_s`` (the compiled step's
    first call, synchronised), ``compile_seconds`` (the step's own
    :attr:`~funcmeta.MetaStep.compile_seconds`, summed), ``eager`` (why the step ran eagerly,
    else ``None``), ``jax_note`` (why JAX was not timed, else ``None``) and ``diff`` (each way's
    error against float64). A first call over ``max_compile_seconds`` returns at once, with no
    way timed."""
    net, loss_fn, support, query, lr = workload(name, tasks, device)
    opt = fm.optim.sgd(lr=lr)
    fmodel = fm.functional_model(net)

    def loop() -> None:
        losses = []
        for t in range(tasks):
            r = fm.adapt(
                fmodel, fmodel.params, loss_fn, (support[0][t], support[1][t]), opt, steps=steps
            )
            losses.append(loss_fn(fmodel(r.params, query[0][t]), query[1][t]))
        torch.stack(losses).mean().backward()

    def batched() -> None:
        r = fm.adapt_tasks(
            fmodel, fmodel.params, loss_fn, support, opt, steps=steps, task_chunk=None
        )
        losses = fm.task_losses(fmodel, r.params, loss_fn, query, task_chunk=r.chunk).losses
        losses.mean().backward()

    chunk: Any = "auto" if task_chunk == 0 else task_chunk
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=steps, task_chunk=chunk)
    with all_threads():
        truth = float64_truth(net, loss_fn, support, query, lr, steps)
    scale = max(g.abs().max().item() for g in truth)

    def errors(agree: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        return {
            k: max((a.cpu().double() - b).abs().max().item() for a, b in zip(v, truth, strict=True))
            / scale
            for k, v in agree.items()
        }

    batched_grads = grads_of(net, batched)
    started = time.perf_counter()
    compiled = grads_of(net, lambda: step(support, query))
    _common.sync(device)
    first = time.perf_counter() - started
    own = sum(step.compile_seconds.values())
    print(
        f"  {name} T={tasks} K={steps}: compiled step's first call {first:.1f} s "
        f"(MetaStep.compile_seconds {own:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    agree = {"adapt_tasks": batched_grads, "compiled": compiled}
    result: dict[str, Any] = {
        "ms": {},
        "compile_s": first,
        "compile_seconds": own,
        "eager": step.eager_reason,
        "jax_note": None,
    }
    if max_compile_seconds is not None and first > max_compile_seconds:
        print(
            f"  {name} T={tasks} K={steps}: first call over {max_compile_seconds:g} s, not timed",
            file=sys.stderr,
            flush=True,
        )
        return {**result, "diff": errors(agree)}
    ways: dict[str, Callable[[], Any]] = {
        "adapt_tasks": batched,
        "compiled": lambda: step(support, query),
    }
    if loop_too:
        ways = {"loop": loop, **ways}
        agree["loop"] = grads_of(net, loop)
    # JAX on the same kind of device: its default backend ("gpu" where jax[cuda] is there)
    want = "cpu" if device == "cpu" else "gpu"
    if not use_jax:
        result["jax_note"] = "JAX left out"
    elif jax is None:
        result["jax_note"] = "no JAX"
    elif jax.default_backend() != want:
        result["jax_note"] = f"no JAX {want} backend"
    else:
        params = {k: to_jax(v) for k, v in net.named_parameters()}
        data = [to_jax(t) for t in (*support, *query)]
        jgrad = jax_step(name, net, lr, steps)
        out = jgrad(params, *data)
        jax.block_until_ready(out)
        agree["jax"] = [torch.from_numpy(np.array(out[k])) for k, _ in net.named_parameters()]
        ways["jax"] = lambda: jax.block_until_ready(jgrad(params, *data))
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(repeats + 1):
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        for k in order:
            for i in range(block):  # a block's first call follows another way's: not timed
                for p in net.parameters():
                    p.grad = None
                _common.sync(device)
                t0 = time.perf_counter()
                ways[k]()
                _common.sync(device)
                if r and (block == 1 or i > 0):
                    times[k].append((time.perf_counter() - t0) * 1e3)
    ms = _common.medians(times)
    return {**result, "ms": ms, "diff": errors(agree)}


def table_row(name: str, tasks: int, steps: int, r: dict[str, Any]) -> str:
    """The markdown row of one :func:`measure` result; a way not timed is ``-``."""
    ms = r["ms"]

    def cell(k: str) -> str:
        return f"{ms[k]:.2f}" if k in ms else "-"

    def ratio(a: str, b: str) -> str:
        return f"{ms[a] / ms[b]:.2f}" if a in ms and b in ms else "-"

    diffs = ", ".join(
        f"{r['diff'][k]:.1e}" for k in ("adapt_tasks", "loop", "compiled", "jax") if k in r["diff"]
    )
    note = f" (eager: {r['eager']})" if r["eager"] else ""
    return (
        f"| {name} | {tasks} | {steps} | {cell('loop')} | {cell('adapt_tasks')} | "
        f"{cell('compiled')}{note} | {cell('jax')} | {r['compile_s']:.1f} | "
        f"{ratio('adapt_tasks', 'compiled')} | {ratio('compiled', 'jax')} | {diffs} |"
    )


def judge(
    label: str,
    r: dict[str, Any],
    max_jax_ratio: float | None = None,
    max_compile_seconds: float | None = None,
) -> tuple[str, str, str]:
    """``(word, reason, details)`` of one :func:`measure` result against the targets: word
    ``FAIL`` when the step ran eagerly, its first call took over ``max_compile_seconds`` or its
    median time is over ``max_jax_ratio`` times JAX's; else ``SKIP`` (reason: why JAX was not
    timed) where the JAX target could not be judged; else ``PASS``."""
    fails: list[str] = []
    checks: list[str] = []
    skip = ""
    if r["eager"]:
        fails.append(f"ran eagerly ({r['eager']})")
    compile_s = r["compile_s"]
    if max_compile_seconds is not None:
        if compile_s <= max_compile_seconds:
            checks.append(f"compile {compile_s:.1f} s <= {max_compile_seconds:g} s")
        else:
            fails.append(f"compile {compile_s:.1f} s > {max_compile_seconds:g} s")
    else:
        checks.append(f"compile {compile_s:.1f} s")
    ms = r["ms"]
    if max_jax_ratio is not None:
        if "compiled" not in ms:
            checks.append("not timed")
        elif "jax" not in ms:
            skip = r.get("jax_note") or "no JAX"
            checks.append(f"compiled {ms['compiled']:.2f} ms, JAX not timed ({skip})")
        else:
            ratio = ms["compiled"] / ms["jax"]
            times = f"({ms['compiled']:.2f} / {ms['jax']:.2f} ms)"
            if ratio <= max_jax_ratio:
                checks.append(f"compiled / JAX {ratio:.2f} <= {max_jax_ratio:g} {times}")
            else:
                fails.append(f"compiled / JAX {ratio:.2f} > {max_jax_ratio:g} {times}")
    word = "FAIL" if fails else "SKIP" if skip else "PASS"
    return word, skip if word == "SKIP" else "", f"{label}: " + "; ".join(fails + checks)


def verdict(judged: list[tuple[str, str, str]]) -> tuple[str, int]:
    """The ``RESULT`` line of the judged rows and the exit status: FAIL (1) where any row
    failed, else SKIP (:data:`NOT_JUDGED`) where any was not judged, else PASS (0)."""
    words = {w for w, _, _ in judged}
    word = "FAIL" if "FAIL" in words else "SKIP" if "SKIP" in words else "PASS"
    reason = next((why for w, why, _ in judged if w == "SKIP"), "")
    head = f"RESULT {word} ({reason})" if word == "SKIP" else f"RESULT {word}"
    details = " / ".join(d for _, _, d in judged) or "nothing measured"
    rc = {"PASS": 0, "FAIL": 1, "SKIP": NOT_JUDGED}[word]
    return f"{head}: {details}", rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--workloads", nargs="+", default=["sinusoid", "conv4"], choices=["sinusoid", "conv4"]
    )
    parser.add_argument("--tasks", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--steps", nargs="+", type=int, default=[1, 5])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--no-jax", action="store_true", help="leave JAX out (its conv4 is slow on a CPU)"
    )
    parser.add_argument(
        "--task-chunk",
        type=int,
        default=None,
        help="the compiled step's task_chunk (default: all tasks in one graph; 0: 'auto')",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="calls of each way in a row per round, the first not timed (default 1: each "
        "call follows another way's, as in the interleaved rounds)",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="fm.keep_freed_memory() first: large tensors stop costing page faults",
    )
    parser.add_argument("--no-loop", action="store_true", help="leave the per-task loop out")
    parser.add_argument(
        "--max-jax-ratio",
        type=float,
        default=None,
        metavar="R",
        help="judge: the compiled step's median time at most R times JAX's",
    )
    parser.add_argument(
        "--max-compile-seconds",
        type=float,
        default=None,
        metavar="S",
        help="judge: the compiled step's first call (compile and run) at most S seconds",
    )
    args = parser.parse_args(argv)
    judging = args.max_jax_ratio is not None or args.max_compile_seconds is not None
    torch.set_num_threads(args.threads)
    kept = args.keep_freed_memory and fm.keep_freed_memory()
    jax_version = jax.__version__ if jax is not None else "not installed"
    print(
        f"compiled meta-step; torch {torch.__version__}, JAX {jax_version}, Python "
        f"{platform.python_version()}, {args.device}, {args.threads} thread(s); "
        f"median of {args.repeats} ms; float32; freed memory kept: {bool(kept)}; "
        f"compiled task_chunk: {args.task_chunk}; calls in a row: {args.block}",
        flush=True,
    )
    print(
        "| workload | T | K | loop ms | adapt_tasks ms | compiled ms | JAX ms | compile s | "
        "adapt_tasks / compiled | compiled / JAX | "
        "error vs float64 (adapt_tasks, loop, compiled, JAX) |"
    )
    print("| --- " * 11 + "|", flush=True)
    judged: list[tuple[str, str, str]] = []
    for name in args.workloads:
        for tasks in args.tasks:
            for steps in args.steps:
                r = measure(
                    name,
                    tasks,
                    steps,
                    args.repeats,
                    args.device,
                    not args.no_jax,
                    args.task_chunk,
                    args.block,
                    loop_too=not args.no_loop,
                    max_compile_seconds=args.max_compile_seconds,
                )
                print(table_row(name, tasks, steps, r), flush=True)
                label = f"{name} T={tasks} K={steps}"
                judged.append(judge(label, r, args.max_jax_ratio, args.max_compile_seconds))
    if not judging:
        return 0
    line, rc = verdict(judged)
    print(line)
    return rc


if __name__ == "__main__":
    sys.exit(main())
