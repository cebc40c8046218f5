"""The examples run end to end and meta-learning helps (short, seeded runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sinusoid_comparison_runs_and_plots(tmp_path, capsys):
    results = load("sinusoid").main(
        [
            "--iterations",
            "150",
            "--shots",
            "10",
            "--eval-tasks",
            "50",
            "--no-progress",
            "--plot",
            str(tmp_path / "s.png"),
        ]
    )
    out = capsys.readouterr().out
    assert "0.77 ± 0.11" in out and "0.53 ± 0.09" in out  # the published 10-shot figures
    for method in ("MAML", "Meta-SGD"):
        after, before = results[(method, 10)]["after"][0], results[(method, 10)]["before"][0]
        assert after < before  # one inner step helps on held-out tasks
    assert (tmp_path / "s.png").exists()


@pytest.mark.parametrize(
    "recipe", ["maml", "fomaml", "metasgd", "anil", "reptile", "mamlpp", "imaml"]
)
def test_fewshot_example_runs_every_recipe(recipe, tmp_path):
    pytest.importorskip(
        "sklearn", reason="the digits example needs scikit-learn (a dev dependency)"
    )
    scores = load("fewshot").main(
        [
            "--recipe",
            recipe,
            "--iterations",
            "3",
            "--channels",
            "8",
            "--meta-batch",
            "2",
            "--steps",
            "2",
            "--eval-episodes",
            "6",
            "--no-progress",
            "--plot",
            str(tmp_path / "f.png"),
        ]
    )
    assert 0.0 <= scores["after"] <= 1.0 and 0.0 <= scores["before"] <= 1.0
