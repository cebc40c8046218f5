"""Where a call of ``torch.utils.checkpoint.checkpoint`` happens: inside a functional model's
run, inside one of funcmeta's checkpointed functions, or elsewhere.

A model may checkpoint its own layers (``checkpoint(block, x)`` in its ``forward``, or
HuggingFace's ``gradient_checkpointing_enable()``). torch recomputes such a block during the
backward, with whatever tensors the block holds then: after a functional model's run, that is
the module's own parameters, not the ones the run was given. So while a functional model runs
(:func:`model_run`) and while funcmeta runs a checkpointed function (:func:`checkpoint_body`),
``checkpoint`` calls are redirected (``funcmeta._src.core.fence.checkpoint_redirected``) to
``funcmeta._src.checkpoint.takeover``, which asks :func:`current` what to do. The state is per
thread: a call in another thread runs torch's own ``checkpoint``.

Example:
    >>> import torch
    >>> from funcmeta._src.module import scope
    >>> scope.current() is None
    True
    >>> with scope.model_run(torch.nn.Linear(1, 1)):
    ...     scope.current().kind
    'run'
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from funcmeta._src.core.fence import checkpoint_redirected

__all__ = ["Scope", "current", "model_run", "checkpoint_body"]


@dataclass(frozen=True)
class Scope:
    """``kind`` is ``"run"`` (a functional model's run of ``root``, the module tree that runs)
    or ``"checkpoint"`` (the body of a checkpointed function: its recomputations replay it)."""

    kind: str
    root: nn.Module | None = None


_STATE = threading.local()


def current() -> Scope | None:
    """The innermost scope of this thread, or ``None`` outside every one."""
    return getattr(_STATE, "scope", None)


@contextlib.contextmanager
def _entered(scope: Scope) -> Iterator[None]:
    saved = current()
    with checkpoint_redirected():
        _STATE.scope = scope
        try:
            yield
        finally:
            _STATE.scope = saved


def model_run(root: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The block runs the module tree ``root`` as a functional model: ``checkpoint`` calls in
    it are checkpointed by funcmeta with the tensors the run was given."""
    return _entered(Scope("run", root))


_CHECKPOINT = Scope("checkpoint")


def checkpoint_body() -> contextlib.AbstractContextManager[None]:
    """The block is the body of a checkpointed function: ``checkpoint`` calls in it run
    their function as it is (the enclosing checkpointing already keeps only inputs)."""
    return _entered(_CHECKPOINT)
