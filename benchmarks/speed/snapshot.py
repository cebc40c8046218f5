"""``fm.snapshot.save`` and ``fm.snapshot.load`` against ``torch.save`` and
``torch.load(weights_only=True)`` of the same tensors.

States (a model's parameters and its optimizer's state):

- ``64MiB``: eight ``Linear(1024, 1024)`` layers and SGD with momentum (32 MiB of parameters,
  32 MiB of momentum);
- ``1GiB``: 128 such layers and SGD with momentum;
- ``bert-base``: the parameter shapes of BERT-base (110 M parameters: word and position
  embeddings, 12 layers of attention and feed-forward) with Adam's two moments, about
  1.3 GB.

Each save writes the state dicts of the model and the optimizer. ``fm.snapshot.save`` hashes
every tensor (SHA-256), writes the file, flushes it to disk (``fsync``) and renames it into
place. It is compared with ``torch.save`` of the same payload written the same crash-safe
way (a new file, flushed, renamed: "torch atomic"), with ``torch.save`` over the same path
followed by a flush, and with ``torch.save`` alone. On this project's virtual disk, writing a
new file costs up to 4x rewriting an existing one, so the first comparison is the one that
measures funcmeta's own work (the checksums). ``fm.snapshot.load``
reads the file and checks every hash; it is compared with ``torch.load(weights_only=True)``
of the ``torch.save`` file. Files go to ``--dir`` (default: a temporary folder beside this
script, on the disk of the working tree); right after a save the file is in the page cache,
for both loads alike. Before each timed call the page cache's dirty pages are written out
(``os.sync``, untimed): a journaling file system's ``fsync`` may otherwise flush an earlier,
unsynced write as well. ``fm save`` and ``torch atomic`` alternate, so that each follows the
other: each frees the file it replaces at its end, and on a virtual machine a write into
memory freed just before is several times faster than one into fresh memory (a fixed order
of four saves had ``fm save`` always follow a save that freed nothing). Median of
``--repeats`` rounds.

    python benchmarks/speed/snapshot.py [--states 64MiB 1GiB bert-base] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common


def model_of(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name in ("64MiB", "1GiB"):
        layers = 8 if name == "64MiB" else 128
        return nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    d, ff = 768, 3072
    layers = []
    for _ in range(12):
        layers += [nn.Linear(d, d) for _ in range(4)]
        layers += [nn.Linear(d, ff), nn.Linear(ff, d), nn.LayerNorm(d), nn.LayerNorm(d)]
    return nn.Sequential(nn.Embedding(30522, d), nn.Embedding(512, d), *layers)


def state(name: str) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    model = model_of(name)
    if name == "bert-base":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the optimizer's state: one (momentum) or two (Adam) tensors per parameter
    copies = 3 if name == "bert-base" else 2
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * copies
    return model, opt, nbytes


def timed(fn) -> float:
    """Seconds of ``fn()``, after ``os.sync()``: no dirty pages of an earlier write left, which
    an fsync may flush too (ext4's journal)."""
    os.sync()
    return _common.timed(fn)[0] / 1e3


def torch_save(payload: dict, path: Path, sync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(payload, f)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def torch_save_atomic(payload: dict, path: Path) -> None:
    """What any save that survives a crash does: a new file, flushed, renamed into place,
    and the rename itself flushed (the folder's fsync)."""
    tmp = path.with_suffix(".tmp")
    torch_save(payload, tmp, True)
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def measure(name: str, folder: Path, repeats: int) -> dict[str, float]:
    model, opt, nbytes = state(name)
    ours, theirs = folder / f"{name}.fm.pt", folder / f"{name}.torch.pt"
    atomic = folder / f"{name}.atomic.pt"
    kinds = ("fm save", "torch atomic", "torch save+fsync", "torch save", "fm load", "torch load")
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    payload = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    calls = {
        "fm save": lambda: fm.snapshot.save(
            ours, step=1, modules={"model": model}, optimizers={"optimizer": opt}
        ),
        "torch atomic": lambda: torch_save_atomic(payload, atomic),
        "torch save+fsync": lambda: torch_save(payload, theirs, True),
        "torch save": lambda: torch_save(payload, theirs, False),
        "fm load": lambda: fm.snapshot.load(
            ours, modules={"model": model}, optimizers={"optimizer": opt}
        ),
        "torch load": lambda: torch.load(theirs, weights_only=True),
    }
    # fm save and torch atomic alternate, so that each follows the other: each frees the
    # file it replaces at its end, and a write into memory freed just before is much faster
    # on a virtual machine than one into fresh memory; the rounds swap which goes first.
    # The two non-atomic saves overwrite one file in place and run after, in their own pairs.
    pairs = (("fm save", "torch atomic"), ("torch save+fsync", "torch save"))
    for pair in pairs:
        for r in range(repeats):
            for k in pair if r % 2 == 0 else pair[::-1]:
                runs[k].append(timed(calls[k]))
    loads = kinds[4:]
    for r in range(repeats):
        for k in loads if r % 2 == 0 else loads[::-1]:
            runs[k].append(timed(calls[k]))
    out: dict[str, float] = _common.medians(runs)
    out["bytes"] = nbytes
    for path in (ours, theirs, atomic):
        path.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--states",
        nargs="+",
        default=["64MiB", "1GiB", "bert-base"],
        choices=["64MiB", "1GiB", "bert-base"],
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parent / "out"
    base.mkdir(parents=True, exist_ok=True)
    print(
        f"snapshot save and load; torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs; median of {args.repeats}; files in {base}"
    )
    print(
        "| state | MB | fm save s | torch atomic s | torch save+fsync s | torch save s | "
        "fm / atomic | fm / save+fsync | fm load s | torch load s | load ratio |"
    )
    print("| --- " * 11 + "|")
    with tempfile.TemporaryDirectory(dir=base) as folder:
        for name in args.states:
            r = measure(name, Path(folder), args.repeats)
            mb = r["bytes"] / 1e6
            print(
                f"| {name} | {mb:.0f} | {r['fm save']:.3f} | {r['torch atomic']:.3f} | "
                f"{r['torch save+fsync']:.3f} | {r['torch save']:.3f} | "
                f"{r['fm save'] / r['torch atomic']:.2f} | "
                f"{r['fm save'] / r['torch save+fsync']:.2f} | {r['fm load']:.3f} | "
                f"{r['torch load']:.3f} | {r['fm load'] / r['torch load']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
