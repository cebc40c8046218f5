"""learn2learn's MAML-Omniglot example (``examples/vision/maml_omniglot.py``), ported to funcmeta.

learn2learn's example: the fully connected ``OmniglotFC`` network (four blocks of linear,
BatchNorm on batch statistics and ReLU: 256, 128, 64, 64; weights from a normal truncated at
two standard deviations of 0.01), 5-way 1-shot tasks of two samples per class (even samples
adapt, odd ones evaluate), ``MAML(model, lr=0.5, first_order=False)``, one adaptation step,
Adam at 0.003 outside, meta-batch 32, each task's evaluation loss ``backward()`` and every
gradient divided by the meta-batch size (the mean over tasks).

The port, call for call (docs/porting.md, "From learn2learn"):

- ``maml = l2l.algorithms.MAML(model, lr)`` -> ``fmodel = fm.functional_model(model)``;
- ``learner = maml.clone()`` and ``learner.adapt(loss)`` per step ->
  ``fm.adapt(fmodel, fmodel.params, loss_fn, (x_adapt, y_adapt), fm.optim.sgd(lr), steps=1)``;
- ``learner(x_eval)`` -> ``fmodel(result.params, x_eval)``;
- the accumulated gradients divided by the meta-batch size -> each task's loss divided by it
  (or, with ``--batched``, all tasks as one computation: ``fm.recipes.maml``, the mean).

The data: Omniglot from its published archives (``--data``: a folder with
``images_background_small1.zip`` and ``images_background_small2.zip``, the minimal splits,
or the full ``images_background.zip`` with ``--splits background``), 28x28 with Lanczos and
inverted as learn2learn's loader does; the first characters train, the others test.
``--download`` fetches the minimal splits into ``--data``, each checked against its sha256;
without the files the script stops with one message naming them and where they are
published, and exits with status 1.

    python examples/l2l_maml_omniglot_port.py --data ../shared/data/omniglot --iterations 20
    python examples/l2l_maml_omniglot_port.py --data data/omniglot --download

Running time, measured on this project's 2-core AMD EPYC shared with other jobs (2026-11-26;
load average about 5: an idle machine is faster): the first command took 75 s (20
meta-iterations of 32 tasks, with loading and five tests).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm


def omniglot_fc(ways: int, sizes: tuple[int, ...] = (256, 128, 64, 64)) -> nn.Sequential:
    """learn2learn's ``OmniglotFC(28 ** 2, ways)``: flatten, linear blocks with BatchNorm on
    batch statistics (``track_running_stats=False``, eps 1e-3), and a linear classifier."""

    def init(linear: nn.Linear) -> nn.Linear:
        nn.init.trunc_normal_(linear.weight, std=0.01, a=-0.02, b=0.02)
        nn.init.zeros_(linear.bias)
        return linear

    layers: list[nn.Module] = [nn.Flatten()]
    for n_in, n_out in zip((28 * 28, *sizes[:-1]), sizes, strict=True):
        layers += [
            init(nn.Linear(n_in, n_out)),
            nn.BatchNorm1d(n_out, affine=True, momentum=0.999, eps=1e-3, track_running_stats=False),
            nn.ReLU(),
        ]
    return nn.Sequential(*layers, init(nn.Linear(sizes[-1], ways)))


def split(batch: fm.data.EpisodeBatch) -> tuple[tuple, tuple]:
    """learn2learn's split of each task's ``2 * shots`` samples per class: with one support
    and one query sample per class, the support set adapts and the query set evaluates."""
    return (batch.x_support, batch.y_support), (batch.x_query, batch.y_query)


def meta_loss(
    fmodel: fm.FunctionalModel, support: tuple, query: tuple, lr: float, steps: int, batched: bool
) -> torch.Tensor:
    """The mean over tasks of the evaluation loss after ``steps`` adaptation steps."""
    if batched:
        out = fm.recipes.maml(
            fmodel, fmodel.params, F.cross_entropy, support, query, steps=steps, lr=lr
        )
        return out.loss
    tasks = support[0].shape[0]
    total = torch.zeros(())
    for t in range(tasks):
        result = fm.adapt(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            (support[0][t], support[1][t]),
            fm.optim.sgd(lr=lr),
            steps=steps,
        )
        predictions = fmodel(result.params, query[0][t])
        total = total + F.cross_entropy(predictions, query[1][t]) / tasks
    return total


def accuracy(
    fmodel: fm.FunctionalModel, support: tuple, query: tuple, lr: float, steps: int
) -> float:
    result = fm.adapt_tasks(
        fmodel, fmodel.params, F.cross_entropy, support, fm.optim.sgd(lr=lr), steps=steps
    )
    _, _, logits = fm.task_losses(
        fmodel,
        result.params,
        F.cross_entropy,
        query,
        return_outputs=True,
        task_chunk=result.chunk,
    )
    return float((logits.argmax(-1) == query[1]).float().mean())


SPLITS = ("background", "evaluation", "background_small1", "background_small2")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--data",
        type=Path,
        default=Path("data/omniglot"),
        help="folder with the official files of --splits (images_<split>.zip, as published "
        "or unpacked)",
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="fetch the splits missing from --data from the dataset's repository "
        f"({fm.data.OMNIGLOT_URL}), each checked against its sha256 (the minimal splits only)",
    )
    p.add_argument(
        "--splits",
        nargs="+",
        choices=SPLITS,
        default=["background_small1", "background_small2"],
        help="Omniglot splits to load, their characters together",
    )
    p.add_argument("--ways", type=int, default=5, help="classes per task")
    p.add_argument(
        "--shots", type=int, default=1, help="adaptation (and evaluation) samples per class"
    )
    p.add_argument("--meta-lr", type=float, default=0.003, help="outer Adam step size")
    p.add_argument("--fast-lr", type=float, default=0.5, help="adaptation SGD step size")
    p.add_argument("--meta-batch", type=int, default=32, help="tasks per meta-iteration")
    p.add_argument("--adaptation-steps", type=int, default=1, help="adaptation steps per task")
    p.add_argument("--iterations", type=int, default=100, help="meta-iterations")
    p.add_argument(
        "--test-characters", type=int, default=100, help="the last N characters are for testing"
    )
    p.add_argument("--batched", action="store_true", help="the tasks as one computation")
    p.add_argument("--seed", type=int, default=42, help="seed of the model and the tasks")
    return p


def no_data(folder: Path, missing: dict[str, str], why: str, downloading: bool) -> str:
    """The message of a run without its files: which ones, where to put them, and how."""
    files = "\n".join(f"  {name}  ({address})" for name, address in missing.items())
    by_hand = f"download them yourself into {folder} (the zip archives as published, or unpacked)."
    if any(name not in fm.data.OMNIGLOT_FILES for name in missing):
        how = by_hand[0].upper() + by_hand[1:] + " --download fetches only the minimal splits."
    elif downloading:
        how = by_hand[0].upper() + by_hand[1:]
    else:
        how = f"Rerun with --download to fetch them there (each checked against its sha256), or {by_hand}"
    return (
        f"{why}\nThis run reads these official Omniglot files from --data {folder}:\n{files}\n{how}"
    )


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``--splits`` from ``--data`` (fetched first with ``--download``); without the files,
    one message and exit status 1 instead of a traceback."""
    missing = fm.data.missing_omniglot_files(args.data, args.splits)
    unfetchable = [name for name in missing if name not in fm.data.OMNIGLOT_FILES]
    if missing and (not args.download or unfetchable):
        why = f"no Omniglot data in {args.data}."
        raise SystemExit(no_data(args.data, missing, why, args.download))
    try:
        return fm.data.load_omniglot(args.data, args.splits, size=28, download=args.download)
    except OSError as e:  # a download that failed (the network, a timeout)
        raise SystemExit(no_data(args.data, missing, str(e), args.download)) from None


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    args = parser().parse_args(argv)
    torch.manual_seed(args.seed)
    images, labels, names = load_data(args)
    classes = len(names)
    train = list(range(classes - args.test_characters))
    test = list(range(classes - args.test_characters, classes))
    sampler = {
        name: fm.data.Episodes(
            images, labels, ways=args.ways, shots=args.shots, query=args.shots, classes=which
        )
        for name, which in (("train", train), ("test", test))
    }
    model = omniglot_fc(args.ways)
    fmodel = fm.functional_model(model)
    opt = torch.optim.Adam(model.parameters(), args.meta_lr)
    g = torch.Generator().manual_seed(args.seed)
    history: dict[str, list[float]] = {"loss": [], "test_accuracy": []}
    start = time.perf_counter()
    for iteration in range(args.iterations):
        support, query = split(sampler["train"].sample(args.meta_batch, generator=g))
        opt.zero_grad()
        loss = meta_loss(fmodel, support, query, args.fast_lr, args.adaptation_steps, args.batched)
        loss.backward()
        opt.step()
        history["loss"].append(float(loss.detach()))
        if iteration % max(1, args.iterations // 5) == 0 or iteration == args.iterations - 1:
            s, q = split(sampler["test"].sample(args.meta_batch, generator=g))
            acc = accuracy(fmodel, s, q, args.fast_lr, args.adaptation_steps)
            history["test_accuracy"].append(acc)
            print(
                f"iteration {iteration:4d}  meta-train loss {loss.item():.4f}  "
                f"meta-test accuracy {acc:.3f}  ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    return history


if __name__ == "__main__":
    main()
