"""Snapshots of meta-training: save and restore the whole training state, atomically, to
resume a run.

:func:`save` writes, in one file:

- the state of every module you name: the model (its initial parameters and buffers) and the
  learnable hyperparameters (``fm.hyper`` trees);
- every outer optimizer (and scheduler);
- every ``torch.Generator`` your task samplers draw from;
- the global random states (torch CPU and CUDA, Python's ``random``, NumPy's when NumPy is
  loaded);
- the step and any extra picklable values.

The file is written to a temporary name in the same folder, flushed to disk and renamed over
the target. A run killed at any moment leaves either the previous complete state or the new
one, never a torn file. (A process killed during a write may leave its temporary
``.<name>.*.tmp`` file behind; it can be deleted.) :func:`load` restores all of it. A run resumed from the last
state continues bit for bit as if it had not stopped (tested by killing a training
subprocess).

Example:
    >>> import tempfile, pathlib, torch, funcmeta as fm
    >>> net = torch.nn.Linear(1, 1)
    >>> outer = torch.optim.Adam(net.parameters(), lr=1e-3)
    >>> rng = torch.Generator().manual_seed(0)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "state.pt"
    >>> fm.snapshot.save(path, step=10, modules={"net": net}, optimizers={"outer": outer}, generators={"tasks": rng})
    >>> fm.snapshot.load(path, modules={"net": net}, optimizers={"outer": outer}, generators={"tasks": rng}).step
    10
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Snapshot", "load", "save"]

FORMAT = 1


class Snapshot(NamedTuple):
    """What :func:`load` returns besides restoring objects in place."""

    step: int
    extra: dict[str, Any]


def _random_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def _restore_random(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        numpy.random.set_state(states["numpy"])


def save(
    path: str | os.PathLike[str],
    *,
    step: int,
    modules: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write the training state to ``path`` atomically (see the module docstring).

    ``optimizers`` may hold anything with ``state_dict``/``load_state_dict`` (optimizers,
    learning-rate schedulers, gradient scalers).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    payload = {
        "format": FORMAT,
        "step": step,
        "modules": {k: m.state_dict() for k, m in (modules or {}).items()},
        "optimizers": {k: o.state_dict() for k, o in (optimizers or {}).items()},
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
        "random": _random_states(),
        "extra": dict(extra or {}),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
            dir_fd = os.open(target.parent, os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(
    path: str | os.PathLike[str],
    *,
    modules: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    map_location: Any = None,
) -> Snapshot:
    """Restore what :func:`save` wrote into the given objects (and the global random
    states); returns :class:`Snapshot` ``(step, extra)``.

    The names must match the saved ones exactly: a missing or unexpected name raises
    ``ValueError`` naming it, before anything is restored.
    """
    payload = torch.load(Path(path), map_location=map_location, weights_only=False)
    if payload.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a funcmeta training state (format {payload.get('format')!r})"
        )
    given = {
        "modules": modules or {},
        "optimizers": optimizers or {},
        "generators": generators or {},
    }
    for kind, objects in given.items():
        saved = payload[kind]
        if saved.keys() != objects.keys():
            missing = sorted(saved.keys() - objects.keys())
            unexpected = sorted(objects.keys() - saved.keys())
            raise ValueError(
                f"{kind} do not match the saved state: not given {missing}, not saved {unexpected}"
            )
    for name, module in given["modules"].items():
        module.load_state_dict(payload["modules"][name])
    for name, optimizer in given["optimizers"].items():
        optimizer.load_state_dict(payload["optimizers"][name])
    for name, generator in given["generators"].items():
        generator.set_state(payload["generators"][name])
    _restore_random(payload["random"])
    return Snapshot(payload["step"], payload["extra"])
