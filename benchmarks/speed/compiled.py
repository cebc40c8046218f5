"""The compiled meta-step (``fm.compile_meta_step``) against the per-task loop,
``fm.adapt_tasks`` and, where ``jax`` is installed, JAX's ``jit(grad(vmap(...)))`` of the same
meta-iteration; with ``--compile-times``, its compile time cold and warm beside ``jax.jit``'s.

One second-order MAML meta-iteration (SGD inner loop, learning rate 0.01 for the sinusoid
and the residual MLP, 0.4 for conv4, 0.1 for the decoder, the query loss averaged over the
tasks, its gradient with respect to the initial parameters), float32:

- ``sinusoid``: the MLP 1-40-40-1 (ReLU), 10-shot support and query;
- ``conv4``: conv4 (64 filters, BatchNorm with batch statistics), 5-way 1-shot, 15 queries
  per class, 28x28 images;
- ``residual16``: 16 residual blocks ``x + W2 tanh(W1 x)`` of width 256 and a linear head
  (the model of ``benchmarks/memory/compiled_checkpoint.py``), 512 support and 512 query
  rows per task, MSE;
- ``decoder``: a transformers ``LlamaForCausalLM`` from a config (2 layers, hidden 64, 4
  heads, intermediate 128, vocabulary 128; random weights, nothing downloaded), 4 support and
  4 query sequences of 16 random tokens per task, next-token cross-entropy.

For each workload, number of tasks T and inner steps K: the median milliseconds of each way
(interleaved rounds, after a warm-up), the compiled step's first call (compile and run), and
each way's error: the largest difference of its float32 meta-gradient from the float64 one
(``fm.adapt_tasks`` in float64 on the CPU, from the same weights and data), relative to the
largest entry. JAX's parameters are the torch model's, so its meta-gradient is measured
too. ``--threads`` sets torch's and XLA's CPU threads (default 1: the figures of one core);
``--keep-freed-memory`` calls :func:`funcmeta.keep_freed_memory` first (``docs/tasks.md``);
``--task-chunk C`` builds the compiled step with ``task_chunk=C`` (default 0: ``"auto"``, the
step's own choice: one task per graph call for conv4, all tasks for the others on a CPU; -1: all
tasks in one graph); ``--block N`` calls each
way N times in a row per round and times all but the first (as a training loop calls one way
over and over, with its data in the caches), where the default times each call right after
another way's; ``--no-loop`` leaves the per-task loop out (the slowest way, by far). The
float64 reference runs on all the CPU cores the process may use, whatever ``--threads`` says
(it is not timed). ``--backend NAME`` compiles with ``torch.compile``'s backend ``NAME``
(``aot_eager``: dynamo and AOTAutograd, the graph run as traced, without inductor's C++
build), ``torch.compile`` monkeypatched as ``benchmarks/memory/compiled_checkpoint.py`` does;
the default, ``plan``, is the step's own (inductor). ``--checkpoint`` builds residual16, conv4
and the decoder with ``checkpoint_layers=`` on their blocks (the residual blocks, conv4's four
conv blocks, the decoder's layers; the sinusoid's MLP has none) and compiles them on the
autograd graph (``graph="autograd"``).

``--compile-times`` measures, instead of the times of the ways, the compiled step's first call
of each workload, T and K in fresh processes of this script (``--child-timeout S`` stops one
over S seconds, 3600 by default, and its row says ``> S``):

- ``torch cold s``: :attr:`funcmeta.MetaStep.compile_seconds` (the graph's first call,
  compiling and running once) in a process with an empty torch compile cache (a new
  ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``, where torch's FX graph and
  AOTAutograd caches live);
- ``torch warm s``: the same in a second fresh process on the cache the cold one left
  (torch caches inductor's output: with ``aot_eager`` there is nothing to read back, and
  dynamo traces again in every process);
- ``dynamo s``, ``AOT s``, ``backend s``: where that time went, from
  ``torch._dynamo.utils.compile_times(aggregate=True)``, each cell ``cold / warm``: dynamo's
  own part (bytecode tracing, fake tensors, guards: ``_compile.compile_inner`` less
  ``OutputGraph.call_user_compiler``), AOTAutograd's (the backend call less inductor's
  part: the joint graph, its passes and partition, the cache keys and lookups) and the
  backend's (inductor's ``compile_fx_inner``, the lowering, code generation and C++ build,
  plus ``AOTAutogradCache.inductor_load``, loading a cached graph; 0 with ``aot_eager``).
  Each process's seconds, the whole first call (the plain path's check before the graph
  included), the cache hits and misses torch counted and ``compile_times``' entries over
  0.5 s go to stderr;
- ``JAX cold s``: the first call (tracing, compiling, running once) of the ``jax.jit``-ed
  meta-step in a fresh process with JAX's persistent compilation cache on an empty folder;
  ``JAX warm s``: a second process on that folder (``jax_compilation_cache_dir``, minimum
  compile time and entry size 0). The first call is timed in its two parts,
  ``lower(...).compile()`` and the first run (stderr): on a CPU JAX's conv4 compiles in
  seconds and then runs for many minutes, so a process stopped over its time still tells
  its compile (``> S (compile X)``). Below the table each
  row's compile alone, without the first run, cold / warm: torch's dynamo + AOT + backend
  seconds, JAX's ``lower(...).compile()``;
- ``first call / JAX's``: the wait for the first meta-gradient, cold, torch's over JAX's:
  the step's whole first call (the plain path's check, the compile and every graph call of
  the batch) over JAX's first call (its compile and one run of all tasks); in brackets the
  compile alone, torch's over JAX's.

The JAX meta-steps are written in ``jax.numpy`` for each workload; the decoder's is checked
first, in float64 against torch from the same weights (logits and meta-gradient, T=2, K=1,
in a process of its own, transformers' RMSNorm computed in float64 there), and is timed only
where both agree to 1e-10; otherwise its JAX cells say ``no JAX twin``.

Targets (``make gpu-check``): with ``--max-jax-ratio R`` the compiled step's median time must be
at most R times JAX's, with ``--max-compile-seconds S`` its first call (compiling and running
once, :attr:`funcmeta.MetaStep.compile_seconds` printed beside it) at most S seconds, and the
step must run compiled. A first call over S ends that row untimed. With ``--compile-times``:
``--max-cold-seconds S`` (the cold compile), ``--max-warm-seconds S`` (the warm one) and
``--max-cold-jax-ratio R`` (the cold first call over JAX's: ``first call / JAX's``), a
process that failed or ran over its time failing them. The last line is then ``RESULT PASS``,
``RESULT FAIL`` (exit status 1) or, where JAX is missing or has no backend for the device and
nothing failed, ``RESULT SKIP (no JAX)`` (exit status 3: not judged).

    python benchmarks/speed/compiled.py [--workloads sinusoid conv4 residual16 decoder]
        [--tasks 8 32] [--steps 1 5] [--repeats 20] [--device cpu|cuda] [--threads 1]
        [--no-jax] [--no-loop] [--keep-freed-memory] [--task-chunk C] [--block N]
        [--backend plan|aot_eager|NAME] [--checkpoint] [--max-jax-ratio R]
        [--max-compile-seconds S]
    python benchmarks/speed/compiled.py --compile-times [the same workloads, sizes, --backend,
        --checkpoint, --task-chunk, --no-jax] [--child-timeout S] [--max-cold-seconds S]
        [--max-warm-seconds S] [--max-cold-jax-ratio R]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
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


#: the residual MLP (``residual16``): blocks, width, support and query rows per task; the same
#: model as ``benchmarks/memory/compiled_checkpoint.py`` (``_common.residual_mlp``)
WIDTH, BLOCKS, ROWS = 256, 16, 512
#: the decoder (``decoder``): transformers' ``LlamaConfig``, and tokens per sequence, sequences
#: per task's support and query
DECODER = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 16,
}
SEQUENCE, SEQUENCES = 16, 4
WORKLOADS = ("sinusoid", "conv4", "residual16", "decoder")


def decoder_net() -> nn.Module:
    """A transformers ``LlamaForCausalLM`` from :data:`DECODER` (random weights, seeded by the
    caller; nothing downloaded), without a key/value cache."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**DECODER, tie_word_embeddings=False, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def next_token_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's loss: cross-entropy of each position's logits against the next token."""
    logits = out.logits[..., :-1, :]
    return F.cross_entropy(logits.flatten(0, -2), ids[..., 1:].flatten())


def chunk_of(task_chunk: int | None) -> Any:
    """``--task-chunk``'s number as ``compile_meta_step``'s ``task_chunk``: 0 ``"auto"``, a
    negative number (or ``None``) all tasks in one graph (``None``), else the number."""
    if task_chunk == 0:
        return "auto"
    return None if task_chunk is None or task_chunk < 0 else task_chunk


def workload(name: str, tasks: int, device: str) -> tuple[nn.Module, Any, Any, Any, float]:
    """``(net, loss_fn, support, query, lr)``, seeded."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "sinusoid":
        b = fm.data.Sinusoid().sample(tasks, 10, 10, generator=g)
        net, loss_fn, lr = sinusoid_net(), F.mse_loss, 0.01
        support, query = b.support, b.query
    elif name == "conv4":
        net, loss_fn, lr = fm.models.conv4(5), F.cross_entropy, 0.4
        support = (torch.randn(tasks, 5, 1, 28, 28, generator=g), torch.arange(5).repeat(tasks, 1))
        query = (torch.randn(tasks, 75, 1, 28, 28, generator=g), torch.arange(5).repeat(tasks, 15))
    elif name == "residual16":
        net, loss_fn, lr = _common.residual_mlp(WIDTH, BLOCKS), F.mse_loss, 0.01
        support, query = (
            (torch.randn(tasks, ROWS, WIDTH, generator=g), torch.randn(tasks, ROWS, 1, generator=g))
            for _ in range(2)
        )
    elif name == "decoder":
        net, loss_fn, lr = decoder_net(), next_token_loss, 0.1
        vocab = DECODER["vocab_size"]
        ids = [torch.randint(0, vocab, (tasks, SEQUENCES, SEQUENCE), generator=g) for _ in "sq"]
        support, query = (ids[0], ids[0]), (ids[1], ids[1])
    else:
        raise ValueError(f"no workload {name!r}: one of {WORKLOADS}")
    move = lambda pair: tuple(t.to(device) for t in pair)  # noqa: E731
    return net.to(device), loss_fn, move(support), move(query), lr


def checkpointed(name: str, net: nn.Module) -> list[str] | None:
    """The layers ``--checkpoint`` builds with ``checkpoint_layers=``: the residual blocks,
    conv4's four conv blocks, the decoder's layers; ``None`` for the sinusoid's MLP (no
    blocks)."""
    prefix = {"residual16": "blocks", "conv4": "features", "decoder": "model.layers"}.get(name)
    if prefix is None:
        return None
    return [f"{prefix}.{c}" for c, _ in net.get_submodule(prefix).named_children()]


def build_step(
    name: str, net: nn.Module, loss_fn: Any, lr: float, steps: int, chunk: Any, checkpoint: bool
) -> tuple[Any, Any]:
    """The compiled step of a workload; with ``checkpoint`` on a model built with
    ``checkpoint_layers=`` (:func:`checkpointed`) and the autograd graph, which compiles
    them: ``(fmodel, step)``."""
    layers = checkpointed(name, net) if checkpoint else None
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    how: dict[str, Any] = {"graph": "autograd"} if layers else {}
    opt = fm.optim.sgd(lr=lr)
    return fmodel, fm.compile_meta_step(fmodel, loss_fn, opt, steps=steps, task_chunk=chunk, **how)


def use_backend(backend: str) -> None:
    """``torch.compile`` with ``backend`` from now on in this process, as
    ``benchmarks/memory/compiled_checkpoint.py`` does (``"plan"``: the step's own)."""
    if backend == "plan":
        return
    compile_ = torch.compile
    torch.compile = lambda fn, **kw: compile_(  # type: ignore[assignment]
        fn, fullgraph=True, dynamic=False, backend=backend
    )


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

    def residual(p, x):
        for i in range(BLOCKS):
            pre = f"blocks.{i}."
            h = jnp.tanh(x @ p[pre + "inner.weight"].T + p[pre + "inner.bias"])
            x = x + h @ p[pre + "outer.weight"].T + p[pre + "outer.bias"]
        return x @ p["head.weight"].T + p["head.bias"]

    forwards = {"sinusoid": mlp, "conv4": conv4, "residual16": residual}
    forward = forwards[name] if name != "decoder" else jax_decoder(net)

    def loss(p, x, y):
        out = forward(p, x)
        if name in ("sinusoid", "residual16"):
            return ((out - y) ** 2).mean()
        if name == "decoder":
            out, y = out[:, :-1].reshape(-1, out.shape[-1]), y[:, 1:].reshape(-1)
        return -jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], axis=1).mean()

    def task(p, xs, ys, xq, yq):
        for _ in range(steps):
            g = jax.grad(loss)(p, xs, ys)
            p = jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g)
        return loss(p, xq, yq)

    def meta(p, xs, ys, xq, yq):
        return jax.vmap(task, in_axes=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).mean()

    return jax.jit(jax.grad(meta))


def jax_decoder(net: nn.Module) -> Callable[..., Any]:
    """transformers' ``LlamaForCausalLM`` forward of :data:`DECODER` in ``jax.numpy``, the
    logits of ``(sequences, SEQUENCE)`` token ids: RMSNorm in the input's dtype (transformers
    computes it in float32, which a float32 run does too), rotary positions from the torch
    model's own tables (computed in float32 by transformers, cast to the model's dtype),
    causal attention, SwiGLU. :func:`twin_check` measures it against torch in float64."""
    heads, eps = net.config.num_attention_heads, net.config.rms_norm_eps
    dim = net.config.hidden_size // heads
    with torch.no_grad():
        like = next(net.parameters())
        cos, sin = net.model.rotary_emb(like, torch.arange(SEQUENCE, device=like.device)[None])
    cos, sin = to_jax(cos)[:, None], to_jax(sin)[:, None]  # (1, 1, positions, dim)

    def rms(x, w):
        return w * (x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps))

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def forward(p, ids):
        n, length = ids.shape
        h = p["model.embed_tokens.weight"][ids]
        causal = jnp.tril(jnp.ones((length, length), bool))
        for i in range(net.config.num_hidden_layers):
            pre = f"model.layers.{i}."
            a = rms(h, p[pre + "input_layernorm.weight"])
            q, k, v = (
                (a @ p[f"{pre}self_attn.{w}_proj.weight"].T)
                .reshape(n, length, heads, dim)
                .transpose(0, 2, 1, 3)
                for w in "qkv"
            )
            scores = rotate(q) @ rotate(k).swapaxes(-1, -2) * dim**-0.5
            weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
            o = (weights @ v).transpose(0, 2, 1, 3).reshape(n, length, -1)
            h = h + o @ p[pre + "self_attn.o_proj.weight"].T
            m = rms(h, p[pre + "post_attention_layernorm.weight"])
            gate = jax.nn.silu(m @ p[pre + "mlp.gate_proj.weight"].T)
            h = (
                h
                + (gate * (m @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T
            )
        return rms(h, p["model.norm.weight"]) @ p["lm_head.weight"].T

    return forward


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
    checkpoint: bool = False,
) -> dict[str, Any]:
    """One row: ``ms`` (each way's median milliseconds), ``compile_s`` (the compiled step's
    first call, synchronised), ``compile_seconds`` (the step's own
    :attr:`~funcmeta.MetaStep.compile_seconds`, summed), ``eager`` (why the step ran eagerly,
    else ``None``), ``jax_note`` (why JAX was not timed, else ``None``) and ``diff`` (each way's
    error against float64). A first call over ``max_compile_seconds`` returns at once, with no
    way timed. ``checkpoint``: the model built with ``checkpoint_layers=`` (every way)."""
    net, loss_fn, support, query, lr = workload(name, tasks, device)
    opt = fm.optim.sgd(lr=lr)
    chunk: Any = chunk_of(task_chunk)
    fmodel, step = build_step(name, net, loss_fn, lr, steps, chunk, checkpoint)

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


# ------------------------------------------------------------------ compile times


#: the top-level timings of ``torch._dynamo.utils.compile_times`` the split reads: dynamo's
#: whole compile of a frame, the part of it in the backend torch.compile was given (AOTAutograd
#: and what it calls), inductor's compile of each graph (lowering, code generation, the C++
#: build) and the load of one from AOTAutograd's cache
DYNAMO, USER_COMPILER = "_compile.compile_inner", "OutputGraph.call_user_compiler"
INDUCTOR = ("compile_fx_inner", "AOTAutogradCache.inductor_load")
#: a child's seconds over this in ``compile_times`` are printed beside its row (stderr)
SHOWN_TIMING = 0.5


def split_times(metrics: dict[str, float]) -> dict[str, float]:
    """``compile_times``' aggregated seconds split three ways: ``dynamo`` (bytecode tracing,
    fake tensors, guards: dynamo's compile less its backend), ``aot`` (AOTAutograd: the joint
    graph, its passes and partition, the cache lookups) and ``backend`` (inductor compiling a
    graph or loading one from the cache; 0 for ``aot_eager``, which runs the graph as traced)."""
    user = metrics.get(USER_COMPILER, 0.0)
    backend = sum(metrics.get(k, 0.0) for k in INDUCTOR)
    return {
        "dynamo": metrics.get(DYNAMO, 0.0) - user,
        "aot": max(user - backend, 0.0),
        "backend": backend,
    }


def torch_first_call(spec: dict[str, Any]) -> dict[str, Any]:
    """A child's part: build the workload's compiled step and call it once;
    ``compile_seconds`` (:attr:`funcmeta.MetaStep.compile_seconds`, summed), ``first_call``
    (the whole first call, the plain path's check before the graph included), the split of
    :func:`split_times`, ``compile_times``' own table and torch's cache hits and misses."""
    from torch._dynamo.utils import compile_times, counters

    use_backend(spec["backend"])
    net, loss_fn, support, query, lr = workload(spec["name"], spec["tasks"], spec["device"])
    chunk = chunk_of(spec["task_chunk"])
    args = (spec["name"], net, loss_fn, lr, spec["steps"], chunk, spec["checkpoint"])
    _, step = build_step(*args)
    started = time.perf_counter()
    step(support, query)
    _common.sync(spec["device"])
    first = time.perf_counter() - started
    headers, values = compile_times(repr="csv", aggregate=True)
    metrics = {k: float(v) for k, v in zip(headers, values, strict=True)}
    caches = {
        f"{group}.{k}": v
        for group in ("inductor", "aot_autograd")
        for k, v in counters[group].items()
        if "cache" in k
    }
    return {
        "compile_seconds": sum(step.compile_seconds.values()),
        "first_call": first,
        "eager": step.eager_reason,
        "split": split_times(metrics),
        "timings": {k: v for k, v in metrics.items() if v >= SHOWN_TIMING},
        "table": compile_times(repr="str", aggregate=True),
        "caches": caches,
    }


def jax_first_call(spec: dict[str, Any]) -> dict[str, Any]:
    """A child's part: the first call of the workload's ``jax.jit``-ed meta-step, with JAX's
    persistent compilation cache in ``spec["cache"]`` (the cold process fills it, the warm one
    reads it), in its two parts: ``compile`` (tracing, lowering and compiling, or reading the
    cache: ``lower(...).compile()``) and ``run`` (the compiled step's first run);
    ``first_call`` is their sum. The compile's seconds are printed as soon as they are known,
    so that a run stopped over its time still tells them."""
    jax.config.update("jax_compilation_cache_dir", spec["cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    net, _, support, query, lr = workload(spec["name"], spec["tasks"], "cpu")
    params = {k: to_jax(v) for k, v in net.named_parameters()}
    data = [to_jax(t) for t in (*support, *query)]
    jgrad = jax_step(spec["name"], net, lr, spec["steps"])
    started = time.perf_counter()
    compiled = jgrad.lower(params, *data).compile()
    done = {"compile": time.perf_counter() - started}
    print(json.dumps(done), flush=True)
    started = time.perf_counter()
    jax.block_until_ready(compiled(params, *data))
    done["run"] = time.perf_counter() - started
    return {**done, "first_call": done["compile"] + done["run"]}


@contextlib.contextmanager
def float64_rms_norm(net: nn.Module) -> Iterator[None]:
    """transformers' ``LlamaRMSNorm`` in the model's dtype for the block (it computes in
    float32 whatever the dtype, which would leave float32's rounding in a float64 check)."""
    norm = type(net.model.norm)
    before = norm.forward

    def forward(self, hidden):  # type: ignore[no-untyped-def]
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    norm.forward = forward
    try:
        yield
    finally:
        norm.forward = before


def twin_check(spec: dict[str, Any]) -> dict[str, Any]:
    """A child's part: JAX's twin of the workload against torch in float64 (``jax_enable_x64``),
    from the same weights and data: ``meta_gradient``, the largest difference of JAX's
    meta-gradient from ``fm.adapt_tasks``' relative to its largest entry, and for the decoder
    ``forward``, the largest difference of the logits (RMSNorm in float64 on both sides:
    :func:`float64_rms_norm`)."""
    jax.config.update("jax_enable_x64", True)
    net, loss_fn, support, query, lr = workload(spec["name"], spec["tasks"], "cpu")
    net = net.double()
    up = lambda pair: tuple(t.double() if t.is_floating_point() else t for t in pair)  # noqa: E731
    support, query = up(support), up(query)
    out: dict[str, Any] = {}
    with float64_rms_norm(net) if spec["name"] == "decoder" else contextlib.nullcontext():
        truth = float64_truth(net, loss_fn, support, query, lr, spec["steps"])
        params = {k: to_jax(v) for k, v in net.named_parameters()}
        if spec["name"] == "decoder":
            ids = support[0].flatten(0, 1)
            with torch.no_grad():
                logits = net(ids).logits
            theirs = np.asarray(jax_decoder(net)(params, to_jax(ids)))
            out["forward"] = float(np.abs(theirs - logits.numpy()).max())
    data = [to_jax(t) for t in (*support, *query)]
    grads = jax_step(spec["name"], net, lr, spec["steps"])(params, *data)
    scale = max(float(g.abs().max()) for g in truth)
    out["meta_gradient"] = (
        max(
            float(np.abs(np.asarray(grads[k]) - t.numpy()).max())
            for (k, _), t in zip(net.named_parameters(), truth, strict=True)
        )
        / scale
    )
    return out


CHILDREN = {"torch": torch_first_call, "jax": jax_first_call, "twin": twin_check}


def child(role: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``role``'s part (:data:`CHILDREN`) of ``spec`` in a fresh process of this script, with
    ``env`` added to its environment: its result, or ``{"error": why}`` (it failed, or ran past
    ``timeout`` seconds: its process group is killed, inductor's compile workers with it)."""
    command = [sys.executable, __file__, "--threads", str(spec["threads"])]
    command += ["--child", role, json.dumps(spec)]
    started = time.perf_counter()
    run = subprocess.Popen(
        command,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate()
        told = [json.loads(s) for s in out.splitlines() if s.startswith("{")]  # so far
        return {**(told[-1] if told else {}), "error": f"over {timeout:g} s", "timed_out": True}
    wall = time.perf_counter() - started
    lines = out.strip().splitlines()
    if run.returncode != 0 or not lines or not lines[-1].startswith("{"):
        last = (err.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {run.returncode}: {last[:300]}"}
    return {**json.loads(lines[-1]), "process": wall}


def compile_row(
    name: str,
    tasks: int,
    steps: int,
    options: argparse.Namespace,
) -> dict[str, Any]:
    """One workload's compile times, each first call in a fresh process: ``cold`` with an
    empty torch compile cache (``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``: torch's
    FX graph and AOTAutograd caches), ``warm`` with the cache the cold one left; ``jax_cold``
    and ``jax_warm`` the same for ``jax.jit`` and JAX's persistent compilation cache; ``twin``
    (the decoder) the float64 check of JAX's twin; ``jax_note`` why JAX has no figures."""
    spec = {
        "name": name,
        "tasks": tasks,
        "steps": steps,
        "device": options.device,
        "threads": options.threads,
        "task_chunk": options.task_chunk,
        "backend": options.backend,
        "checkpoint": options.checkpoint,
    }
    label = f"{name} T={tasks} K={steps}"
    row: dict[str, Any] = {"jax_note": None}
    with tempfile.TemporaryDirectory(prefix="compiled_torch_cache_") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        for kind in ("cold", "warm"):
            row[kind] = child("torch", spec, env, options.child_timeout)
            report(label, f"torch {kind}", row[kind])
            if "error" in row[kind]:
                break
    want = "cpu" if options.device == "cpu" else "gpu"
    if options.no_jax:
        row["jax_note"] = "JAX left out"
    elif jax is None:
        row["jax_note"] = "no JAX"
    elif jax.default_backend() != want:
        row["jax_note"] = f"no JAX {want} backend"
    if row["jax_note"] is None and name == "decoder":
        row["twin"] = child("twin", {**spec, "tasks": 2, "steps": 1}, {}, options.child_timeout)
        report(label, "JAX twin (float64, T=2 K=1)", row["twin"])
        worst = max(row["twin"].get(k, math.inf) for k in ("forward", "meta_gradient"))
        if not worst <= TWIN_TOLERANCE:
            row["jax_note"] = "no JAX twin"
    if row["jax_note"] is None:
        with tempfile.TemporaryDirectory(prefix="compiled_jax_cache_") as cache:
            for kind in ("cold", "warm"):
                done = child("jax", {**spec, "cache": cache}, {}, options.child_timeout)
                row[f"jax_{kind}"] = done
                report(label, f"JAX {kind}", done)
                if "error" in done:
                    break
    return row


#: the float64 agreement a JAX twin must have with torch to be timed beside it
TWIN_TOLERANCE = 1e-10


def report(label: str, what: str, done: dict[str, Any]) -> None:
    """A child's result on stderr: its seconds, cache hits and the larger timings."""
    if "error" in done:
        known = f" (compiled in {done['compile']:.1f} s)" if "compile" in done else ""
        print(f"  {label}: {what}: {done['error']}{known}", file=sys.stderr, flush=True)
        return
    if "compile_seconds" in done:
        split = ", ".join(f"{k} {v:.1f} s" for k, v in done["split"].items())
        timings = ", ".join(f"{k} {v:.1f}" for k, v in done["timings"].items())
        caches = ", ".join(f"{k} {v}" for k, v in done["caches"].items()) or "none counted"
        eager = f"; ran eagerly: {done['eager']}" if done["eager"] else ""
        print(
            f"  {label}: {what}: MetaStep.compile_seconds {done['compile_seconds']:.1f} s "
            f"(first call {done['first_call']:.1f} s, process {done['process']:.1f} s); "
            f"{split}; caches: {caches}{eager}\n    compile_times over {SHOWN_TIMING} s: "
            f"{timings}",
            file=sys.stderr,
            flush=True,
        )
    elif "first_call" in done:
        print(
            f"  {label}: {what}: first call {done['first_call']:.1f} s: compile "
            f"{done['compile']:.1f} s, run {done['run']:.1f} s (process {done['process']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    else:
        found = ", ".join(f"{k} {v:.1e}" for k, v in done.items() if k != "process")
        print(f"  {label}: {what}: {found}", file=sys.stderr, flush=True)


def backend_name(name: str, options: argparse.Namespace) -> str:
    """The table's backend cell: inductor (the step's plan) or the one given, and whether
    the model's blocks are checkpointed."""
    backend = "inductor (plan)" if options.backend == "plan" else options.backend
    if options.checkpoint and name != "sinusoid":
        backend += ", checkpoint_layers"
    return backend


def compile_table_row(name: str, tasks: int, steps: int, backend: str, r: dict[str, Any]) -> str:
    """The markdown row of one :func:`compile_row` result; the split cells are the cold
    process's and the warm one's (``cold / warm``), what was not measured ``-``, a child
    that failed or ran over its time ``failed`` or ``> S``."""

    def seconds(done: dict[str, Any] | None, key: str) -> str:
        if done is None:
            return "-"
        if "error" in done:
            if not done.get("timed_out"):
                return "failed"
            known = f" (compile {done['compile']:.1f})" if "compile" in done else ""
            return f"> {done['error'].split()[1]}{known}"
        return f"{done[key]:.1f}"

    def split(key: str) -> str:
        cold, warm = r.get("cold"), r.get("warm")
        cells = [
            f"{d['split'][key]:.1f}" if d is not None and "split" in d else "-"
            for d in (cold, warm)
        ]
        return " / ".join(cells)

    cold, warm = r.get("cold"), r.get("warm")
    jax_cold, jax_warm = r.get("jax_cold"), r.get("jax_warm")
    note = f" (eager: {cold['eager']})" if cold and cold.get("eager") else ""
    jax_cells = (
        [seconds(jax_cold, "first_call"), seconds(jax_warm, "first_call")]
        if r["jax_note"] is None
        else [f"- ({r['jax_note']})", "-"]
    )
    ratio = (
        f"{cold['first_call'] / jax_cold['first_call']:.2f} "
        f"({sum(cold['split'].values()) / jax_cold['compile']:.1f})"
        if cold and "error" not in cold and jax_cold and "error" not in jax_cold
        else "-"
    )
    return (
        f"| {name} | {tasks} | {steps} | {backend} | {seconds(cold, 'compile_seconds')}{note} | "
        f"{seconds(warm, 'compile_seconds')} | {split('dynamo')} | {split('aot')} | "
        f"{split('backend')} | {' | '.join(jax_cells)} | {ratio} |"
    )


def judge_compile(
    label: str,
    r: dict[str, Any],
    max_cold: float | None = None,
    max_warm: float | None = None,
    max_ratio: float | None = None,
) -> tuple[str, str, str]:
    """``(word, reason, details)`` of one :func:`compile_row` against the compile-time
    targets: ``FAIL`` where the step ran eagerly, a process failed or ran over its time, the
    cold compile took over ``max_cold`` seconds, the warm one over ``max_warm``, or the cold
    first call (check, compile and every graph call) over ``max_ratio`` times JAX's first
    call; else ``SKIP`` (reason: why JAX has no figure) where the ratio could not be judged;
    else ``PASS``."""
    fails: list[str] = []
    checks: list[str] = []
    skip = ""
    for kind, limit in (("cold", max_cold), ("warm", max_warm)):
        done = r.get(kind)
        if done is None:
            if limit is not None:
                fails.append(f"no {kind} compile (the cold one failed)")
            continue
        if "error" in done:
            fails.append(f"{kind} compile {done['error']}")
            continue
        s = done["compile_seconds"]
        if limit is None:
            checks.append(f"{kind} {s:.1f} s")
        elif s <= limit:
            checks.append(f"{kind} {s:.1f} s <= {limit:g} s")
        else:
            fails.append(f"{kind} {s:.1f} s > {limit:g} s")
        if kind == "cold" and done["eager"]:
            fails.append(f"ran eagerly ({done['eager']})")
    if max_ratio is not None:
        cold, jax_cold = r.get("cold"), r.get("jax_cold")
        if r["jax_note"] is not None:
            skip = r["jax_note"]
            checks.append(f"JAX not compiled ({skip})")
        elif jax_cold is None or "error" in jax_cold:
            fails.append(f"JAX's cold compile {(jax_cold or {}).get('error', 'not run')}")
        elif cold is not None and "error" not in cold:
            ratio = cold["first_call"] / jax_cold["first_call"]
            times = f"({cold['first_call']:.1f} / {jax_cold['first_call']:.1f} s)"
            if ratio <= max_ratio:
                checks.append(f"first call / JAX's {ratio:.2f} <= {max_ratio:g} {times}")
            else:
                fails.append(f"first call / JAX's {ratio:.2f} > {max_ratio:g} {times}")
    word = "FAIL" if fails else "SKIP" if skip else "PASS"
    return word, skip if word == "SKIP" else "", f"{label}: " + "; ".join(fails + checks)


def compile_times_table(options: argparse.Namespace) -> list[tuple[str, str, str]]:
    """``--compile-times``: print the table of every workload, T and K; the judged rows."""
    jax_version = jax.__version__ if jax is not None else "not installed"
    chunk = options.task_chunk
    print(
        f"compile times of the compiled meta-step; torch {torch.__version__}, JAX {jax_version}, "
        f"Python {platform.python_version()}, {options.device}, {options.threads} thread(s); "
        f"float32; compiled task_chunk: {chunk_of(chunk)}; each first call in a "
        "fresh process: cold on an empty compile cache, warm on the cold one's; the dynamo, AOT "
        "and backend cells are torch's cold / warm",
        flush=True,
    )
    print(
        "| workload | T | K | backend | torch cold s | torch warm s | dynamo s | AOT s | "
        "backend s | JAX cold s | JAX warm s | first call / JAX's (compile alone) |"
    )
    print("| --- " * 12 + "|", flush=True)
    judged = []
    compile_only = []
    for name in options.workloads:
        for tasks in options.tasks:
            for steps in options.steps:
                r = compile_row(name, tasks, steps, options)
                backend = backend_name(name, options)
                print(compile_table_row(name, tasks, steps, backend, r), flush=True)
                compile_only.append(compile_only_line(name, tasks, steps, r))
                judged.append(
                    judge_compile(
                        f"{name} T={tasks} K={steps}",
                        r,
                        options.max_cold_seconds,
                        options.max_warm_seconds,
                        options.max_cold_jax_ratio,
                    )
                )
    print(
        "\ncompile alone, without the first run (torch: dynamo + AOT + backend; JAX: "
        "lower(...).compile()), cold / warm s:"
    )
    print("\n".join(compile_only), flush=True)
    return judged


def compile_only_line(name: str, tasks: int, steps: int, r: dict[str, Any]) -> str:
    """One row's compile seconds without the first run: torch's split summed, JAX's
    ``lower(...).compile()``, each ``cold / warm`` (``-`` where not measured)."""

    def torch_part(done: dict[str, Any] | None) -> str:
        return f"{sum(done['split'].values()):.1f}" if done and "split" in done else "-"

    def jax_part(done: dict[str, Any] | None) -> str:
        return f"{done['compile']:.1f}" if done and "compile" in done else "-"

    kinds = ("cold", "warm")
    ours = " / ".join(torch_part(r.get(k)) for k in kinds)
    theirs = " / ".join(jax_part(r.get(f"jax_{k}")) for k in kinds)
    return f"  {name} T={tasks} K={steps}: torch {ours}, JAX {theirs}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--workloads", nargs="+", default=["sinusoid", "conv4"], choices=list(WORKLOADS)
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
        default=0,
        help="the compiled step's task_chunk (default 0: 'auto', the step's own; -1: all tasks "
        "in one graph)",
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
    parser.add_argument(
        "--compile-times",
        action="store_true",
        help="measure the compiled step's first call cold and warm (compile caches) in fresh "
        "processes, beside jax.jit's, instead of timing the ways",
    )
    parser.add_argument(
        "--backend",
        default="plan",
        metavar="NAME",
        help="torch.compile's backend (default 'plan': the step's own, inductor), e.g. aot_eager",
    )
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="build residual16, conv4 and decoder with checkpoint_layers on their blocks "
        "(compiled on the autograd graph)",
    )
    parser.add_argument(
        "--child-timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="--compile-times: a process over S seconds is stopped and its row says so",
    )
    parser.add_argument(
        "--max-cold-seconds",
        type=float,
        default=None,
        metavar="S",
        help="judge (--compile-times): the cold compile (MetaStep.compile_seconds) at most S s",
    )
    parser.add_argument(
        "--max-warm-seconds",
        type=float,
        default=None,
        metavar="S",
        help="judge (--compile-times): the warm compile at most S s",
    )
    parser.add_argument(
        "--max-cold-jax-ratio",
        type=float,
        default=None,
        metavar="R",
        help="judge (--compile-times): the cold first call (the check, the compile and every "
        "graph call) at most R times jax.jit's cold first call (its compile and one run)",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # a process of its own
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child is not None:
        role, spec = args.child
        print(json.dumps(CHILDREN[role](json.loads(spec))), flush=True)
        return 0
    if args.compile_times:
        judged = compile_times_table(args)
        targets = (args.max_cold_seconds, args.max_warm_seconds, args.max_cold_jax_ratio)
        if all(t is None for t in targets):
            return 0
        line, rc = verdict(judged)
        print(line)
        return rc
    judging = args.max_jax_ratio is not None or args.max_compile_seconds is not None
    use_backend(args.backend)
    kept = args.keep_freed_memory and fm.keep_freed_memory()
    jax_version = jax.__version__ if jax is not None else "not installed"
    print(
        f"compiled meta-step; torch {torch.__version__}, JAX {jax_version}, Python "
        f"{platform.python_version()}, {args.device}, {args.threads} thread(s); "
        f"median of {args.repeats} ms; float32; freed memory kept: {bool(kept)}; "
        f"compiled task_chunk: {chunk_of(args.task_chunk)}; calls in a row: {args.block}",
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
                    checkpoint=args.checkpoint,
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
