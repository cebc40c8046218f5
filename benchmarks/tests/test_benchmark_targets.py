"""The targets ``make gpu-check`` holds the benchmarks to, judged on a CPU: the compiled
meta-step against JAX's time and its compile time (``benchmarks/speed/compiled.py``, with
``--compile-times`` its cold and warm compiles in fresh processes beside ``jax.jit``'s), and
``fm.exact_float32``'s error against float64 (``benchmarks/checks/tf32.py``, which on a CPU says it
judged nothing)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from bench_scripts import load
from helpers import GRAPH_TORCH

import funcmeta as fm

compiled = load("speed/compiled.py")
tf32 = load("checks/tf32.py")


def _row(ms: dict[str, float], compile_s: float = 27.4, **more: Any) -> dict[str, Any]:
    r = {"ms": ms, "compile_s": compile_s, "eager": None, "jax_note": None, "diff": {}}
    return {**r, **more}


# ------------------------------------------------------------ benchmarks/speed/compiled.py


def test_the_compiled_step_passes_at_or_under_its_share_of_jax_time():
    word, reason, details = compiled.judge("sinusoid", _row({"compiled": 0.79, "jax": 0.83}), 1.5)
    assert (word, reason) == ("PASS", "")
    assert details == "sinusoid: compile 27.4 s; compiled / JAX 0.95 <= 1.5 (0.79 / 0.83 ms)"
    assert compiled.judge("s", _row({"compiled": 1.5, "jax": 1.0}), 1.5)[0] == "PASS"  # equal


def test_the_compiled_step_fails_over_its_share_of_jax_time():
    word, _, details = compiled.judge("sinusoid", _row({"compiled": 7.01, "jax": 0.83}), 1.5)
    assert word == "FAIL"
    assert "compiled / JAX 8.45 > 1.5 (7.01 / 0.83 ms)" in details


def test_a_compile_over_its_limit_fails_and_is_not_timed():
    r = _row({}, compile_s=130.2)
    word, _, details = compiled.judge("conv4", r, 1.0, 120)
    assert word == "FAIL"
    assert details == "conv4: compile 130.2 s > 120 s; not timed"
    ok = _row({"compiled": 40.0, "jax": 41.0}, compile_s=119.0)
    word, _, details = compiled.judge("conv4", ok, 1.0, 120)
    assert word == "PASS" and details.startswith("conv4: compile 119.0 s <= 120 s; compiled / JAX")


def test_a_step_that_ran_eagerly_fails():
    r = _row({"compiled": 0.5, "jax": 0.83}, eager="a graph break")
    word, _, details = compiled.judge("sinusoid", r, 1.5)
    assert word == "FAIL" and details.startswith("sinusoid: ran eagerly (a graph break)")


def test_a_missing_jax_is_a_skip_unless_something_failed():
    no_jax = _row({"compiled": 7.01}, jax_note="no JAX")
    word, reason, details = compiled.judge("sinusoid", no_jax, 1.5)
    assert (word, reason) == ("SKIP", "no JAX")
    assert "compiled 7.01 ms, JAX not timed (no JAX)" in details
    slow = _row({"compiled": 7.01}, compile_s=130, jax_note="no JAX")
    assert compiled.judge("conv4", slow, 1.0, 120)[0] == "FAIL"
    # no JAX target asked: nothing to skip
    assert compiled.judge("conv4", _row({"compiled": 7.0}, jax_note="no JAX"), None, 120)[0] == (
        "PASS"
    )


def test_the_verdict_of_several_rows_and_its_exit_status():
    passed = ("PASS", "", "a: fine")
    skipped = ("SKIP", "no JAX", "b: JAX not timed")
    failed = ("FAIL", "", "c: compile 130 s > 120 s")
    assert compiled.verdict([passed]) == ("RESULT PASS: a: fine", 0)
    assert compiled.verdict([passed, skipped]) == (
        "RESULT SKIP (no JAX): a: fine / b: JAX not timed",
        compiled.NOT_JUDGED,
    )
    line, rc = compiled.verdict([skipped, failed, passed])
    assert rc == 1 and line.startswith("RESULT FAIL: b: JAX not timed / c: compile 130 s")


def test_a_row_leaves_the_ways_not_timed_blank():
    r = _row({"adapt_tasks": 18.68, "compiled": 7.01}, diff={"adapt_tasks": 1.8e-7})
    assert compiled.table_row("sinusoid", 32, 5, r) == (
        "| sinusoid | 32 | 5 | - | 18.68 | 7.01 | - | 27.4 | 2.66 | - | 1.8e-07 |"
    )
    untimed = _row({}, compile_s=130.0, eager="x")
    assert compiled.table_row("conv4", 32, 5, untimed).startswith(
        "| conv4 | 32 | 5 | - | - | - (eager: x) | - | 130.0 | - | - |"
    )


def test_the_benchmark_judges_a_small_sinusoid_on_a_cpu(monkeypatch, capsys):
    build = fm.compile_meta_step  # uncompiled here (a compile takes a minute): it fails
    monkeypatch.setattr(fm, "compile_meta_step", lambda *a, **k: build(*a, **k, compile=False))
    small = ["--device", "cpu", "--workloads", "sinusoid", "--tasks", "2", "--steps", "1"]
    small += ["--repeats", "1", "--no-loop", "--no-jax"]
    assert compiled.main([*small, "--max-jax-ratio", "1.5"]) == 1
    out = capsys.readouterr()
    rows = [s for s in out.out.splitlines() if s.startswith("| sinusoid |")]
    assert len(rows) == 1 and rows[0].startswith("| sinusoid | 2 | 1 | - | ")
    assert "(eager: compile=False was given" in rows[0]
    assert out.out.splitlines()[-1].startswith(
        "RESULT FAIL: sinusoid T=2 K=1: ran eagerly (compile=False was given: pass compile=True "
    )
    assert "JAX not timed (JAX left out)" in out.out
    assert "MetaStep.compile_seconds" in out.err
    assert compiled.main(small) == 0  # no target: no verdict
    assert "RESULT" not in capsys.readouterr().out


# ---------------------------------------- benchmarks/speed/compiled.py --compile-times

#: compile_times' aggregated seconds of the sinusoid's step (T=2, K=1) on this 2-core CPU:
#: inductor cold (an empty cache), inductor warm (AOTAutograd's cache hit), aot_eager
INDUCTOR_COLD = {
    "_compile.compile_inner": 29.38,
    "bytecode_tracing": 5.41,
    "OutputGraph.call_user_compiler": 23.49,
    "create_aot_dispatcher_function": 22.65,
    "compile_fx.<locals>.fw_compiler_base": 21.54,
    "compile_fx_inner": 20.44,
    "compile_file": 14.17,
    "build_guards": 0.37,
}
INDUCTOR_WARM = {
    "_compile.compile_inner": 10.27,
    "bytecode_tracing": 6.91,
    "OutputGraph.call_user_compiler": 2.94,
    "AOTAutogradCache.inductor_load": 2.15,
    "compile_file": 0.55,
}
AOT_EAGER = {
    "_compile.compile_inner": 19.27,
    "bytecode_tracing": 14.0,
    "OutputGraph.call_user_compiler": 4.3,
    "create_aot_dispatcher_function": 4.28,
}


def _close(found: dict[str, float], want: dict[str, float]) -> bool:
    return found.keys() == want.keys() and all(abs(found[k] - v) < 1e-9 for k, v in want.items())


def test_the_compile_time_splits_into_dynamo_aot_autograd_and_the_backend():
    cold = compiled.split_times(INDUCTOR_COLD)
    assert _close(cold, {"dynamo": 29.38 - 23.49, "aot": 23.49 - 20.44, "backend": 20.44})
    warm = compiled.split_times(INDUCTOR_WARM)  # the backend's share: loading the cached graph
    assert _close(warm, {"dynamo": 10.27 - 2.94, "aot": 2.94 - 2.15, "backend": 2.15})
    eager = compiled.split_times(AOT_EAGER)  # aot_eager runs the graph as traced: no backend
    assert _close(eager, {"dynamo": 19.27 - 4.3, "aot": 4.3, "backend": 0.0})
    assert compiled.split_times({}) == {"dynamo": 0.0, "aot": 0.0, "backend": 0.0}


def _first(seconds: float, eager: str | None = None, **split: float) -> dict[str, Any]:
    parts = {"dynamo": 0.0, "aot": 0.0, "backend": 0.0, **split}
    return {"compile_seconds": seconds, "first_call": seconds + 1, "eager": eager, "split": parts}


def _compile_row(**more: Any) -> dict[str, Any]:
    r = {
        "cold": _first(31.2, dynamo=5.9, aot=3.0, backend=20.4),
        "warm": _first(10.3, dynamo=7.3, aot=0.8, backend=2.2),
        "jax_cold": {"compile": 1.4, "first_call": 2.4},
        "jax_warm": {"compile": 0.2, "first_call": 0.6},
        "jax_note": None,
    }
    return {**r, **more}


def test_a_compile_times_row_gives_cold_warm_their_split_and_jax():
    row = compiled.compile_table_row("sinusoid", 32, 5, "inductor (plan)", _compile_row())
    assert row == (
        "| sinusoid | 32 | 5 | inductor (plan) | 31.2 | 10.3 | 5.9 / 7.3 | 3.0 / 0.8 | "
        "20.4 / 2.2 | 2.4 | 0.6 | 13.42 (20.9) |"
    )
    no_jax = _compile_row(jax_cold=None, jax_warm=None, jax_note="no JAX")
    assert compiled.compile_table_row("conv4", 32, 1, "aot_eager", no_jax).endswith(
        "| 31.2 | 10.3 | 5.9 / 7.3 | 3.0 / 0.8 | 20.4 / 2.2 | - (no JAX) | - | - |"
    )
    over = _compile_row(cold={"error": "over 1800 s", "timed_out": True}, jax_note="no JAX")
    del over["warm"]
    assert compiled.compile_table_row("conv4", 32, 1, "inductor (plan)", over).startswith(
        "| conv4 | 32 | 1 | inductor (plan) | > 1800 | - | - / - | - / - | - / - |"
    )
    slow_jax = _compile_row(  # compiled, then stopped while it ran (JAX's conv4 on a CPU)
        jax_cold={"compile": 18.6, "error": "over 420 s", "timed_out": True}, jax_warm=None
    )
    assert compiled.compile_table_row("conv4", 32, 1, "aot_eager", slow_jax).endswith(
        "| 20.4 / 2.2 | > 420 (compile 18.6) | - | - |"
    )
    assert compiled.compile_only_line("conv4", 32, 1, slow_jax) == (
        "  conv4 T=32 K=1: torch 29.3 / 10.3, JAX 18.6 / -"
    )
    failed = _compile_row(cold={"error": "exit 1: RuntimeError: x"})
    assert "| failed |" in compiled.compile_table_row("decoder", 2, 1, "aot_eager", failed)
    eager = _compile_row(cold=_first(3.0, eager="a graph break"))
    assert "| 3.0 (eager: a graph break) | 10.3 |" in compiled.compile_table_row(
        "sinusoid", 2, 1, "aot_eager", eager
    )


def test_the_compile_time_targets():
    word, reason, details = compiled.judge_compile("s", _compile_row(), 90, 15, 15)
    assert (word, reason) == ("PASS", "")
    assert details == (
        "s: cold 31.2 s <= 90 s; warm 10.3 s <= 15 s; first call / JAX's 13.42 <= 15 (32.2 / 2.4 s)"
    )
    word, _, details = compiled.judge_compile("s", _compile_row(), 30, 10, 5)
    assert word == "FAIL"
    assert details == (
        "s: cold 31.2 s > 30 s; warm 10.3 s > 10 s; first call / JAX's 13.42 > 5 (32.2 / 2.4 s)"
    )
    no_jax = _compile_row(jax_cold=None, jax_note="no JAX")
    assert compiled.judge_compile("s", no_jax, 90, 15, 5)[:2] == ("SKIP", "no JAX")
    assert compiled.judge_compile("s", no_jax, 90, 15)[0] == "PASS"  # no ratio asked
    assert compiled.judge_compile("s", no_jax, 30, 15, 5)[0] == "FAIL"
    eager = _compile_row(cold=_first(3.0, eager="a graph break"))
    word, _, details = compiled.judge_compile("s", eager)
    assert word == "FAIL" and "ran eagerly (a graph break)" in details
    over = _compile_row(cold={"error": "over 600 s", "timed_out": True})
    del over["warm"]
    word, _, details = compiled.judge_compile("s", over, 90, 15)
    assert word == "FAIL" and details.startswith("s: cold compile over 600 s; no warm compile")


def test_the_new_workloads_and_their_checkpointed_layers():
    net, _, support, query, _ = compiled.workload("residual16", 2, "cpu")
    assert sum(p.numel() for p in net.parameters()) == 16 * 2 * (256 * 256 + 256) + 257
    assert support[0].shape == (2, 512, 256) and query[1].shape == (2, 512, 1)
    assert compiled.checkpointed("residual16", net) == [f"blocks.{i}" for i in range(16)]
    assert compiled.checkpointed("conv4", fm.models.conv4(5)) == [f"features.{i}" for i in range(4)]
    assert compiled.checkpointed("sinusoid", compiled.sinusoid_net()) is None
    pytest.importorskip("transformers")
    net, loss_fn, support, _, _ = compiled.workload("decoder", 3, "cpu")
    assert support[0].shape == (3, 4, 16) and torch.equal(support[0], support[1])
    assert compiled.checkpointed("decoder", net) == ["model.layers.0", "model.layers.1"]
    loss = loss_fn(net(support[0][0]), support[1][0])
    assert abs(loss.item() - math.log(128)) < 0.5  # random weights: about uniform


@GRAPH_TORCH
def test_compile_times_reports_a_cold_and_a_warm_first_call(capsys):
    """The sinusoid (T=2, K=1) with aot_eager: two fresh processes (seconds each), JAX left
    out (the suite does not install it)."""
    args = ["--compile-times", "--backend", "aot_eager", "--workloads", "sinusoid"]
    args += ["--tasks", "2", "--steps", "1", "--no-jax", "--max-cold-seconds", "600"]
    assert compiled.main([*args, "--max-warm-seconds", "600"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[1] == (
        "| workload | T | K | backend | torch cold s | torch warm s | dynamo s | AOT s | "
        "backend s | JAX cold s | JAX warm s | first call / JAX's (compile alone) |"
    )
    rows = [s for s in lines if s.startswith("| sinusoid |")]
    assert len(rows) == 1, out.out
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[:4] == ["sinusoid", "2", "1", "aot_eager"]
    cold, warm = float(cells[4]), float(cells[5])  # numbers: warm is reported
    assert 0 < cold < 600 and 0 < warm < 600
    dynamo = [float(x) for x in cells[6].split(" / ")]
    assert len(dynamo) == 2 and all(0 < x <= s for x, s in zip(dynamo, (cold, warm), strict=True))
    assert cells[8] == "0.0 / 0.0"  # aot_eager: no backend compile
    assert cells[9:] == ["- (JAX left out)", "-", "-"]
    assert lines[-1].startswith("RESULT PASS: sinusoid T=2 K=1: cold ")
    assert "torch warm: MetaStep.compile_seconds" in out.err


@pytest.mark.slow
def test_compile_times_beside_jax_cold_and_warm(capsys):
    pytest.importorskip("jax")
    args = ["--compile-times", "--backend", "aot_eager", "--workloads", "sinusoid"]
    args += ["--tasks", "2", "--steps", "1", "--max-cold-jax-ratio", "1000"]
    assert compiled.main(args) == 0
    row = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("| sinusoid |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    first_call, compile_alone = cells[11].rstrip(")").split(" (")
    ratios = [first_call, compile_alone]
    assert all(float(c) > 0 for c in [*cells[9:11], *ratios]), row  # JAX's seconds, the ratios


@pytest.mark.slow
def test_the_decoders_jax_twin_is_exact_in_float64():
    pytest.importorskip("jax")
    pytest.importorskip("transformers")
    spec = {"name": "decoder", "tasks": 2, "steps": 1, "threads": 1}
    found = compiled.child("twin", spec, {}, 600)
    assert found.get("forward", 1) < 1e-10 and found.get("meta_gradient", 1) < 1e-10, found


# --------------------------------------------------------------- benchmarks/checks/tf32.py


def test_exact_float32_passes_at_or_under_the_target():
    ok, line = tf32.judge_exact({"loop": 2.3e-4, "loop again": 2.2e-4, "batched": 1e-3}, 1e-3)
    assert ok
    assert line == (
        "RESULT PASS: fm.exact_float32 vs float64, largest 1.0e-03 <= 1e-03 "
        "(loop 2.3e-04, loop again 2.2e-04, batched 1.0e-03)"
    )


def test_exact_float32_fails_over_the_target_or_on_a_nan():
    ok, line = tf32.judge_exact({"loop": 3.6e-1, "loop again": 3.5e-1, "batched": 5.7e-5}, 1e-3)
    assert not ok and line.startswith("RESULT FAIL: fm.exact_float32 vs float64, largest 3.6e-01 >")
    ok, line = tf32.judge_exact({"loop": math.nan, "batched": 1e-5}, 1e-3)
    assert not ok and "largest nan" in line
    assert not tf32.judge_exact({}, 1e-3)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="judges where there is no CUDA device")
def test_tf32_on_a_cpu_judges_nothing(capsys):
    assert tf32.main(["--max-exact-error", "1e-3"]) == tf32.NOT_JUDGED
    out = capsys.readouterr().out
    assert "no CUDA device here" in out
    assert out.splitlines()[-1].startswith("RESULT SKIP (no CUDA device)")
    assert "PASS" not in out
    assert tf32.main([]) == 0
    assert "RESULT" not in capsys.readouterr().out
