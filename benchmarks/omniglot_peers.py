"""MAML on Omniglot at equal wall-clock: funcmeta against higher, TorchOpt and learn2learn.

The same algorithm (second-order MAML, SGD in the inner loop), network (conv4, 64 filters,
BatchNorm on batch statistics), data, episodes, seeds, settings and budget of meta-training
seconds for each implementation; only the meta-iteration differs. funcmeta runs
``fm.recipes.maml`` (the tasks as one computation); the peers run their own MAML, a loop over
the tasks, from ``benchmarks/peers.py``. Every implementation is evaluated by the same code
(``fm.evaluate``) on the same seeded held-out episodes and the official runs, with a learning
curve on the way (``examples/omniglot.py`` does the training, curves and evaluation; its
options apply, ``--settings`` included).

    python benchmarks/omniglot_peers.py --data ../shared/data/omniglot --budget 240

A peer that does not import is reported and skipped (``pip install -e .[bench]``; learn2learn:
``bash benchmarks/build_learn2learn.sh``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import omniglot
import peers

PEER_NAMES = ("higher", "torchopt", "learn2learn")


class PeerMAML(omniglot.Recipe):
    """MAML with a peer library's meta-iteration; all else as funcmeta's MAML recipe."""

    def __init__(self, peer: str, args) -> None:
        super().__init__("maml", args)
        self.peer = peer
        self.name = f"maml/{peer}"
        self.implementation = peers.IMPLEMENTATIONS[peer]

    def loss(self, batch: fm.data.EpisodeBatch, progress: float) -> fm.recipes.RecipeResult:
        loss = self.implementation(
            self.net,
            None,
            batch.support,
            batch.query,
            F.cross_entropy,
            self.steps,
            lr=self.cfg["inner_lr"],
        )
        return fm.recipes.RecipeResult(loss, loss.detach(), None)


def main(argv: list[str] | None = None) -> dict:
    p = omniglot.parser()
    p.description = __doc__.splitlines()[0]
    p.add_argument(
        "--peers",
        nargs="+",
        choices=PEER_NAMES,
        default=[n for n in PEER_NAMES if n in peers.PEERS],
    )
    p.set_defaults(
        out=Path("benchmarks/out/omniglot_peers.json"),
        plot=Path("benchmarks/out/omniglot_peers.png"),
    )
    args = p.parse_args(argv)
    omniglot.use_threads(args)
    data = omniglot.prepare(args)
    results: dict = {}
    for peer in [None, *args.peers]:
        torch.manual_seed(args.seed)  # the same initial weights for every implementation
        recipe = omniglot.Recipe("maml", args) if peer is None else PeerMAML(peer, args)
        if peer is None:
            recipe.name = "maml/funcmeta"
        results[recipe.name] = omniglot.run_recipe(recipe, data, args)
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
