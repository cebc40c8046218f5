"""The peers' MAML, ANIL and Meta-SGD on Omniglot (benchmarks/peers/omniglot_peers.py) compute the
same meta-gradients as funcmeta's recipes, so that the comparison at equal time compares
implementations of one algorithm. Peers that are not installed are skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import load

import funcmeta as fm

omniglot_peers = load("peers/omniglot_peers.py")
omniglot = omniglot_peers.omniglot  # examples/omniglot.py, which it trains through
peers = omniglot_peers._peer_maml  # the peers' meta-iterations

# two inner steps at a small rate, a random head (no zeroing): every term of the meta-gradient
ARGS = ["--settings", "shared", "--steps", "2", "--inner-lr", "0.1", "--hidden", "8", "--ways", "5"]


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def batch() -> fm.data.EpisodeBatch:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(60, 1, 28, 28, generator=g)
    y = torch.arange(10).repeat_interleave(6)
    return fm.data.Episodes(x, y, ways=5, shots=1, query=2).sample(3, generator=g)


def meta_gradients(recipe: omniglot.Recipe, episodes: fm.data.EpisodeBatch) -> list[torch.Tensor]:
    tensors = [p for group in recipe.outer.param_groups for p in group["params"]]
    return list(torch.autograd.grad(recipe.loss(episodes, 0.0).loss, tensors))


@pytest.mark.parametrize(
    ("method", "peer"),
    [(m, p) for m in omniglot_peers.METHODS for p in omniglot_peers.peers_of(m)],
)
def test_peer_meta_gradients_match_funcmeta(float64, method: str, peer: str) -> None:
    if peer not in peers.PEERS:  # optional peers, not installed in CI
        how = (
            "bash benchmarks/peers/build_learn2learn.sh"
            if peer == "learn2learn"
            else "pip install -e '.[bench]'"
        )
        pytest.skip(f"{peer} is not installed: {how}")
    args = omniglot.parser().parse_args(ARGS)
    episodes = batch()
    torch.manual_seed(0)
    ours = omniglot.Recipe(method, args)
    torch.manual_seed(0)
    theirs = omniglot_peers.PeerRecipe(method, peer, args)
    assert all(p.dtype == torch.float64 for p in theirs.net.parameters())
    expected, got = meta_gradients(ours, episodes), meta_gradients(theirs, episodes)
    assert len(expected) == len(got) > 0
    for a, b in zip(got, expected, strict=True):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_peer_without_the_method_is_refused() -> None:
    args = omniglot.parser().parse_args(ARGS)
    with pytest.raises(ValueError, match="one scalar rate"):
        omniglot_peers.PeerRecipe("metasgd", "torchopt", args)
    with pytest.raises(ValueError, match="method 'reptile'"):
        omniglot_peers.PeerRecipe("reptile", "higher", args)
    with pytest.raises(SystemExit):
        omniglot_peers.main(["--method", "metasgd", "--peers", "torchopt"])


def test_training_in_turn_changes_nothing_but_the_order(float64) -> None:
    """Implementations trained in turn, one iteration each, learn what each learns alone:
    the same episodes, the same steps, the same curve (float64: funcmeta's task chunk, chosen
    by timing, may differ between the runs, and with it the rounding)."""
    args = omniglot.parser().parse_args(
        [*ARGS, "--iterations", "3", "--curve-every", "0", "--curve-episodes", "2"]
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(120, 1, 28, 28, generator=g), torch.arange(20).repeat_interleave(6)
    held = fm.data.Episodes(x[:60], y[:60], ways=5, shots=1, query=1)
    data = {"train": (x, y), "held5": held, "held20": held}

    def recipes(n: int) -> list[omniglot.Recipe]:
        out = []
        for _ in range(n):
            torch.manual_seed(0)
            out.append(omniglot.Recipe("maml", args))
        return out

    alone = recipes(1)[0]
    log = omniglot.meta_train(
        alone, omniglot.training_episodes(alone, x, y), args, omniglot.curve_sets(data, args)
    )
    together = recipes(2)
    logs = omniglot_peers.train_in_turn(together, data, args)
    for r, other in zip(together, logs, strict=True):
        assert other["iterations"] == log["iterations"] == 3
        assert [c["5-way"] for c in other["curve"]] == [c["5-way"] for c in log["curve"]]
        for a, b in zip(r.net.parameters(), alone.net.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_time_steps_times_each_implementation_in_turn(float64) -> None:
    """--time-steps: every implementation steps as many times, and gets a median of the
    iterations after the skipped ones; fewer steps than skipped ones is refused."""
    args = omniglot.parser().parse_args(ARGS)
    args.time_steps, args.time_skip = 4, 1
    g = torch.Generator().manual_seed(2)
    data = {
        "train": (torch.rand(60, 1, 28, 28, generator=g), torch.arange(10).repeat_interleave(6))
    }
    recipes = []
    for peer in [None, *[n for n in omniglot_peers.PEER_NAMES if n in peers.PEERS][:1]]:
        torch.manual_seed(0)
        recipes.append(
            omniglot.Recipe("maml", args)
            if peer is None
            else omniglot_peers.PeerRecipe("maml", peer, args)
        )
    medians = omniglot_peers.time_steps(recipes, data, args)
    assert list(medians) == [r.name for r in recipes]
    assert all(0 < sec < 60 for sec in medians.values())
    for r in recipes:  # each took its 4 steps: its weights moved
        assert r.outer.state and all(v["step"] == 4 for v in r.outer.state.values())
    with pytest.raises(SystemExit):
        omniglot_peers.main(["--time-steps", "3", "--time-skip", "5"])


def results_file(
    path: Path, seed: int, values: dict, mhd: float = 0.3875, budget: str = "240"
) -> Path:
    """A results file as ``omniglot.save_results`` writes it: ``values`` maps an
    implementation to (iterations, runs error, 5-way accuracy, 20-way accuracy)."""
    recipes = {
        name: {
            "iterations": it,
            "official_runs": {"error": err, "ci95": 0.05},
            "5way_1shot": {"accuracy": five, "ci95": 0.01},
            "20way_1shot": {"accuracy": twenty, "ci95": 0.01},
        }
        for name, (it, err, five, twenty) in values.items()
    }
    path.write_text(
        json.dumps(
            {
                "mhd_error": mhd,
                "settings": {"seed": str(seed), "budget": budget, "out": str(path)},
                "recipes": recipes,
            }
        )
    )
    return path


def test_summarize_gives_means_and_paired_differences(tmp_path) -> None:
    """``--summarize``: mean and sd per implementation over runs with other seeds, and
    funcmeta's paired difference to each peer, computed by hand here."""
    a = results_file(
        tmp_path / "a.json",
        1,
        {"maml/funcmeta": (100, 0.20, 0.94, 0.80), "maml/higher": (90, 0.25, 0.95, 0.78)},
    )
    b = results_file(
        tmp_path / "b.json",
        2,
        {"maml/funcmeta": (110, 0.30, 0.92, 0.82), "maml/higher": (100, 0.25, 0.93, 0.80)},
    )
    out = tmp_path / "summary.json"
    summary = omniglot_peers.main(["--summarize", str(a), str(b), "--out", str(out)])
    ours = summary["table"]["maml/funcmeta"]
    assert ours["iterations"]["mean"] == pytest.approx(105)
    assert ours["iterations"]["sd"] == pytest.approx(50**0.5)  # sample sd of 100 and 110
    assert ours["official runs error %"]["values"] == pytest.approx([20, 30])
    paired = summary["paired"]["maml/higher"]
    assert paired["official runs error %"]["values"] == pytest.approx([-5, 5])
    assert paired["official runs error %"]["funcmeta_at_least_as_good"] == 1  # lower is better
    assert paired["held-out 5-way %"]["mean"] == pytest.approx(-1)
    assert paired["held-out 5-way %"]["funcmeta_at_least_as_good"] == 0
    assert paired["held-out 20-way %"]["funcmeta_at_least_as_good"] == 2
    assert paired["iterations"]["funcmeta_at_least_as_good"] == 2
    assert json.loads(out.read_text())["seeds"] == ["1", "2"]


def test_summarize_refuses_runs_that_do_not_pair(tmp_path) -> None:
    impls = {"maml/funcmeta": (100, 0.2, 0.9, 0.8), "maml/higher": (90, 0.2, 0.9, 0.8)}
    a = results_file(tmp_path / "a.json", 1, impls)
    cases = {
        "seed 1, as": results_file(tmp_path / "same_seed.json", 1, impls),
        "implementations": results_file(
            tmp_path / "other.json", 2, {"maml/funcmeta": impls["maml/funcmeta"]}
        ),
        "another dataset": results_file(tmp_path / "data.json", 3, impls, mhd=0.5),
        "cannot read it": tmp_path / "missing.json",
        r"settings differ from the first file's in \['budget'\]": results_file(
            tmp_path / "longer.json", 5, impls, budget="1200"
        ),
    }
    bare = results_file(tmp_path / "bare.json", 6, impls)
    bare.write_text(
        json.dumps({k: v for k, v in json.loads(bare.read_text()).items() if k != "settings"})
    )
    cases["has no settings"] = bare
    for message, path in cases.items():
        with pytest.raises(SystemExit, match=message):
            omniglot_peers.main(["--summarize", str(a), str(path)])
    no_ours = results_file(tmp_path / "peers_only.json", 4, {"maml/higher": impls["maml/higher"]})
    with pytest.raises(SystemExit, match="one funcmeta implementation"):
        omniglot_peers.main(["--summarize", str(no_ours)])
