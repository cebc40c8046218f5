"""Whether funcmeta is running a forward again: :func:`recomputing`.

Some forwards run more than once. A layer under per-layer checkpointing runs at the forward
and again at every backward that goes through it (twice in a backward that goes through the
graph of a recorded one); an inner step under ``checkpoint_steps`` runs again in the outer
backward; the first task-batched call of a model runs it once without a graph, to find out
whether it can run under ``vmap``. Forward hooks and pre-hooks run at each of these runs,
as they do under ``torch.utils.checkpoint``. A hook with side effects (one that appends to a
list, counts or logs) checks :func:`recomputing` to act once per real call.

Example:
    >>> import torch, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    >>> seen = []
    >>> _ = net[0].register_forward_hook(
    ...     lambda m, i, o: None if fm.recomputing() else seen.append(o.shape))
    >>> fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    >>> fmodel(fmodel.params, torch.ones(3, 2)).sum().backward()   # recomputes net[0]
    >>> len(seen)
    1
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from funcmeta._src.core.exposed import exposed_in

__all__ = ["recomputation", "recomputing"]

_LOCK = threading.Lock()
_DEPTH = [0]  # a count, not a thread-local: backward may run on autograd's own threads


@exposed_in("funcmeta")
def recomputing() -> bool:
    """``True`` while funcmeta runs a forward again (a checkpoint's recomputation, or the
    one-time probe of a task-batched model), ``False`` during the forward itself."""
    return _DEPTH[0] > 0


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """Mark the block as a recomputation for :func:`recomputing`."""
    with _LOCK:
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
