"""MAML, ANIL and Meta-SGD on Omniglot at equal wall-clock: funcmeta against higher, TorchOpt
and learn2learn.

The same algorithm (second order, SGD in the inner loop), network (conv4, 64 filters,
BatchNorm on batch statistics), data, episodes, seeds, settings and budget of meta-training
seconds for each implementation; only the meta-iteration differs. funcmeta runs its recipe
(``fm.recipes.maml``, ``anil`` or ``metasgd``: the tasks as one computation); each peer runs
the method as its users write it, a loop over the tasks: MAML and Meta-SGD from
``_peer_maml.py`` beside this script (higher with a per-tensor rate override, learn2learn's ``MetaSGD``;
TorchOpt's ``MetaSGD`` optimizer takes one scalar rate, so it has no Meta-SGD), ANIL below
(the body's features computed once per task, the head adapted by the peer). Every
implementation trains in turn with the others, one meta-iteration each, on its own clock
(``train_in_turn``), so that all meet the same conditions of the machine. Every
implementation is evaluated by the same code (``fm.evaluate``) on the same seeded held-out
episodes and the official runs, with a learning curve on the way (``examples/omniglot.py``
does the training, curves and evaluation; its options apply, ``--settings`` included).

    python benchmarks/peers/omniglot_peers.py --data ../shared/data/omniglot --budget 240
    python benchmarks/peers/omniglot_peers.py --data ../shared/data/omniglot --method anil

Runs with other ``--seed`` values (other initial weights and training episodes) are summed
up with ``--summarize``: per implementation the mean and standard deviation over the runs,
and per peer funcmeta's paired difference (its result minus the peer's in the same run):

    python benchmarks/peers/omniglot_peers.py --summarize run1.json run2.json run3.json

``--time-steps N`` only times the meta-iterations, N of each implementation in turn (no
budget, curves or evaluation):

    python benchmarks/peers/omniglot_peers.py --data ../shared/data/omniglot --time-steps 60

A peer that does not import is reported and skipped (``pip install -e .[bench]``; learn2learn:
``bash benchmarks/peers/build_learn2learn.sh``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common
import _peer_maml  # beside this script

_common.examples_importable()
import omniglot  # noqa: E402  (examples/omniglot.py, the shared Omniglot example module)

PEER_NAMES = ("higher", "torchopt", "learn2learn")
METHODS = ("maml", "anil", "metasgd")


def features(net: nn.Module, x: Tensor) -> Tensor:
    """conv4's body: everything but the head (``fm.models`` names the parts)."""
    return net.flatten(net.features(x))


def anil_higher(net, support, query, steps: int, lr: float) -> Tensor:
    """ANIL with higher: ``innerloop_ctx`` over the head, on the body's features."""
    higher = _peer_maml.PEERS["higher"]
    opt = torch.optim.SGD(net.head.parameters(), lr=lr)
    losses = []
    for t in range(support[0].shape[0]):
        fs, fq = features(net, support[0][t]), features(net, query[0][t])
        with higher.innerloop_ctx(net.head, opt, copy_initial_weights=False) as (head, diffopt):
            for _ in range(steps):
                diffopt.step(F.cross_entropy(head(fs), support[1][t]))
            losses.append(F.cross_entropy(head(fq), query[1][t]))
    return torch.stack(losses).mean()


def anil_torchopt(net, support, query, steps: int, lr: float) -> Tensor:
    """ANIL with TorchOpt: ``MetaSGD`` on the head, its state recovered after each task."""
    torchopt = _peer_maml.PEERS["torchopt"]
    state = torchopt.extract_state_dict(net.head)
    losses = []
    for t in range(support[0].shape[0]):
        fs, fq = features(net, support[0][t]), features(net, query[0][t])
        inner = torchopt.MetaSGD(net.head, lr=lr)
        for _ in range(steps):
            inner.step(F.cross_entropy(net.head(fs), support[1][t]))
        losses.append(F.cross_entropy(net.head(fq), query[1][t]))
        torchopt.recover_state_dict(net.head, state)
    return torch.stack(losses).mean()


def anil_learn2learn(net, support, query, steps: int, lr: float) -> Tensor:
    """ANIL as learn2learn's own ANIL example writes it: ``MAML`` around the head alone."""
    head = _peer_maml.PEERS["learn2learn"].algorithms.MAML(net.head, lr=lr, first_order=False)
    losses = []
    for t in range(support[0].shape[0]):
        fs, fq = features(net, support[0][t]), features(net, query[0][t])
        learner = head.clone()
        for _ in range(steps):
            learner.adapt(F.cross_entropy(learner(fs), support[1][t]))
        losses.append(F.cross_entropy(learner(fq), query[1][t]))
    return torch.stack(losses).mean()


ANIL: dict[str, Callable[..., Tensor]] = {
    "higher": anil_higher,
    "torchopt": anil_torchopt,
    "learn2learn": anil_learn2learn,
}


def peers_of(method: str) -> tuple[str, ...]:
    """The peers that have ``method``: Meta-SGD needs a rate per element."""
    if method == "metasgd":
        return tuple(n for n in PEER_NAMES if n not in _peer_maml.NO_PER_ELEMENT_RATES)
    return PEER_NAMES


class PeerRecipe(omniglot.Recipe):
    """``method`` with a peer library's meta-iteration; all else as funcmeta's recipe (the
    same settings, head zeroing, outer optimizer over the same tensors, evaluation)."""

    def __init__(self, method: str, peer: str, args) -> None:
        if method not in METHODS:
            raise ValueError(f"method {method!r}: one of {METHODS}")
        if peer not in peers_of(method):
            raise ValueError(
                f"{peer} has no {method}: its MetaSGD optimizer takes one scalar rate, "
                "Meta-SGD learns one per element"
            )
        super().__init__(method, args)
        self.peer = peer
        self.name = f"{method}/{peer}"

    def loss(self, batch: fm.data.EpisodeBatch, progress: float) -> fm.recipes.RecipeResult:
        lr = self.cfg.get("inner_lr")
        if self.method == "anil":
            loss = ANIL[self.peer](self.net, batch.support, batch.query, self.steps, lr)
        else:  # MAML, or Meta-SGD with the rates the outer optimizer trains
            rates = None if self.rates is None else self.rates()
            loss = _peer_maml.IMPLEMENTATIONS[self.peer](
                self.net, rates, batch.support, batch.query, F.cross_entropy, self.steps, lr=lr
            )
        return fm.recipes.RecipeResult(loss, loss.detach(), None)


def train_in_turn(recipes: list[omniglot.Recipe], data: dict, args) -> list[dict]:
    """Meta-train the implementations in turn, one meta-iteration each, each on its own
    clock until its budget is spent: a machine that slows down or speeds up meanwhile does so
    for all of them alike (one after the other, the last would meet other conditions than
    the first)."""
    trainers = [
        omniglot.Trainer(
            r,
            omniglot.training_episodes(r, *data["train"]),
            args,
            omniglot.curve_sets(data, args),
            progress=False,
        )
        for r in recipes
    ]
    last_print = time.perf_counter()
    while not all(t.done for t in trainers):
        for t in trainers:
            if not t.done:
                t.step()
        if not args.no_progress and time.perf_counter() - last_print > 30:
            print("  " + ", ".join(f"{t.recipe.name} {t.iteration} it" for t in trainers))
            last_print = time.perf_counter()
    return [t.finish() for t in trainers]


def time_steps(recipes: list[omniglot.Recipe], data: dict, args) -> dict[str, float]:
    """Each implementation's median seconds per meta-iteration over ``args.time_steps``
    iterations, taken in turn (one of each, then again) from the same start, the first
    ``args.time_skip`` of each left out (warm-up, funcmeta's choice of chunk)."""
    trainers = [
        omniglot.Trainer(
            r, omniglot.training_episodes(r, *data["train"]), args, None, progress=False
        )
        for r in recipes
    ]
    seconds: list[list[float]] = [[] for _ in trainers]
    for _ in range(args.time_steps):
        for t, times in zip(trainers, seconds, strict=True):
            start = time.perf_counter()
            t.step()
            times.append(time.perf_counter() - start)
    return {
        r.name: statistics.median(times[args.time_skip :])
        for r, times in zip(recipes, seconds, strict=True)
    }


MEASURES = {
    "iterations": lambda r: float(r["iterations"]),
    "official runs error %": lambda r: 100 * r["official_runs"]["error"],
    "held-out 5-way %": lambda r: 100 * r["5way_1shot"]["accuracy"],
    "held-out 20-way %": lambda r: 100 * r["20way_1shot"]["accuracy"],
}


# where runs to be summed up may differ: the seed, and where the results went
UNPAIRED_SETTINGS = frozenset({"seed", "out", "plot", "data", "no_progress", "summarize"})


def summarize(paths: list[Path]) -> dict:
    """Runs of the same implementations with other seeds, summed up: per implementation and
    measure the values, their mean and standard deviation; per peer and measure, funcmeta's
    paired differences (funcmeta minus the peer, run by run) with their mean and the number of
    runs in which funcmeta was at least as good. The files must hold the same implementations
    of one method, on the same data, from runs with distinct seeds."""
    summaries = omniglot.read_results(paths, "--summarize")
    names = list(summaries[0]["recipes"])
    seeds: dict[str, Path] = {}
    first: dict = {}
    for path, summary in zip(paths, summaries, strict=True):
        settings = summary.get("settings")
        if not isinstance(settings, dict):
            raise SystemExit(f"--summarize {path}: it has no settings")
        if list(summary["recipes"]) != names:
            raise SystemExit(
                f"--summarize {path}: implementations {list(summary['recipes'])}, the first "
                f"file has {names}"
            )
        seed = str(settings.get("seed"))
        if seed in seeds:
            raise SystemExit(f"--summarize {path}: seed {seed}, as {seeds[seed]}")
        seeds[seed] = path
        # runs that differ in anything but the seed (budget, threads, settings) do not pair
        same = {k: v for k, v in settings.items() if k not in UNPAIRED_SETTINGS}
        differ = sorted(k for k in same.keys() | first.keys() if same.get(k) != first.get(k))
        if first and differ:
            raise SystemExit(
                f"--summarize {path}: settings differ from the first file's in {differ}"
            )
        first = first or same
    ours = [n for n in names if n.endswith("/funcmeta")]
    if len(ours) != 1:
        raise SystemExit(f"--summarize: one funcmeta implementation expected, found {ours}")

    def stats(values: list[float]) -> dict:
        mean = sum(values) / len(values)
        sd = (
            (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if values[1:] else 0.0
        )
        return {"values": values, "mean": mean, "sd": sd}

    table = {
        n: {m: stats([f(s["recipes"][n]) for s in summaries]) for m, f in MEASURES.items()}
        for n in names
    }
    lower_is_better = {"official runs error %"}
    paired = {}
    for peer in (n for n in names if n not in ours):
        paired[peer] = {}
        for m in MEASURES:
            diffs = [
                a - b
                for a, b in zip(table[ours[0]][m]["values"], table[peer][m]["values"], strict=True)
            ]
            at_least = sum((d <= 0) if m in lower_is_better else (d >= 0) for d in diffs)
            paired[peer][m] = {**stats(diffs), "funcmeta_at_least_as_good": at_least}
    return {"runs": [str(p) for p in paths], "seeds": list(seeds), "table": table, "paired": paired}


def print_summary(summary: dict) -> None:
    runs = len(summary["runs"])
    print(f"mean ± sd over {runs} runs (seeds {', '.join(summary['seeds'])})")
    print("implementation | " + " | ".join(MEASURES))
    for name, row in summary["table"].items():
        cells = [f"{c['mean']:.1f} ± {c['sd']:.1f}" for c in row.values()]
        print(f"{name} | " + " | ".join(cells))
    print(
        f"funcmeta minus the peer, run by run: mean ± sd (runs where funcmeta is at least as good, of {runs})"
    )
    for peer, row in summary["paired"].items():
        cells = [
            f"{c['mean']:+.1f} ± {c['sd']:.1f} ({c['funcmeta_at_least_as_good']})"
            for c in row.values()
        ]
        print(f"{peer} | " + " | ".join(cells))


def main(argv: list[str] | None = None) -> dict:
    p = omniglot.parser()
    p.description = __doc__.splitlines()[0]
    p.add_argument("--method", choices=METHODS, default="maml")
    p.add_argument(
        "--peers",
        nargs="+",
        choices=PEER_NAMES,
        default=None,
        help="default: every installed peer that has the method",
    )
    p.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="no training: the results of runs with other seeds (their --out files), summed up "
        "(written to --out when given)",
    )
    p.add_argument(
        "--time-steps",
        type=int,
        default=0,
        metavar="N",
        help="no budget, curves or evaluation: N meta-iterations of each implementation in "
        "turn, and each one's median seconds per iteration",
    )
    p.add_argument(
        "--time-skip", type=int, default=10, help="with --time-steps: the first ones left out"
    )
    args = p.parse_args(argv)
    if args.time_steps and args.time_steps <= args.time_skip:
        p.error("--time-steps must exceed --time-skip")
    if args.summarize:
        summary = summarize(args.summarize)
        print_summary(summary)
        if args.out != p.get_default("out"):
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=1))
        return summary
    installed = [n for n in peers_of(args.method) if n in _peer_maml.PEERS]
    if args.peers is None:
        args.peers = installed
    for name in args.peers:
        if name not in peers_of(args.method):
            p.error(f"{name} has no {args.method} (Meta-SGD needs a rate per element)")
        if name not in _peer_maml.PEERS:
            p.error(f"{name} is not installed (pip install -e .[bench])")
    suffix = "" if args.method == "maml" else f"_{args.method}"
    if args.out == p.get_default("out"):
        args.out = Path(f"benchmarks/out/omniglot_peers{suffix}.json")
    if args.plot == p.get_default("plot"):
        args.plot = Path(f"benchmarks/out/omniglot_peers{suffix}.png")
    omniglot.use_threads(args)
    data = omniglot.prepare(args)
    recipes = []
    for peer in [None, *args.peers]:
        torch.manual_seed(args.seed)  # the same initial weights for every implementation
        if peer is None:
            recipe = omniglot.Recipe(args.method, args)
            recipe.name = f"{args.method}/funcmeta"
        else:
            recipe = PeerRecipe(args.method, peer, args)
        recipes.append(recipe)
    if args.time_steps:
        medians = time_steps(recipes, data, args)
        ours = medians[recipes[0].name]
        print("\nimplementation | ms per meta-iteration (median) | funcmeta's time / its time")
        for name, sec in medians.items():
            print(f"{name} | {1e3 * sec:.1f} | {ours / sec:.3f}")
        return {"seconds_per_iteration": medians}
    logs = train_in_turn(recipes, data, args)
    results = {
        r.name: omniglot.evaluate_recipe(r, log, data, args)
        for r, log in zip(recipes, logs, strict=True)
    }
    summary = omniglot.save_results(results, data, args)
    print("\nimplementation | iterations | official runs error % | held-out 5-way % | 20-way %")
    for name, r in results.items():
        print(
            f"{name} | {r['iterations']} | {100 * r['official_runs']['error']:.1f} | "
            f"{100 * r['5way_1shot']['accuracy']:.1f} | {100 * r['20way_1shot']['accuracy']:.1f}"
        )
    return summary


if __name__ == "__main__":
    main()
