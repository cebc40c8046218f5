"""scripts/torch_matrix.py: docs/torch-versions.md from the matrix's runs. A capability's
cell is exact where it runs and its tests passed, refused where it refuses by name, and the
failures otherwise; the floors are the oldest exact release; a run without its files is
left out; --check says whether the file is current."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("torch_matrix", ROOT / "scripts/torch_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, version: str, refused: dict, cases: dict[str, str]) -> None:
    env = folder / f"torch-{version}"
    env.mkdir(parents=True)
    (env / "capabilities.json").write_text(json.dumps({"torch": version, "capabilities": refused}))
    rows = []
    for test, outcome in cases.items():
        path, name = test.split("::")
        classname = path.removesuffix(".py").replace("/", ".")
        inner = {"failed": "<failure message='x'/>", "skipped": "<skipped/>"}.get(outcome, "")
        rows.append(f'<testcase classname="{classname}" name="{name}">{inner}</testcase>')
    (env / "junit.xml").write_text(
        f"<testsuites><testsuite>{''.join(rows)}</testsuite></testsuites>"
    )


def test_the_table_says_exact_refused_and_failed_and_finds_the_floors(tmp_path):
    matrix = _script()
    steps = "tests/checkpoint/test_engine.py::test_x[steps]"
    sharded = "tests/distributed/test_sharded.py::test_y"
    _run(
        tmp_path,
        "2.6.0",
        {"checkpoint_steps": "checkpoint_steps needs torch >= 2.7", "sharded models": "no"},
        {steps: "skipped", sharded: "skipped", "tests/inner/test_adapt.py::test_z": "passed"},
    )
    _run(tmp_path, "2.11.0", {}, {steps: "passed", sharded: "failed"})
    _run(tmp_path, "2.12.1", {}, {steps: "passed", sharded: "passed"})
    (tmp_path / "torch-2.13.0").mkdir()  # no run recorded: left out
    runs = [r for env in sorted(tmp_path.glob("torch-*")) if (r := matrix.read(env)) is not None]
    assert [r.version for r in runs] == ["2.11.0", "2.12.1", "2.6.0"]
    text = matrix.render(runs)
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line[:4] == "| 2."}
    assert list(rows) == ["2.6.0", "2.11.0", "2.12.1"]  # by release, not by name
    names = next(line for line in text.splitlines() if line.startswith("| torch |")).split(" | ")
    cells = dict(zip(names, rows["2.6.0"].split(" | "), strict=True))
    assert cells["checkpoint_steps"] == "refused" and cells["sharded models"] == "refused"
    assert cells["inner loops"] == "exact (1)"
    cells = dict(zip(names, rows["2.11.0"].split(" | "), strict=True))
    assert cells["sharded models"] == "**1 failed**, 0 passed"
    assert "- checkpoint_steps: torch 2.11.0" in text
    assert "- sharded models: torch 2.12.1" in text


def test_check_reports_a_stale_table(tmp_path, monkeypatch):
    matrix = _script()
    _run(tmp_path / "m", "2.13.0", {}, {"tests/inner/test_adapt.py::test_z": "passed"})
    monkeypatch.setattr(matrix, "OUT", tmp_path / "torch-versions.md")
    monkeypatch.setattr(matrix, "ROOT", tmp_path)
    assert matrix.main(["--matrix", str(tmp_path / "m"), "--check"]) == 1
    assert matrix.main(["--matrix", str(tmp_path / "m")]) == 0
    assert matrix.main(["--matrix", str(tmp_path / "m"), "--check"]) == 0
    assert matrix.main(["--matrix", str(tmp_path / "empty")]) == 2
