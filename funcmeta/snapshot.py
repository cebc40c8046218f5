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
``.<name>.*.tmp`` file behind; it can be deleted.) :func:`load` restores all of it.

Loading never runs code: the file holds only tensors, numbers, strings, ``None`` and
lists, tuples and dicts of them, and :func:`load` reads it with ``torch.load(...,
weights_only=True)``, which refuses anything else. ``extra`` is limited to those types and
checked by :func:`save`. A file that is not a funcmeta snapshot, a truncated one, one from a
newer format and one that would build other objects each raise :class:`SnapshotError`
naming the file and the cause, before anything is restored. A run resumed from the last
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
import pickle
import random
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["FORMAT", "Snapshot", "SnapshotError", "load", "save"]

FORMAT = 2
"""The snapshot format this version writes. It reads this one and format 1 (NumPy's random
state as an array, which a safe load refuses: such a file loads only if NumPy was not in
use)."""


class SnapshotError(ValueError):
    """A file that :func:`load` will not restore from; the message names the file and why."""


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
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        # as a tensor and numbers: an ndarray would need unpickling code to load
        states["numpy"] = (
            str(kind),
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(gauss),
        )
    return states


def _restore_random(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        if isinstance(keys, Tensor):  # format 2; format 1 kept numpy's own array
            keys = keys.numpy().astype("uint32")
        numpy.random.set_state((kind, keys, pos, has_gauss, gauss))


_PLAIN = (str, int, float, bool, type(None))


def _check_extra(value: Any, where: str) -> None:
    """``extra`` holds tensors, numbers, strings, None, and lists, tuples and dicts (with
    string keys) of them: what loads without running code."""
    if isinstance(value, (Tensor, *_PLAIN)):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_extra(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has the key {key!r}; extra takes string keys only")
            _check_extra(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; extra holds tensors, numbers, strings, None, "
        "and lists, tuples and dicts of them (what loads without running code)"
    )


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
    learning-rate schedulers, gradient scalers). ``extra`` holds tensors, numbers, strings,
    ``None``, and lists, tuples and dicts (string keys) of them; anything else raises
    ``TypeError`` naming it.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    extra = dict(extra or {})
    _check_extra(extra, "extra")
    payload = {
        "format": FORMAT,
        "step": step,
        "modules": {k: m.state_dict() for k, m in (modules or {}).items()},
        "optimizers": {k: o.state_dict() for k, o in (optimizers or {}).items()},
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
        "random": _random_states(),
        "extra": extra,
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


def _read(path: Path, map_location: Any) -> dict[str, Any]:
    """The payload of a snapshot file, read without running code, its format checked."""
    if not path.is_file():
        raise FileNotFoundError(f"no snapshot at {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes zip archives; a cut one has no index
        raise SnapshotError(f"{path} is truncated, corrupt or not a file that torch.save writes")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is long; its line naming the refused object is the one that matters
        lines = [ln.strip() for ln in str(e).splitlines()]
        reason = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0])
        raise SnapshotError(
            f"{path} holds objects other than tensors, numbers, strings and containers; it was "
            f"not loaded (loading it could run code), and funcmeta never writes such a file "
            f"({reason})"
        ) from None
    except Exception as e:  # the reader's errors for a cut or foreign file vary by release
        raise SnapshotError(
            f"{path} is truncated, corrupt or not a torch file ({type(e).__name__}: {e})"
        ) from None
    found = payload.get("format") if isinstance(payload, dict) else None
    if not isinstance(found, int) or isinstance(found, bool):
        raise SnapshotError(f"{path} is not a funcmeta snapshot (no format number)")
    if found > FORMAT:
        raise SnapshotError(
            f"{path} has snapshot format {found}, newer than this funcmeta reads ({FORMAT}): "
            "upgrade funcmeta"
        )
    if found < 1:
        raise SnapshotError(f"{path} has no valid snapshot format number ({found})")
    missing = {"step", "modules", "optimizers", "generators", "random", "extra"} - payload.keys()
    if missing:
        raise SnapshotError(f"{path} is not a complete funcmeta snapshot: no {sorted(missing)}")
    return payload


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
    ``ValueError`` naming it, before anything is restored. The file is read with
    ``weights_only=True``: it cannot run code. :class:`SnapshotError` names a file that is not
    a snapshot, is truncated or corrupt, comes from a newer format, or holds other objects.
    """
    payload = _read(Path(path), map_location)
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
