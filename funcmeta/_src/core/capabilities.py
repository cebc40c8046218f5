"""What each funcmeta capability needs of torch, and the refusal where the running torch
falls short of it.

The package installs on every torch from its declared floor on; a capability that is exact
only from a later release, or that needs a private access the running torch lacks (a probe
of the fence, :data:`~funcmeta._src.core.fence.ACCESSES`), refuses at the call that would use
it with :class:`UnsupportedTorchError`, naming the capability, the torch installed and the
torch it needs: never a wrong number. The floors are those the suite found exact, torch
release by torch release (``docs/torch-versions.md``, made by ``scripts/torch_matrix.py``
from ``make test-matrix``'s runs).

Example:
    >>> from funcmeta._src.core.capabilities import CAPABILITIES, missing
    >>> CAPABILITIES["checkpoint_steps"].floor
    (2, 8)
    >>> missing("inner loops") is None
    True
"""

from __future__ import annotations

import dataclasses
import re

import torch

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import ACCESSES

__all__ = [
    "CAPABILITIES",
    "Capability",
    "UnsupportedTorchError",
    "missing",
    "require",
    "torch_capabilities",
    "torch_release",
]


@exposed_in("funcmeta")
class UnsupportedTorchError(Exception):
    """A capability that the running torch cannot give exactly: it names the capability
    (also as its attribute ``capability``), the torch installed and the torch it needs. No
    ``RuntimeError``: an ``except RuntimeError`` around a call does not swallow it."""

    def __init__(self, message: str, capability: str) -> None:
        super().__init__(message)
        self.capability = capability


@dataclasses.dataclass(frozen=True)
class Capability:
    """One capability: the oldest torch release on which it is exact (``floor``, major and
    minor), the fence's private accesses it needs (``accesses``), and why (``why``, for the
    refusal)."""

    floor: tuple[int, int]
    accesses: tuple[str, ...] = ()
    why: str = ""


#: Every capability with its floor. The package's floor (``torch>=`` in ``pyproject.toml``)
#: is the core's, ``inner loops``.
CAPABILITIES: dict[str, Capability] = {
    "inner loops": Capability((2, 5)),
    "checkpoint_layers": Capability((2, 5)),
    "task batching": Capability((2, 5)),
    "checkpoint_steps": Capability(
        (2, 8),
        ("torch._C._autograd._top_saved_tensors_default_hooks",),
        "a step checkpoint checks the tensors its step saves for in-place writes through "
        "the saved-tensor hooks in force, which torch lets a library read from 2.8 on; "
        "without the check, a forward that changes a saved tensor in place gives wrong "
        "meta-gradients without a word",
    ),
    "sharded models": Capability(
        (2, 11),
        (),
        "DTensor has no sharding rule before 2.11 for operations the inner loops run on "
        "shards: softplus (a learnable rate's parameterization; 2.10 and older), unbind and "
        "select (per-step rates; 2.9 and older)",
    ),
}


def torch_release(version: str | None = None) -> tuple[int, int]:
    """The major and minor release of ``version`` (``torch.__version__`` by default):
    ``"2.11.0+cu130"`` gives ``(2, 11)``."""
    text = torch.__version__ if version is None else version
    found = re.match(r"(\d+)\.(\d+)", str(text))
    if found is None:
        raise ValueError(f"cannot read a torch release from {text!r}")
    return int(found.group(1)), int(found.group(2))


def missing(name: str, version: str | None = None) -> str | None:
    """Why the running torch (or ``version``) cannot give the capability ``name``, or
    ``None`` where it can: below its floor, or a private access it needs is missing."""
    capability = CAPABILITIES[name]
    installed = torch.__version__ if version is None else version
    floor = ".".join(map(str, capability.floor))
    if torch_release(installed) < capability.floor:
        return f"{name} needs torch >= {floor}, and torch {installed} is installed"
    unknown = [a for a in capability.accesses if a not in ACCESSES]
    if unknown:  # a name the fence does not register: a mistake here, not on the user's side
        raise KeyError(f"{name} names {unknown}, which the fence does not register (ACCESSES)")
    lacking = [a for a in capability.accesses if not ACCESSES[a]()]
    if lacking:
        return (
            f"{name} needs {', '.join(lacking)}, which torch {installed} lacks (its floor is "
            f"torch {floor})"
        )
    return None


@exposed_in("funcmeta")
def torch_capabilities() -> dict[str, str | None]:
    """Each capability of funcmeta on the running torch: ``None`` where it runs (exact),
    else why it refuses (the torch it needs).

    Example:
        >>> import funcmeta as fm
        >>> fm.torch_capabilities()["inner loops"] is None
        True
    """
    return {name: missing(name) for name in CAPABILITIES}


def require(name: str, entry: str) -> None:
    """Raise :class:`UnsupportedTorchError` where the running torch cannot give the
    capability ``name``, which ``entry`` (the call, for the message) would use."""
    why = missing(name)
    if why is None:
        return
    reason = CAPABILITIES[name].why
    raise UnsupportedTorchError(
        f"{entry}: {why}{f' ({reason})' if reason else ''}. Install a newer torch "
        f"(pip install 'torch>={'.'.join(map(str, CAPABILITIES[name].floor))}'), or leave "
        f"{name} out.",
        name,
    )
