"""Why task batching falls back to a loop over the tasks: which layer refused ``vmap``, and why.

When part of a model's forward cannot run under ``vmap`` (it branches on tensor values, or
calls an operator without a batching rule), task batching runs the whole model once per
task. :func:`describe_refusal` turns ``vmap``'s error into a sentence naming the innermost
submodule whose forward raised it, found in the error's traceback, so that the fallback is
said once and :attr:`funcmeta.FunctionalModel.per_task_layers` can report it.

Example:
    >>> import torch
    >>> from funcmeta._src.batching.fallback import describe_refusal
    >>> class Branchy(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x if x.sum() > 0 else -x
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), Branchy())
    >>> try:
    ...     torch.func.vmap(net)(torch.randn(3, 2))
    ... except RuntimeError as error:
    ...     print(describe_refusal(error, [net]))
    ('1', 'Branchy: its forward branches on tensor values (data-dependent control flow)')
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterable

from torch import nn

from funcmeta._src.core.fence import frame_local
from funcmeta._src.module.shadow import Standin

__all__ = ["describe_refusal"]


def _layer(error: BaseException, roots: Iterable[nn.Module]) -> tuple[str, nn.Module] | None:
    """The innermost submodule of ``roots`` whose ``forward`` is on ``error``'s traceback."""
    names: dict[int, tuple[str, nn.Module]] = {}
    for root in roots:
        for name, module in root.named_modules():
            names.setdefault(id(module), (name, module))
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame_local(frame, "self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = names[id(owner)]
    return found


def _reason(error: BaseException) -> str:
    message = str(error)
    if "data-dependent control flow" in message or "item()" in message:
        return "its forward branches on tensor values (data-dependent control flow)"
    op = re.search(r"aten::[\w.]+", message)
    if "batching rule" in message and op:
        return f"it calls {op.group(0)}, which has no vmap batching rule"
    first = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    return first[:200]


def describe_refusal(error: BaseException, roots: Iterable[nn.Module]) -> tuple[str, str]:
    """``(layer name, why)`` for ``vmap``'s refusal ``error`` raised in a forward of one of
    ``roots`` (the user's module and the runners built on it); the name is ``""`` for the
    root's own forward, and the reason starts with the layer's type."""
    found = _layer(error, roots)
    name, module = found if found is not None else ("", None)
    if isinstance(module, Standin):  # a checkpointed layer or a fast path: name the layer
        module = module.original
    kind = type(module).__name__ if module is not None else "the model"
    return name, f"{kind}: {_reason(error)}"
