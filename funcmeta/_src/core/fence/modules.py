"""``nn.Module`` internals: its ``_parameters``, ``_buffers`` and ``_modules`` dicts (shadow
module trees share them; :class:`funcmeta.FunctionalModel` swaps tensors in them), its hook
dictionaries, a convolution's ``_conv_forward`` and padding, multi-head attention's packed
projection flag, ``functional_call``'s reparametrisation as a context, and the modules on an
error's traceback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import Tensor, nn

from funcmeta._src.core.fence.registry import ACCESSES

__all__ = [
    "buffer_dict",
    "conv_forward",
    "conv_padding",
    "has_hooks",
    "module_dict",
    "parameter_dict",
    "qkv_same_embed_dim",
    "reparametrized",
    "set_module_dict",
    "share_dicts",
    "take_attributes",
    "traceback_modules",
    "write_back_attributes",
]


def parameter_dict(module: nn.Module) -> dict[str, Any]:
    """The module's own ``_parameters`` dict (the object, not a copy)."""
    return module._parameters


def buffer_dict(module: nn.Module) -> dict[str, Any]:
    """The module's own ``_buffers`` dict (the object, not a copy)."""
    return module._buffers


def module_dict(module: nn.Module) -> dict[str, Any]:
    """The module's own ``_modules`` dict (the object, not a copy)."""
    return module._modules


def share_dicts(standin: nn.Module, original: nn.Module) -> None:
    """Give ``standin`` the very parameter, buffer and child dicts of ``original``, so that a
    name reaches the same tensors in both (a stand-in in a shadow tree)."""
    standin.__dict__["_parameters"] = original._parameters
    standin.__dict__["_buffers"] = original._buffers
    standin.__dict__["_modules"] = original._modules


def set_module_dict(module: nn.Module, children: dict[str, Any]) -> None:
    """Give ``module`` (a shallow copy) a child dict of its own."""
    module.__dict__["_modules"] = children


def take_attributes(twin: nn.Module, original: nn.Module) -> None:
    """Give the shallow copy ``twin`` every attribute of ``original`` but its child dict."""
    children = twin._modules
    twin.__dict__.update(original.__dict__)
    twin.__dict__["_modules"] = children


def write_back_attributes(twin: nn.Module, original: nn.Module) -> None:
    """Set on ``original`` the attributes the shallow copy ``twin`` holds that ``original``
    lacks or holds another object for (its child dict aside), tensors excepted: a tensor a
    task-batched run keeps on a module is batched, and must not reach the user's module."""
    mine = original.__dict__
    mine.update(
        {
            k: v
            for k, v in twin.__dict__.items()
            if k != "_modules" and (k not in mine or mine[k] is not v) and not isinstance(v, Tensor)
        }
    )


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _HOOKS)


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs forward or backward hooks, its own or global ones.
    Written out, not looped: it runs for every stand-in layer on every call."""
    hooks = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def reparametrized(module: nn.Module, values: dict[str, Tensor]) -> Any:
    """A context in which ``module``'s parameters of those names are ``values``: what
    ``torch.func.functional_call`` does, as a context around other code (torch.compile
    traces it)."""
    from torch.nn.utils import stateless

    return stateless._reparametrize_module(module, values)


def qkv_same_embed_dim(module: nn.MultiheadAttention) -> bool:
    """Whether ``nn.MultiheadAttention`` keeps one packed input projection (query, key and
    value of one size): its private flag."""
    return bool(module._qkv_same_embed_dim)


def conv_forward(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A convolution's forward with the given weight and bias (its padding mode included)."""
    forward = cast(Callable[[Tensor, Tensor, Tensor | None], Tensor], module._conv_forward)
    return forward(x, weight, bias)


def conv_padding(module: nn.Module) -> Any:
    """The ``F.pad`` padding of a convolution with a non-zero padding mode."""
    return module._reversed_padding_repeated_twice


def traceback_modules(error: BaseException) -> list[nn.Module]:
    """The modules whose methods are on ``error``'s traceback (each frame's ``self``),
    outermost first: where in a model a forward failed."""
    found: list[nn.Module] = []
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and (not found or found[-1] is not owner):
            found.append(owner)
        tb = tb.tb_next
    return found


def _has_module_internals() -> bool:
    m = nn.Conv1d(1, 1, 1, padding=1, padding_mode="reflect")
    dicts = (m._parameters, m._buffers, m._modules)
    return (
        all(isinstance(d, dict) for d in dicts)
        and all(hasattr(m, name) for name in _HOOKS)
        and all(hasattr(nn.modules.module, name) for name in _GLOBAL_HOOKS)
        and callable(getattr(m, "_conv_forward", None))
        and hasattr(m, "_reversed_padding_repeated_twice")
    )


ACCESSES["nn.Module _parameters/_buffers/_modules, hook dicts, Conv _conv_forward"] = (
    _has_module_internals
)
