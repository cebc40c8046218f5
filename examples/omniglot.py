"""Omniglot one-shot classification on the official benchmark, every recipe, on a CPU budget.

Meta-trains conv4 (64 filters) with each recipe on the union of Omniglot's two minimal
background splits (242 distinct characters; 90-degree rotations as extra classes), holding out
some characters, then evaluates:

(a) the 20 official within-alphabet 20-way one-shot runs (``all_runs.zip``): error % with a
    95% interval over the runs, beside the dataset's Modified Hausdorff Distance baseline,
    recomputed here from the same images;
(b) 600 seeded 5-way 1-shot and 600 20-way 1-shot episodes of the held-out characters.

    python examples/omniglot.py --data data/omniglot --download            # every recipe
    python examples/omniglot.py --recipes maml protonet --budget 120
    python examples/omniglot.py --data ../shared/data/omniglot --budget 20 --eval-episodes 50

MAML-family models get a 20-way head (the official runs are 20-way); on 5-way episodes they
are adapted and scored on its first 5 outputs (``fm.evaluate`` does this). Prototypical
Networks and R2D2 (a closed-form ridge-regression head) use the same conv4 without a head. ``--budget`` is the meta-training time of each
recipe in seconds; evaluation comes on top. Results go to ``--out`` (JSON) and a plot.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from _threads import add_threads_option, available_cores, use_threads

import funcmeta as fm

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None

RECIPES = ("maml", "fomaml", "metasgd", "anil", "reptile", "mamlpp", "imaml", "protonet", "r2d2")
EMBEDDINGS = ("protonet", "r2d2")  # no inner loop, no classifier layer
MHD_STATED = 0.388  # the dataset's own demo, demo_classification.py


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The union of the two minimal background splits, one class per distinct character
    (Greek and Latin are in both, drawing for drawing: they come once)."""
    splits = ["background_small1", "background_small2"]
    return fm.data.load_omniglot(args.data, splits, size=28, download=args.download)


def split_characters(
    images: torch.Tensor, labels: torch.Tensor, held_out: int, seed: int
) -> tuple[fm.data.Episodes, tuple[torch.Tensor, torch.Tensor]]:
    """Meta-training classes (each kept character in 4 rotations) and the held-out characters."""
    train, test = fm.data.split_classes(
        labels,
        [len(labels.unique()) - held_out, held_out],
        generator=torch.Generator().manual_seed(seed),
    )
    keep = torch.isin(labels, torch.tensor(train))
    x, y = images[keep], labels[keep]
    remap = {c: i for i, c in enumerate(train)}
    y = torch.tensor([remap[c] for c in y.tolist()])
    turns = [torch.rot90(x, k, dims=(2, 3)) for k in range(4)]
    x_rot, y_rot = torch.cat(turns), torch.cat([y + k * len(train) for k in range(4)])
    held = torch.isin(labels, torch.tensor(test))
    return (x_rot, y_rot), (images[held], labels[held])


class Recipe:
    """One recipe's model, learnable extras, outer optimizer, outer loss and evaluation."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        head = None if name in EMBEDDINGS else args.ways
        self.net = fm.models.conv4_omniglot(head, hidden=args.hidden)
        self.fmodel = fm.functional_model(self.net)
        params = self.fmodel.params
        self.rates = None
        if name == "metasgd":
            self.rates = fm.recipes.metasgd_rates(
                params, 0.1, 0.4, generator=torch.Generator().manual_seed(args.seed)
            )
        elif name == "mamlpp":
            self.rates = fm.hyper.per_layer(params, args.inner_lr, steps=args.steps)
        extra = list(self.rates.parameters()) if self.rates is not None else []
        # R2D2's ridge-regression head, with its learnable regulariser, scale and bias
        self.ridge = fm.heads.RidgeHead(lam=1.0, scale=5.0) if name == "r2d2" else None
        if self.ridge is not None:
            extra = list(self.ridge.parameters())
        if name == "reptile":  # theta += eps (phi - theta)
            self.outer = torch.optim.SGD(self.net.parameters(), lr=args.reptile_eps)
        else:
            self.outer = torch.optim.Adam([*self.net.parameters(), *extra], lr=args.meta_lr)
        own_steps = {
            "fomaml": args.fomaml_steps,
            "reptile": args.reptile_steps,
            "imaml": args.imaml_steps,
        }
        self.steps = own_steps.get(name, args.steps)
        self.residuals: list[float] = []
        self.curvature_stops = 0
        self.warnings = 0

    def inner_opt(self) -> fm.optim.GradientTransformation:
        sgd = fm.optim.sgd(lr=self.args.inner_lr if self.rates is None else self.rates)
        if self.name == "imaml":
            anchor = {k: v.detach() for k, v in self.fmodel.params.items()}
            return fm.optim.chain(fm.optim.add_proximal(self.args.imaml_lam, anchor), sgd)
        return sgd

    def loss(self, batch: fm.data.EpisodeBatch, progress: float) -> torch.Tensor:
        a, fmodel = self.args, self.fmodel
        args = (fmodel, self.fmodel.params, F.cross_entropy, batch.support, batch.query)
        if self.name == "protonet":
            return fm.recipes.protonet(*args).loss
        if self.name == "r2d2":
            return fm.recipes.r2d2(*args, head=self.ridge).loss
        own: dict = {"steps": self.steps}
        own["lr"] = a.inner_lr if self.rates is None else self.rates
        if self.name == "anil":
            own["trainable"] = "head"
        elif self.name == "imaml":
            own["lam"] = a.imaml_lam
        elif self.name == "mamlpp":
            epoch = int(10 * progress)  # ten "epochs" over the budget
            own["step_weights"] = fm.recipes.mamlpp_step_weights(a.steps, epoch, msl_epochs=3)
            own["first_order"] = epoch < 3  # derivative-order annealing
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", fm.recipes.ConvergenceWarning)
            out = getattr(fm.recipes, self.name)(*args, **own)
        self.warnings += len(caught)
        if out.residual is not None:
            self.residuals.append(out.residual.max().item())
            self.curvature_stops += int(out.curvature_stop.sum())
        return out.loss

    def evaluate(self, episodes: fm.data.Episodes | fm.data.EpisodeBatch, n: int) -> fm.Evaluation:
        fmodel = self.fmodel
        if self.name in EMBEDDINGS:
            return fm.evaluate(
                fmodel,
                fmodel.params,
                F.cross_entropy,
                episodes,
                method="prototypes" if self.ridge is None else self.ridge,
                num_episodes=n,
                seed=self.args.seed,
            )
        own = {"trainable": "head"} if self.name == "anil" else {}
        return fm.evaluate(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            episodes,
            self.inner_opt(),
            steps=self.steps,
            num_episodes=n,
            seed=self.args.seed,
            **own,
        )


def meta_train(recipe: Recipe, episodes: fm.data.Episodes, args: argparse.Namespace) -> dict:
    """Meta-train until the budget is spent (or ``--iterations``); returns the log."""
    rng = torch.Generator().manual_seed(args.seed)
    bar = None
    if tqdm is not None and not args.no_progress:
        bar = tqdm(total=round(args.budget), desc=recipe.name, unit="s", leave=False)
    start = last = time.perf_counter()
    losses, iteration = [], 0
    while iteration < args.iterations:
        elapsed = time.perf_counter() - start
        if elapsed >= args.budget:
            break
        batch = episodes.sample(args.meta_batch, generator=rng)
        loss = recipe.loss(batch, elapsed / args.budget)
        recipe.outer.zero_grad()
        loss.backward()
        recipe.outer.step()
        losses.append(loss.item())
        iteration += 1
        now = time.perf_counter()
        if bar is not None:
            bar.update(round(now - start) - bar.n)
            bar.set_postfix(it=iteration, loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        elif args.no_progress is False and now - last > 30:
            print(
                f"  {recipe.name}: {now - start:.0f} s, {iteration} iterations, loss {loss.item():.3f}"
            )
            last = now
    if bar is not None:
        bar.close()
    return {
        "iterations": iteration,
        "train_seconds": time.perf_counter() - start,
        "final_loss": sum(losses[-50:]) / max(len(losses[-50:]), 1),
    }


def modified_hausdorff_error(runs_root: Path) -> float:
    """The dataset's baseline on the official runs: nearest training image by the Modified
    Hausdorff Distance between inked pixels, each set of points centred on its mean."""
    runs = fm.data.load_omniglot_runs(runs_root, size=105)

    def points(image: torch.Tensor) -> torch.Tensor:
        p = (image[0] > 0.5).nonzero().double()
        return p - p.mean(0)

    errors = []
    for r in range(runs.x_support.shape[0]):
        train = [points(x) for x in runs.x_support[r]]
        wrong = 0
        for q, answer in zip(runs.x_query[r], runs.y_query[r].tolist(), strict=True):
            pq = points(q)
            cost = []
            for pt in train:
                d = torch.cdist(pq, pt)
                cost.append(max(d.min(1).values.mean().item(), d.min(0).values.mean().item()))
            wrong += int(min(range(len(cost)), key=cost.__getitem__) != answer)
        errors.append(wrong / len(runs.y_query[r]))
    return sum(errors) / len(errors)


def plot(results: dict, mhd: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[examples])")
        return
    names = list(results)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    err = [100 * results[n]["official_runs"]["error"] for n in names]
    ci = [100 * results[n]["official_runs"]["ci95"] for n in names]
    ax.bar(names, err, yerr=ci, capsize=3, color="tab:blue", alpha=0.8)
    ax.axhline(100 * mhd, color="tab:red", ls="--", label=f"MHD baseline ({100 * mhd:.1f}%)")
    ax.axhline(20, color="gray", ls=":", label="20% target")
    ax.set_ylabel("error on the 20 official runs (%)")
    ax.set_title("Omniglot one-shot, 20-way within alphabet (95% interval)")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data/omniglot"))
    p.add_argument("--download", action="store_true", help="fetch missing official files")
    p.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    p.add_argument("--budget", type=float, default=300, help="meta-training seconds per recipe")
    p.add_argument("--iterations", type=int, default=10**9, help="at most this many")
    p.add_argument("--hidden", type=int, default=64, help="conv4's filters per layer")
    p.add_argument("--ways", type=int, default=20, help="ways in meta-training episodes")
    p.add_argument("--query", type=int, default=1, help="query examples per class in training")
    p.add_argument("--meta-batch", type=int, default=4)
    p.add_argument(
        "--steps", type=int, default=1, help="inner steps, training and test (second order)"
    )
    p.add_argument("--fomaml-steps", type=int, default=5, help="FOMAML's inner steps")
    p.add_argument("--reptile-steps", type=int, default=5, help="Reptile's inner steps")
    p.add_argument("--imaml-steps", type=int, default=5, help="iMAML's proximal inner steps")
    p.add_argument("--inner-lr", type=float, default=0.4)
    p.add_argument("--meta-lr", type=float, default=1e-3)
    p.add_argument("--reptile-eps", type=float, default=1.0)
    p.add_argument("--imaml-lam", type=float, default=0.5)
    p.add_argument("--held-out", type=int, default=42, help="characters kept for evaluation (b)")
    p.add_argument("--eval-episodes", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("examples/out/omniglot.json"))
    p.add_argument("--plot", type=Path, default=Path("examples/out/omniglot.png"))
    p.add_argument("--no-progress", action="store_true")
    add_threads_option(
        p,
        available_cores(),
        "the cores available: convolutions on 28x28 images gain from every core",
    )
    args = p.parse_args(argv)
    use_threads(args)

    torch.manual_seed(args.seed)
    images, labels, names = load_data(args)
    (x_train, y_train), (x_held, y_held) = split_characters(
        images, labels, args.held_out, args.seed
    )
    train = fm.data.Episodes(x_train, y_train, ways=args.ways, shots=1, query=args.query)
    held5 = fm.data.Episodes(x_held, y_held, ways=5, shots=1, query=5)
    held20 = fm.data.Episodes(x_held, y_held, ways=20, shots=1, query=5)
    runs_root = args.data
    runs = fm.data.load_omniglot_runs(runs_root, download=args.download)
    mhd = modified_hausdorff_error(runs_root)
    print(
        f"{len(names)} characters: {len(names) - args.held_out} for meta-training "
        f"(x4 rotations: {len(y_train.unique())} classes), {args.held_out} held out; "
        f"MHD baseline on the official runs: {100 * mhd:.2f}% error (stated: {100 * MHD_STATED:.1f}%)"
    )
    results: dict = {}
    for name in args.recipes:
        torch.manual_seed(args.seed)
        recipe = Recipe(name, args)
        log = meta_train(recipe, train, args)
        start = time.perf_counter()
        official = recipe.evaluate(runs, 20)
        five = recipe.evaluate(held5, args.eval_episodes)
        twenty = recipe.evaluate(held20, args.eval_episodes)
        log["eval_seconds"] = time.perf_counter() - start
        log["inner_steps"] = 0 if name in EMBEDDINGS else recipe.steps
        log["official_runs"] = {"error": official.error, "ci95": official.ci95}
        log["5way_1shot"] = {"accuracy": five.accuracy, "ci95": five.ci95}
        log["20way_1shot"] = {"accuracy": twenty.accuracy, "ci95": twenty.ci95}
        if recipe.residuals:
            r = sorted(recipe.residuals)
            log["cg_residual"] = {"median": r[len(r) // 2], "max": r[-1]}
            log["convergence_warnings"] = recipe.warnings
            log["curvature_stops"] = recipe.curvature_stops
        results[name] = log
        print(
            f"{name:9s} {log['iterations']:5d} it in {log['train_seconds']:4.0f} s | official runs "
            f"error {100 * official.error:5.1f}% ± {100 * official.ci95:4.1f} | 5-way "
            f"{100 * five.accuracy:5.1f}% ± {100 * five.ci95:3.1f} | 20-way "
            f"{100 * twenty.accuracy:5.1f}% ± {100 * twenty.ci95:3.1f} | eval {log['eval_seconds']:.0f} s"
            + (f" | CG residual max {log['cg_residual']['max']:.1e}" if recipe.residuals else "")
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "mhd_error": mhd,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "recipes": results,
    }
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"results: {args.out}")
    plot(results, mhd, args.plot)
    if not all(math.isfinite(r["final_loss"]) for r in results.values()):
        raise SystemExit("a recipe's meta-training loss is not finite")
    return summary


if __name__ == "__main__":
    main()
