"""``make gpu-check`` judges without a GPU: ``scripts/gpu_judge.py`` turns each section's exit
status and output into PASS, FAIL, SKIP or NOT RUN and builds the table, and
``scripts/gpu_check.sh`` runs end to end with a stand-in for ``python`` that plays a GPU
machine (every section's command answers as the stand-in is told)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
_spec = importlib.util.spec_from_file_location("gpu_judge", ROOT / "scripts" / "gpu_judge.py")
assert _spec is not None and _spec.loader is not None
gj = importlib.util.module_from_spec(_spec)
sys.modules["gpu_judge"] = gj  # dataclasses look the module up by name
_spec.loader.exec_module(gj)

PYTEST_FAILED = """\
FFF..                                                                    [100%]
FAILED tests/integration/test_cuda_models.py::test_cuda_zoo_default_kernels[lstm-none-False]
56 failed, 26 passed, 1722 deselected in 31.78s
"""
SCENARIO_FAIL = (
    "iteration    9  query loss 100.4535  scale 1024  (skipped)\n"
    "RESULT FAIL: query loss 0.19 -> 100.5 (rises); memory 0.23x <= 0.4x; time 2.69x > 2.5x\n"
)


# ------------------------------------------------------------------ parsing


def test_the_last_result_line_counts_with_its_reason_and_details():
    out = "RESULT FAIL: an earlier try\nnoise\nRESULT SKIP (no JAX): compiled 7.01 ms\ntail\n"
    assert gj.parse_result(out) == gj.Result("SKIP", "no JAX", "compiled 7.01 ms")
    assert gj.parse_result("RESULT: PASS memory 0.23x") == gj.Result("PASS", "", "memory 0.23x")
    assert gj.parse_result("RESULTS are in\nRESULT MAYBE: x") is None
    assert gj.parse_result("") is None


def test_pytest_summary_is_its_last_count_line():
    assert gj.pytest_summary(PYTEST_FAILED) == "56 failed, 26 passed, 1722 deselected in 31.78s"
    assert gj.pytest_summary("== 3 passed in 0.1s ==") == "3 passed in 0.1s"
    assert gj.pytest_summary("no tests ran in 0.01s") == "no tests ran in 0.01s"
    assert gj.pytest_summary("ImportError: boom") is None


# ------------------------------------------------------------------ verdicts


def test_tests_pass_only_on_exit_0_with_a_test_passed():
    assert gj.judge("tests", 0, "26 passed, 1722 deselected in 31.78s") == (
        "PASS",
        "26 passed, 1722 deselected in 31.78s",
    )
    assert gj.judge("tests", 1, PYTEST_FAILED) == (
        "FAIL",
        "56 failed, 26 passed, 1722 deselected in 31.78s",
    )
    status, measured = gj.judge("tests", 5, "1804 deselected in 2.1s")
    assert status == "FAIL" and measured.startswith("no tests ran")
    status, measured = gj.judge("tests", 0, "82 skipped, 1722 deselected in 1.0s")
    assert status == "FAIL" and measured.startswith("no test passed")
    status, measured = gj.judge("tests", 4, "ERROR: file or directory not found: tests")
    assert status == "FAIL" and "exit status 4" in measured


def test_a_result_section_passes_on_exit_0_and_result_pass():
    out = "table\nRESULT PASS: compiled / JAX 0.95 <= 1.5\n"
    assert gj.judge("result", 0, out) == ("PASS", "compiled / JAX 0.95 <= 1.5")


def test_a_result_section_fails_on_result_fail_or_a_non_zero_exit():
    assert gj.judge("result", 1, SCENARIO_FAIL) == (
        "FAIL",
        "query loss 0.19 -> 100.5 (rises); memory 0.23x <= 0.4x; time 2.69x > 2.5x",
    )
    status, measured = gj.judge("result", 0, SCENARIO_FAIL)  # says FAIL, exits 0
    assert status == "FAIL" and "RESULT FAIL" in measured
    status, measured = gj.judge("result", 1, "RESULT PASS: fine\n")  # says PASS, exits 1
    assert status == "FAIL" and "exit status 1" in measured


def test_a_result_section_without_a_result_line_fails_with_its_last_line():
    usage = "checkpointed_maml.py: error: unrecognized arguments: --max-memory-ratio 0.4\n"
    status, measured = gj.judge("result", 2, "usage: ...\n" + usage)
    assert status == "FAIL"
    assert measured == f"exit status 2, no RESULT line: {usage.strip()}"
    status, measured = gj.judge("result", 0, "a table and no verdict\n")
    assert status == "FAIL" and "no RESULT line" in measured


def test_a_missing_jax_is_a_skip_not_a_pass():
    out = "RESULT SKIP (no JAX): sinusoid T=32 K=5: compiled 7.01 ms, JAX not timed\n"
    status, measured = gj.judge("result", gj.NOT_JUDGED, out)
    assert status == "SKIP (no JAX)" and measured.startswith("sinusoid")
    assert gj.judge("result", 0, out)[0] == "SKIP (no JAX)"
    assert gj.judge("result", 1, out)[0] == "FAIL"  # a crash after it is a crash


def test_a_section_over_its_limit_fails():
    for rc in (124, 137):  # timeout's own stop, and its kill after the grace period
        assert gj.judge("result", rc, "RESULT PASS: x", seconds=150, limit=150) == (
            "FAIL",
            "stopped after 150 s: over its limit",
        )
    assert gj.judge("tests", 124, "", seconds=90, limit=90)[0] == "FAIL"
    status, measured = gj.judge("result", 124, "", seconds=31, limit=31, by_budget=True)
    assert status == "FAIL" and "budget ran out" in measured
    # killed before its limit (memory): a failure, but not "over its limit"
    status, measured = gj.judge("result", 137, "Killed", seconds=20, limit=150)
    assert status == "FAIL" and "over its limit" not in measured


def test_a_section_without_a_target_ran_or_erred():
    assert gj.judge("none", 0, "table") == ("ran (no target)", "-")
    assert gj.judge("none", 1, "Traceback\nValueError: x")[0] == "ERROR"
    assert gj.judge("none", 124, "", seconds=120, limit=120)[0] == "stopped (no target)"
    with pytest.raises(ValueError):
        gj.judge("other", 0, "")


# ------------------------------------------------------------------ the table


def _verdicts() -> list:
    return [
        gj.Verdict("CUDA tests", "pytest exits 0", "26 passed in 31.8s", "PASS", 39),
        gj.Verdict("scenario", "memory <= 0.4x", "time 2.69x > 2.5x | rises", "FAIL", 54),
        gj.Verdict("compiled sinusoid", "<= 1.5x JAX", "JAX not timed", "SKIP (no JAX)", 40),
        gj.Verdict("compiled conv4", "<= 120 s", "the budget is spent", "NOT RUN", 0),
        gj.Verdict("memory", "", "-", "ran (no target)", 30),
    ]


def test_the_table_lists_every_section_and_marks_the_misses():
    lines = gj.table(_verdicts()).splitlines()
    assert lines[0] == "| section | target | measured | seconds | result |"
    assert len(lines) == 2 + 5
    assert lines[2] == "| CUDA tests | pytest exits 0 | 26 passed in 31.8s | 39 | PASS |"
    assert lines[3].endswith("| 54 | **FAIL** |") and "2.5x \\| rises" in lines[3]
    assert lines[4].endswith("| **SKIP (no JAX)** |")
    assert lines[5].endswith("| **NOT RUN** |")
    assert lines[6] == "| memory | no target | - | 30 | ran (no target) |"


def test_the_check_fails_unless_every_target_passed():
    verdicts = _verdicts()
    assert gj.exit_status(verdicts) == 1
    assert gj.summary(verdicts) == (
        "1 of 4 targets met; not met: scenario (FAIL), compiled sinusoid (SKIP (no JAX)), "
        "compiled conv4 (NOT RUN)"
    )
    passed = [verdicts[0], gj.Verdict("memory", "", "-", "ERROR", 3)]
    assert gj.exit_status(passed) == 0  # a section without a target does not count
    assert gj.summary(passed) == "1 of 1 targets met"


def test_the_command_line_records_sections_and_prints_the_table(tmp_path, capsys):
    records, log = tmp_path / "records.jsonl", tmp_path / "log"
    log.write_text("RESULT PASS: largest 2.3e-04 <= 1e-03\n")
    common = ["judge", "--records", str(records), "--kind", "result"]
    assert gj.main([*common, "--name", "TF32", "--target", "<= 1e-3", "--log", str(log)]) == 0
    assert gj.main([*common, "--name", "conv4", "--target", "<= 120 s", "--not-run", "budget"]) == 0
    assert capsys.readouterr().out == "PASS: largest 2.3e-04 <= 1e-03\nNOT RUN: budget\n"
    assert gj.main(["table", "--records", str(records)]) == 1
    out = capsys.readouterr().out
    assert "| TF32 | <= 1e-3 | largest 2.3e-04 <= 1e-03 | 0 | PASS |" in out
    assert "| conv4 | <= 120 s | budget | 0 | **NOT RUN** |" in out
    assert out.rstrip().endswith("gpu-check: 1 of 2 targets met; not met: conv4 (NOT RUN)")


# ------------------------------------------------------------------ scripts/gpu_check.sh

FAKE_PYTHON = r"""#!/usr/bin/env bash
# python on a pretend GPU machine: each section's command answers as FAKE_* says
case "$*" in
    *scripts/gpu_judge.py*) exec "$REAL_PYTHON" "$@" ;;
    "-c "*) echo "Fake GPU" ;;
    *"-m pytest"*) sleep "${FAKE_TESTS_SLEEP:-0}"; echo "$FAKE_TESTS_OUT"; exit "$FAKE_TESTS_RC" ;;
    *checkpointed_maml.py*) echo "$FAKE_SCENARIO_OUT"; exit "$FAKE_SCENARIO_RC" ;;
    *tf32.py*) echo "$FAKE_TF32_OUT"; exit "$FAKE_TF32_RC" ;;
    *"--workloads sinusoid"*) echo "$FAKE_SINUSOID_OUT"; exit "$FAKE_SINUSOID_RC" ;;
    *"--workloads conv4"*) exit "$FAKE_CONV4_RC" ;;
    *sharded_maml.py*) echo "$FAKE_SHARDED_OUT"; exit "$FAKE_SHARDED_RC" ;;
    *memory.py*) exit 1 ;;
    *) echo "ran: $*" ;;
esac
"""


def _check(tmp_path: Path, **env: str) -> tuple[int, str, str]:
    """scripts/gpu_check.sh with the stand-in python; (exit status, stdout, the report)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    report = tmp_path / "gpu_check.md"
    full = {
        **os.environ,
        "PYTHON": str(fake),
        "REAL_PYTHON": sys.executable,
        "GPU_CHECK_REPORT": str(report),
        "FAKE_TESTS_OUT": "82 passed, 1722 deselected in 31.78s",
        "FAKE_TESTS_RC": "0",
        "FAKE_SCENARIO_OUT": SCENARIO_FAIL,
        "FAKE_SCENARIO_RC": "1",
        "FAKE_TF32_OUT": "RESULT PASS: fm.exact_float32 vs float64, largest 2.3e-04 <= 1e-03",
        "FAKE_TF32_RC": "0",
        "FAKE_SINUSOID_OUT": "RESULT SKIP (no JAX): sinusoid T=32 K=5: compile 27.4 s",
        "FAKE_SINUSOID_RC": str(gj.NOT_JUDGED),
        "FAKE_CONV4_RC": "124",
        "FAKE_SHARDED_OUT": "RESULT PASS: adapted query loss 1.576 -> 0.736",
        "FAKE_SHARDED_RC": "0",
        **env,
    }
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stdout, report.read_text() if report.exists() else ""


def _rows(text: str) -> dict[str, str]:
    """The table's rows by section."""
    rows = [s for s in text.splitlines() if s.startswith("| ") and "| --- |" not in s]
    return {s.split(" | ")[0][2:]: s for s in rows[1:] if " | " in s}


def test_the_check_says_so_and_exits_0_without_a_cuda_device(tmp_path):
    report = tmp_path / "gpu_check.md"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_REPORT": str(report)}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "no CUDA device here" in done.stdout
    assert not report.exists()


def test_the_check_judges_every_section_and_ends_with_the_table(tmp_path):
    rc, stdout, report = _check(tmp_path)
    assert rc == 1
    rows = _rows(report)
    assert list(rows) == [
        "CUDA tests",
        "scenario",
        "TF32",
        "compiled sinusoid",
        "compiled conv4",
        "sharded",
        "memory",
        "compiled checkpointed",
        "tasks",
        "peers",
        "sequence",
    ]
    assert rows["CUDA tests"].endswith("| PASS |")
    assert "82 passed" in rows["CUDA tests"]
    assert rows["scenario"].endswith("| **FAIL** |") and "time 2.69x > 2.5x" in rows["scenario"]
    assert rows["TF32"].endswith("| PASS |") and "2.3e-04" in rows["TF32"]
    assert rows["compiled sinusoid"].endswith("| **SKIP (no JAX)** |")
    assert "over its limit" in rows["compiled conv4"]
    assert rows["compiled conv4"].endswith("| **FAIL** |")
    assert rows["sharded"].endswith("| PASS |") and "1.576 -> 0.736" in rows["sharded"]
    assert rows["memory"].endswith("| ERROR |")
    assert rows["compiled checkpointed"].endswith("| ran (no target) |")
    assert rows["sequence"].endswith("| ran (no target) |")
    # each section prints its verdict where it ends, and the report holds what stdout shows
    assert "\nFAIL: query loss 0.19 -> 100.5 (rises)" in report
    assert "\nPASS: 82 passed, 1722 deselected in 31.78s" in report
    assert "3 of 6 targets met; not met: scenario (FAIL)" in stdout
    assert "--max-memory-ratio 0.4 --max-time-ratio 2.5" in report
    assert "# GPU check: Fake GPU" in report


def test_a_section_left_for_lack_of_time_is_not_run_and_fails_the_check(tmp_path):
    # a budget of 46 s leaves 31 s for the first section (15 s are kept back); after its 2 s
    # the next would start with under 30 s
    rc, stdout, report = _check(
        tmp_path,
        GPU_CHECK_BUDGET="46",
        GPU_CHECK_ONLY="tests tf32 peers",
        FAKE_TESTS_SLEEP="2",
    )
    assert rc == 1
    rows = _rows(report)
    assert list(rows) == ["CUDA tests", "TF32", "peers"]
    assert rows["CUDA tests"].endswith("| PASS |")
    # its limit of 90 s, cut to the budget's: 31 s, less the whole seconds the check took to
    # start (a loaded machine: 30)
    limit = re.search(r"\(limit (\d+) s\)", report)
    assert limit is not None and 25 <= int(limit.group(1)) <= 31, report
    assert rows["TF32"].endswith("| **NOT RUN** |") and "budget of 46 s is spent" in rows["TF32"]
    assert rows["peers"].endswith("| NOT RUN |")  # no target: does not count
    assert "1 of 2 targets met; not met: TF32 (NOT RUN)" in stdout


def test_the_check_exits_0_when_every_target_passed(tmp_path):
    rc, stdout, _ = _check(
        tmp_path,
        GPU_CHECK_ONLY="tests tf32 memory",
    )
    assert rc == 0
    assert "2 of 2 targets met" in stdout
