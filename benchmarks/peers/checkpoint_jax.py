"""Per-layer checkpointing in second-order MAML: funcmeta against JAX's ``jax.checkpoint``.

The workload: a residual stack of pre-norm blocks ``x + b(tanh(a(norm(x))))`` and a linear head
(width to 1), an inner loop of SGD steps (learning rate 0.01, mean squared error on a support
batch), and the meta-gradient of the query loss with respect to the initial parameters, in
float32. Defaults on the CPU: 16 blocks of width 256, 512 rows, 5 inner steps, one thread; with
``--device cuda`` the motivating shape: 40 blocks of width 768, 4096 rows, 5 steps.

Ways, each plain and checkpointed:

- ``second``: ``fm.adapt`` (second order) and ``torch.autograd.grad`` of the query loss;
  checkpointed: ``functional_model(net, checkpoint_layers=<every block>)``;
- ``takeover``: the same model checkpointing its own blocks with ``torch.utils.checkpoint``
  in its ``forward``, which funcmeta takes over (compared with ``second``'s checkpointed time);
- ``first``: the same, first order (``first_order=True``);
- ``tasks``: ``fm.adapt_tasks`` on 4 tasks of a quarter of the rows each, second order;
- ``steps``: ``checkpoint_steps=True`` (plain: step checkpoints alone; checkpointed: both);
- ``jax``: ``jit(grad(meta))`` of the same function on the same weights and data, plain and
  with ``jax.checkpoint`` on every block (skipped, and said so, where JAX is not installed).

Time: every way's meta-iteration in one process, after a warm-up call each, in interleaved
rounds (each round calls every way once, in turn); the median over ``--repeats`` rounds of the
wall time, and on the CPU of the process's CPU time too (less disturbed by other jobs on the
machine). With one thread (the default) the process is pinned to one core: XLA's CPU runtime
(JAX 0.10) otherwise runs part of a program on a second thread whatever its flags say
(``--no-pin`` leaves the process free). Peak memory: each way in a fresh process (``benchmarks/_common.py``'s ``measure``): on the
CPU the peak resident set above the start of one meta-iteration after a warm-up, with
``MALLOC_MMAP_THRESHOLD_=65536`` so that the resident set follows live tensors; on CUDA the
peak of allocated bytes above the start (torch's allocator, and JAX's ``peak_bytes_in_use``
above the bytes in use at the start). XLA keeps a compiled program's buffers once it has run,
so JAX's figure is that of the program's first execution after compiling it ahead of time;
XLA's own figure for the program (``memory_analysis``: its temporary buffers) is printed
beside it.

Each checkpointed meta-gradient is compared with its plain one (largest difference relative to
the largest entry; float32 round-off), and JAX's with funcmeta's.

    python benchmarks/peers/checkpoint_jax.py [--device cpu|cuda] [--repeats 5] [--threads 1]
        [--ways second takeover first tasks steps jax] [--width W --depth D --rows N --steps K]
        [--no-memory] [--no-pin]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

THREADS = ("--threads" in sys.argv and sys.argv[sys.argv.index("--threads") + 1]) or "1"
os.environ.setdefault(
    "XLA_FLAGS",
    f"--xla_cpu_multi_thread_eigen={'true' if THREADS != '1' else 'false'} "
    f"intra_op_parallelism_threads={THREADS}",
)

WAYS = ("second", "takeover", "first", "tasks", "steps", "jax")
SHAPES = {
    "cpu": {"width": 256, "depth": 16, "rows": 512, "steps": 5},
    "cuda": {"width": 768, "depth": 40, "rows": 4096, "steps": 5},
}
TASKS = 4
LR = 0.01


def pin() -> str:
    """Pin the process to one core when it runs one thread (see the module docstring);
    which core, or why not."""
    if THREADS != "1" or "--no-pin" in sys.argv:
        return "not pinned"
    return _common.pin_one_core()


# --- funcmeta ------------------------------------------------------------------------------


def build_net(width: int, depth: int, own: bool) -> Any:
    """The residual stack; ``own``: its forward checkpoints each block with
    ``torch.utils.checkpoint``."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.a = nn.Linear(width, width)
            self.b = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.tanh(self.a(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(depth)])
            self.head = nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if own else block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Stack()


def data(shape: dict[str, int], device: Any, tasks: bool = False) -> list[Any]:
    """Support and query inputs and targets; with ``tasks``, the same rows as 4 tasks."""
    import torch

    g = torch.Generator().manual_seed(1)
    n, w = shape["rows"], shape["width"]
    out = [torch.randn(n, k, generator=g) for k in (w, 1, w, 1)]
    if tasks:
        out = [t.reshape(TASKS, n // TASKS, t.shape[-1]) for t in out]
    return [t.to(device) for t in out]


def funcmeta_way(
    way: str, checkpointed: bool, shape: dict[str, int], device: Any
) -> tuple[Callable[[], list[Any]], list[str]]:
    """``(meta_iteration, parameter names)``: one meta-iteration of ``way`` returning the
    meta-gradient."""
    import torch
    import torch.nn.functional as F

    import funcmeta as fm

    own = way == "takeover" and checkpointed
    net = build_net(shape["width"], shape["depth"], own).to(device)
    layers = [f"blocks.{i}" for i in range(shape["depth"])]
    per_layer = checkpointed and way != "takeover"
    fmodel = fm.functional_model(net, checkpoint_layers=layers if per_layer else None)
    params = list(net.parameters())
    names = [n for n, _ in net.named_parameters()]
    tasks = way == "tasks"
    xs, ys, xq, yq = data(shape, device, tasks)
    options = {
        "first_order": way == "first",
        "checkpoint_steps": way == "steps",
    }
    opt = fm.optim.sgd(lr=LR)

    def meta_iteration() -> list[Any]:
        if tasks:
            r = fm.adapt_tasks(
                fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=shape["steps"], **options
            )
            losses = fm.task_losses(
                fmodel, r.params, F.mse_loss, (xq, yq), task_chunk=r.chunk
            ).losses
            loss = losses.mean()
        else:
            r = fm.adapt(
                fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=shape["steps"], **options
            )
            loss = F.mse_loss(fmodel(r.params, xq), yq)
        return list(torch.autograd.grad(loss, params))

    return meta_iteration, names


# --- JAX -----------------------------------------------------------------------------------


def jax_missing(device: str) -> str | None:
    """Why JAX cannot run here, or ``None``."""
    try:
        import jax
    except ImportError:
        return "JAX is not installed (pip install jax, or pip install -e .[bench])"
    want = "gpu" if device == "cuda" else "cpu"
    if jax.default_backend() != want:
        return f"JAX has no {want} backend here (its default is {jax.default_backend()})"
    return None


def jax_way(checkpointed: bool, shape: dict[str, int], device: Any) -> tuple[Any, Any, Any]:
    """``(function, params, data)``: ``jit(grad(meta))`` on the torch model's weights."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    net = build_net(shape["width"], shape["depth"], False)
    state = {k: jnp.asarray(v.detach().numpy()) for k, v in net.state_dict().items()}

    def block(p: dict[str, Any], x: Any) -> Any:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        h = (x - mean) / jnp.sqrt(var + 1e-5) * p["norm.weight"] + p["norm.bias"]
        h = jnp.tanh(h @ p["a.weight"].T + p["a.bias"])
        return x + h @ p["b.weight"].T + p["b.bias"]

    run_block = jax.checkpoint(block) if checkpointed else block

    def forward(params: dict[str, Any], x: Any) -> Any:
        for i in range(shape["depth"]):
            prefix = f"blocks.{i}."
            p = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
            x = run_block(p, x)
        return x @ params["head.weight"].T + params["head.bias"]

    def loss(params: dict[str, Any], x: Any, y: Any) -> Any:
        return ((forward(params, x) - y) ** 2).mean()

    def meta(params: dict[str, Any], xs: Any, ys: Any, xq: Any, yq: Any) -> Any:
        for _ in range(shape["steps"]):
            g = jax.grad(loss)(params, xs, ys)
            params = jax.tree_util.tree_map(lambda a, b: a - LR * b, params, g)
        return loss(params, xq, yq)

    batch = [jnp.asarray(np.asarray(t.cpu())) for t in data(shape, "cpu")]
    return jax.jit(jax.grad(meta)), state, batch


def jax_temp_bytes(compiled: Any) -> int | None:
    """XLA's temporary buffers for a compiled program, where it says."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:
        return None


# --- measuring -----------------------------------------------------------------------------


def make_way(name: str, shape: dict[str, int], device: Any) -> Callable[[], Any]:
    """A meta-iteration by name: ``"<way>:plain"`` or ``"<way>:checkpointed"``."""
    way, kind = name.split(":")
    checkpointed = kind == "checkpointed"
    if way == "jax":
        import jax

        fn, params, batch = jax_way(checkpointed, shape, device)
        return lambda: jax.block_until_ready(fn(params, *batch))
    meta_iteration, _ = funcmeta_way(way, checkpointed, shape, device)
    return meta_iteration


def jax_peak_above(run: Callable[[], Any]) -> int:
    """The peak of JAX's device memory during ``run()`` above the bytes in use before."""
    import jax

    dev = jax.devices()[0]
    before = dev.memory_stats()["bytes_in_use"]
    run()
    return int(dev.memory_stats()["peak_bytes_in_use"]) - before


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One way's peak memory, in a process of its own."""
    import torch

    if args.device == "cpu":
        pin()
    torch.set_num_threads(int(THREADS))
    device = torch.device(args.device)
    shape = json.loads(args.config)
    out: dict[str, Any] = {}
    if args.way.startswith("jax"):
        # XLA keeps the buffers of a compiled program once it has run: the figure is its first
        # execution after compiling (ahead of time, the warm-up)
        import jax

        fn, params, batch = jax_way(args.way.endswith("checkpointed"), shape, device)
        compiled = fn.lower(params, *batch).compile()
        out["xla_temp"] = jax_temp_bytes(compiled)

        def run() -> Any:
            return jax.block_until_ready(compiled(params, *batch))

        if device.type == "cuda":
            out["peak"] = jax_peak_above(run)
        else:
            out["peak"], _ = _common.measure(run, device, 1)
        return out
    run = make_way(args.way, shape, device)
    run()  # warm-up: code paths, kernels, thread pools
    out["peak"], _ = _common.measure(run, device, 1)
    return out


def peak_of(way: str, shape: dict[str, int], device: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--way", way, "--device", device]
    cmd += ["--config", json.dumps(shape), "--threads", THREADS]
    cmd += ["--no-pin"] if "--no-pin" in sys.argv else []
    env = {**os.environ, **_common.MMAP_ENV}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def relative_difference(a: list[Any], b: list[Any]) -> float:

    scale = max(float(t.abs().max()) for t in b)
    return (
        max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True)) / scale
    )


def timed(
    ways: dict[str, Callable[[], Any]], repeats: int, device: Any
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU seconds of each way, in interleaved rounds."""
    wall: dict[str, list[float]] = {k: [] for k in ways}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):
        for name, run in ways.items():
            _common.sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            _common.sync(device)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return _common.medians(wall), _common.medians(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--threads", default="1", help="torch's and XLA's CPU threads")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    for key in ("width", "depth", "rows", "steps"):
        parser.add_argument(f"--{key}", type=int, default=None, help="default: by device")
    parser.add_argument("--no-memory", action="store_true", help="time only")
    parser.add_argument(
        "--no-pin", action="store_true", help="with one thread, leave the process on every core"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    import torch

    pinned = pin() if args.device == "cpu" else "not pinned"
    torch.set_num_threads(int(THREADS))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return
    shape = {k: getattr(args, k) or v for k, v in SHAPES[args.device].items()}
    if "tasks" in args.ways and shape["rows"] % TASKS:
        parser.error(f"--rows must be a multiple of {TASKS} for the tasks way")
    missing = jax_missing(args.device) if "jax" in args.ways else None
    try:
        import jax

        jax_version = jax.__version__
    except ImportError:
        jax_version = "not installed"
    where = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(
        f"per-layer checkpointing, second-order MAML: {json.dumps(shape)}, float32, SGD lr {LR}; "
        f"device {args.device} ({where or 'cpu'}), {THREADS} thread(s), {pinned}, torch "
        f"{torch.__version__}, JAX {jax_version}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}"
    )
    if missing:
        print(f"JAX left out: {missing}")
    names = [
        f"{way}:{kind}"
        for way in args.ways
        if not (way == "jax" and missing)
        for kind in ("plain", "checkpointed")
    ]
    ways = {name: make_way(name, shape, device) for name in names}
    results = {name: run() for name, run in ways.items()}  # warm-up (JAX compiles)
    for way in args.ways:
        if way == "jax" or f"{way}:plain" not in results:
            continue
        diff = relative_difference(results[f"{way}:checkpointed"], results[f"{way}:plain"])
        print(f"{way}: checkpointed meta-gradient against plain: {diff:.1e} (relative)")
    if "jax:plain" in results and "second:plain" in results:
        import numpy as np

        _, order = funcmeta_way("second", False, shape, device)
        ours = results["second:plain"]
        theirs = [torch.from_numpy(np.array(results["jax:plain"][k])) for k in order]
        print(f"JAX's meta-gradient against funcmeta's: {relative_difference(theirs, ours):.1e}")
    del results
    wall, cpu = timed(ways, args.repeats, device)
    peaks: dict[str, dict[str, Any]] = {}
    if not args.no_memory:
        for name in names:
            peaks[name] = peak_of(name, shape, args.device)

    def mib(name: str) -> str:
        return f"{peaks[name]['peak'] / 2**20:.1f}" if name in peaks else "-"

    def ratio(a: str, b: str, table: dict[str, Any]) -> str:
        if a not in table or b not in table or table[b] <= 0:
            return "-"
        return f"{table[a] / table[b]:.2f}"

    print(
        f"\nmedians of {args.repeats} interleaved rounds (ms); peak MiB above the start of a "
        "meta-iteration, each way in a fresh process"
    )
    show_cpu = device.type == "cpu"
    head = "| way | plain ms | checkpointed ms | ratio |"
    head += " plain CPU ms | checkpointed CPU ms | CPU ratio |" if show_cpu else ""
    head += " plain MiB | checkpointed MiB | memory ratio |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    peak_values = {k: v["peak"] for k, v in peaks.items()}
    for way in args.ways:
        p, c = f"{way}:plain", f"{way}:checkpointed"
        if p not in wall:
            continue
        row = f"| {way} | {wall[p] * 1e3:.0f} | {wall[c] * 1e3:.0f} | {ratio(c, p, wall)} |"
        if show_cpu:
            row += f" {cpu[p] * 1e3:.0f} | {cpu[c] * 1e3:.0f} | {ratio(c, p, cpu)} |"
        row += f" {mib(p)} | {mib(c)} | {ratio(c, p, peak_values)} |"
        print(row)
    if "takeover:checkpointed" in wall and "second:checkpointed" in wall:
        print(
            "takeover / checkpoint_layers (checkpointed times): wall "
            f"{ratio('takeover:checkpointed', 'second:checkpointed', wall)}"
            + (
                f", CPU {ratio('takeover:checkpointed', 'second:checkpointed', cpu)}"
                if show_cpu
                else ""
            )
        )
    base = "second:plain"
    knobs = {
        "per-layer": "second:checkpointed",
        "model's own checkpoints": "takeover:checkpointed",
        "step-level": "steps:plain",
        "both": "steps:checkpointed",
        "first order": "first:plain",
        "first order, per-layer": "first:checkpointed",
    }
    cells = [
        f"{knob} {ratio(name, base, peak_values)}x memory, {ratio(name, base, wall)}x time"
        for knob, name in knobs.items()
        if name in wall and base in wall
    ]
    if cells:
        print("against the unchecked second-order run: " + "; ".join(cells))
    for name in names:
        temp = peaks.get(name, {}).get("xla_temp")
        if temp is not None:
            print(f"{name}: XLA's temporary buffers {temp / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
