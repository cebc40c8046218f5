"""The demo example runs end to end and meta-learning helps (a short, seeded run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sinusoid_maml.py"


def test_sinusoid_maml_demo_runs_and_improves(capsys):
    spec = importlib.util.spec_from_file_location("sinusoid_maml", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scores = module.main(["--iterations", "400", "--eval-tasks", "50", "--no-progress"])
    out = capsys.readouterr().out
    assert "MAML init, after 1 step(s)" in out
    assert scores["post"] < scores["pre"] < scores["random_init"]
    assert scores["post10"] < scores["post"]
