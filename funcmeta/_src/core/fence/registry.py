"""The one registry of the fence's private accesses: each subsystem's module adds its own,
by name, with a probe that is ``True`` when this torch release has it."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ACCESSES", "missing_accesses"]

ACCESSES: dict[str, Callable[[], bool]] = {}
"""Every private access, by name, with a probe: ``True`` when this torch has it."""


def missing_accesses() -> list[str]:
    """The names of :data:`ACCESSES` that this torch release lacks."""
    return [name for name, probe in ACCESSES.items() if not probe()]
