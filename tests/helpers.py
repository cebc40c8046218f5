"""Small models and data shared by the tests (float64 unless a test says otherwise)."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from funcmeta._src.compiled.eager_reasons import AUTOGRAD_GRAPH_TORCH as _graph_torch
from funcmeta._src.core.capabilities import missing as _missing
from funcmeta._src.core.capabilities import torch_release as _release

DTYPE = torch.float64

#: Tests of the compiled step's graph and of torch's compiler: they hold from torch 2.13 on, where
#: the step traces ``torch.autograd.grad`` (``AUTOGRAD_GRAPH_TORCH``). Below it the step compiles
#: the ``torch.func`` graph, runs eager where that graph breaks and says why (its meta-gradients
#: the eager path's either way: the unmarked tests of ``tests/compiled`` assert that on every torch).
GRAPH_TORCH = pytest.mark.skipif(
    _release() < _graph_torch,
    reason=f"the compiled step's graph is tested from torch {_graph_torch[0]}.{_graph_torch[1]} on",
)


def graph_or_reason(step) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``step`` (an ``fm.MetaStep`` that has run) compiled its graph. From torch 2.13
    on it must (an eager reason fails the test); below, it may run eager instead, with the
    same meta-gradients, and then it says why."""
    if _release() >= _graph_torch:
        assert step.eager_reason is None, step.eager_reason
        return True
    if step.eager_reason is not None:
        assert isinstance(step.eager_reason, str) and step.eager_reason.strip()
        return False
    return True


#: Tests of a sharded model (``fm.distributed.shard_model``): skipped, with the refusal, on a
#: torch below the sharded runtime's floor, where ``shard_model`` refuses by name
#: (``tests/core/test_capabilities.py`` asserts the refusal there).
NEEDS_SHARDED = pytest.mark.skipif(
    _missing("sharded models") is not None,
    reason=f"refused on this torch: {_missing('sharded models')}",
)

#: The devices a test of CUDA code runs on: the CPU always, so that CI runs each path's logic,
#: and CUDA where a device exists (the ``cuda`` mark skips it elsewhere). What needs the
#: device's own kernels (TF32 numerics, CUDA graphs, device memory) stays CUDA-only.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def mlp(
    sizes: tuple[int, ...] = (3, 5, 4, 2), *, seed: int = 0, act: type[nn.Module] = nn.Tanh
) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers).to(DTYPE)


def batches(
    n: int, *, inputs: int = 3, outputs: int = 2, size: int = 8, seed: int = 1
) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, inputs, generator=g, dtype=DTYPE),
            torch.randn(size, outputs, generator=g, dtype=DTYPE),
        )
        for _ in range(n)
    ]


def per_task(params: dict[str, Tensor], tasks: int, seed: int, scale: float) -> dict[str, Tensor]:
    """Each of ``tasks`` tasks' own parameters: ``params`` perturbed differently per task by
    ``scale`` times standard normal noise drawn from ``seed``, with a leading task axis."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(tasks, *v.shape, generator=g, dtype=v.dtype)
        for k, v in params.items()
    }


def detached(params: dict[str, Tensor], requires_grad: bool = False) -> dict[str, Tensor]:
    return {k: v.detach().clone().requires_grad_(requires_grad) for k, v in params.items()}


def trajectory(fmodel, opt, data: list[tuple[Tensor, Tensor]]) -> list[dict[str, Tensor]]:
    """The parameters after each step of ``opt`` on the MSE of ``fmodel`` over ``data``, from
    a detached copy of ``fmodel.params``."""
    import torch.nn.functional as F

    import funcmeta

    params = detached(fmodel.params)
    state = opt.init(params)
    out = []
    for x, y in data:
        p = detached(params, requires_grad=True)
        loss = F.mse_loss(fmodel(p, x), y)
        grads = dict(zip(p, torch.autograd.grad(loss, list(p.values())), strict=True))
        updates, state = opt.update(grads, state, params)
        params = funcmeta.apply_updates(params, updates)
        out.append(params)
    return out


def init_gloo(rank: int, rendezvous: str, world_size: int = 2) -> None:
    """Join a gloo process group through the rendezvous file ``rendezvous`` (60 s timeout)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )


def tiny_llama(blocks: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A transformers ``LlamaForCausalLM`` from a config (vocabulary 32, width 16, grouped-query
    attention, untied head, no key/value cache), seeded: the same weights on every rank."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=blocks,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def _gloo_case(rank: int, world: int, rendezvous: str, out: str, case, args: tuple) -> None:
    """One rank of :func:`spawn_gloo`: ``case(world, *args)`` on one thread, its result (or
    its traceback) saved for the test; no rank tears the group down while a peer's last
    collective is in flight."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, rendezvous, world)
    try:
        result = case(world, *args)
    except Exception:  # reported to the test, which judges it
        result = ("raised", traceback.format_exc())
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def spawn_gloo(world: int, case: Callable, *args) -> list:
    """Every rank's result of ``case(world, *args)`` (a module-level function) on ``world``
    gloo processes; the test fails with a rank's traceback where it raised."""
    import torch.multiprocessing as mp

    folder = Path(tempfile.mkdtemp())
    mp.spawn(
        _gloo_case, args=(world, str(folder / "rendezvous"), str(folder), case, args), nprocs=world
    )
    results = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in results:
        if isinstance(r, tuple) and r and r[0] == "raised":
            pytest.fail(r[1])
    return results


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
"""The shared data folder beside the project (CI clones with it there)."""

OMNIGLOT_ENV = "FUNCMETA_OMNIGLOT"
"""The one setting that tells the tests where the Omniglot files are: a folder holding
``images_background_small1.zip``, ``images_background_small2.zip`` and ``all_runs.zip``."""


def omniglot_folder() -> Path:
    """Where the tests look for the Omniglot files: ``$FUNCMETA_OMNIGLOT`` if set, else
    ``omniglot/`` in the shared data folder beside the project (``../shared/data/omniglot``)."""
    import os

    env = os.environ.get(OMNIGLOT_ENV)
    return Path(env).expanduser() if env else SHARED_DATA / "omniglot"


def _in_ci() -> bool:
    import os

    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def shared_file(relative: str) -> Path:
    """A file of the shared data folder; ``"omniglot/NAME"`` is looked up in
    :func:`omniglot_folder`. A missing file skips the test, with a message that says how to
    get it; it fails instead in CI (``CI`` set) or when ``FUNCMETA_OMNIGLOT`` names a folder
    without it, so that a test cannot skip silently where the data is meant to be."""
    import os

    import pytest

    head, _, rest = relative.partition("/")
    omniglot = head == "omniglot" and bool(rest)
    path = omniglot_folder() / rest if omniglot else SHARED_DATA / relative
    if path.exists():
        return path
    if not omniglot:
        if _in_ci():
            pytest.fail(f"{path} is missing in CI")
        pytest.skip(f"no {path} (the shared data folder beside the project)")
    where = os.environ.get(OMNIGLOT_ENV)
    if where or _in_ci():
        set_by = f"{OMNIGLOT_ENV}={where}" if where else "in CI, the shared data folder"
        pytest.fail(f"no {path} ({set_by}): the Omniglot files must be there")
    pytest.skip(
        f"no {path}: set {OMNIGLOT_ENV} to a folder holding the official Omniglot files "
        "(default: ../shared/data/omniglot beside the project); fetch them into DIR with "
        "python -c \"import funcmeta as fm; fm.data.download_omniglot('DIR')\" or "
        "python examples/omniglot.py --data DIR --download (from "
        "https://github.com/brendenlake/omniglot/raw/master/python/, verified by sha256)"
    )


def write_zip(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A zip archive at ``path`` holding ``(name, data)`` members, names as given."""
    with zipfile.ZipFile(path, "w") as z:
        for arcname, data in members:
            z.writestr(arcname, data)
    return path


def next_token_loss(out, ids: Tensor) -> Tensor:
    """A causal language model's next-token cross-entropy (its logits in float32)."""
    import torch.nn.functional as F

    return F.cross_entropy(out.logits[..., :-1, :].flatten(0, -2).float(), ids[..., 1:].flatten())


def profiled(fn: Callable[[], object]) -> int:
    """The most bytes tensors held at once while ``fn()`` ran, above what they held before
    (from the profiler's allocation events, counted as the sequence benchmark counts them:
    ``benchmarks/_common.py``'s ``peak_allocated``, whose test checks the two agree)."""
    with (
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof,
        torch.profiler.record_function("window"),
    ):
        fn()
    return peak_allocated(prof, "window")


def peak_allocated(prof: torch.profiler.profile, window: str) -> int:
    """The most bytes allocated at once inside the range ``window`` above the amount at its
    start, from the profiler's ``[memory]`` events ("Total Allocated": the bytes the
    allocator has handed out at that moment)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    (span,) = [e for e in events if e.get("name") == window and e.get("ph") == "X"]
    begin, end = span["ts"], span["ts"] + span["dur"]
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and begin <= e["ts"] <= end),
        key=lambda e: e["ts"],
    )
    if not memory:
        return 0
    first = memory[0]["args"]
    start = first["Total Allocated"] - first["Bytes"]  # before the first event in the window
    return max(e["args"]["Total Allocated"] for e in memory) - start


def flip_stored_bit(
    path: Path, member: str, *, at: int = 0, bit: int = 0x10, out: Path | None = None
) -> Path:
    """Flip one bit of the ``at``-th stored byte of zip record ``member`` of ``path``, written
    to ``out`` (default: ``path`` itself); returns the file written."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    off = info.header_offset
    name_len = int.from_bytes(raw[off + 26 : off + 28], "little")
    extra_len = int.from_bytes(raw[off + 28 : off + 30], "little")
    raw[off + 30 + name_len + extra_len + at] ^= bit
    target = path if out is None else out
    target.write_bytes(bytes(raw))
    return target


def chunks_run(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The chunk of every vmapped run of the eager runtime from now on (``None``: all tasks
    at once), in order: one entry per inner step of ``fm.adapt_tasks`` and one per
    ``fm.task_losses`` or ``fm.apply_tasks`` pass."""
    from funcmeta._src.runtime.eager import EagerRuntime

    seen: list[int | None] = []
    over_tasks = EagerRuntime.over_tasks

    def spy(self, one_task, trees, in_dims, chunk):  # type: ignore[no-untyped-def]
        seen.append(chunk)
        return over_tasks(self, one_task, trees, in_dims, chunk)

    monkeypatch.setattr(EagerRuntime, "over_tasks", spy)
    return seen


def report_refusals(item, call):  # type: ignore[no-untyped-def]
    """``pytest_runtest_makereport`` of the suites' conftests: a test that reaches a
    capability below its torch floor ends in that capability's refusal
    (``funcmeta.UnsupportedTorchError``), reported as skipped with the refusal there. A
    refusal at or above the floor (a private access missing where it should be there) stays
    the failure it is (``docs/torch-versions.md``)."""
    from funcmeta._src.core.capabilities import CAPABILITIES

    outcome = yield
    report = outcome.get_result()
    error = call.excinfo.value if call.excinfo is not None else None
    name = getattr(error, "capability", None) if call.excinfo is not None else None
    refused = type(error).__name__ == "UnsupportedTorchError" and name in CAPABILITIES
    if report.failed and refused and _release() < CAPABILITIES[name].floor:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"refused: {error}")
