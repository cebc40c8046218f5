"""The inner loop: :func:`adapt` takes K explicit, differentiable optimizer steps on a task.

Example (5 second-order steps of SGD, then a meta-gradient for the initial parameters):
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fmodel = fm.functionalize(net)
    >>> x, y = torch.randn(10, 1), torch.randn(10, 1)
    >>> result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=5)
    >>> result.losses.shape
    torch.Size([5])
    >>> F.mse_loss(fmodel(result.params, x), y).backward()   # reaches net's .grad
    >>> net[0].weight.grad is not None
    True
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from funcmeta import kernels, tree
from funcmeta.functional import FunctionalModel
from funcmeta.inputs import CallInputs, check_batch, check_call, split_batch, task_count
from funcmeta.optim.base import GradientTransformation, apply_updates
from funcmeta.optim.clip import _check_max_norm, clip_grads_by_global_norm
from funcmeta.tree import Filter, Tree

__all__ = ["AdaptResult", "NonFiniteError", "adapt"]

LossFn = Callable[[Any, Any], Tensor]


class AdaptResult(NamedTuple):
    """What :func:`adapt` returns.

    Attributes:
        params: the adapted parameters (all of them; the ones held fixed are passed through).
        buffers: the buffers after the last inner forward (BatchNorm running statistics).
        losses: the inner loss before each step, shape ``(steps,)``; attached to the graph
            for second-order steps (``.detach()`` it to log it).
        state: the optimizer state after the last step (pass it back to continue).
        skipped: indices of steps skipped for non-finite values (``on_nonfinite="skip"``).
    """

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    losses: Tensor
    state: Any
    skipped: tuple[int, ...] = ()


class NonFiniteError(FloatingPointError):
    """An inner loss or gradient was NaN or infinite; the message names the step."""


def _forward_loss(
    fmodel: FunctionalModel,
    loss_fn: LossFn,
    batch: tuple[CallInputs, Any],
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(loss_fn(fmodel(params, *args, **kwargs), targets), new_buffers)`` for a batch
    ``((args, kwargs), targets)`` made by :func:`_validate`."""
    (args, kwargs), targets = batch
    out, new_buffers = fmodel.apply(params, buffers, *args, **kwargs)
    loss = loss_fn(out, targets)
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
    return loss, new_buffers


def _validate(
    fmodel: Any,
    params: Any,
    opt: Any,
    batch: Any,
    steps: int,
    truncate: int,
    loss_scale: float | None,
    on_nonfinite: str | None,
    clip_grad_norm: Any,
    tasks: bool = False,
) -> tuple[tuple[CallInputs, Any], int | None]:
    """Check the arguments of :func:`adapt` (with ``tasks``, of :func:`funcmeta.adapt_tasks`)
    before any computation. Returns the batch split into call arguments and targets, and the
    number of tasks (``None`` without ``tasks``)."""
    check_call(fmodel, params, opt)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    if not isinstance(truncate, int) or isinstance(truncate, bool) or not 0 <= truncate <= steps:
        raise ValueError(f"truncate must be an int in [0, steps={steps}], got {truncate!r}")
    split = split_batch(batch)
    count = task_count(split) if tasks else None
    check_batch(split, params)
    if loss_scale is not None and (
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, int | float)
        or not math.isfinite(loss_scale)
        or loss_scale <= 0
    ):
        raise ValueError(f"loss_scale must be a finite positive number, got {loss_scale!r}")
    if on_nonfinite not in (None, "raise", "skip"):
        raise ValueError(f"on_nonfinite must be None, 'raise' or 'skip', got {on_nonfinite!r}")
    if clip_grad_norm is not None:
        _check_max_norm(clip_grad_norm)
    return split, count


Forward = Callable[[Tree, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class _Inner:
    """What one inner loop holds fixed; :meth:`step` is one pure inner step.

    ``forward(params, buffers) -> (loss, new_buffers)`` gives one loss, or one per task
    (shape ``(T,)``) when ``tasks`` is the number of tasks; the inner gradient is then that
    of their sum, which is each task's own gradient since the tasks share nothing.
    """

    forward: Forward
    opt: GradientTransformation
    spec: Any
    names: list[str]
    fixed: Tree | None
    clip_grad_norm: float | Tensor | None
    loss_scale: float | None
    on_nonfinite: str | None
    allow_unused: bool
    tasks: int | None = None

    def step(
        self,
        k: int,
        graph: bool,
        second: bool,
        offload: bool,
        state: Any,
        buffers: dict[str, Tensor],
        *leaves: Tensor,
    ) -> tuple[list[Tensor], Any, dict[str, Tensor], Tensor, bool]:
        """Step ``k``: ``(new_leaves, new_state, new_buffers, loss, skipped)``.

        Pure (it writes nothing outside its return value), so that step-level checkpointing
        can run it again during backward. ``offload`` keeps what it saves for backward in
        CPU memory.
        """
        with _offload(offload and graph, leaves):
            return self._step(k, graph, second, state, buffers, list(leaves))

    def _step(
        self,
        k: int,
        graph: bool,
        second: bool,
        state: Any,
        buffers: dict[str, Tensor],
        leaves: list[Tensor],
    ) -> tuple[list[Tensor], Any, dict[str, Tensor], Tensor, bool]:
        with torch.enable_grad():
            if second:
                if not all(p.requires_grad for p in leaves):
                    leaves = [p if p.requires_grad else p.detach().requires_grad_() for p in leaves]
                wrt = leaves
            else:
                wrt = [p.detach().requires_grad_() for p in leaves]
            current = tree.unflatten(self.spec, wrt)
            full = current if self.fixed is None else tree.combine(current, self.fixed)
            loss, new_buffers = self.forward(full, buffers)
            objective = loss if self.tasks is None else loss.sum()
            if self.loss_scale is not None:
                objective = objective * self.loss_scale
            grads = torch.autograd.grad(objective, wrt, create_graph=second, allow_unused=True)
        grads = _fill_unused(grads, wrt, self.names, self.allow_unused)
        if self.loss_scale is not None:
            inv = 1.0 / self.loss_scale
            grads = [g * inv for g in grads]
        if not second:
            loss = loss.detach()
        if self.on_nonfinite is not None and not _all_finite(loss, grads):
            if self.on_nonfinite == "raise":
                raise NonFiniteError(_nonfinite_message(k, loss, grads, self.names, self.tasks))
            return leaves, state, buffers, loss, True
        grad_tree = tree.unflatten(self.spec, grads)
        if self.clip_grad_norm is not None:
            grad_tree = clip_grads_by_global_norm(
                grad_tree, self.clip_grad_norm, task_axis=self.tasks is not None
            )
        adapted = tree.unflatten(self.spec, leaves)
        with contextlib.nullcontext() if graph else torch.no_grad():
            updates, state = self.opt.update(grad_tree, state, adapted)
            adapted = apply_updates(adapted, updates)
        return self.spec.flatten_up_to(adapted), state, new_buffers, loss, False


def _offload(on: bool, leaves: Any) -> contextlib.AbstractContextManager:
    """``save_on_cpu`` (pinned when the parameters are on CUDA) if ``on``."""
    if not on:
        return contextlib.nullcontext()
    pin = any(p.is_cuda for p in leaves)
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)


def _run(
    inner: _Inner,
    leaves: list[Tensor],
    state: Any,
    buffers: dict[str, Tensor],
    steps: int,
    *,
    truncate: int,
    first_order: bool,
    checkpoint_steps: bool,
    offload: bool,
) -> AdaptResult:
    """The loop of :func:`adapt` and :func:`funcmeta.adapt_tasks` over :meth:`_Inner.step`.

    Steps ``truncate`` on build a graph. In second order it is differentiated again, so they
    run on kernels that allow it (:func:`funcmeta.kernels.twice_differentiable`, entered once
    for all of them; a recomputation restores the choice of its forward).
    """
    # Without an outer graph (evaluation under no_grad) nothing differentiates the inner
    # gradients: the steps run first order, same values, on the kernels in force.
    outer = torch.is_grad_enabled()
    first_order = first_order or not outer
    losses: list[Tensor] = []
    skipped: list[int] = []
    start = leaves
    kernel_choice = contextlib.ExitStack()
    with kernel_choice:
        for k in range(steps):
            if k == truncate and truncate > 0:
                leaves = _reenter(leaves, start)
            if k == truncate and not first_order:
                kernel_choice.enter_context(kernels.twice_differentiable())
            graph = k >= truncate
            leaves, state, buffers, loss, was_skipped = _one_step(
                inner,
                k,
                graph,
                graph and not first_order,
                outer,
                leaves,
                state,
                buffers,
                checkpoint_steps=checkpoint_steps,
                offload=offload,
            )
            losses.append(loss)
            if was_skipped:
                skipped.append(k)
    if truncate > 0 and truncate == steps:
        leaves = _reenter(leaves, start)
    adapted = tree.unflatten(inner.spec, leaves)
    final = adapted if inner.fixed is None else tree.combine(adapted, inner.fixed)
    stacked = torch.stack(losses) if losses else torch.empty(0)
    return AdaptResult(dict(final), buffers, stacked, state, tuple(skipped))


def _one_step(
    inner: _Inner,
    k: int,
    graph: bool,
    second: bool,
    outer: bool,
    leaves: list[Tensor],
    state: Any,
    buffers: dict[str, Tensor],
    *,
    checkpoint_steps: bool,
    offload: bool,
) -> tuple[list[Tensor], Any, dict[str, Tensor], Tensor, bool]:
    """Step ``k`` of :func:`_run`, under a step checkpoint if asked."""
    if not (checkpoint_steps and graph and outer):
        return inner.step(k, graph, second, offload, state, buffers, *leaves)
    # State and buffers are bound now: the recomputation must see these values, on the
    # kernels of this forward. Offload, if asked, applies to what the checkpoint keeps (inside
    # it, it would keep everything and recompute nothing).
    with _offload(offload, leaves):
        return torch_checkpoint(
            inner.step,
            k,
            graph,
            second,
            False,
            state,
            buffers,
            *leaves,
            use_reentrant=False,
            context_fn=kernels.recompute_with(kernels.capture()),
        )


def adapt(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    opt: GradientTransformation,
    steps: int,
    *,
    first_order: bool = False,
    buffers: Mapping[str, Tensor] | None = None,
    state: Any = None,
    trainable: Filter | None = None,
    clip_grad_norm: float | Tensor | None = None,
    truncate: int = 0,
    loss_scale: float | None = None,
    on_nonfinite: Literal["raise", "skip"] | None = None,
    allow_unused: bool = False,
    checkpoint_steps: bool = False,
    offload_activations: bool = False,
) -> AdaptResult:
    """Take ``steps`` optimizer steps on ``loss_fn(fmodel(params, inputs), targets)``.

    Args:
        fmodel: from :func:`funcmeta.functionalize`.
        params: the initial parameters, usually ``fmodel.params`` (meta-gradients then reach
            the module's ``.grad``); a dict with the module's parameter names.
        loss_fn: ``(output, targets) -> scalar tensor``, e.g. ``F.mse_loss``.
        batch: ``(inputs, targets)``. ``inputs`` are the model's arguments: a tuple is
            positional, a dict (a HuggingFace batch) is keywords, ``fm.Args(x, mask=m)`` is
            both, anything else is the one argument (:mod:`funcmeta.inputs`).
        opt: a :class:`~funcmeta.optim.GradientTransformation` (hyperparameters may require grad).
        steps: number of inner steps K.
        first_order: take gradients of detached parameters (FOMAML): the result is exactly the
            meta-gradient of the unroll in which each inner gradient is a constant. The paths
            through the parameters, the optimizer state and the hyperparameters are kept.
        buffers: initial buffers (default: the module's); never mutated.
        state: optimizer state to continue from (default: ``opt.init`` of the adapted params).
        trainable: a filter (predicate ``(path, tensor) -> bool``, a name prefix or several)
            choosing the parameters to adapt; the rest are held fixed in the inner loop and
            still receive outer gradients through the forward (ANIL). Parameters frozen on
            the module (``requires_grad=False``, see ``fmodel.frozen``) are never adapted
            and get no meta-gradient.
        clip_grad_norm: clip each step's gradients to this global 2-norm (differentiable,
            ``torch.nn.utils.clip_grad_norm_`` numbers).
        truncate: run the first ``truncate`` steps without building a graph; the parameters
            re-enter with an identity Jacobian (``p_j + (p_0 - stopgrad(p_0))``), so the
            initial parameters get the first-order path through those steps and the
            hyperparameters and optimizer state get gradients from the later steps only.
        loss_scale: multiply each inner loss by this before differentiating and divide the
            gradients by it (fp16). Implies ``on_nonfinite="raise"`` unless given.
        on_nonfinite: check every inner loss and gradient (one host sync per step):
            ``"raise"`` raises :class:`NonFiniteError` naming the step and the parameters;
            ``"skip"`` leaves parameters, optimizer state and buffers as they were for that
            step and records it in ``result.skipped``. ``None`` (the default without
            ``loss_scale``) does not check.
        allow_unused: treat the gradient of an adapted parameter that the loss does not use
            as zero (optimizer weight decay and momentum still apply to it); by default such
            a parameter raises ``ValueError`` naming it.
        checkpoint_steps: run each inner step (forward, ``autograd.grad`` and update) inside
            one non-reentrant checkpoint: only each step's parameters, optimizer state and
            buffers are kept, and the step is recomputed during the outer backward. Same
            meta-gradients; the memory that saves second-order loops (docs/memory.md).
        offload_activations: keep the tensors the inner steps save for backward in CPU
            memory (``torch.autograd.graph.save_on_cpu``, pinned on CUDA). Same results.

    Returns:
        :class:`AdaptResult` ``(params, buffers, losses, state, skipped)``.

    Second-order steps run on kernels that can be differentiated twice (math attention,
    RNNs without cuDNN: :mod:`funcmeta.kernels`); other steps keep the kernels in force.

    Works under ``torch.no_grad()`` too (evaluation): gradients are still taken, no outer
    graph is kept, and the steps run first order (the same values) on the kernels in force.
    """
    split, _ = _validate(
        fmodel, params, opt, batch, steps, truncate, loss_scale, on_nonfinite, clip_grad_norm
    )
    return _adapt(
        params,
        opt,
        steps,
        fmodel.buffers if buffers is None else dict(buffers),
        make_forward=lambda adapted: functools.partial(_forward_loss, fmodel, loss_fn, split),
        frozen=fmodel.frozen,
        first_order=first_order,
        state=state,
        trainable=trainable,
        clip_grad_norm=clip_grad_norm,
        truncate=truncate,
        loss_scale=loss_scale,
        on_nonfinite=on_nonfinite,
        allow_unused=allow_unused,
        checkpoint_steps=checkpoint_steps,
        offload_activations=offload_activations,
    )


def _adapt(
    params: Mapping[str, Tensor],
    opt: GradientTransformation,
    steps: int,
    buffers: dict[str, Tensor],
    *,
    make_forward: Callable[[dict[str, Tensor | None]], Forward],
    prepare: Callable[[dict[str, Tensor | None]], dict[str, Tensor | None]] | None = None,
    tasks: int | None = None,
    frozen: list[str],
    first_order: bool,
    state: Any,
    trainable: Filter | None,
    clip_grad_norm: float | Tensor | None,
    truncate: int,
    loss_scale: float | None,
    on_nonfinite: str | None,
    allow_unused: bool,
    checkpoint_steps: bool,
    offload_activations: bool,
) -> AdaptResult:
    """What :func:`adapt` and :func:`funcmeta.adapt_tasks` share, once the arguments are
    checked: split off the adapted parameters (``prepare`` may reshape them), initialise the
    optimizer, run the loop with the forward ``make_forward(adapted)``."""
    if loss_scale is not None and on_nonfinite is None:
        on_nonfinite = "raise"
    adapted, fixed = _split_adapted(dict(params), trainable, frozen)
    if prepare is not None:
        adapted = prepare(adapted)
    names, leaves, spec = _adapted_leaves(adapted, frozen)
    if state is None:
        state = opt.init(adapted)
    inner = _Inner(
        make_forward(adapted),
        opt,
        spec,
        names,
        fixed,
        clip_grad_norm,
        loss_scale,
        on_nonfinite,
        allow_unused,
        tasks=tasks,
    )
    return _run(
        inner,
        leaves,
        state,
        buffers,
        steps,
        truncate=truncate,
        first_order=first_order,
        checkpoint_steps=checkpoint_steps,
        offload=offload_activations,
    )


def _split_adapted(
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
    names = tree.paths(adapted)
    leaves, spec = tree.flatten(adapted)
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


def _all_finite(loss: Tensor, grads: list[Tensor]) -> bool:
    checks = [torch.isfinite(loss).all()] + [torch.isfinite(g).all() for g in grads]
    return bool(torch.stack(checks).all())


def _nonfinite_message(
    k: int, loss: Tensor, grads: list[Tensor], names: list[str], tasks: int | None
) -> str:
    bad = [n for n, g in zip(names, grads, strict=True) if not bool(torch.isfinite(g).all())]
    what = "loss" if not bool(torch.isfinite(loss).all()) else "gradient"
    where = ""
    if tasks is not None:
        finite = torch.isfinite(loss)
        for g in grads:
            finite = finite & torch.isfinite(g).flatten(1).all(1)
        where = f" in tasks {(~finite).nonzero().flatten().tolist()}"
        value = loss.detach().float().tolist()
    else:
        value = loss.detach().float().item()
    return (
        f"inner step {k}: non-finite {what}{where} (loss={value}); parameters with "
        f"non-finite gradients: {bad}"
    )
