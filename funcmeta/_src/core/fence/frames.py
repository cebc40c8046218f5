"""Python's frames: a caller's frame and its locals, and the ``stacklevel`` that points a
warning at the user's code."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["caller_frame", "frame_executes", "frame_local", "user_stacklevel"]


def caller_frame(depth: int = 1) -> types.FrameType | None:
    """The frame ``depth`` calls above the caller of this function."""
    return sys._getframe(depth + 1)


def frame_local(frame: types.FrameType | None, name: str, default: Any = None) -> Any:
    """The local variable ``name`` of ``frame`` (``default`` if it has none)."""
    return default if frame is None else frame.f_locals.get(name, default)


def frame_executes(frame: types.FrameType | None, function: Callable[..., Any]) -> bool:
    """Whether ``frame`` runs ``function``'s code."""
    code = getattr(function, "__code__", None)
    return frame is not None and code is not None and frame.f_code is code


_PACKAGE = str(Path(__file__).resolve().parents[3]) + "/"


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn``, called right where this is called, that
    points at the first frame outside funcmeta: the user's call, however deep the warning
    is raised."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
