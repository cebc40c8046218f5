"""The inner-loop options: one set of keywords shared by :func:`funcmeta.adapt`,
:func:`funcmeta.adapt_tasks` and every recipe.

Each of those functions takes ``**options``. They are checked, once and before any
computation, by building an :class:`AdaptOptions` from them: an unknown name or a bad value
raises an error that names it. The functions' signatures list the options by name
(:func:`takes_options`), so ``help()`` and the API reference show them.

Example:
    >>> import funcmeta as fm
    >>> fm.AdaptOptions.of({"first_order": True}).first_order
    True
    >>> fm.AdaptOptions.of({"first_ordr": True})
    Traceback (most recent call last):
      ...
    TypeError: unknown option 'first_ordr'; the options are first_order, trainable, clip_grad_norm, truncate, loss_scale, on_nonfinite, allow_unused, checkpoint_steps, offload_activations
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, TypeVar, cast

from torch import Tensor
from torch.amp import GradScaler

from funcmeta._src.core.capabilities import require
from funcmeta._src.core.checks import check_choice, check_int, check_max_norm, check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Filter

__all__ = [
    "AdaptKeywords",
    "AdaptOptions",
    "FirstOrderKeywords",
    "HeadKeywords",
    "StepKeywords",
    "takes_options",
]


@exposed_in("funcmeta")
@dataclass(frozen=True)
class AdaptOptions:
    """Keyword options of the inner loop (all optional).

    Attributes:
        first_order: take gradients of detached parameters (FOMAML): the result is exactly the
            meta-gradient of the unroll in which each inner gradient is a constant. The paths
            through the parameters, the optimizer state and the hyperparameters are kept.
        trainable: a filter choosing the parameters to adapt (:data:`funcmeta.tree.Filter`: a
            predicate ``(name, tensor) -> bool``, a name prefix or several); the rest are held
            fixed in the inner loop and still receive outer gradients through the forward
            (ANIL). Parameters frozen on the module (``requires_grad=False``, see
            ``fmodel.frozen``) are never adapted and get no meta-gradient.
        clip_grad_norm: clip each step's gradients to this global 2-norm (differentiable,
            ``torch.nn.utils.clip_grad_norm_`` numbers); per task under task batching.
        truncate: run the first ``truncate`` steps without building a graph; the parameters
            re-enter with an identity Jacobian (``p_j + (p_0 - stopgrad(p_0))``), so the
            initial parameters get the first-order path through those steps and the
            hyperparameters and optimizer state get gradients from the later steps only.
        loss_scale: multiply each inner loss by this before differentiating and divide the
            gradients by it (fp16). A number implies ``on_nonfinite="raise"`` unless given.
            A ``torch.amp.GradScaler`` gives its current scale (a disabled one: no scaling)
            and, unless ``on_nonfinite`` is given, makes an inner overflow what an overflow
            in the outer backward is to it: the inner loop stops at the overflowing step,
            ``result.overflowed`` is ``True``, and every meta-gradient through the adapted
            parameters comes out non-finite, so that ``scaler.step`` skips the outer
            optimizer and ``scaler.update`` lowers the scale (docs/memory.md).
        on_nonfinite: check every inner loss and gradient (one host sync per step):
            ``"raise"`` raises :class:`funcmeta.NonFiniteError` naming the step, the
            parameters and (task-batched) the tasks; ``"skip"`` leaves parameters, optimizer
            state and buffers as they were for that step and records it in
            ``result.skipped`` (not with task batching: the tasks share the optimizer's step
            count). ``None`` (the default without ``loss_scale``) does not check.
        allow_unused: treat the gradient of an adapted parameter that the loss does not use
            as zero (weight decay and momentum still apply to it); by default such a
            parameter raises ``ValueError`` naming it.
        checkpoint_steps: run each inner step (forward, ``autograd.grad`` and update) inside
            one non-reentrant activation checkpoint: only each step's parameters, optimizer
            state and buffers are kept, and the step is recomputed during the outer backward.
            Same meta-gradients; the memory that saves second-order loops (docs/memory.md).
            Needs torch 2.8 or newer (``fm.UnsupportedTorchError`` on older torch, where
            the step's check for tensors changed in place after a save cannot run).
        offload_activations: keep the tensors the inner steps save for backward in CPU memory
            (``torch.autograd.graph.save_on_cpu``, pinned on CUDA). Same results.
    """

    first_order: bool = False
    trainable: Filter | None = None
    clip_grad_norm: float | Tensor | None = None
    truncate: int = 0
    loss_scale: float | GradScaler | None = None
    on_nonfinite: Literal["raise", "skip"] | None = None
    allow_unused: bool = False
    checkpoint_steps: bool = False
    offload_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("first_order", "allow_unused", "checkpoint_steps", "offload_activations"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.checkpoint_steps:
            require("checkpoint_steps", "checkpoint_steps=True")
        truncate = self.truncate
        check_int(truncate, "truncate", what="a non-negative int")
        scale = self.loss_scale
        if scale is not None and not isinstance(scale, GradScaler):
            try:
                check_real(scale, "loss_scale", low=0.0, low_open=True)
            except (TypeError, ValueError) as error:  # the message names the GradScaler too
                raise ValueError(
                    "loss_scale must be a finite positive number or a torch.amp.GradScaler, "
                    f"got {scale!r}"
                ) from error
        check_choice(self.on_nonfinite, "on_nonfinite", (None, "raise", "skip"))
        if self.clip_grad_norm is not None:
            check_max_norm(self.clip_grad_norm, "clip_grad_norm")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> AdaptOptions:
        """Build from keyword options; an unknown name raises ``TypeError`` naming it."""
        if not options:
            # a class is hashable (mypy checks the frozen dataclass's instance __hash__)
            return _default(cast(Hashable, cls))
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in options if k not in known]
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise TypeError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {names}; the options are "
                + ", ".join(known)
            )
        return cls(**options)

    @property
    def scale(self) -> float | None:
        """The loss scale in force, that is ``loss_scale``, a GradScaler's current scale, or ``None``
        (a disabled GradScaler included)."""
        scale = self.loss_scale
        if isinstance(scale, GradScaler):
            return scale.get_scale() if scale.is_enabled() else None
        return scale

    @property
    def nonfinite(self) -> str | None:
        """The check in force, that is ``on_nonfinite``; else ``"scaler"`` with an enabled GradScaler
        (an overflow makes the meta-iteration a skipped step), ``"raise"`` with a number."""
        if self.on_nonfinite is None and self.loss_scale is not None:
            if isinstance(self.loss_scale, GradScaler):
                return "scaler" if self.loss_scale.is_enabled() else None
            return "raise"
        return self.on_nonfinite

    def check_steps(self, steps: Any) -> None:
        """Check ``steps`` and that ``truncate`` does not exceed it."""
        check_int(steps, "steps", what="a non-negative int")
        check_int(self.truncate, "truncate", high=steps, what=f"an int in [0, steps={steps}]")


class StepKeywords(TypedDict, total=False):
    """The options of :class:`AdaptOptions` but ``first_order`` and ``trainable``, as
    keywords (see :class:`AdaptKeywords`)."""

    clip_grad_norm: float | Tensor | None
    truncate: int
    loss_scale: float | GradScaler | None
    on_nonfinite: Literal["raise", "skip"] | None
    allow_unused: bool
    checkpoint_steps: bool
    offload_activations: bool


@exposed_in("funcmeta")
class AdaptKeywords(StepKeywords, total=False):
    """The options of :class:`AdaptOptions` as keywords, for type checkers: the ``**options``
    of :func:`funcmeta.adapt`, :func:`funcmeta.adapt_tasks` and the recipes are
    ``Unpack[AdaptKeywords]`` (a recipe that sets an option itself takes the others), so a
    misspelled option or a value of the wrong type is an error before the code runs; the
    same check happens at run time, for everyone."""

    first_order: bool
    trainable: Filter | None


class FirstOrderKeywords(StepKeywords, total=False):
    """:class:`AdaptKeywords` less ``first_order`` (a recipe that is first order by
    definition)."""

    trainable: Filter | None


class HeadKeywords(StepKeywords, total=False):
    """:class:`AdaptKeywords` less ``trainable`` (a recipe that chooses what it adapts)."""

    first_order: bool


@functools.cache
def _default(cls: type[AdaptOptions]) -> AdaptOptions:
    """The options with every default (frozen, so one instance serves every call)."""
    return cls()


F = TypeVar("F", bound=Callable[..., Any])


def takes_options(fn: F, *, without: tuple[str, ...] = ()) -> F:
    """Show the fields of :class:`AdaptOptions` (less ``without``) in ``fn``'s signature in
    place of its ``**options``, for ``help()``, ``inspect.signature`` and the API reference.
    Returns ``fn`` itself."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    params += [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in dataclasses.fields(AdaptOptions)
        if f.name not in taken and f.name not in without
    ]
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return fn
