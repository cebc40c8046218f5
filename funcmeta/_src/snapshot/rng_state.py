"""The state of a random generator as plain values (tensors, numbers, strings, containers),
which a ``weights_only`` load reads without running code, and back.

Kinds: ``torch.Generator`` (its byte state, as before), NumPy's ``Generator``, its bit
generators (``PCG64``, ``MT19937``, ``Philox``, ``SFC64``, ...) and the legacy
``RandomState``, and Python's ``random.Random``. A NumPy array inside a state (MT19937's key,
Philox's counter) is kept as its bytes in a ``uint8`` tensor with its dtype and shape.

Example:
    >>> import numpy as np
    >>> from funcmeta._src.snapshot.rng_state import get_state, set_state
    >>> rng = np.random.default_rng(0)
    >>> saved = get_state(rng, "tasks")
    >>> a = rng.random()
    >>> set_state(rng, saved, "tasks")
    >>> rng.random() == a
    True
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch import Tensor

__all__ = ["KINDS", "check_state", "get_state", "set_state"]

KINDS = (
    "torch.Generator, numpy.random.Generator, a numpy.random.BitGenerator, "
    "numpy.random.RandomState or random.Random"
)


def _kind(obj: Any) -> str | None:
    if isinstance(obj, torch.Generator):
        return "torch.Generator"
    if isinstance(obj, random.Random):
        return "random.Random"
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    if isinstance(obj, numpy.random.Generator):
        return "numpy.random.Generator"
    if isinstance(obj, numpy.random.RandomState):
        return "numpy.random.RandomState"
    if isinstance(obj, numpy.random.BitGenerator):
        return "numpy.random.BitGenerator"
    return None


def _plain(value: Any) -> Any:
    """NumPy arrays and scalars inside a state, as tensors and Python numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        raw = numpy.ascontiguousarray(value)
        return {
            "ndarray": raw.dtype.str,
            "shape": list(raw.shape),
            "bytes": torch.from_numpy(numpy.frombuffer(raw.tobytes(), numpy.uint8).copy()),
        }
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    return value


def _native(value: Any) -> Any:
    """The inverse of :func:`_plain`."""
    if isinstance(value, dict):
        if value.keys() == {"ndarray", "shape", "bytes"}:
            import numpy

            data = numpy.frombuffer(value["bytes"].numpy().tobytes(), numpy.dtype(value["ndarray"]))
            return data.reshape(value["shape"]).copy()
        return {k: _native(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_native(v) for v in value)
    return value


def get_state(obj: Any, where: str) -> Any:
    """The state of ``obj`` as plain values; ``TypeError`` naming ``where`` for another kind."""
    kind = _kind(obj)
    if kind == "torch.Generator":
        return obj.get_state()  # a uint8 tensor, as snapshots have always stored it
    if kind is None:
        raise TypeError(f"{where} is a {type(obj).__qualname__}; a generator is a {KINDS}")
    state = obj.getstate() if kind == "random.Random" else _numpy_state(obj, kind)
    return {"kind": kind, "type": type(obj).__qualname__, "state": _plain(state)}


def check_state(obj: Any, saved: Any, where: str) -> str:
    """The kind of ``obj``; ``TypeError`` naming ``where`` when ``saved`` (from
    :func:`get_state`) is the state of another kind of generator, or of another bit generator."""
    kind = _kind(obj)
    if kind is None:
        raise TypeError(f"{where} is a {type(obj).__qualname__}; a generator is a {KINDS}")
    saved_kind = "torch.Generator" if isinstance(saved, Tensor) else "an unknown generator"
    if isinstance(saved, dict) and isinstance(saved.get("kind"), str):
        saved_kind = saved["kind"]
    if saved_kind != kind:
        raise TypeError(f"{where} is a {kind}, but the saved state is of a {saved_kind}")
    if kind.startswith("numpy") and isinstance(saved.get("state"), dict):
        want = _numpy_state(obj, kind).get("bit_generator")
        got = saved["state"].get("bit_generator")
        if want != got:
            raise TypeError(f"{where} draws from {want}, but the saved state is of {got}")
    return kind


def _numpy_state(obj: Any, kind: str) -> dict:
    if kind == "numpy.random.Generator":
        return obj.bit_generator.state
    if kind == "numpy.random.RandomState":
        return obj.get_state(legacy=False)
    return obj.state


def set_state(obj: Any, saved: Any, where: str) -> None:
    """Put ``saved`` (from :func:`get_state`) into ``obj``; ``TypeError`` naming ``where`` when
    it is the state of another kind of generator (:func:`check_state`)."""
    kind = check_state(obj, saved, where)
    if kind == "torch.Generator":
        obj.set_state(saved)
        return
    state = _native(saved["state"])
    if kind == "random.Random":
        obj.setstate(_as_tuples(state))
    elif kind == "numpy.random.Generator":
        obj.bit_generator.state = state
    elif kind == "numpy.random.RandomState":
        obj.set_state(state)
    else:
        obj.state = state


def _as_tuples(state: Any) -> Any:
    """``random.Random.setstate`` takes tuples; a load may give them back as lists."""
    if isinstance(state, list | tuple):
        return tuple(_as_tuples(v) for v in state)
    return state
