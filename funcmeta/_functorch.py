"""Leaving a ``vmap`` level: checkpointed layers and layers without batching rules.

``torch.utils.checkpoint`` cannot run inside ``torch.func.vmap`` (its recomputation happens
in backward, outside the vmap, on tensors of a finished vmap level). ``vmap`` *inside* a
checkpoint works. So when a checkpointed layer is called under task batching,
:func:`call_outside_vmap` unwraps the batched arguments of the innermost vmap level into
ordinary tensors with a task axis, steps out of that level, runs ``checkpoint(vmap(fn))`` on
them and wraps the outputs back into the level. Autograd sees ordinary tensors throughout,
so second-order gradients flow as without vmap. The same function with ``per_task=True``
runs ``fn`` once per task instead of vmapping it: for layers that have no vmap batching rule
(``aten::lstm``, ``aten::gru``), see :class:`TaskLoop`.

:class:`TaskLinear` is the task-batched fast path for ``nn.Linear``. Under ``vmap``, a linear
layer whose weights are batched costs about ten times an unbatched one (torch 2.13, CPU): the
generic batching rule. When the input, weight and bias are batched at the same level,
``TaskLinear`` does the whole batch as one ``torch.baddbmm`` on the unwrapped tensors. A layer
with hooks runs as it is (the hooks see what they would see in a per-task loop). The fast
paths of convolutions, BatchNorm and pooling are in :mod:`funcmeta._task_layers`.

Both use functorch's batching primitives from ``torch._C._functorch`` (present from torch
2.0 to at least 2.15). If a torch release lacks them, :func:`call_outside_vmap` raises an
error that says so, and :class:`TaskLinear` falls back to ``F.linear``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optree
import torch
import torch.nn.functional as F

try:  # torch's pytree registry on optree: registered types (HuggingFace ModelOutput), fast
    import torch.utils._cxx_pytree as torch_pytree
except ImportError:  # pragma: no cover - depends on the torch and optree releases
    import torch.utils._pytree as torch_pytree  # type: ignore[no-redef]
from torch import Tensor, nn

from funcmeta._shadow import Standin, has_hooks, within
from funcmeta.kernels import in_twice_differentiable

__all__ = [
    "PRIMITIVES",
    "TaskLinear",
    "TaskLoop",
    "any_batched",
    "call_outside_vmap",
    "concat_outputs",
    "fast_vmap",
    "innermost_level",
    "is_batched",
    "map_tensors",
    "missing_primitives",
    "named_tensors",
    "physical",
    "recurrent_layers",
]

PRIMITIVES = (
    "_add_batch_dim",
    "_remove_batch_dim",
    "_unwrap_batched",
    "_vmap_decrement_nesting",
    "_vmap_increment_nesting",
    "is_batchedtensor",
    "maybe_get_level",
    "peek_interpreter_stack",
    "pop_dynamic_layer_stack",
    "push_dynamic_layer_stack",
)
"""The names this module takes from ``torch._C._functorch`` (checked by the test suite on
every torch it runs on: see :func:`missing_primitives`)."""


def missing_primitives() -> list[str]:
    """The names of :data:`PRIMITIVES` that this torch's ``torch._C._functorch`` lacks."""
    import torch._C._functorch as functorch_c

    return [name for name in PRIMITIVES if not hasattr(functorch_c, name)]


try:
    from torch._C._functorch import (
        _add_batch_dim,
        _remove_batch_dim,
        _unwrap_batched,
        _vmap_decrement_nesting,
        _vmap_increment_nesting,
        is_batchedtensor,
        maybe_get_level,
    )
except ImportError:  # pragma: no cover - depends on the torch release
    _add_batch_dim = _remove_batch_dim = _unwrap_batched = None
    _vmap_decrement_nesting = _vmap_increment_nesting = None
    is_batchedtensor = maybe_get_level = None

try:
    from torch._C._functorch import (
        peek_interpreter_stack,
        pop_dynamic_layer_stack,
        push_dynamic_layer_stack,
    )
except ImportError:  # pragma: no cover - depends on the torch release
    peek_interpreter_stack = pop_dynamic_layer_stack = push_dynamic_layer_stack = None

#: Whether :func:`fast_vmap` uses the primitives (tests switch it off to check the fallback).
USE_PRIMITIVES = _vmap_increment_nesting is not None
_PREPARED = False


def _prepare() -> None:
    """Let ``torch.func.vmap`` register its batching decompositions (``nll_loss`` and others
    would otherwise take the slow per-example fallback): it does so on its first call."""
    global _PREPARED
    torch.func.vmap(torch.neg)(torch.zeros(1))
    _PREPARED = True


def map_tensors(fn: Callable[[Tensor], Any], out: Any) -> Any:
    """``fn`` on every tensor of ``out``; other leaves as they are. Walks torch's pytree
    registry too, so registered output types (HuggingFace ``ModelOutput``) are opened."""
    leaves, spec = torch_pytree.tree_flatten(out)
    return torch_pytree.tree_unflatten(
        [fn(t) if isinstance(t, Tensor) else t for t in leaves], spec
    )


def fast_vmap(
    fn: Callable[..., Any],
    flat_args: tuple[Any, ...],
    in_dims: tuple[int | None, ...],
    batch_size: int,
    randomness: str = "different",
) -> Any:
    """``torch.func.vmap(fn, in_dims, randomness=...)(*flat_args)`` with the outputs' batch
    dimension first, for flat positional arguments.

    It is the core of ``torch.func.vmap`` without its argument and output processing. For a
    small model that processing costs more than the model, once per inner step. Tensor
    outputs get the batch dimension first; other outputs pass through as they are.
    """
    if not USE_PRIMITIVES:
        return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*flat_args)
    if not _PREPARED:
        _prepare()
    level = _vmap_increment_nesting(batch_size, randomness)
    try:
        batched = [
            x if d is None else _add_batch_dim(x, d, level)
            for x, d in zip(flat_args, in_dims, strict=True)
        ]
        out = fn(*batched)
        return map_tensors(lambda t: _remove_batch_dim(t, level, batch_size, 0), out)
    finally:
        _vmap_decrement_nesting()


def is_batched(x: Any) -> bool:
    """Whether ``x`` is a tensor batched by an enclosing ``vmap``."""
    return is_batchedtensor is not None and isinstance(x, Tensor) and is_batchedtensor(x)


def any_batched(*values: Any) -> bool:
    """Whether a tensor among ``values`` (tensors, mappings and sequences of them, or any pytrees) is
    batched by an enclosing vmap. Tensors, mapping values and sequence items are looked at directly, since this
    runs on every call of a model."""
    if peek_interpreter_stack is not None and peek_interpreter_stack() is None:
        return False  # no vmap (nor any other torch.func transform) is running
    for value in values:
        if isinstance(value, Tensor):
            if is_batched(value):
                return True
        elif isinstance(value, Mapping):
            if any_batched(*value.values()):
                return True
        elif isinstance(value, list | tuple):
            if any_batched(*value):
                return True
        elif value is not None and any(is_batched(x) for x in optree.tree_leaves(value)):
            return True
    return False


def innermost_level(tree: Any) -> int | None:
    """The innermost vmap level at which a tensor of ``tree`` is batched, or None."""
    levels = [maybe_get_level(x) for x in optree.tree_leaves(tree) if is_batched(x)]
    return max(levels) if levels else None


@contextlib.contextmanager
def _outside(level: int) -> Iterator[None]:
    """Step out of vmap level ``level`` for the block, when it is the innermost one. Inside
    it, random operations on ordinary tensors are no longer batched by that level."""
    top = peek_interpreter_stack() if peek_interpreter_stack is not None else None
    if top is None or top.level() != level:
        yield
        return
    saved = pop_dynamic_layer_stack()
    try:
        yield
    finally:
        push_dynamic_layer_stack(saved)


def _join_outputs(outs: list[Any], join: Callable[[list[Tensor]], Tensor]) -> Any:
    """One output from several of the same structure: ``join`` of each tensor's values,
    other leaves from the first."""
    flat = [torch_pytree.tree_flatten(o) for o in outs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise RuntimeError("the tasks' runs returned differently structured outputs")
    joined = [
        join([leaves[i] for leaves, _ in flat]) if isinstance(leaf, Tensor) else leaf
        for i, leaf in enumerate(flat[0][0])
    ]
    return torch_pytree.tree_unflatten(joined, spec)


def _stack_outputs(outs: list[Any]) -> Any:
    """One output with a leading task axis from the outputs of each task."""
    return _join_outputs(outs, torch.stack)


def concat_outputs(outs: list[Any]) -> Any:
    """One output from the outputs of consecutive chunks of tasks (task axis first)."""
    return _join_outputs(outs, torch.cat)


def call_outside_vmap(
    wrap: Callable[[Callable[..., Any], tuple[Any, ...]], Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    extra: tuple[Any, ...] = (),
    randomness: str = "different",
    per_task: bool = False,
) -> Any:
    """Run ``fn(*args, *extra)`` for every task, outside the innermost vmap level of its inputs.

    ``wrap(f, flat_args)`` calls ``f(*flat_args)``, typically under a checkpoint that keeps
    ``flat_args`` for the recomputation. ``extra`` reaches ``fn`` without passing through
    ``wrap``: tensors the first call writes into. Tensors batched at the innermost level are
    unwrapped; everything else is passed as it is (shared by the tasks). ``fn`` is vmapped
    over the tasks, or with ``per_task=True`` called once per task on each task's slice and
    its outputs stacked. The outputs come back batched at that level.
    """
    if _unwrap_batched is None:  # pragma: no cover - depends on the torch release
        raise RuntimeError(
            "checkpointed layers and layers without vmap batching rules need "
            "torch._C._functorch's batching primitives, which torch "
            f"{torch.__version__} does not have"
        )
    leaves, spec = optree.tree_flatten((args, extra))
    level = innermost_level(leaves)
    flat, dims = [], []
    for x in leaves:
        if is_batched(x) and maybe_get_level(x) == level:
            tensor, dim = _unwrap_batched(x, level)
            flat.append(tensor)
            dims.append(dim)
        else:
            flat.append(x)
            dims.append(None)
    n_args = len(optree.tree_leaves(args))

    def unflat_fn(*xs: Any) -> Any:
        a, e = optree.tree_unflatten(spec, list(xs))
        return fn(*a, *e)

    size = next(x.shape[d] for x, d in zip(flat, dims, strict=True) if d is not None)
    flat_args, flat_extra = tuple(flat[:n_args]), tuple(flat[n_args:])

    def batched_fn(*xs: Any) -> Any:
        every = (*xs, *flat_extra)
        if not per_task:
            return fast_vmap(unflat_fn, every, tuple(dims), size, randomness)
        return _stack_outputs(
            [
                unflat_fn(
                    *(x if d is None else x.select(d, t) for x, d in zip(every, dims, strict=True))
                )
                for t in range(size)
            ]
        )

    with _outside(level):
        out = wrap(batched_fn, flat_args)
    return map_tensors(lambda t: _add_batch_dim(t, 0, level), out)


def physical(x: Tensor, level: int, dim: int = 0) -> Tensor:
    """The ordinary tensor under ``x``, batched at vmap ``level``, with the batch axis at
    ``dim`` (a view)."""
    tensor, bdim = _unwrap_batched(x, level)
    return tensor if bdim == dim else tensor.movedim(bdim, dim)


class TaskLinear(Standin):
    """Stands in for an ``nn.Linear`` under task batching: one ``baddbmm`` for all tasks when
    the input, weight and bias are batched at the same vmap level, ``F.linear`` otherwise.
    A layer with hooks (its own or global ones) runs as it is, hooks included."""

    def forward(self, x: Tensor) -> Tensor:
        original = self.original
        if has_hooks(original):
            return original(x)
        w, b = original.weight, original.bias
        if not (is_batched(x) and is_batched(w)):
            return F.linear(x, w, b)
        level = maybe_get_level(w)
        if maybe_get_level(x) != level or (
            b is not None and not (is_batched(b) and maybe_get_level(b) == level)
        ):
            return F.linear(x, w, b)
        xp, wp = physical(x, level), physical(w, level)
        flat = xp.dim() != 3  # (T, N, in) goes in as it is; other shapes via (T, -1, in)
        x3 = xp.reshape(xp.shape[0], -1, xp.shape[-1]) if flat else xp
        if b is None:
            out = torch.bmm(x3, wp.transpose(1, 2))
        else:
            out = torch.baddbmm(physical(b, level).unsqueeze(1), x3, wp.transpose(1, 2))
        if flat:
            out = out.reshape(*xp.shape[:-1], out.shape[-1])
        return _add_batch_dim(out, 0, level)


@contextlib.contextmanager
def _rnn_kernels() -> Iterator[None]:
    """cuDNN off inside a twice-differentiable block: its RNN kernels have no double
    backward. Other blocks keep the user's setting."""
    if not in_twice_differentiable() or not torch.backends.cudnn.enabled:
        yield
        return
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = True


class TaskLoop(Standin):
    """Stands in for a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), which has no vmap
    batching rule: under task batching it runs once per task outside the vmap level, with
    that task's parameters, buffers and inputs, and its outputs are stacked. Unbatched calls
    run the layer as it is. Inside :func:`funcmeta.kernels.twice_differentiable` it runs
    without cuDNN, whose RNN kernels have no double backward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original = self.original
        pnames, ptensors = named_tensors(original.named_parameters())
        bnames, btensors = named_tensors(original.named_buffers())
        tensors = ptensors + btensors
        with _rnn_kernels():
            if not any_batched(tensors, args, kwargs):
                return original(*args, **kwargs)

            def one_task(ts: list[Tensor], a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
                params = dict(zip(pnames, ts[: len(pnames)], strict=True))
                buffers = dict(zip(bnames, ts[len(pnames) :], strict=True))
                return torch.func.functional_call(original, (params, buffers), a, kw)

            return call_outside_vmap(
                lambda f, flat: f(*flat), one_task, (tensors, args, kwargs), per_task=True
            )


def named_tensors(items: Any) -> tuple[list[str], list[Tensor]]:
    pairs = list(items)
    return [n for n, _ in pairs], [t for _, t in pairs]


def recurrent_layers(module: nn.Module) -> dict[str, type[Standin]]:
    """The recurrent layers of ``module`` (outermost), each to be run by :class:`TaskLoop`."""
    out: dict[str, type[Standin]] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.RNNBase) and not any(within(name, n) for n in out):
            out[name] = TaskLoop
    return out
