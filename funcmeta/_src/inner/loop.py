"""The inner-loop engine behind :func:`funcmeta.adapt` and :func:`funcmeta.adapt_tasks`.

Three layers, bottom up:

- :meth:`InnerLoop.unrolled_step`: one inner step (forward, ``autograd.grad``, optimizer
  update), a pure function of the parameters, optimizer state and buffers, in a
  :class:`StepMode` (graph or not, second order or not, offloaded or not);
- :func:`checkpointed_step`: that step under a step checkpoint (``checkpoint_steps=True``),
  or as it is;
- :func:`inner_loop`: the inner loop on the adapted parameters (split off by
  :func:`split_adapted`): initialise the optimizer, take the steps (truncation, kernel
  choice), collect the losses.

It calls nothing above it: the forward is a value the caller builds
(``funcmeta._src.inner.forward``), never a callback into the caller, and the call was checked
before (``funcmeta._src.inner.inputs.check_adapt_call``). How the inner gradient is taken,
what frames each step and the kernels of second-order steps are the runtime's
(``funcmeta._src.runtime``: eager for ``fm.adapt`` and ``fm.adapt_tasks``, traced for
:func:`funcmeta.compile_meta_step`); the loop asks it and branches on nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from funcmeta._src.core import kernels, tree
from funcmeta._src.core.saved import checked_under
from funcmeta._src.core.sharding import rewrite_mixed_hyper
from funcmeta._src.core.tree import Filter, PyTreeSpec, Tree
from funcmeta._src.core.types import AdaptResult, NonFiniteError
from funcmeta._src.inner.options import AdaptOptions
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.optim.base import step as optim_step
from funcmeta._src.optim.clip import clip_grads_by_global_norm
from funcmeta._src.runtime import Runtime

__all__ = [
    "Forward",
    "InnerLoop",
    "StepMode",
    "checkpointed_step",
    "inner_loop",
    "split_adapted",
]


Forward = Callable[[Tree, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]
"""``forward(params, buffers) -> (loss, new_buffers)``: one loss, or one per task ``(T,)``."""


@dataclass(frozen=True)
class StepMode:
    """How one inner step runs.

    Attributes:
        graph: build a graph through the step (steps before ``truncate`` do not).
        second_order: take the inner gradient with ``create_graph``.
        offload: keep what the step saves for backward in CPU memory.
    """

    graph: bool
    second_order: bool
    offload: bool = False


@dataclass(frozen=True)
class InnerLoop:
    """What one inner loop holds fixed; :meth:`unrolled_step` is one pure inner step.

    ``forward(params, buffers) -> (loss, new_buffers)`` gives one loss, or one per task
    (shape ``(T,)``) when ``tasks`` is the number of tasks; the inner gradient is then that
    of their sum, which is each task's own gradient since the tasks share nothing.
    ``param_spec`` is the tree structure of the adapted parameters, whose leaves the steps
    take and return as a flat list (in the order of ``names``). ``runtime`` takes the inner
    gradient, frames each step and chooses the second-order steps' kernels.
    """

    forward: Forward
    opt: GradientTransformation
    param_spec: PyTreeSpec
    names: list[str]
    fixed: Tree | None
    options: AdaptOptions
    tasks: int | None
    runtime: Runtime

    def unrolled_step(
        self,
        k: int,
        mode: StepMode,
        state: Any,
        buffers: dict[str, Tensor],
        *leaves: Tensor,
    ) -> tuple[list[Tensor], Any, dict[str, Tensor], Tensor, bool]:
        """Step ``k``: ``(new_leaves, new_state, new_buffers, loss, skipped)``.

        Pure (it writes nothing outside its return value), so that step-level checkpointing
        can run it again during backward.
        """
        with _offload(mode.offload and mode.graph, leaves):
            return self._compute_step(k, mode, state, buffers, list(leaves))

    def _compute_step(
        self,
        k: int,
        mode: StepMode,
        state: Any,
        buffers: dict[str, Tensor],
        leaves: list[Tensor],
    ) -> tuple[list[Tensor], Any, dict[str, Tensor], Tensor, bool]:
        # A second-order step's checkpointed layers take their inner gradient on their
        # forward's graph, dropped right after it: one recomputation fewer, for one step's
        # activations held for a moment. Not where the activations are offloaded (the least
        # device memory asked for), nor under a step checkpoint, which runs the step's
        # forward again inside its inner gradient: that would hold the graphs of both runs.
        # Nor where the runtime says not (a sharded model's: a kept graph holds its layer's
        # gathered parameters, so every layer's at once; recomputing gathers one at a time).
        keep = (
            mode.second_order
            and self.runtime.keeps_layer_graphs
            and not (mode.offload or self.options.checkpoint_steps)
        )
        loss, found, new_buffers = self.runtime.gradient(
            self._objective, leaves, buffers, second_order=mode.second_order, keep_graph=keep
        )
        grads = _fill_unused(tuple(found), leaves, self.names, self.options.allow_unused)
        scale = self.options.scale
        if scale is not None:
            inv = 1.0 / scale
            grads = [g * inv for g in grads]
        if not mode.second_order:
            loss = loss.detach()
        grad_tree = tree.unflatten(self.param_spec, grads)
        if self.options.clip_grad_norm is not None:
            grad_tree = clip_grads_by_global_norm(
                grad_tree, self.options.clip_grad_norm, task_axis=self.tasks is not None
            )
        adapted = tree.unflatten(self.param_spec, leaves)
        with contextlib.nullcontext() if mode.graph else torch.no_grad():
            try:
                adapted, new_state = optim_step(
                    self.opt, grad_tree, state, adapted, tasks=self.tasks is not None
                )
            except RuntimeError as error:
                placed = rewrite_mixed_hyper(error, leaves)
                if placed is not None:
                    raise placed from error
                raise
        new_leaves = cast(list[Tensor], self.param_spec.flatten_up_to(adapted))
        check = self.options.nonfinite
        # what the step produced is checked too: an overflowing update (a huge rate, fp16)
        # makes finite gradients into non-finite parameters; one host sync for all of it
        if check is not None and not _all_finite(loss, grads, new_leaves):
            if check == "raise":
                raise NonFiniteError(
                    _nonfinite_message(k, loss, grads, new_leaves, self.names, self.tasks)
                )
            return leaves, state, buffers, loss, True
        return new_leaves, new_state, new_buffers, loss, False

    def _objective(
        self, wrt: list[Tensor], buffers: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``(objective, loss, new_buffers)`` at the adapted leaves ``wrt``: the objective is
        the loss (summed over the tasks), scaled by ``loss_scale``."""
        current = tree.unflatten(self.param_spec, wrt)
        full = current if self.fixed is None else tree.combine(current, self.fixed)
        loss, new_buffers = self.forward(full, buffers)
        objective = loss if self.tasks is None else loss.sum()
        scale = self.options.scale
        return (objective if scale is None else objective * scale), loss, new_buffers


def _offload(on: bool, leaves: Any) -> contextlib.AbstractContextManager:
    """``save_on_cpu`` (pinned when the parameters are on CUDA) if ``on``."""
    if not on:
        return contextlib.nullcontext()
    pin = any(p.is_cuda for p in leaves)
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)


def _take_steps(
    inner: InnerLoop,
    leaves: list[Tensor],
    state: Any,
    buffers: dict[str, Tensor],
    steps: int,
) -> AdaptResult:
    """The loop of :func:`funcmeta.adapt` and :func:`funcmeta.adapt_tasks` over
    :meth:`InnerLoop.unrolled_step`.

    Steps ``truncate`` on build a graph. In second order it is differentiated again, so they
    run on kernels that allow it (:func:`funcmeta.checkpoint.kernels.twice_differentiable`, entered once
    for all of them; a recomputation restores the choice of its forward).
    """
    # Without an outer graph (evaluation under no_grad) nothing differentiates the inner
    # gradients: the steps run first order, same values, on the kernels in force.
    outer = torch.is_grad_enabled()
    first_order = inner.options.first_order or not outer
    truncate = inner.options.truncate
    offload = inner.options.offload_activations
    losses: list[Tensor] = []
    skipped: list[int] = []
    overflowed = False
    start = leaves
    kernel_choice = contextlib.ExitStack()
    with kernel_choice:
        for k in range(steps):
            if k == truncate and truncate > 0:
                leaves = _reenter(leaves, start)
            if k == truncate and not first_order:
                inner.runtime.second_order_kernels(kernel_choice)
            graph = k >= truncate
            mode = StepMode(graph, graph and not first_order, offload)
            with inner.runtime.step_scope(k, steps, inner.options.first_order):
                leaves, state, buffers, loss, was_skipped = checkpointed_step(
                    inner, k, mode, outer, leaves, state, buffers
                )
            losses.append(loss)
            if was_skipped:
                skipped.append(k)
                if inner.options.nonfinite == "scaler":
                    # an overflow under a GradScaler: the rest of the loop is not taken
                    overflowed = True
                    skipped += range(k + 1, steps)
                    losses += [torch.full_like(loss, math.nan)] * (steps - k - 1)
                    break
    if truncate > 0 and truncate == steps:
        leaves = _reenter(leaves, start)
    if overflowed:
        leaves = [_NonFiniteGradient.apply(p) for p in leaves]
    adapted = tree.unflatten(inner.param_spec, leaves)
    final = adapted if inner.fixed is None else tree.combine(adapted, inner.fixed)
    stacked = (
        torch.stack(losses) if losses else torch.empty(0, device=start[0].device if start else None)
    )
    return AdaptResult(dict(final), buffers, stacked, state, tuple(skipped), overflowed)


class _NonFiniteGradient(torch.autograd.Function):
    """The identity, whose backward gives NaN: the adapted parameters of an inner loop that
    overflowed under a GradScaler, so that every meta-gradient through them is non-finite
    and the scaler skips the outer step, as for an overflow in the outer backward."""

    @staticmethod
    def forward(ctx: Any, p: Tensor) -> Tensor:
        return p.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return torch.full_like(grad, math.nan)


def checkpointed_step(
    inner: InnerLoop,
    k: int,
    mode: StepMode,
    outer: bool,
    leaves: list[Tensor],
    state: Any,
    buffers: dict[str, Tensor],
) -> tuple[list[Tensor], Any, dict[str, Tensor], Tensor, bool]:
    """Step ``k`` of the inner loop, under a step checkpoint when ``checkpoint_steps`` is set
    and an outer graph is being built (``outer``), else as it is (also where the runtime
    recomputes the steps itself: ``Runtime.recomputes_steps``)."""
    if not (inner.options.checkpoint_steps and mode.graph and outer) or (
        inner.runtime.recomputes_steps
    ):
        return inner.unrolled_step(k, mode, state, buffers, *leaves)
    # State and buffers are bound now: the recomputation must see these values, on the
    # kernels of this forward. Offload, if asked, applies to what the checkpoint keeps (inside
    # it, it would keep everything and recompute nothing).
    inside = StepMode(mode.graph, mode.second_order, offload=False)
    with _offload(mode.offload, leaves):
        return torch_checkpoint(
            _checked(inner.unrolled_step),
            k,
            inside,
            state,
            buffers,
            *leaves,
            use_reentrant=False,
            context_fn=kernels.recompute_with(kernels.capture()),
        )


def _checked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` under :func:`~funcmeta._src.core.saved.checked_under`: a tensor the step saves
    and then changes in place is refused at the backward, as autograd refuses it without a
    checkpoint, not recomputed into a wrong gradient."""

    def checked(*args: Any) -> Any:
        with checked_under():
            return step(*args)

    return checked


def inner_loop(
    adapted: Tree,
    fixed: Tree | None,
    opt: GradientTransformation,
    steps: int,
    buffers: dict[str, Tensor],
    options: AdaptOptions,
    *,
    frozen: list[str],
    forward: Forward,
    tasks: int | None,
    state: Any,
    runtime: Runtime,
) -> AdaptResult:
    """Once the arguments are checked and the adapted parameters split off
    (:func:`split_adapted`): initialise the optimizer unless ``state`` is given, and run
    ``steps`` steps with ``forward`` (the forward for the adapted parameters), on
    ``runtime``."""
    names, leaves, spec = _adapted_leaves(adapted, frozen)
    if state is None:
        state = opt.init(adapted)
    else:
        _check_state(state, opt.init(adapted))
    inner = InnerLoop(
        forward=forward,
        opt=opt,
        param_spec=spec,
        names=names,
        fixed=fixed,
        options=options,
        tasks=tasks,
        runtime=runtime,
    )
    return _take_steps(inner, leaves, state, buffers, steps)


def _check_state(state: Any, fresh: Any) -> None:
    """Raise ``ValueError`` unless ``state`` has the structure of ``opt.init`` of the adapted
    parameters (the state of another optimizer, or for other parameters, would fail deep in
    the update or, worse, be read as something else)."""
    given = tree.structure(state, none_is_leaf=True)
    expected = tree.structure(fresh, none_is_leaf=True)
    if given != expected:
        raise ValueError(
            "state does not match the optimizer: pass the state that this optimizer returned "
            "for these parameters (result.state of an adapt call with the same opt= and "
            f"trainable=), or None to start afresh. Expected {_short(expected)}, got "
            f"{_short(given)}"
        )


def _short(spec: Any) -> str:
    text = str(spec)
    return text if len(text) <= 300 else text[:300] + " ..."


def split_adapted(
    params: dict[str, Tensor], trainable: Filter | None, frozen: list[str]
) -> tuple[Tree, Tree | None]:
    """``(adapted, fixed)``: the parameters ``trainable`` selects, less the frozen ones, and
    the rest (``None`` when nothing is held fixed)."""
    if trainable is None and not frozen:
        return params, None
    adapted, fixed = (params, None) if trainable is None else tree.partition(params, trainable)
    if frozen:
        adapted, held = tree.partition(adapted, lambda path, _: path not in frozen)
        fixed = held if fixed is None else tree.combine(fixed, held)
    return adapted, fixed


def _reenter(truncated: list[Tensor], start: list[Tensor]) -> list[Tensor]:
    """The truncated unroll's values with an identity Jacobian to the initial parameters."""
    return [p + (p0 - p0.detach()) for p, p0 in zip(truncated, start, strict=True)]


def _adapted_leaves(adapted: Tree, frozen: list[str]) -> tuple[list[str], list[Tensor], Any]:
    leaves, spec = tree.flatten(adapted)
    names = tree.spec_paths(spec)
    if not leaves:
        why = (
            f"; the module's frozen parameters (requires_grad=False) are {frozen}" if frozen else ""
        )
        raise ValueError(f"no parameters to adapt: the trainable filter selected none{why}")
    for name, leaf in zip(names, leaves, strict=True):
        if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
            raise TypeError(f"parameter {name!r} is not a floating-point tensor")
    return names, leaves, spec


def _fill_unused(
    grads: tuple[Tensor | None, ...], wrt: list[Tensor], names: list[str], allow_unused: bool
) -> list[Tensor]:
    unused = [n for n, g in zip(names, grads, strict=True) if g is None]
    if unused and not allow_unused:
        raise ValueError(
            f"the inner loss does not depend on the adapted parameters {unused}; pass "
            "allow_unused=True to give them zero gradients, or leave them out with trainable="
        )
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, wrt, strict=True)]


def _all_finite(loss: Tensor, grads: list[Tensor], params: list[Tensor]) -> bool:
    checks = [torch.isfinite(loss).all()] + [torch.isfinite(t).all() for t in (*grads, *params)]
    return bool(torch.stack(checks).all())


def _finite_tasks(tensors: list[Tensor], start: Tensor) -> Tensor:
    finite = start
    for t in tensors:
        finite = finite & torch.isfinite(t).flatten(1).all(1)
    return finite


def _nonfinite_message(
    k: int,
    loss: Tensor,
    grads: list[Tensor],
    params: list[Tensor],
    names: list[str],
    tasks: int | None,
) -> str:
    bad_grads = [n for n, g in zip(names, grads, strict=True) if not bool(torch.isfinite(g).all())]
    if bool(torch.isfinite(loss).all()) and not bad_grads:
        bad = [n for n, p in zip(names, params, strict=True) if not bool(torch.isfinite(p).all())]
        where = ""
        if tasks is not None:
            finite = _finite_tasks(params, torch.ones(tasks, dtype=torch.bool, device=loss.device))
            where = f" in tasks {(~finite).nonzero().flatten().tolist()}"
        return (
            f"inner step {k}: the loss and gradients were finite, but the update made the "
            f"parameters {bad} non-finite{where} (the step overflowed): lower the learning "
            "rate, clip the gradients (clip_grad_norm=), or adapt in a wider dtype"
        )
    what = "loss" if not bool(torch.isfinite(loss).all()) else "gradient"
    where = ""
    if tasks is not None:
        finite = _finite_tasks(grads, torch.isfinite(loss))
        where = f" in tasks {(~finite).nonzero().flatten().tolist()}"
        value: list[Any] | float = loss.detach().float().tolist()
    else:
        value = loss.detach().float().item()
    return (
        f"inner step {k}: non-finite {what}{where} (loss={value}); parameters with "
        f"non-finite gradients: {bad_grads}"
    )
