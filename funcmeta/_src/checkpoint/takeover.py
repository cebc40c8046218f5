"""Checkpoints a model takes itself, run by funcmeta's checkpointing.

A model may checkpoint its own layers: ``torch.utils.checkpoint.checkpoint(block, x)`` in its
``forward`` (either ``use_reentrant``), ``checkpoint_sequential``, or HuggingFace's
``gradient_checkpointing_enable()``. torch recomputes the block during the backward with the
tensors the block holds *then*. After a functional model's run those are the module's own
parameters, not the adapted ones the run was given: the meta-gradients come out silently
wrong (or torch refuses the recomputation). And torch's recomputation is recorded into a
``create_graph`` backward, so second order saves no memory.

While a functional model runs (``funcmeta._src.module.scope.model_run``), every such call is
sent here (:func:`dispatch`) and run by ``funcmeta._src.checkpoint.engine.checkpoint_closed`` as a pure
function of the tensors it reads: its arguments (those bound in a ``functools.partial``
included) and the parameters and buffers of the modules it was given (the function itself,
a bound method's module, modules among its arguments or in its closure; the whole model when
none is found), as the run holds them. Its recomputations put those tensors back in place,
replay the random number generators (the same dropout masks) and the autocast state, and keep
only inputs, in second order too. The first run is checked to depend on nothing else that
requires grad (``funcmeta._src.checkpoint.engine.OpenFunctionError`` otherwise).

Inside a checkpointed function (a layer of ``checkpoint_layers``, or a block taken over
here) a ``checkpoint`` call runs its function as it is: it is checkpointed once. Elsewhere,
and in other threads, torch's own ``checkpoint`` runs.

Example:
    >>> import torch, funcmeta as fm
    >>> from torch.utils.checkpoint import checkpoint
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.block = torch.nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return checkpoint(self.block, x, use_reentrant=False)
    >>> fmodel = fm.functional_model(Net())
    >>> params = {k: v * 2 for k, v in fmodel.params.items()}   # not the module's own
    >>> x = torch.randn(3, 2)
    >>> (g,) = torch.autograd.grad(fmodel(params, x).sum(), params["block.weight"])
    >>> torch.allclose(g, x.sum(0).expand(2, 2))
    True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn
from torch.utils.checkpoint import noop_context_fn

from funcmeta._src.checkpoint.engine import checkpoint_closed
from funcmeta._src.checkpoint.layers import TensorSlots, is_checkpointed_layer
from funcmeta._src.core.fence import original_checkpoint, set_checkpoint_dispatch
from funcmeta._src.core.vmap import any_batched, call_outside_vmap
from funcmeta._src.module import scope

__all__ = ["dispatch"]

#: ``checkpoint``'s own keywords; every other keyword goes to the function.
_OPTIONS = (
    "use_reentrant",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "preserve_rng_state",
)


def dispatch(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call ``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)`` (redirected
    here while funcmeta runs a model or a checkpointed function)."""
    where = scope.current()
    if where is None:
        return original_checkpoint(function, *args, **kwargs)
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    _check_call(function, options, kwargs)
    if where.kind == "checkpoint" or is_checkpointed_layer(function):
        return function(*args, **kwargs)
    assert where.root is not None
    return _recompute(where.root, function, args, kwargs)


def _check_call(function: Any, options: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """torch's own refusals of a call, and the one option funcmeta cannot honour."""
    reentrant = options.get("use_reentrant")
    reentrant = True if reentrant is None else reentrant
    context_fn = options.get("context_fn", noop_context_fn)
    if reentrant:
        if kwargs:
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
        if context_fn is not noop_context_fn or options.get("debug", False) is not False:
            raise ValueError(
                "Passing `context_fn` or `debug` is only supported when use_reentrant=False."
            )
    elif context_fn is not noop_context_fn:
        raise ValueError(
            f"checkpoint({_name_of(function)}, ..., context_fn=...) inside a functional model: "
            "funcmeta recomputes the checkpoints a model takes itself (exact with the "
            "adapted parameters, in second order too) and cannot run them under a context "
            "of torch's checkpoint, such as a selective-checkpointing policy. Drop context_fn "
            "while the model runs under funcmeta, or leave the layer unchecked and choose it "
            "with functional_model(..., checkpoint_layers=[...])"
        )


def _unpartial(
    function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``functools.partial`` objects opened, so that the tensors bound in them are
    arguments (kept for recomputation, and given gradients)."""
    while isinstance(function, functools.partial):
        args = (*function.args, *args)
        kwargs = {**function.keywords, **kwargs}
        function = function.func
    return function, args, kwargs


def _modules_in(values: Sequence[Any]) -> list[nn.Module]:
    """The modules among ``values``, and in lists, tuples and dict values among them."""
    found: list[nn.Module] = []
    for v in values:
        if isinstance(v, nn.Module):
            found.append(v)
        elif isinstance(v, list | tuple):
            found += [m for m in v if isinstance(m, nn.Module)]
        elif isinstance(v, dict):
            found += [m for m in v.values() if isinstance(m, nn.Module)]
    return found


def _modules_of(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[nn.Module]:
    """The modules whose tensors ``function(*args, **kwargs)`` can be seen to read: the
    function if it is one, a bound method's object, modules among the arguments and in the
    function's closure (``checkpoint_sequential``'s segments, ``lambda x: self.block(x)``)."""
    owner = getattr(function, "__self__", None)
    cells = getattr(function, "__closure__", None) or ()
    values: list[Any] = [function, owner, *args, *kwargs.values()]
    for cell in cells:
        with contextlib.suppress(ValueError):  # an empty cell
            values.append(cell.cell_contents)
    return _modules_in(values)


def _recompute(
    root: nn.Module, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``function(*args, **kwargs)`` checkpointed as a pure function of its arguments and
    the tensors of its modules as the run holds them (see the module docstring)."""
    func, args, kwargs = _unpartial(function, args, kwargs)
    modules = _modules_of(func, args, kwargs) or [root]
    slots = TensorSlots(modules)
    ptensors, btensors = slots.tensors()
    n_p, n_b = len(ptensors), len(btensors)
    calls = [0]

    def body(inputs: tuple[Any, ...], kw: dict[str, Any], live: list[Tensor]) -> Any:
        # The first run writes into the run's buffers (BatchNorm statistics), once; a
        # recomputation starts from the buffers as they were and writes into copies.
        first = calls[0] == 0
        calls[0] += 1
        buffers = list(live) if first else [b.clone() for b in inputs[n_p : n_p + n_b]]
        with slots.holding(inputs[:n_p], buffers, keep_replaced=first):
            return func(*inputs[n_p + n_b :], **kw)

    def what() -> str:
        return _describe(root, function, modules)

    snapshots = [b.clone() for b in btensors]
    inputs = (*ptensors, *snapshots, *args)
    if any_batched(inputs, kwargs):
        # under task batching: recompute vmap(body) outside the vmap level
        return call_outside_vmap(
            lambda f, flat: checkpoint_closed(what, f, *flat),
            body,
            (inputs, kwargs),
            extra=(list(btensors),),
        )
    return checkpoint_closed(what, lambda inp, kw: body(inp, kw, btensors), inputs, kwargs)


def _name_of(function: Any) -> str:
    inner = function
    while isinstance(inner, functools.partial):
        inner = inner.func
    if isinstance(inner, nn.Module):
        return type(inner).__name__
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _describe(root: nn.Module, function: Any, modules: list[nn.Module]) -> str:
    """``function`` for an error message, with the names of its modules in the model."""
    names = {id(m): name for name, m in root.named_modules()}
    found = [names[id(m)] or "(the model itself)" for m in modules if id(m) in names]
    where = f" (layers {found})" if found else ""
    return f"the checkpointed function {_name_of(function)}{where} in the model's forward"


set_checkpoint_dispatch(dispatch)
