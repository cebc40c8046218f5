"""Few-shot image classification with the conv4 network and any recipe.

Images: scikit-learn's bundled handwritten digits (8x8, upsampled to 28x28), with each digit
rotated by 0, 90, 180 and 270 degrees as four classes (the Omniglot augmentation): 40
classes, 6 digits (24 classes) for meta-training and the other 4 (16 classes) for
meta-testing, every rotation of a digit on one side. Point ``--omniglot`` at a folder with
Omniglot to use that instead (with rotations as more classes in meta-training): the official
``images_background`` and ``images_evaluation`` splits (background characters meta-train,
evaluation ones test), or else the two minimal background splits, 200 of their 242
characters for meta-training and 42 held out, split by character. ``--download`` fetches
the minimal splits (the full ones have no published checksum); without it nothing is
downloaded, and a folder without either pair stops the run with a message that names the
files and where they are published.

    python examples/fewshot.py --recipe maml                 # 5-way 1-shot, second order
    python examples/fewshot.py --recipe metasgd --shots 5
    python examples/fewshot.py --recipe imaml --omniglot ~/data/omniglot --channels 64
    python examples/fewshot.py --recipe maml --iterations 100
    python examples/fewshot.py --omniglot data/omniglot --download --iterations 100

Running time, measured on this project's 2-core AMD EPYC shared with other jobs (2026-11-26;
load average about 5: an idle machine is faster): ``--recipe maml --iterations 100`` took
670 s, and ``--omniglot ../shared/data/omniglot --iterations 100`` (the minimal splits) 409 s,
each with its 300 test episodes before and after; the default 600 iterations of MAML on the
digits took 219 s on 2 idle AMD EPYC cores (2026-11-21, benchmarks/RESULTS.md).

Recipes: maml, fomaml, metasgd, anil, reptile, mamlpp, imaml. The script prints the
meta-test accuracy (mean and 95% interval over episodes) and saves the training curve.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _threads import add_threads_option, available_cores, use_threads
from torch import nn

import funcmeta as fm

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None

RECIPES = ("maml", "fomaml", "metasgd", "anil", "reptile", "mamlpp", "imaml")


def conv4(ways: int, channels: int) -> nn.Module:
    """4 x (conv3x3, BatchNorm, ReLU, max-pool 2) and a linear head, for 1x28x28 inputs."""

    def block(cin: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )

    blocks = [block(1), block(channels), block(channels), block(channels)]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(channels, ways))


def digits_with_rotations() -> tuple[torch.Tensor, fm.data.ClassLabels]:
    """scikit-learn's digits as (N, 1, 28, 28) in [0, 1]; 40 classes (10 digits x 4 turns),
    class ``digit + 10 * turn``, the labels carrying each class's digit as its group."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise SystemExit("the digits need scikit-learn: pip install -e .[examples]") from e
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    images = F.interpolate(images, size=28, mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target)
    turns = [torch.rot90(images, k, dims=(2, 3)) for k in range(4)]
    rotated = torch.cat([labels + 10 * k for k in range(4)])
    return torch.cat(turns), fm.data.ClassLabels(rotated, [c % 10 for c in range(40)])


FULL = ["background", "evaluation"]  # background characters train, evaluation ones test
MINIMAL = ["background_small1", "background_small2"]  # 242 characters, --download fetches
HELD_OUT = 42  # characters of the minimal splits held out for meta-testing


def no_omniglot(
    folder: Path, full: dict[str, str], minimal: dict[str, str], why: str, downloading: bool
) -> str:
    """The message of a run without Omniglot in ``--omniglot``: either pair of files."""

    def files(missing: dict[str, str]) -> str:
        return "\n".join(f"  {name}  ({address})" for name, address in missing.items())

    by_hand = (
        f"download either pair yourself into {folder} (the zip archives as published, or unpacked)."
    )
    how = (
        by_hand[0].upper() + by_hand[1:]
        if downloading
        else "Rerun with --download to fetch the minimal splits there (each checked against "
        f"its sha256), or {by_hand}"
    )
    return (
        f"{why}\n--omniglot reads from {folder} either the full background and evaluation "
        f"splits (background characters meta-train, evaluation ones test), missing:\n"
        f"{files(full)}\nor the two minimal background splits ({HELD_OUT} of their 242 "
        f"characters held out for testing), missing:\n{files(minimal)}\n{how}"
    )


def omniglot(args: argparse.Namespace) -> tuple[fm.data.Episodes, fm.data.Episodes]:
    """Omniglot from ``--omniglot``, with the three rotations of each character as more
    classes in meta-training: the full splits if the folder has them, else the minimal
    splits (fetched with ``--download``), split by character."""
    kwargs = dict(ways=args.ways, shots=args.shots, query=args.query)
    full = fm.data.missing_omniglot_files(args.omniglot, FULL)
    if not full:
        train_x, train_y, _ = fm.data.load_omniglot(args.omniglot, "background", rotations=True)
        test_x, test_y, _ = fm.data.load_omniglot(args.omniglot, "evaluation")
        return fm.data.Episodes(train_x, train_y, **kwargs), fm.data.Episodes(
            test_x, test_y, **kwargs
        )
    minimal = fm.data.missing_omniglot_files(args.omniglot, MINIMAL)
    if minimal and not args.download:
        why = f"no Omniglot data in {args.omniglot}."
        raise SystemExit(no_omniglot(args.omniglot, full, minimal, why, False))
    try:
        images, labels, _ = fm.data.load_omniglot(
            args.omniglot, MINIMAL, rotations=True, download=args.download
        )
    except OSError as e:  # a download that failed (the network, a timeout)
        raise SystemExit(no_omniglot(args.omniglot, full, minimal, str(e), True)) from None
    # the labels carry each class's character: its four rotations stay on one side
    characters = len(set(labels.groups))
    train, test = fm.data.split_classes(
        labels,
        [4 * (characters - HELD_OUT), 4 * HELD_OUT],
        generator=torch.Generator().manual_seed(0),
    )
    return (
        fm.data.Episodes(images, labels, classes=train, **kwargs),
        fm.data.Episodes(images, labels, classes=test, **kwargs),
    )


def datasets(args: argparse.Namespace) -> tuple[fm.data.Episodes, fm.data.Episodes]:
    if args.omniglot:
        return omniglot(args)
    kwargs = dict(ways=args.ways, shots=args.shots, query=args.query)
    images, labels = digits_with_rotations()
    # 6 digits (24 classes) meta-train, the other 4 (16) test: the labels carry each
    # class's digit, so no test class is a rotation of a digit trained on
    train, test = fm.data.split_classes(
        labels, [24, 16], generator=torch.Generator().manual_seed(0)
    )
    return (
        fm.data.Episodes(images, labels, classes=train, **kwargs),
        fm.data.Episodes(images, labels, classes=test, **kwargs),
    )


class Method:
    """One recipe: its learnable extras, its outer loss and its inner optimizer."""

    def __init__(self, name: str, fmodel: fm.FunctionalModel, args: argparse.Namespace) -> None:
        self.name, self.fmodel, self.args = name, fmodel, args
        self.extra: list[torch.Tensor] = []
        self.rates = None
        if name == "metasgd":
            self.rates = fm.recipes.metasgd_rates(
                fmodel.params, 0.1, 0.4, generator=torch.Generator().manual_seed(args.seed)
            )
        elif name == "mamlpp":
            self.rates = fm.hyper.per_layer(fmodel.params, args.inner_lr, steps=args.steps)
        if self.rates is not None:
            self.extra = list(self.rates.parameters())
        self.step_buffers = None

    def outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if self.name == "reptile":  # Reptile's interpolation step theta += eps (phi - theta)
            return torch.optim.SGD(params, lr=self.args.reptile_eps)
        return torch.optim.Adam(params, lr=self.args.meta_lr)

    def loss(self, support: tuple, query: tuple, iteration: int) -> torch.Tensor:
        """The recipe's outer loss: every recipe takes the same arguments, plus its own."""
        a, fmodel = self.args, self.fmodel
        own: dict = {"lr": a.inner_lr if self.rates is None else self.rates}
        if self.name == "anil":
            own["trainable"] = str(len(fmodel.module) - 1)  # the head
        elif self.name == "imaml":
            own["lam"] = a.imaml_lam
        elif self.name == "mamlpp":
            epoch = 10 * iteration // max(a.iterations, 1)  # ten "epochs" over the run
            own["step_weights"] = fm.recipes.mamlpp_step_weights(a.steps, epoch, msl_epochs=3)
            own["step_buffers"] = self.step_buffers
            own["first_order"] = epoch < 3  # derivative-order annealing
        recipe = getattr(fm.recipes, self.name)
        out = recipe(fmodel, fmodel.params, F.cross_entropy, support, query, steps=a.steps, **own)
        if self.name == "mamlpp":
            self.step_buffers = out.step_buffers
        return out.loss

    def inner_optimizer(self) -> fm.optim.GradientTransformation:
        if self.rates is not None:
            return fm.optim.sgd(lr=self.rates)
        sgd = fm.optim.sgd(lr=self.args.inner_lr)
        if self.name == "imaml":
            anchor = {k: v.detach() for k, v in self.fmodel.params.items()}
            return fm.optim.chain(fm.optim.add_proximal(self.args.imaml_lam, anchor), sgd)
        return sgd

    def accuracy(self, batch: fm.data.EpisodeBatch, steps: int) -> list[float]:
        """Per-episode query accuracy after ``steps`` inner steps."""
        fmodel = self.fmodel
        trainable = str(len(fmodel.module) - 1) if self.name == "anil" else None
        with torch.no_grad():
            result = fm.adapt_tasks(
                fmodel,
                fmodel.params,
                F.cross_entropy,
                (batch.x_support, batch.y_support),
                self.inner_optimizer(),
                steps=steps,
                trainable=trainable,
            )
            out, _ = fm.apply_tasks(
                fmodel,
                result.params,
                batch.x_query,
                buffers=result.buffers,
                task_chunk=result.chunk,  # the query pass on the inner loop's chunk
            )
        return (out.argmax(-1) == batch.y_query).float().mean(-1).tolist()


def mean_ci(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, 1.96 * math.sqrt(var / n)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Few-shot classification with conv4.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--recipe", choices=RECIPES, default="maml", help="the recipe to meta-train")
    p.add_argument("--ways", type=int, default=5, help="classes per episode (N-way)")
    p.add_argument("--shots", type=int, default=1, help="support examples per class (K-shot)")
    p.add_argument("--query", type=int, default=5, help="query examples per class")
    p.add_argument("--steps", type=int, default=5, help="inner steps in training and test")
    p.add_argument("--inner-lr", type=float, default=0.4, help="inner SGD step size")
    p.add_argument("--meta-lr", type=float, default=1e-3, help="outer Adam step size")
    p.add_argument(
        "--reptile-eps", type=float, default=0.5, help="Reptile's outer step (SGD on theta - phi)"
    )
    p.add_argument("--imaml-lam", type=float, default=2.0, help="iMAML's proximal weight lambda")
    p.add_argument("--meta-batch", type=int, default=8, help="tasks per meta-iteration")
    p.add_argument("--iterations", type=int, default=600, help="meta-iterations")
    p.add_argument("--channels", type=int, default=32, help="conv4's filters per layer")
    p.add_argument(
        "--eval-episodes", type=int, default=300, help="meta-test episodes before and after"
    )
    p.add_argument(
        "--omniglot",
        type=Path,
        default=None,
        help="Omniglot instead of the digits: a folder with the official images_background "
        "and images_evaluation splits, or the two minimal background splits "
        "(images_background_small1.zip, images_background_small2.zip)",
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="with --omniglot: fetch the minimal background splits into it from the dataset's "
        f"repository ({fm.data.OMNIGLOT_URL}), each checked against its sha256",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the episodes")
    p.add_argument(
        "--plot",
        type=Path,
        default=Path("examples/out/fewshot.png"),
        help="plot of the meta-test accuracy during training",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none when stderr is not a terminal)",
    )
    add_threads_option(
        p,
        available_cores(),
        "the cores available: convolutions on 28x28 images gain from every core",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = parser()
    args = p.parse_args(argv)
    if args.download and args.omniglot is None:
        p.error("--download fetches Omniglot into the folder --omniglot names; give it")
    use_threads(args)

    torch.manual_seed(args.seed)
    train_episodes, test_episodes = datasets(args)
    net = conv4(args.ways, args.channels)
    fmodel = fm.functional_model(net)
    method = Method(args.recipe, fmodel, args)
    outer = method.outer_optimizer([*net.parameters(), *method.extra])
    rng = torch.Generator().manual_seed(args.seed)
    test = test_episodes.sample(args.eval_episodes, generator=torch.Generator().manual_seed(99))
    print(
        f"{args.recipe}: {args.ways}-way {args.shots}-shot, conv4-{args.channels}, "
        f"{args.steps} inner steps, meta-batch {args.meta_batch}, {args.iterations} iterations, "
        f"{'Omniglot' if args.omniglot else 'digits x 4 rotations'}"
    )
    before = mean_ci(method.accuracy(test, args.steps))
    curve: list[tuple[int, float]] = []
    steps = range(args.iterations)
    bar = None
    if tqdm is not None and not args.no_progress and sys.stderr.isatty():
        steps = bar = tqdm(steps, desc="meta-training", unit="it")
    start = time.perf_counter()
    for i in steps:
        b = train_episodes.sample(args.meta_batch, generator=rng)
        loss = method.loss(b.support, b.query, i)
        outer.zero_grad()
        loss.backward()
        outer.step()
        if (i + 1) % max(args.iterations // 10, 1) == 0:
            probe = test_episodes.sample(32, generator=torch.Generator().manual_seed(i))
            acc = sum(method.accuracy(probe, args.steps)) / 32
            curve.append((i + 1, acc))
            if bar is not None:
                bar.set_postfix(test_acc=f"{acc:.3f}")
    if bar is not None:
        bar.close()
    after = mean_ci(method.accuracy(test, args.steps))
    print(f"meta-training took {time.perf_counter() - start:.0f} s")
    print(f"meta-test accuracy over {args.eval_episodes} episodes, {args.steps} inner steps:")
    print(f"  before meta-training: {before[0]:.3f} ± {before[1]:.3f}")
    print(f"  after meta-training:  {after[0]:.3f} ± {after[1]:.3f}")
    save_curve(curve, args)
    return {"before": before[0], "after": after[0]}


def save_curve(curve: list[tuple[int, float]], args: argparse.Namespace) -> None:
    if not curve:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[examples])")
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o")
    ax.set_xlabel("meta-iteration")
    ax.set_ylabel("meta-test accuracy (32 episodes)")
    ax.set_title(f"{args.recipe}, {args.ways}-way {args.shots}-shot")
    ax.grid(alpha=0.3)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
