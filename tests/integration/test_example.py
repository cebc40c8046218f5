"""The examples run end to end and meta-learning helps (short, seeded runs)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import shared_file

import funcmeta as fm
from funcmeta._src.data import omniglot

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def keep_thread_count():
    """The examples set torch's thread count for their work; the suite keeps its own."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def load(name):
    if str(EXAMPLES) not in sys.path:  # as when run as a script: its helpers beside it
        sys.path.insert(0, str(EXAMPLES))
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
    assert torch.get_num_threads() == 1  # the sinusoid MLP's operations are tiny


def test_sinusoid_meta_trains_with_the_compiled_step(tmp_path):
    """``--compiled``: each method's meta-iteration compiled once, and meta-learning helps."""
    results = load("sinusoid").main(
        [
            "--iterations",
            "60",
            "--shots",
            "10",
            "--eval-tasks",
            "50",
            "--no-progress",
            "--compiled",
            "--plot",
            str(tmp_path / "s.png"),
        ]
    )
    for method in ("MAML", "Meta-SGD"):
        after, before = results[(method, 10)]["after"][0], results[(method, 10)]["before"][0]
        assert after < before


@pytest.mark.parametrize(
    "recipe", ["maml", "fomaml", "metasgd", "anil", "reptile", "mamlpp", "imaml"]
)
def test_fewshot_example_runs_every_recipe(recipe, tmp_path):
    pytest.importorskip(
        "sklearn", reason="scikit-learn is not installed: pip install -e '.[examples]'"
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


@pytest.mark.slow
def test_omniglot_example_runs_every_recipe_on_the_real_data(tmp_path, capsys):
    """A short run of examples/omniglot.py on the official files: every recipe trains for a
    few iterations and is scored on the 20 official runs and on held-out episodes; the
    dataset's Modified Hausdorff baseline comes out as published."""
    shared = shared_file("omniglot/all_runs.zip").parent
    summary = load("omniglot").main(
        [
            "--data",
            str(shared),
            "--iterations",
            "3",
            "--hidden",
            "8",
            "--meta-batch",
            "2",
            "--eval-episodes",
            "8",
            "--curve-episodes",
            "4",
            "--curve-every",
            "0",
            "--settings",
            "shared",
            "--no-progress",
            "--out",
            str(tmp_path / "o.json"),
            "--plot",
            str(tmp_path / "o.png"),
        ]
    )
    assert summary["mhd_error"] == pytest.approx(0.3875)  # 155 of 400 wrong: the demo's 38.8%
    assert sorted(summary["recipes"]) == sorted(
        ["maml", "fomaml", "metasgd", "anil", "reptile", "mamlpp", "imaml", "protonet", "r2d2"]
    )
    for name, r in summary["recipes"].items():
        assert r["iterations"] == 3, name
        assert 0 <= r["official_runs"]["error"] <= 1 and r["official_runs"]["ci95"] > 0
        assert 0 <= r["5way_1shot"]["accuracy"] <= 1 and 0 <= r["20way_1shot"]["accuracy"] <= 1
    assert "cg_residual" in summary["recipes"]["imaml"]
    steps = {name: r["inner_steps"] for name, r in summary["recipes"].items()}
    assert steps == {
        "maml": 1,
        "fomaml": 5,
        "metasgd": 1,
        "anil": 1,
        "reptile": 5,
        "mamlpp": 1,
        "imaml": 5,
        "protonet": 0,
        "r2d2": 0,
    }
    for name, r in summary["recipes"].items():  # a curve point before training, then each it
        assert [c["iterations"] for c in r["curve"]] == [0, 1, 2, 3], name
        assert all(0 <= c["5-way"] <= 1 and 0 <= c["20-way"] <= 1 for c in r["curve"])
    assert (tmp_path / "o.json").exists() and (tmp_path / "o.png").exists()
    assert "official runs error" in capsys.readouterr().out


def test_omniglot_published_settings_are_each_methods_own():
    omniglot = load("omniglot")
    args = omniglot.parser().parse_args(["--settings", "published"])
    got = {name: omniglot.settings(name, args) for name in omniglot.RECIPES}
    assert (got["maml"]["steps"], got["maml"]["inner_lr"], got["maml"]["meta_batch"]) == (
        5,
        0.1,
        16,
    )
    assert got["metasgd"]["steps"] == 1 and got["metasgd"]["rates"] == (0.005, 0.1)
    assert got["reptile"]["inner_adam"] and got["reptile"]["train_shots"] == 9
    assert (got["reptile"]["eps"], got["reptile"]["eps_final"]) == (1.0, 0.0)
    assert (got["imaml"]["steps"], got["imaml"]["lam"], got["imaml"]["meta_batch"]) == (16, 2.0, 32)
    assert (got["protonet"]["ways"], got["protonet"]["query"]) == (60, 5)
    shared = omniglot.parser().parse_args(["--settings", "shared"])
    assert omniglot.settings("maml", shared)["steps"] == 1
    assert omniglot.settings("reptile", shared)["inner_lr"] == 0.4
    # the schedules: Reptile's outer step annealed linearly to 0, MAML++'s cosine to 1e-5
    reptile = omniglot.Recipe("reptile", args)
    reptile.schedule(0.5, 0)
    assert reptile.outer.param_groups[0]["lr"] == pytest.approx(0.5)
    mamlpp = omniglot.Recipe("mamlpp", args)
    mamlpp.schedule(1.0, 0)
    assert mamlpp.outer.param_groups[0]["lr"] == pytest.approx(1e-5)
    proto = omniglot.Recipe("protonet", args)
    proto.schedule(0.1, 4000)
    assert proto.outer.param_groups[0]["lr"] == pytest.approx(2.5e-4)


def test_omniglot_budget_settings_zero_the_head_before_every_inner_loop(tmp_path):
    """The default settings are the budget ones; with them the head is zero at the start of
    every inner loop (the zeroing trick), while the body learns; published MAML keeps its
    learned head."""
    omniglot = load("omniglot")
    args = omniglot.parser().parse_args(["--hidden", "8", "--iterations", "2", "--no-progress"])
    assert args.settings == "budget"
    assert omniglot.settings("maml", args)["zero_head"]
    assert not omniglot.settings("protonet", args).get("zero_head")
    reptile = omniglot.Recipe("reptile", args)
    assert isinstance(reptile.outer, torch.optim.Adam)  # its update theta - phi through Adam
    assert reptile.outer.param_groups[0]["lr"] == 3e-3
    shared = shared_file("omniglot/all_runs.zip").parent
    x, y, _ = fm.data.load_omniglot(shared, "background_small1", size=28)
    for setting, zeroed in (("budget", True), ("published", False)):
        args.settings = setting
        torch.manual_seed(0)
        recipe = omniglot.Recipe("maml", args)
        head = recipe.net.head.weight
        assert bool((head == 0).all()) is zeroed
        body = recipe.net.features[0].conv.weight.detach().clone()
        log = omniglot.meta_train(recipe, omniglot.training_episodes(recipe, x, y), args)
        assert log["iterations"] == 2
        assert bool((recipe.net.head.weight == 0).all()) is zeroed
        assert not bool((recipe.net.head.bias != 0).any()) or not zeroed
        assert not torch.equal(recipe.net.features[0].conv.weight, body)  # the body learns


@pytest.mark.slow
def test_omniglot_budget_reptile_and_imaml_run(tmp_path):
    """The default settings' own paths: Reptile's update through Adam on batches of 20 drawn
    from 5 examples per class, iMAML with 5 queries per class and the undamped system set by
    ``--set``."""
    shared = shared_file("omniglot/all_runs.zip").parent
    omniglot = load("omniglot")
    summary = omniglot.main(
        [
            "--data",
            str(shared),
            "--recipes",
            "reptile",
            "imaml",
            "--iterations",
            "2",
            "--hidden",
            "8",
            "--eval-episodes",
            "4",
            "--curve-episodes",
            "0",
            "--set",
            "imaml.damping=0.0",
            "--no-progress",
            "--out",
            str(tmp_path / "o.json"),
            "--plot",
            str(tmp_path / "o.png"),
        ]
    )
    reptile, imaml = summary["recipes"]["reptile"], summary["recipes"]["imaml"]
    assert reptile["iterations"] == imaml["iterations"] == 2
    assert reptile["settings"]["outer"] == "adam" and reptile["settings"]["train_shots"] == 5
    assert imaml["settings"]["query"] == 5 and imaml["settings"]["damping"] == 0.0
    assert "cg_residual" in imaml


def test_omniglot_budget_imaml_is_tested_with_15_proximal_steps():
    """iMAML's budget settings adapt with 15 proximal steps at test (5 in training): its
    evaluation equals ``fm.evaluate`` run directly with 15 steps of the proximal SGD anchored
    at the meta-parameters, and differs from 5 steps."""
    omniglot = load("omniglot")
    args = omniglot.parser().parse_args(["--hidden", "8", "--no-progress"])
    torch.manual_seed(0)
    recipe = omniglot.Recipe("imaml", args)
    assert recipe.steps == 5 and recipe.test_steps() == 15
    with torch.no_grad():  # a head that is not zero, so that the steps matter
        recipe.net.head.weight.normal_(0, 0.1)
    g = torch.Generator().manual_seed(0)
    episodes = fm.data.Episodes(
        torch.rand(40, 1, 28, 28, generator=g), torch.arange(40) // 4, ways=5, shots=1, query=2
    )
    got = recipe.evaluate(episodes, 20, seed=1).per_episode
    fmodel = recipe.fmodel
    anchor = {k: v.detach() for k, v in fmodel.params.items()}
    prox = fm.optim.chain(fm.optim.add_proximal(0.5, anchor), fm.optim.sgd(lr=0.1))

    def direct(steps):
        return fm.evaluate(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            episodes,
            prox,
            steps=steps,
            num_episodes=20,
            seed=1,
        ).per_episode

    torch.testing.assert_close(got, direct(15), rtol=0, atol=0)
    assert not torch.equal(got, direct(5))


def test_omniglot_set_changes_one_setting_of_one_recipe(capsys):
    omniglot = load("omniglot")
    args = omniglot.parser().parse_args(
        [
            "--set",
            "maml.inner_lr=0.2",
            "--set",
            "maml.rates=(0.05, 0.1)",
            "--set",
            "maml.zero_head=None",
            "--set",
            "reptile.outer=sgd",
            "--set",
            "imaml.steps=None",
        ]
    )
    maml = omniglot.settings("maml", args)
    assert (maml["inner_lr"], maml["rates"]) == (0.2, (0.05, 0.1))
    assert "zero_head" not in maml  # dropped: no shared value
    assert omniglot.settings("fomaml", args)["zero_head"]  # other recipes keep theirs
    assert omniglot.settings("reptile", args)["outer"] == "sgd"  # a bare word is a string
    assert omniglot.settings("imaml", args)["steps"] == args.imaml_steps  # the shared value
    with pytest.raises(ValueError, match="only reptile has a choice of outer"):
        omniglot.Recipe("maml", omniglot.parser().parse_args(["--set", "maml.outer=adam"]))
    with pytest.raises(ValueError, match="protonet: zero_head: it has no head"):
        omniglot.Recipe("protonet", omniglot.parser().parse_args(["--set", "protonet.zero_head=1"]))
    with pytest.raises(ValueError, match="outer='lbfgs'"):
        omniglot.Recipe("reptile", omniglot.parser().parse_args(["--set", "reptile.outer=lbfgs"]))
    for bad, message in (
        ("maml.inner_lr", "expected RECIPE.KEY=VALUE"),
        ("inner_lr=0.1", "expected RECIPE.KEY=VALUE"),
        ("mamll.inner_lr=0.1", "no recipe 'mamll'"),
        ("maml.inner_rate=0.1", "no setting 'inner_rate'"),
    ):
        with pytest.raises(SystemExit):
            omniglot.parser().parse_args(["--set", bad])
        assert message in capsys.readouterr().err


def test_hyperparameter_example_learns_per_feature_penalties(capsys):
    result = load("hyperparameters").main(["--iterations", "100"])
    assert result["learned_test_mse"] < 0.7 * result["single_test_mse"]
    assert result["other_lam"] > 100 * result["informative_lam"]  # it finds the signal
    assert result["last_residual"] < 1e-8
    assert "learned by implicit gradients (cg)" in capsys.readouterr().out


def test_learned_optimizer_example_runs(capsys):
    result = load("learned_optimizer").main(["--iterations", "3", "--eval-tasks", "20"])
    assert result["sgd_lr"] > 0 and result["learned"] == result["learned"]  # finite
    assert "learned optimizer" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, default",
    [("sinusoid", 1), ("learned_optimizer", 1), ("hyperparameters", 1), ("omniglot", None)],
)
def test_examples_choose_their_thread_count_and_say_why(name, default, capsys):
    threads = load("_threads")
    expected = threads.available_cores() if default is None else default
    with pytest.raises(SystemExit):
        load(name).main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        f"--threads THREADS intra-op threads (torch.set_num_threads); default {expected}:" in text
    )
    with pytest.raises(SystemExit):
        load(name).main(["--threads", "0"])
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err


def test_the_port_keeps_freed_memory_by_default_and_says_why(monkeypatch, capsys):
    threads = load("_threads")
    with pytest.raises(SystemExit):
        load("maml_omniglot_port").main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--keep-freed-memory, --no-keep-freed-memory" in text
    assert "default on: 32 tasks' activations" in text
    calls = []
    monkeypatch.setattr(threads.fm, "keep_freed_memory", lambda: calls.append(1) or True)
    parser = argparse.ArgumentParser()
    threads.add_allocator_option(parser, True, "why")
    kept = threads.use_allocator(parser.parse_args([]))
    assert kept == "allocator: freed memory kept (fm.keep_freed_memory)" and calls == [1]
    off = threads.use_allocator(parser.parse_args(["--no-keep-freed-memory"]))
    assert off == "allocator: the C library's defaults"
    assert calls == [1]  # off: the allocator is left alone
    # where it does not apply, the run goes on and says why, once, in the line it prints
    monkeypatch.setattr(threads.fm, "keep_freed_memory", lambda: False)
    monkeypatch.setattr(threads.fm.cpu_memory, "why_not_kept", lambda: "the C library is musl")
    said = threads.use_allocator(parser.parse_args([]))
    assert said.endswith("(fm.keep_freed_memory does not apply: the C library is musl)")


def test_omniglot_combine_puts_runs_in_one_file_and_refuses_what_does_not_fit(tmp_path):
    """``--combine``: the results of runs made apart in one file and one plot; a file that is
    not one of its results, from other data, or naming a recipe twice is refused by name."""
    omniglot = load("omniglot")
    result = {
        "iterations": 5,
        "official_runs": {"error": 0.25, "ci95": 0.05},
        "curve": [{"seconds": 0.0, "iterations": 0, "5-way": 0.3, "20-way": 0.1}],
    }

    def write(name: str, summary) -> str:
        path = tmp_path / name
        path.write_text(summary if isinstance(summary, str) else json.dumps(summary))
        return str(path)

    a = write("a.json", {"mhd_error": 0.3875, "recipes": {"maml": result}})
    b = write("b.json", {"mhd_error": 0.3875, "recipes": {"protonet": dict(result, iterations=7)}})
    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    summary = omniglot.main(["--combine", a, b, "--out", str(out), "--plot", str(png)])
    assert {k: r["iterations"] for k, r in summary["recipes"].items()} == {"maml": 5, "protonet": 7}
    assert json.loads(out.read_text())["recipes"] == summary["recipes"] and png.exists()
    bad = {
        "is already in an earlier file": [a, a],
        "another dataset": [a, write("c.json", {"mhd_error": 0.5, "recipes": {"x": result}})],
        "not a results file": [write("d.json", [1, 2])],
        "has no results": [write("e.json", {"mhd_error": 0.3875, "recipes": {"maml": 3}})],
        "cannot read it": [write("f.json", '{"mhd_error": 0.38')],
    }
    for message, files in bad.items():
        with pytest.raises(SystemExit, match=message):
            omniglot.main(["--combine", *files, "--out", str(out), "--plot", str(png)])
    with pytest.raises(SystemExit, match="cannot read it"):
        omniglot.main(["--combine", str(tmp_path / "missing.json"), "--out", str(out)])


@pytest.mark.slow
def test_checkpointed_maml_example_saves_memory_with_the_same_meta_gradients(capsys):
    """The motivating scenario's example: the model that checkpoints its own modules keeps a
    fraction of the unchecked model's peak memory in a second-order meta-iteration, with
    the same meta-gradients (fp32: to float32 round-off)."""
    example = load("checkpointed_maml")
    args = example.parser().parse_args(
        ["--device", "cpu", "--precision", "fp32", "--modules", "8", "--iterations", "2"]
    )
    history = example.train(args)
    assert len(history["loss"]) == 2 and all(s is None for s in history["scale"])
    results = example.measure(args)
    example.report(results)
    plain, ours = results["unchecked"], results["checkpointed"]
    assert ours["peak"] < 0.6 * plain["peak"], (ours["peak"], plain["peak"])
    a, b = torch.tensor(plain["grad"]), torch.tensor(ours["grad"])
    assert float((a - b).norm() / a.norm()) < 1e-5
    assert "checkpointed / unchecked" in capsys.readouterr().out


@pytest.mark.parametrize("order", ["second", "first"])
def test_lora_maml_example_learns_adapters_that_adapt(order):
    """MAML on a bf16 decoder's LoRA adapters, task batched: after meta-training, a few inner
    steps on the adapters lower each task's query loss well below the unadapted one."""
    pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[dev]'")
    example = load("lora_maml")
    argv = ["--iterations", "60", "--bf16"] + (["--first-order"] if order == "first" else [])
    history = example.main(argv)
    before, after = history["before"][-10:], history["after"][-10:]
    assert sum(after) / 10 < sum(before) / 10 - 0.15


@pytest.mark.slow
def test_omniglot_example_compiled_trains_as_the_recipes_do(tmp_path):
    """``--compiled`` runs MAML as one compiled graph (one task per graph call): the same
    training losses as the recipe, to float32 rounding, over the same episodes. (The other
    compiled recipes are held to their recipes in ``tests/compiled/test_compiled.py``.)"""
    shared = shared_file("omniglot/all_runs.zip").parent
    common = [
        "--data",
        str(shared),
        "--recipes",
        "maml",
        "--iterations",
        "2",
        "--hidden",
        "4",
        "--meta-batch",
        "2",
        "--eval-episodes",
        "2",
        "--curve-episodes",
        "1",
        "--settings",
        "shared",
        "--no-progress",
    ]
    omniglot = load("omniglot")
    runs = {}
    for how, extra in (("plain", []), ("compiled", ["--compiled", "--task-chunk", "1"])):
        out = [f"--out={tmp_path / how}.json", f"--plot={tmp_path / how}.png"]
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            runs[how] = omniglot.main(common + extra + out)["recipes"]
        assert not [w for w in said if "compile_meta_step" in str(w.message)], how
    plain, compiled = runs["plain"]["maml"], runs["compiled"]["maml"]
    assert compiled["iterations"] == plain["iterations"] == 2
    assert compiled["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)
    assert compiled["train_query_accuracy"] is None


# the examples that read Omniglot, each with how to point it at a folder
OMNIGLOT_EXAMPLES = {
    "omniglot": "--data",
    "maml_omniglot_port": "--data",
    "l2l_maml_omniglot_port": "--data",
    "fewshot": "--omniglot",
}


@pytest.mark.parametrize("name", sorted(OMNIGLOT_EXAMPLES))
def test_omniglot_examples_without_data_say_how_to_get_it(name, tmp_path):
    """Run as a script on an empty folder: one message naming --download, the files and where
    they are published, exit status 1, no traceback, nothing fetched."""
    import subprocess

    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), OMNIGLOT_EXAMPLES[name], str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    message = " ".join(done.stderr.split())
    assert f"no Omniglot data in {tmp_path}." in message
    assert "Rerun with --download" in message and f"yourself into {tmp_path}" in message
    for file in ("images_background_small1.zip", "images_background_small2.zip"):
        assert f"{file} ({fm.data.OMNIGLOT_URL}python/{file})" in message
    if name == "omniglot":
        assert f"all_runs.zip ({fm.data.OMNIGLOT_URL}python/one-shot-classification/" in message
    if name == "fewshot":  # or the full splits, which --download cannot fetch
        assert f"images_evaluation.zip ({fm.data.OMNIGLOT_URL}python/" in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", sorted(OMNIGLOT_EXAMPLES))
def test_omniglot_examples_say_when_the_download_fails(name, tmp_path, monkeypatch):
    def offline(root, files, **kwargs):
        raise OSError(f"could not download {files[0]}: no network here")

    monkeypatch.setattr(omniglot, "download_omniglot", offline)
    argv = [OMNIGLOT_EXAMPLES[name], str(tmp_path / "new"), "--download"]
    if name == "maml_omniglot_port":
        argv.append("--no-keep-freed-memory")  # a process-wide setting: not for the test process
    with pytest.raises(SystemExit) as stop:
        load(name).main(argv)
    message = str(stop.value.code)
    assert message.startswith("could not download images_background_small1.zip: no network")
    what = "either pair" if name == "fewshot" else "them"
    assert "Rerun" not in message and f"\nDownload {what} yourself into {tmp_path}" in message


def test_omniglot_example_ports_cannot_fetch_the_full_splits_and_say_so(tmp_path):
    with pytest.raises(SystemExit) as stop:
        load("l2l_maml_omniglot_port").main(
            ["--data", str(tmp_path), "--splits", "background", "--download"]
        )
    message = " ".join(str(stop.value.code).split())
    assert f"images_background.zip ({fm.data.OMNIGLOT_URL}python/images_background.zip)" in message
    assert message.endswith("--download fetches only the minimal splits.")


@pytest.mark.parametrize("name", sorted(OMNIGLOT_EXAMPLES))
def test_omniglot_examples_help_shows_every_option_with_its_default(name, capsys):
    parser = load(name).parser()
    assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in options if not a.help] == []
    with pytest.raises(SystemExit) as stop:
        load(name).main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--download" in text and "(default: False)" in text
    if name == "fewshot":
        assert "classes per episode (N-way) (default: 5)" in text
        assert "support examples per class (K-shot) (default: 1)" in text
    else:
        assert "(default: data/omniglot)" in text


@pytest.mark.parametrize(("average", "expected"), [(0.1, 2), (1.2, 1), (5.0, 1), (None, 2)])
def test_the_checkpointed_example_takes_the_cores_the_load_leaves_idle(
    monkeypatch, average, expected
):
    """``--threads``' default in checkpointed_maml.py: the cores less the load average (a
    thread on a core another job holds makes every parallel region wait); no load average:
    every core."""
    threads = load("_threads")
    monkeypatch.setattr(threads, "available_cores", lambda: 2)

    def loadavg():
        if average is None:
            raise OSError("no load average")
        return (average, average, average)

    monkeypatch.setattr(threads.os, "getloadavg", loadavg)
    assert threads.idle_cores() == expected
