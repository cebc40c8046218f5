"""Shadow module trees: a stand-in for some submodules of a tree, the tree itself untouched.

:func:`shadow` builds a tree that runs like the original, with chosen submodules replaced by
stand-ins. The chosen submodules are layers under per-layer checkpointing, or the task-batched
fast path for ``nn.Linear``. Only the modules on the path from the root to a replaced one
are shallow copies, with their own child dicts. Every parameter and buffer dict is shared
with the original, so a name reaches the same tensors in both trees.

Example:
    >>> import torch
    >>> from funcmeta._src.module.shadow import shadow
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    >>> root, copies = shadow(net, {"1": lambda m: torch.nn.Identity()})
    >>> type(root[1]).__name__, type(net[1]).__name__, root[0] is net[0]
    ('Identity', 'Tanh', True)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

from funcmeta._src.core.fence import (
    has_hooks,
    module_dict,
    set_module_dict,
    share_dicts,
    take_attributes,
    write_back_attributes,
)

__all__ = [
    "LayerTensors",
    "Standin",
    "ancestors",
    "has_hooks",
    "relative",
    "shadow",
    "synced",
    "within",
]


@dataclass(frozen=True)
class LayerTensors:
    """The names of a layer's parameters and buffers, to call it as a pure function of their
    tensors (a checkpointed layer, a layer run once per task)."""

    params: tuple[str, ...]
    buffers: tuple[str, ...]

    @classmethod
    def of(cls, module: nn.Module) -> tuple[LayerTensors, list[Tensor], list[Tensor]]:
        """``(names, parameter tensors, buffer tensors)`` of ``module`` as it holds them now."""
        params = list(module.named_parameters())
        buffers = list(module.named_buffers())
        names = cls(tuple(n for n, _ in params), tuple(n for n, _ in buffers))
        return names, [t for _, t in params], [t for _, t in buffers]

    def call(
        self,
        module: nn.Module,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``module(*args, **kwargs)`` with these tensors in place of its own."""
        tensors = (
            dict(zip(self.params, params, strict=True)),
            dict(zip(self.buffers, buffers, strict=True)),
        )
        return functional_call(module, tensors, args, kwargs)


def ancestors(name: str) -> list[str]:
    """The names of the modules above submodule ``name`` (``""`` is the root)."""
    parts = name.split(".") if name else []
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))] if parts else []


def within(name: str, layer: str) -> bool:
    """Whether submodule ``name`` is ``layer`` or lies inside it (``""`` is the root)."""
    return layer == "" or name == layer or name.startswith(layer + ".")


def relative(name: str, layer: str) -> str:
    """``name`` relative to ``layer``, which holds it (``""`` for the layer itself)."""
    return name if layer == "" else name[len(layer) + 1 :]


class Standin(nn.Module):
    """Stands in for ``original`` in a shadow tree and shares its parameter, buffer and child
    dicts, so names resolve to the same tensors. Calling it runs its ``forward`` directly,
    without hooks: the original's hooks (and global ones) run once, when the stand-in calls
    the original, or the stand-in computes the layer itself only when there are none.
    Attributes it lacks are read from the original."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        share_dicts(self, original)
        self.__dict__["_fm_original"] = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @property
    def original(self) -> nn.Module:
        return self.__dict__["_fm_original"]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_fm_original"], name)


def shadow(
    module: nn.Module, replace: dict[str, Callable[[nn.Module], nn.Module]]
) -> tuple[nn.Module, list[tuple[nn.Module, nn.Module]]]:
    """A tree that runs like ``module`` with the submodules named in ``replace`` swapped for
    ``replace[name](submodule)``.

    Returns ``(root, copies)``. ``copies`` pairs each shallow copy with its original, for
    :func:`synced`. Nothing in ``module`` is changed.
    """
    if not replace:
        return module, []
    on_path = {a for n in replace for a in ancestors(n)}
    copies: list[tuple[nn.Module, nn.Module]] = []

    def build(m: nn.Module, name: str) -> nn.Module:
        if name in replace:
            return replace[name](m)
        if name not in on_path:
            return m
        twin = copy.copy(m)
        prefix = f"{name}." if name else ""
        set_module_dict(
            twin,
            {
                child_name: (None if child is None else build(child, prefix + child_name))
                for child_name, child in module_dict(m).items()
            },
        )
        copies.append((twin, m))
        return twin

    return build(module, ""), copies


@contextlib.contextmanager
def synced(copies: Sequence[tuple[nn.Module, nn.Module]]) -> Iterator[None]:
    """Run a shadow tree as its originals: every shallow copy takes its original's attributes
    (all but its child dict: ``training`` after ``.train()``/``.eval()``, flags and caches a
    library sets lazily) before the block, and what the block sets on a copy is written back
    to its original after it. Without the write-back, a library that installs hooks lazily
    and marks the module as done (HuggingFace's ``output_hidden_states`` capture) would mark
    only the copy, and install its hooks again on the next plain call."""
    for twin, original in copies:
        take_attributes(twin, original)
    try:
        yield
    finally:
        for twin, original in copies:
            write_back_attributes(twin, original)
