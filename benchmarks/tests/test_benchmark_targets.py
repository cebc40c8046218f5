"""The targets ``make gpu-check`` holds the benchmarks to, judged on a CPU: the compiled
meta-step against JAX's time and its compile time (``benchmarks/speed/compiled.py``), and
``fm.exact_float32``'s error against float64 (``benchmarks/checks/tf32.py``, which on a CPU says it
judged nothing)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from bench_scripts import load

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
