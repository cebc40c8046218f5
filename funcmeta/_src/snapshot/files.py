"""Saving and loading snapshots: the implementation of :mod:`funcmeta.snapshot` (file format
4, atomic writes, checks before anything is unpickled)."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import os
import pickle
import random
import sys
import zipfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tempfiles import make_temp, remove_stale
from funcmeta._src.snapshot.records import RecordCheck, check_records, compute_crc32, file_stamp
from funcmeta._src.snapshot.rng_state import check_state, get_state, set_state

__all__ = ["FORMAT", "Snapshot", "SnapshotError", "load", "save"]

FORMAT = 4
"""The snapshot format this version writes: format 2 with the CRC-32 of every record of the
file (the structure and numbers, and each tensor's bytes) stored in the archive's index and
checked on load before anything is unpickled. It reads format 3 (format 2 with a SHA-256
checksum of every tensor and of everything else, inside the payload), format 2 (no
checksums) and format 1 (NumPy's random state as an array, which a safe load refuses: such a
file loads only if NumPy was not in use)."""


@exposed_in("funcmeta.snapshot")
class SnapshotError(ValueError):
    """A file that :func:`load` will not restore from; the message names the file and why."""


@exposed_in("funcmeta.snapshot")
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
_CONVERT = {
    int: "int(x)",
    float: "float(x)",
    str: "str(x)",
    bool: "bool(x)",
    list: "list(x)",
    tuple: "tuple(x)",
    dict: "dict(x)",
}


def _check_extra(value: Any, where: str, path: frozenset[int] = frozenset()) -> None:
    """``extra`` holds tensors, numbers, strings, None, and lists, tuples and dicts (with
    string keys) of them, of exactly those types: what :func:`load` reads without running code.
    Subclasses (``np.float64``, an ``IntEnum``, a namedtuple, a ``defaultdict``, a tensor
    subclass) would be refused at load, so they are refused here, with the conversion that
    makes them plain."""
    kind = type(value)
    if kind is Tensor or kind is nn.Parameter:
        why = unsupported(value)
        if why is not None:
            raise TypeError(f"{where} is {why}")
        return
    if kind in _PLAIN:
        return
    if kind in (list, tuple, dict):
        if id(value) in path:
            raise ValueError(f"{where} contains itself; extra must be a tree, not a cycle")
        inner = path | {id(value)}
        if kind is dict:
            for key, item in value.items():
                if type(key) is not str:
                    raise TypeError(f"{where} has the key {key!r}; extra takes string keys only")
                _check_extra(item, f"{where}[{key!r}]", inner)
        else:
            for i, item in enumerate(value):
                _check_extra(item, f"{where}[{i}]", inner)
        return
    if isinstance(value, Tensor):
        convert: str | None = "x.as_subclass(torch.Tensor)"
    else:
        convert = next((c for base, c in _CONVERT.items() if isinstance(value, base)), None)
    hint = f"; convert it ({convert}) before saving" if convert else ""
    raise TypeError(
        f"{where} is a {_type_name(kind)}; extra holds tensors, numbers, "
        "strings, None, and lists, tuples and dicts of them, of exactly those types (what "
        f"loads without running code){hint}"
    )


def _type_name(kind: type) -> str:
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def unsupported(t: Tensor) -> str | None:
    """Why a snapshot cannot hold ``t`` (and how to make it a plain tensor), or ``None``."""
    if t.is_nested:
        return "a nested tensor; save its parts (x.unbind()) instead"
    if t.layout != torch.strided:
        return f"a {t.layout} tensor; convert it with x.to_dense() before saving"
    if t.is_quantized:
        return "a quantized tensor; save x.dequantize() (or its int_repr() and scales) instead"
    if t.device.type == "meta":
        return "a tensor on the meta device, which holds no data; materialise it first"
    return None


def _raw_bytes(t: Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, without copying (keep ``t`` alive
    while the view is used)."""
    size = t.numel() * t.element_size()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B")


def _digest_tensor(t: Tensor, where: str = "") -> str:
    """SHA-256 of the tensor's dtype, shape and bytes, hashed straight from its memory
    (hashlib releases the GIL, so tensors hash in parallel)."""
    why = unsupported(t)
    if why is not None:
        raise TypeError(f"{where or 'a tensor'} is {why}")
    data = t.detach().resolve_conj().resolve_neg()
    data = data.cpu().contiguous()
    h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    h.update(_raw_bytes(data))
    return h.hexdigest()


def _checksums(payload: Mapping[str, Any]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes (dtype and shape included), by its path in the
    payload, and under ``""`` of everything else (the structure, numbers and strings)."""
    tensors: dict[str, Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, Tensor):
            tensors[where] = value
            return "<tensor>"
        if isinstance(value, Mapping):
            return [(repr(k), walk(v, f"{where}[{k!r}]")) for k, v in value.items()]
        if isinstance(value, list | tuple):
            return [type(value).__name__, *(walk(v, f"{where}[{i}]") for i, v in enumerate(value))]
        return repr(value)

    rest = walk({k: v for k, v in payload.items() if k != "checksums"}, "")
    # the largest first, so that the threads finish together
    order = sorted(tensors, key=lambda k: -tensors[k].numel() * tensors[k].element_size())
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(lambda k: _digest_tensor(tensors[k], k), order)
        sums = dict(zip(order, digests, strict=True))
    sums[""] = hashlib.sha256(repr(rest).encode()).hexdigest()
    return sums


@exposed_in("funcmeta.snapshot")
def save(
    path: str | os.PathLike[str],
    *,
    step: int,
    modules: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    generators: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write the training state to ``path`` atomically (see the module docstring).

    ``optimizers`` may hold anything with ``state_dict``/``load_state_dict`` (optimizers,
    learning-rate schedulers, gradient scalers). ``generators`` may hold ``torch.Generator``,
    ``numpy.random.Generator`` (and its bit generators), ``numpy.random.RandomState`` and
    ``random.Random``; anything else raises ``TypeError`` naming it. ``extra`` holds tensors, numbers, strings,
    ``None``, and lists, tuples and dicts (string keys) of them; anything else raises
    ``TypeError`` naming it.
    """
    check_int(step, "step", what="a non-negative int")
    extra = dict(extra or {})
    _check_extra(extra, "extra")
    payload: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "modules": {k: m.state_dict() for k, m in (modules or {}).items()},
        "optimizers": {k: o.state_dict() for k, o in (optimizers or {}).items()},
        "generators": {
            k: get_state(g, f"generators[{k!r}]") for k, g in (generators or {}).items()
        },
        "random": _random_states(),
        "extra": extra,
    }
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a directory; pass the path of the snapshot file")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target, ".tmp")  # of saves of this path that were interrupted
    fd, tmp = make_temp(target, ".tmp")
    try:
        with os.fdopen(fd, "wb") as f, _crc32_on():
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


@contextlib.contextmanager
def _crc32_on() -> Iterator[None]:
    """``torch.save`` stores each record's CRC-32 within (a user may have turned it off)."""
    if compute_crc32():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


def _check_records(path: Path) -> RecordCheck:
    """The CRC-32 of every record, checked before anything in the file is unpickled."""
    try:
        return check_records(path)
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise SnapshotError(f"{path} is truncated, corrupt or not a torch file ({e})") from None


def _corrupt(path: Path, what: list[str]) -> SnapshotError:
    names = ", ".join(what[:5]) + (", ..." if len(what) > 5 else "")
    return SnapshotError(
        f"{path} is corrupt: its data does not match the checksums written with it "
        f"({names}); nothing was restored"
    )


def _read(path: Path, map_location: Any) -> dict[str, Any]:
    """The payload of a snapshot file, read without running code, its format checked."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; pass the path of the snapshot file")
    if not path.is_file():
        raise FileNotFoundError(f"no snapshot at {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes zip archives; a cut one has no index
        raise SnapshotError(f"{path} is truncated, corrupt or not a file that torch.save writes")
    records = _check_records(path)
    if records.bad and records.has_crcs:
        # data.pkl is the structure, numbers and strings; data/<n> is a tensor's bytes
        raise _corrupt(path, [_record_name(r) for r in records.bad])
    try:
        # mapped, not read: format 3's checksums read each tensor's bytes once, straight from the
        # file; what is kept is copied out of the mapping afterwards (_materialised)
        payload = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
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
    if found == 3:
        missing |= {"checksums"} - payload.keys()
    if missing:
        raise SnapshotError(f"{path} is not a complete funcmeta snapshot: no {sorted(missing)}")
    if found >= 4:
        if not records.has_crcs:
            raise SnapshotError(
                f"{path} stores no CRC-32 of its records, which every snapshot of format "
                f"{found} does: it was not written by fm.snapshot.save"
            )
        if file_stamp(path) != records.stamp:
            raise SnapshotError(f"{path} was replaced or changed while it was read; load it again")
    if found == 3:
        _check_sha256(path, payload)
    return _materialised(payload)


def _check_sha256(path: Path, payload: Mapping[str, Any]) -> None:
    """Format 3's checksums: SHA-256 of every tensor and of everything else, in the payload."""
    saved = payload["checksums"]
    now = _checksums(payload)
    if not isinstance(saved, dict) or saved != now:
        keys = saved.keys() | now.keys() if isinstance(saved, dict) else now.keys()
        bad = sorted(k for k in keys if not isinstance(saved, dict) or saved.get(k) != now.get(k))
        raise _corrupt(path, ["the numbers and structure" if k == "" else k for k in bad])


def _record_name(record: str) -> str:
    """What a record of the archive holds, for an error message."""
    inner = record.partition("/")[2]
    if inner == "data.pkl":
        return "the numbers and structure"
    if inner.startswith("data/"):
        return f"the bytes of tensor record {inner}"
    return f"record {inner or record}"


def _materialised(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload with every tensor in memory of its own, not in the file's mapping (a file
    replaced in place later would pull the pages from under it). Module states are left
    mapped: ``load_state_dict`` copies them into the module's own tensors."""

    def copy_out(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.clone() if value.device.type == "cpu" else value
        if isinstance(value, dict):
            return {k: copy_out(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(copy_out(v) for v in value)
        return value

    return {k: v if k == "modules" else copy_out(v) for k, v in payload.items()}


@exposed_in("funcmeta.snapshot")
def load(
    path: str | os.PathLike[str],
    *,
    modules: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    generators: Mapping[str, Any] | None = None,
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
    _check_shapes(path, given["modules"], payload["modules"])
    for name, g in given["generators"].items():
        try:
            check_state(g, payload["generators"][name], f"generators[{name!r}]")
        except TypeError as e:
            raise SnapshotError(f"{path}: {e}; nothing was restored") from None
    # modules last: the restores that can fail (an optimizer's parameter groups, a
    # generator's state) come first, and the last module needs no copy of its state to put
    # back when its load_state_dict is torch's own (see _plain_load)
    names = list(given["modules"])
    restore = [
        *(
            _Restorer(f"generators[{n!r}]", g, payload["generators"][n], generator=True)
            for n, g in given["generators"].items()
        ),
        *(
            _Restorer(f"optimizers[{n!r}]", o, payload["optimizers"][n])
            for n, o in given["optimizers"].items()
        ),
        _Restorer("the random states", None, payload["random"], random_states=True),
        *(
            _Restorer(
                f"modules[{n!r}]",
                m,
                payload["modules"][n],
                backup=n != names[-1] or not _plain_load(m),
            )
            for n, m in given["modules"].items()
        ),
    ]
    done: list[_Restorer] = []
    try:
        for r in restore:
            r.apply()
            done.append(r)
    except Exception as e:
        failed = restore[len(done)]
        if failed.before is not None:  # it may have failed part way
            failed.undo()
        for r in reversed(done):
            r.undo()
        partly = (
            f"; {failed.name} may be partly restored, the rest was put back"
            if failed.before is None and isinstance(failed.obj, nn.Module)
            else "; nothing was restored (what had been was put back)"
        )
        raise SnapshotError(
            f"{path}: restoring {failed.name} failed ({type(e).__name__}: {e}){partly}"
        ) from e
    return Snapshot(payload["step"], payload["extra"])


def _check_shapes(
    path: str | os.PathLike[str], modules: Mapping[str, nn.Module], saved: Mapping[str, Any]
) -> None:
    """Every saved module state has the module's entries and shapes, checked before anything
    is restored."""
    for name, module in modules.items():
        want = module.state_dict()
        state = saved[name]
        if not isinstance(state, Mapping):
            raise SnapshotError(f"{path}: modules[{name!r}] is not a state dict")
        missing = sorted(want.keys() - state.keys())
        unexpected = sorted(state.keys() - want.keys())
        if missing or unexpected:
            raise SnapshotError(
                f"{path}: modules[{name!r}] does not match the module: missing {missing}, "
                f"unexpected {unexpected}; nothing was restored"
            )
        for key, value in want.items():
            got = state[key]
            if isinstance(value, Tensor) and (
                not isinstance(got, Tensor) or got.shape != value.shape
            ):
                shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
                raise SnapshotError(
                    f"{path}: modules[{name!r}][{key!r}] has shape {shape}; the module has "
                    f"{tuple(value.shape)}; nothing was restored"
                )


class _Restorer:
    """Restores one object from its saved state, keeping what it held before, to put back if
    a later restore fails (a module without ``backup`` is restored last: it keeps nothing)."""

    def __init__(
        self,
        name: str,
        obj: Any,
        state: Any,
        *,
        generator: bool = False,
        random_states: bool = False,
        backup: bool = True,
    ) -> None:
        self.name, self.obj, self.state = name, obj, state
        self.generator, self.random_states, self.backup = generator, random_states, backup
        self.before: Any = None

    def apply(self) -> None:
        obj = self.obj
        if self.random_states:
            self.before = _random_states()
            _restore_random(self.state)
        elif self.generator:
            self.before = get_state(obj, self.name)
            set_state(obj, self.state, self.name)
        elif isinstance(obj, nn.Module):
            if self.backup:
                self.before = {k: v.clone() for k, v in obj.state_dict().items()}
            obj.load_state_dict(self.state)
        elif isinstance(obj, torch.optim.Optimizer):
            # its load_state_dict puts new tensors in place and leaves the old ones as they
            # were: references to them are a backup, no copy needed
            self.before = obj.state_dict()
            obj.load_state_dict(self.state)
        else:
            self.before = copy.deepcopy(obj.state_dict())
            obj.load_state_dict(self.state)

    def undo(self) -> None:
        if self.random_states:
            _restore_random(self.before)
        elif self.generator:
            set_state(self.obj, self.before, self.name)
        elif isinstance(self.obj, nn.Module):
            # copied straight back, past the module's hooks (one may be what failed)
            with torch.no_grad():
                for k, v in self.obj.state_dict().items():
                    v.copy_(self.before[k])
        else:
            self.obj.load_state_dict(self.before)


def _plain_load(module: nn.Module) -> bool:
    """Whether ``module.load_state_dict`` is torch's own throughout: no hooks, no overrides
    outside ``torch.nn``. After :func:`_check_shapes` it then only copies tensors of the
    right shapes into place, which fails only if the device does (out of memory)."""
    if type(module).load_state_dict is not nn.Module.load_state_dict:
        return False
    for m in module.modules():
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return False
        if not type(m)._load_from_state_dict.__module__.startswith("torch.nn."):
            return False
    return True
