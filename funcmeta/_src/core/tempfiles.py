"""Temporary files written beside a target and renamed into place (snapshots, downloads):
names that carry the writer's process id, so that a later writer can remove those that an
interrupted one left behind without touching one still being written."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from pathlib import Path

__all__ = ["make_temp", "remove_stale"]

_UNNAMED_AGE = 3600.0  # seconds after which a temporary file without a process id is stale


def make_temp(target: Path, suffix: str) -> tuple[int, str]:
    """``(fd, path)`` of a new temporary file beside ``target``, named
    ``.<name>.<pid>.<random><suffix>``."""
    return tempfile.mkstemp(
        prefix=f".{target.name}.{os.getpid()}.", suffix=suffix, dir=target.parent
    )


def remove_stale(target: Path, suffix: str) -> list[Path]:
    """Remove the temporary files of ``target`` left by writers that are gone (the process id
    in the name is not running), and those without a process id older than an hour (older
    releases' names). Returns what was removed; files it cannot remove are left."""
    removed = []
    for tmp in target.parent.glob(f".{glob.escape(target.name)}.*{glob.escape(suffix)}"):
        middle = tmp.name[len(target.name) + 2 : -len(suffix)]
        pid, _, rest = middle.partition(".")
        try:
            if pid.isdigit() and rest and "." not in rest:
                stale = int(pid) != os.getpid() and not _alive(int(pid))
            else:
                stale = time.time() - tmp.stat().st_mtime > _UNNAMED_AGE
            if stale:
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by another user
        return True
    return True
