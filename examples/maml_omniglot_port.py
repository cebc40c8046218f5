"""The MAML-Omniglot examples of ``higher`` and TorchOpt, ported to funcmeta line for line.

Both peers publish the same example (``higher``: ``examples/maml-omniglot.py``; TorchOpt:
``examples/few-shot/maml_omniglot.py``): a 3-conv network with BatchNorm on batch statistics,
5-way episodes, 5 SGD steps at 0.1 in the inner loop, Adam at 1e-3 outside, meta-batch 32.
They differ in one place: ``higher`` calls ``backward()`` on each task's query loss (the
meta-gradient is the *sum* over tasks), TorchOpt on the mean. ``--style`` picks one.

What the port keeps, so that a run gives the peers' numbers:

- the data as their loader makes it: ``resample="bicubic"`` (Pillow's default resize) and
  ``invert=False`` (black strokes on white, in [0, 1]), the first classes for training;
- their episode sampler (:class:`NShot`), drawing from a NumPy ``Generator`` in the same order;
- the network, the optimizers and the loss scaling.

``fm.adapt`` replaces ``higher.innerloop_ctx`` / ``torchopt.MetaSGD``: each task adapts from
the module's parameters (``fmodel.params``, which are ``net.parameters()``: the peers'
``copy_initial_weights=False``), and the query loss backpropagates into ``net``'s ``.grad``.
``--batched`` runs the 32 tasks as one computation with ``fm.recipes.maml`` instead of a loop
(the same meta-gradients up to float32 rounding). See ``docs/porting.md``.

It keeps freed memory (:func:`funcmeta.keep_freed_memory`; ``--no-keep-freed-memory`` leaves
glibc's defaults): 32 tasks' activations of tens of MiB otherwise start on fresh pages at
every step. On 2 AMD EPYC cores (2026-11-24) the loop then took 9.15 s per meta-iteration
instead of 12.55 s.

``--data`` is a folder with the official archives of ``--splits`` (as published or
unpacked); ``--download`` fetches the minimal splits into it, each checked against its
sha256 (the full ``background`` and ``evaluation`` splits have no published checksum: put
them there yourself). Without them the script stops with one message naming the files and
where they are published, and exits with status 1.

    python examples/maml_omniglot_port.py --data ../shared/data/omniglot --iterations 20
    python examples/maml_omniglot_port.py --data data/omniglot --download --iterations 20

Running time, measured on this project's 2-core AMD EPYC shared with other jobs (2026-11-26;
load average about 5: an idle machine is faster): ``--data ../shared/data/omniglot
--iterations 10 --test-every 10`` took 1330 s (loading, 10 meta-iterations of 32 tasks, one
test); a meta-iteration took 9.15 s on 2 idle cores (above, 2026-11-24).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _threads import (
    add_allocator_option,
    add_threads_option,
    available_cores,
    use_allocator,
    use_threads,
)
from torch import nn

import funcmeta as fm


def network(ways: int) -> nn.Sequential:
    """The peers' network: 3 x (conv 3x3, 64 filters, BatchNorm with momentum 1, ReLU, pool)."""
    layers: list[nn.Module] = []
    for c_in in (1, 64, 64):
        layers += [
            nn.Conv2d(c_in, 64, 3),
            nn.BatchNorm2d(64, momentum=1.0, affine=True),
            nn.ReLU(inplace=False),
            nn.MaxPool2d(2, 2),
        ]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, ways))


class NShot:
    """The peers' episode sampler (``OmniglotNShot``): per mode, a cache of 10 meta-batches
    drawn from ``rng`` at once, refilled when used up; the train cache is drawn first."""

    def __init__(
        self,
        images: np.ndarray,
        train_classes: int,
        *,
        batchsz: int,
        n_way: int,
        k_shot: int,
        k_query: int,
        rng: np.random.Generator,
    ) -> None:
        self.data = {"train": images[:train_classes], "test": images[train_classes:]}
        self.batchsz, self.n_way, self.k_shot, self.k_query, self.rng = (
            batchsz,
            n_way,
            k_shot,
            k_query,
            rng,
        )
        self.index = {"train": 0, "test": 0}
        self.cache = {mode: self._fill(self.data[mode]) for mode in ("train", "test")}

    def _fill(self, pack: np.ndarray) -> list[list[torch.Tensor]]:
        size = pack.shape[-1]
        cache = []
        for _ in range(10):
            batch: list[list[np.ndarray]] = [[], [], [], []]
            for _ in range(self.batchsz):
                x_s, y_s, x_q, y_q = [], [], [], []
                for j, c in enumerate(self.rng.choice(pack.shape[0], self.n_way, False)):
                    drawn = self.rng.choice(pack.shape[1], self.k_shot + self.k_query, False)
                    x_s.append(pack[c][drawn[: self.k_shot]])
                    x_q.append(pack[c][drawn[self.k_shot :]])
                    y_s.append([j] * self.k_shot)
                    y_q.append([j] * self.k_query)
                for x, y, n, i in ((x_s, y_s, self.k_shot, 0), (x_q, y_q, self.k_query, 2)):
                    perm = self.rng.permutation(self.n_way * n)  # shuffled within the set
                    batch[i].append(np.array(x).reshape(self.n_way * n, 1, size, size)[perm])
                    batch[i + 1].append(np.array(y).reshape(self.n_way * n)[perm])
            cache.append(
                [
                    torch.from_numpy(np.array(batch[0], dtype=np.float32)),
                    torch.from_numpy(np.array(batch[1], dtype=np.int64)),
                    torch.from_numpy(np.array(batch[2], dtype=np.float32)),
                    torch.from_numpy(np.array(batch[3], dtype=np.int64)),
                ]
            )
        return cache

    def next(self, mode: str = "train") -> list[torch.Tensor]:
        if self.index[mode] >= len(self.cache[mode]):
            self.index[mode] = 0
            self.cache[mode] = self._fill(self.data[mode])
        self.index[mode] += 1
        return self.cache[mode][self.index[mode] - 1]


SPLITS = ("background", "evaluation", "background_small1", "background_small2")


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


def check_data(args: argparse.Namespace) -> dict[str, str]:
    """The files of ``--splits`` missing from ``--data``; without ``--download`` (or for a
    split it cannot fetch), one message and exit status 1 instead of a traceback."""
    missing = fm.data.missing_omniglot_files(args.data, args.splits)
    unfetchable = [name for name in missing if name not in fm.data.OMNIGLOT_FILES]
    if missing and (not args.download or unfetchable):
        why = f"no Omniglot data in {args.data}."
        raise SystemExit(no_data(args.data, missing, why, args.download))
    return missing


def read_data(args: argparse.Namespace, missing: dict[str, str]) -> np.ndarray:
    """:func:`load_images` of ``--splits`` from ``--data``, fetching ``missing`` first."""
    try:
        return load_images(args.data, args.splits, download=args.download)
    except OSError as e:  # a download that failed (the network, a timeout)
        raise SystemExit(no_data(args.data, missing, str(e), args.download)) from None


def load_images(
    root: Path, splits: list[str], size: int = 28, *, download: bool = False
) -> np.ndarray:
    """``(classes, 20, 1, size, size)`` float64 in [0, 1], as the peers' loader gives them."""
    x, y, _ = fm.data.load_omniglot(
        root, splits, size=size, invert=False, resample="bicubic", download=download
    )
    # the peers keep pixels / 255 in float64; funcmeta returns float32 of the same bytes / 255
    pixels = torch.round(x.double() * 255) / 255
    return np.stack([pixels[y == c].numpy() for c in range(int(y.max()) + 1)])


def meta_step(
    fmodel: fm.FunctionalModel,
    batch: list[torch.Tensor],
    meta_opt: torch.optim.Optimizer,
    args: argparse.Namespace,
) -> tuple[float, float]:
    """One meta-iteration; returns the query loss and accuracy (%) averaged over tasks."""
    x_spt, y_spt, x_qry, y_qry = batch
    tasks = x_spt.shape[0]
    inner = fm.optim.sgd(lr=args.inner_lr)
    meta_opt.zero_grad()
    if args.batched:
        out = fm.recipes.maml(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            (x_spt, y_spt),
            (x_qry, y_qry),
            steps=args.inner_steps,
            opt=inner,
        )
        (out.loss * (tasks if args.style == "higher" else 1)).backward()
        meta_opt.step()
        acc = (out.logits.argmax(-1) == y_qry).float().mean().item()
        return out.query_loss.item(), 100 * acc
    losses, accs = [], []
    for i in range(tasks):
        adapted = fm.adapt(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            (x_spt[i], y_spt[i]),
            inner,
            steps=args.inner_steps,
        )
        logits, _ = fmodel.run(adapted.params, adapted.buffers, x_qry[i])
        loss = F.cross_entropy(logits, y_qry[i])
        if args.style == "higher":
            loss.backward()  # per task: the meta-gradient is the sum over tasks
        losses.append(loss if args.style == "torchopt" else loss.detach())
        accs.append((logits.argmax(1) == y_qry[i]).float().mean().item())
    mean = torch.stack(losses).mean()
    if args.style == "torchopt":
        mean.backward()  # the mean over tasks
    meta_opt.step()
    return mean.item(), 100 * float(np.mean(accs))


def evaluate(fmodel: fm.FunctionalModel, db: NShot, args: argparse.Namespace) -> float:
    """The peers' test: every test meta-batch of one cache, 5 inner steps per task without
    a graph, query accuracy (%)."""
    accs = []
    for _ in range(len(db.cache["test"])):
        x_spt, y_spt, x_qry, y_qry = db.next("test")
        for i in range(x_spt.shape[0]):
            with torch.no_grad():
                adapted = fm.adapt(
                    fmodel,
                    fmodel.params,
                    F.cross_entropy,
                    (x_spt[i], y_spt[i]),
                    fm.optim.sgd(lr=args.inner_lr),
                    steps=args.inner_steps,
                )
                logits, _ = fmodel.run(adapted.params, adapted.buffers, x_qry[i])
            accs.append((logits.argmax(1) == y_qry[i]).float().mean().item())
    return 100 * float(np.mean(accs))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
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
        help="Omniglot splits to load (the peers use background and evaluation, in full)",
    )
    p.add_argument(
        "--train-classes",
        type=int,
        default=1200,
        help="the first N classes are for training (at most 74%% of them)",
    )
    p.add_argument(
        "--style",
        choices=("higher", "torchopt"),
        default="higher",
        help="the meta-gradient as the sum over tasks (higher) or the mean (TorchOpt)",
    )
    p.add_argument("--batched", action="store_true", help="the tasks as one computation")
    p.add_argument("--n-way", type=int, default=5, help="classes per episode")
    p.add_argument("--k-spt", type=int, default=5, help="support examples per class")
    p.add_argument("--k-qry", type=int, default=15, help="query examples per class")
    p.add_argument("--task-num", type=int, default=32, help="tasks per meta-batch")
    p.add_argument("--inner-steps", type=int, default=5, help="inner SGD steps per task")
    p.add_argument("--inner-lr", type=float, default=0.1, help="inner SGD step size")
    p.add_argument("--meta-lr", type=float, default=1e-3, help="outer Adam step size")
    p.add_argument("--iterations", type=int, default=100, help="meta-iterations")
    p.add_argument(
        "--test-every", type=int, default=50, help="meta-iterations between test evaluations"
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the model and the sampler")
    add_threads_option(
        p, available_cores(), "the cores available: convolutions gain from every core"
    )
    add_allocator_option(
        p, True, "32 tasks' activations, tens of MiB each, would start on fresh pages each step"
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    missing = check_data(args)
    use_threads(args)
    print(use_allocator(args))

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # TorchOpt's sampler; higher's draws from np.random
    images = read_data(args, missing)
    train_classes = min(args.train_classes, round(0.74 * len(images)))
    db = NShot(
        images,
        train_classes,
        batchsz=args.task_num,
        n_way=args.n_way,
        k_shot=args.k_spt,
        k_query=args.k_qry,
        rng=rng,
    )
    net = network(args.n_way)
    fmodel = fm.functional_model(net)
    meta_opt = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    log: dict = {"train": [], "test": []}
    for it in range(1, args.iterations + 1):
        start = time.perf_counter()
        loss, acc = meta_step(fmodel, db.next(), meta_opt, args)
        log["train"].append({"loss": loss, "acc": acc, "seconds": time.perf_counter() - start})
        if it % args.test_every == 0 or it == args.iterations:
            test_acc = evaluate(fmodel, db, args)
            log["test"].append({"iteration": it, "acc": test_acc})
            print(f"[it {it}] train loss {loss:.3f} acc {acc:.2f} | test acc {test_acc:.2f}")
    log["net"] = net
    return log


if __name__ == "__main__":
    main()
