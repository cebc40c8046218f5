"""The traced runtime: :data:`TRACED`, the step as ``fm.compile_meta_step`` traces it.

The model runs through ``torch.func.functional_call`` on fresh copies of the buffers (no
tensor swap of its own, no task executor: neither is traced by dynamo), all tasks of a call
under one ``torch.func.vmap`` (dropout draws per task; a call of one task runs the function on
its slice of the trees instead, see :func:`one_task_slices`), and the inner gradient is
``torch.func.grad``'s, which nests in the compiled step's outer ``torch.func.grad``. No step
frame and no kernel choice: the graph holds what it computes. A leaf the objective does not
use gets a zero gradient here (``autograd.grad`` finds none): the compiled step runs the
eager path's check once before its first graph call.

Example:
    >>> import torch, funcmeta as fm
    >>> from funcmeta._src.runtime import TRACED
    >>> fmodel = fm.functional_model(torch.nn.Linear(2, 1))
    >>> out, _ = TRACED.run(fmodel, fmodel.params, fmodel.buffers, (torch.ones(3, 2),), {})
    >>> out.shape
    torch.Size([3, 1])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from funcmeta._src.core import tree
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.runtime.base import Objective, Runtime

__all__ = ["TRACED", "TracedRuntime", "one_task_slices"]


class TracedRuntime(Runtime):
    """The traced runtime (see the module docstring); :data:`TRACED` is the one instance."""

    def run(
        self,
        fmodel: FunctionalModel,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        new_buffers = {k: b.clone() for k, b in buffers.items()}
        module = self.module_of(fmodel)
        # tie_weights walks the module for shared tensors; dynamo traces that walk on every
        # call, so it is asked for only where the model has them (worked out once, eagerly)
        out = torch.func.functional_call(
            module, (dict(params), new_buffers), args, kwargs, tie_weights=self.tied(fmodel)
        )
        return out, new_buffers

    def module_of(self, fmodel: FunctionalModel) -> nn.Module:
        """The module the traced step runs for ``fmodel``: its own module here."""
        return fmodel.module

    def tied(self, fmodel: FunctionalModel) -> bool:
        """Whether :meth:`module_of` holds a tensor in two places (tied weights)."""
        return fmodel.tied

    def over_tasks(
        self,
        one_task: Callable[..., Any],
        trees: tuple[Any, ...],
        in_dims: tuple[Any, ...],
        chunk: int | None,
    ) -> Any:
        # the compiled step chunks its graph calls itself; one vmap over the tasks given
        dims = tuple(_uniform(d) for d in in_dims)
        sliced = one_task_slices(trees, dims)
        if sliced is not None:  # one task: the function on its slice, no vmap to trace
            return _with_task_axis(one_task(*sliced))
        return torch.func.vmap(one_task, in_dims=dims, randomness="different")(*trees)

    def gradient(
        self,
        objective: Objective,
        leaves: list[Tensor],
        buffers: dict[str, Tensor],
        *,
        second_order: bool,
        keep_graph: bool,
    ) -> tuple[Tensor, list[Tensor | None], dict[str, Tensor]]:
        def traced(
            wrt: list[Tensor], bufs: dict[str, Tensor]
        ) -> tuple[Tensor, tuple[Tensor, dict[str, Tensor]]]:
            total, loss, new_buffers = objective(wrt, bufs)
            return total, (loss, new_buffers)

        # first order (and a step without a graph) differentiates detached copies, as the
        # eager step does: nothing the forward returns stays connected to the outer graph
        at = leaves if second_order else [p.detach() for p in leaves]
        grads, (loss, new_buffers) = torch.func.grad(traced, has_aux=True)(at, buffers)
        if not second_order:
            grads = [g.detach() for g in grads]
        return loss, list(grads), new_buffers

    def second_order_kernels(self, steps: contextlib.ExitStack) -> None:
        return None  # the graph holds what it computes (and dynamo traces no ExitStack entry)

    def step_scope(
        self, k: int, steps: int, first_order: bool
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


#: The traced runtime.
TRACED = TracedRuntime()


def one_task_slices(trees: tuple[Any, ...], dims: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``trees`` with the task axis taken out of every tensor ``dims`` batches (0 or None,
    prefix trees), where that axis holds one task; ``None`` where a batched axis holds more,
    a batched leaf is not a tensor, or nothing is batched (``vmap`` then takes the call and
    says what it refuses). For one task, ``vmap(f)(*trees)`` is ``f`` on these slices with
    the task axis put back on its outputs (the same function of the same values; a kernel may
    round differently from ``vmap``'s batched one), and dynamo, which traces ``vmap``'s
    matching of arguments and in-dims leaf by leaf, traces none of it (residual16's step at
    one task a graph call: 195 k instructions traced with ``vmap``, 140 k without). Like the
    eager path's one task a call (``core.vmap.per_task_call``), it runs what ``vmap`` has no
    rule for (in-place random draws on a new tensor, say), which a graph of more tasks
    leaves to the eager path.

    Example:
        >>> import torch
        >>> x, w = torch.ones(1, 3), torch.ones(3)
        >>> [t.shape for t in one_task_slices((x, w), (0, None))]
        [torch.Size([3]), torch.Size([3])]
        >>> one_task_slices((torch.ones(2, 3),), (0,)) is None
        True
    """
    # the in-dims tree leads the walk (its leaves 0 or None): core.vmap's loop_flat flattens
    # the arguments themselves with None as a leaf, which dynamo's optree stand-in does not
    # trace (torch 2.13: "Unexpected type in sourceless builder")
    sizes: list[int] = []

    def take(d: Any, x: Any) -> Any:
        if d is None:
            return x
        return tree.tree_map(lambda t: _first_task(t, d, sizes), x, none_is_leaf=True)

    sliced = tuple(
        tree.tree_map(take, d, t, none_is_leaf=True) for t, d in zip(trees, dims, strict=True)
    )
    return sliced if sizes and all(n == 1 for n in sizes) else None


def _first_task(t: Any, d: int, sizes: list[int]) -> Any:
    """The slice of tensor ``t`` at index 0 of its task axis ``d``, its size noted in
    ``sizes`` (-1 for a leaf that is no tensor or has no axis ``d``: ``vmap`` refuses it)."""
    if not isinstance(t, Tensor) or t.dim() <= d:
        sizes.append(-1)
        return t
    sizes.append(t.shape[d])
    return t.select(d, 0)


def _with_task_axis(out: Any) -> Any:
    """``out`` with a task axis of one in front of every tensor, as ``vmap``'s ``out_dims=0``
    puts it, the outputs walked as ``vmap`` walks them (torch's pytree registry: registered
    output types opened, ``None`` a leaf); a leaf that is no tensor is refused with
    ``vmap``'s words."""
    leaves, spec = tree.flatten_registered(out)
    for t in leaves:
        if not isinstance(t, Tensor):
            raise ValueError(f"vmap: the function must only return Tensors, got type {type(t)}")
    return tree.unflatten_registered([t.unsqueeze(0) for t in leaves], spec)


def _uniform(dims: Any) -> Any:
    """``dims`` (a tree's vmap in-dims) as one ``0`` or ``None`` for the whole tree where a
    dict gives every entry that one value: vmap reads a prefix the same way, and dynamo
    traces the matching of a dict of in-dims to the tree entry by entry."""
    if isinstance(dims, dict) and dims:
        values = set(dims.values())
        if len(values) == 1 and next(iter(values)) in (0, None):
            return next(iter(values))
    return dims
