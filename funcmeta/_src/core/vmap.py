"""The vmap glue of task batching: T tasks as one computation, and leaving a ``vmap`` level.

:func:`fast_vmap` is ``torch.func.vmap`` without its per-call argument processing (a visible
share of a small model's step). ``torch.utils.checkpoint`` cannot run inside ``vmap`` (its
recomputation happens in backward, outside the vmap, on tensors of a finished vmap level);
``vmap`` *inside* a checkpoint works. So when a checkpointed layer is called under task
batching, :func:`call_outside_vmap` unwraps the batched arguments of the innermost vmap level
into ordinary tensors with a task axis, steps out of that level, runs ``checkpoint(vmap(fn))``
on them and wraps the outputs back into the level. Autograd sees ordinary tensors throughout,
so second-order gradients flow as without vmap. With ``per_task=True`` it runs ``fn`` once per
task instead of vmapping it: for layers without a vmap batching rule
(``funcmeta._src.batching.recurrent.PerTask``).

The primitives come from functorch (``torch._C._functorch``), through
``funcmeta._src.core.fence``. If a torch release lacks them, :func:`call_outside_vmap`
raises an error that says so, and :func:`fast_vmap` falls back to ``torch.func.vmap``.

Example:
    >>> import torch
    >>> from funcmeta._src.core.vmap import per_task_call, vmap_flat
    >>> x, w = torch.randn(3, 4), torch.randn(4)
    >>> batched = vmap_flat(lambda x, w: x * w, (x, w), (0, None))
    >>> torch.equal(batched, per_task_call(lambda x, w: x * w, (x, w), (0, None), 3))
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.fence import (
    add_batch_dim,
    inside_transform,
    is_batchedtensor,
    maybe_get_level,
    peek_interpreter_stack,
    pop_dynamic_layer_stack,
    prepare_vmap,
    push_dynamic_layer_stack,
    remove_batch_dim,
    unwrap_batched,
    vmap_decrement_nesting,
    vmap_increment_nesting,
)

__all__ = [
    "vmap_flat",
    "any_batched",
    "call_outside_vmap",
    "concat_outputs",
    "fast_vmap",
    "innermost_level",
    "is_batched",
    "map_tensors",
    "outside_level",
    "per_task_call",
    "physical",
    "uniform_value",
]

#: The attribute marking the tensors that stand for task-batched packed sequences
#: (``funcmeta._src.batching.packed``): they are not what they seem, and are never unwrapped.
PACKED_TOKEN = "_fm_task_packed"

#: Whether :func:`fast_vmap` uses the primitives (tests switch it off to check the fallback).
USE_PRIMITIVES = vmap_increment_nesting is not None


def map_tensors(fn: Callable[[Tensor], Any], out: Any) -> Any:
    """``fn`` on every tensor of ``out``; other leaves as they are. Walks torch's pytree
    registry too, so registered output types (HuggingFace ``ModelOutput``) are opened."""
    leaves, spec = tree.flatten_registered(out)
    return tree.unflatten_registered([fn(t) if isinstance(t, Tensor) else t for t in leaves], spec)


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
    prepare_vmap()
    level = vmap_increment_nesting(batch_size, randomness)
    try:
        batched = [
            x if d is None else add_batch_dim(x, d, level)
            for x, d in zip(flat_args, in_dims, strict=True)
        ]
        out = fn(*batched)
        return map_tensors(lambda t: remove_batch_dim(t, level, batch_size, 0), out)
    finally:
        vmap_decrement_nesting()


def is_batched(x: Any) -> bool:
    """Whether ``x`` is a tensor batched by an enclosing ``vmap``."""
    return is_batchedtensor is not None and isinstance(x, Tensor) and is_batchedtensor(x)


def any_batched(*values: Any) -> bool:
    """Whether a tensor among ``values`` (tensors, mappings and sequences of them, or any pytrees) is
    batched by an enclosing vmap. Tensors, mapping values and sequence items are looked at directly, since this
    runs on every call of a model."""
    if inside_transform() is False:
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
        elif value is not None and any(is_batched(x) for x in tree.leaves(value)):
            return True
    return False


def innermost_level(values: Any) -> int | None:
    """The innermost vmap level at which a tensor of ``values`` is batched, or None."""
    levels = [maybe_get_level(x) for x in tree.leaves(values) if is_batched(x)]
    return max(levels) if levels else None


@contextlib.contextmanager
def outside_level(level: int) -> Iterator[None]:
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
    flat = [tree.flatten_registered(o) for o in outs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise RuntimeError("the tasks' runs returned differently structured outputs")
    joined = [
        join([leaves[i] for leaves, _ in flat]) if isinstance(leaf, Tensor) else leaf
        for i, leaf in enumerate(flat[0][0])
    ]
    return tree.unflatten_registered(joined, spec)


def _stack_outputs(outs: list[Any]) -> Any:
    """One output with a leading task axis from the outputs of each task."""
    return _join_outputs(outs, torch.stack)


def concat_outputs(outs: list[Any]) -> Any:
    """One output from the outputs of consecutive chunks of tasks (task axis first)."""
    return _join_outputs(outs, torch.cat)


def per_task_call(
    fn: Callable[..., Any], flat_args: tuple[Any, ...], in_dims: tuple[int | None, ...], size: int
) -> Any:
    """The per-task runner: ``fn`` once per task on that task's slice of each argument batched
    along ``in_dims`` (the others passed whole), the outputs stacked with a leading task
    axis. What :func:`fast_vmap` computes, one task at a time and without ``vmap``."""
    # unbind, not select per task: one backward for all the slices, where select's would
    # fill a zero tensor of the whole batch for every task
    slices = [None if d is None else x.unbind(d) for x, d in zip(flat_args, in_dims, strict=True)]
    return _stack_outputs(
        [
            fn(*(x if s is None else s[t] for x, s in zip(flat_args, slices, strict=True)))
            for t in range(size)
        ]
    )


def loop_flat(fn: Callable[..., Any], trees: tuple[Any, ...], dims: tuple[Any, ...]) -> Any:
    """What :func:`vmap_flat` computes, without ``vmap``: ``fn`` once per task on each task's
    slice of the trees batched along ``dims`` (0 or None), the outputs stacked with a leading
    task axis, for tensors that run under no ``torch.func`` transform (``DTensor`` shards).

    Example:
        >>> import torch
        >>> loop_flat(lambda x, w: x @ w, (torch.ones(3, 2), torch.ones(2)), (0, None)).shape
        torch.Size([3])
    """
    unflat, flat, flat_dims, size = _flattened(fn, trees, dims)
    return per_task_call(unflat, flat, flat_dims, size)


def _flattened(
    fn: Callable[..., Any], trees: tuple[Any, ...], dims: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...], tuple[Any, ...], int]:
    """``(f, leaves, leaf_dims, tasks)``: ``fn`` taking the flat leaves of ``trees``, those
    leaves, their dims from ``dims`` (a prefix tree), and the size of the task axis."""
    # None is a leaf of both (an absent input, ``targets=None``): it passes through unbatched
    flat, spec = tree.flatten(trees, none_is_leaf=True)
    flat_dims = tuple(tree.flatten(dims, none_is_leaf=True)[0])
    if len(flat_dims) != len(flat):  # pragma: no cover - a bug, not a user error
        raise AssertionError("in_dims do not line up with the arguments")
    size = next(x.shape[d] for x, d in zip(flat, flat_dims, strict=True) if d is not None)

    def unflat(*xs: Any) -> Any:
        return fn(*tree.unflatten(spec, xs))

    return unflat, tuple(flat), flat_dims, size


def vmap_flat(
    fn: Callable[..., Any], trees: tuple[Any, ...], dims: tuple[Any, ...], chunk: int | None = None
) -> Any:
    """``vmap(fn)(*trees)`` with ``in_dims`` trees ``dims`` (0 or None), the trees passed flat:
    vmap then walks a flat argument list instead of dicts (its pytree walk is a visible share
    of a small model's step). With ``chunk``, the tasks run ``chunk`` at a time (one at a
    time without vmap for 1: :func:`per_task_call`) and the outputs are concatenated."""
    unflat, flat, flat_dims, size = _flattened(fn, trees, dims)
    if chunk is None or chunk >= size:
        return fast_vmap(unflat, flat, flat_dims, size)
    if chunk == 1:
        return per_task_call(unflat, flat, flat_dims, size)
    # split, not narrow per chunk: one backward for all the chunks (as unbind above)
    parts = [None if d is None else x.split(chunk, d) for x, d in zip(flat, flat_dims, strict=True)]
    outs = []
    for i, start in enumerate(range(0, size, chunk)):
        n = min(chunk, size - start)
        part = [x if p is None else p[i] for x, p in zip(flat, parts, strict=True)]
        outs.append(fast_vmap(unflat, tuple(part), flat_dims, n))
    return concat_outputs(outs)


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
    if unwrap_batched is None:  # pragma: no cover - depends on the torch release
        raise RuntimeError(
            "checkpointed layers and layers without vmap batching rules need "
            "functorch's batching primitives, which torch "
            f"{torch.__version__} does not have"
        )
    leaves, spec = tree.flatten((args, extra))
    level = innermost_level(leaves)
    flat, dims = [], []
    for x in leaves:
        if hasattr(x, PACKED_TOKEN):
            raise RuntimeError(
                "vmap: a layer run outside the vmap level cannot take a task-batched packed "
                "sequence whose tasks differ in length"
            )
        if is_batched(x) and maybe_get_level(x) == level:
            tensor, dim = unwrap_batched(x, level)
            flat.append(tensor)
            dims.append(dim)
        else:
            flat.append(x)
            dims.append(None)
    n_args = len(tree.leaves(args))

    def unflat_fn(*xs: Any) -> Any:
        a, e = tree.unflatten(spec, xs)
        return fn(*a, *e)

    size = next(x.shape[d] for x, d in zip(flat, dims, strict=True) if d is not None)
    flat_args, flat_extra = tuple(flat[:n_args]), tuple(flat[n_args:])

    def batched_fn(*xs: Any) -> Any:
        every = (*xs, *flat_extra)
        if not per_task:
            return fast_vmap(unflat_fn, every, tuple(dims), size, randomness)
        return per_task_call(unflat_fn, every, tuple(dims), size)

    assert level is not None  # a leaf is batched, else `size` above found no batched axis
    with outside_level(level):
        out = wrap(batched_fn, flat_args)
    return map_tensors(lambda t: add_batch_dim(t, 0, level), out)


def physical(x: Tensor, level: int, dim: int = 0) -> Tensor:
    """The ordinary tensor under ``x``, batched at vmap ``level``, with the batch axis at
    ``dim`` (a view)."""
    tensor, bdim = unwrap_batched(x, level)
    return tensor if bdim == dim else tensor.movedim(bdim, dim)


def uniform_value(x: Tensor) -> Tensor | None:
    """One task's value of ``x`` (batched at its innermost level) when every task's equals
    it, else None: where tasks disagree (NaN never agrees), or ``x`` is batched at an outer
    level too."""
    values = physical(x, maybe_get_level(x))
    if is_batched(values):
        return None  # batched at an outer level too
    flat = values.reshape(values.shape[0], -1)
    if flat.shape[0] and not bool((flat == flat[:1]).all()):
        return None
    return values[0]
