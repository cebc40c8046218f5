"""iMAML (Rajeswaran et al., 2019): implicit meta-gradients through a proximal inner problem.

Each task's inner loop minimises ``L_support(phi) + lam/2 * ||phi - theta||^2``, taken
without a graph. At its minimiser ``phi*``, the meta-gradient of the query loss with respect
to ``theta`` is ``x = (I + H/lam)^{-1} grad L_query(phi*)``, where ``H`` is the Hessian of the
support loss at ``phi*``. :func:`imaml` solves for ``x`` by conjugate gradient with
Hessian-vector products from autograd. It never differentiates through the inner path, so
memory does not grow with the number of inner steps. It returns a surrogate scalar whose
gradient with respect to ``theta`` is the mean of the tasks' ``x``, as ``result.loss``.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(4, 10, 10)
    >>> out = fm.recipes.imaml(fmodel, fmodel.params, F.mse_loss, b.support, b.query,
    ...                        steps=20, lam=2.0, lr=0.05)
    >>> out.loss.backward()
    >>> out.query_loss.item() > 0
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from funcmeta import kernels
from funcmeta._loop import LossFn
from funcmeta.functional import FunctionalModel
from funcmeta.inputs import check_model
from funcmeta.optim.base import GradientTransformation, chain
from funcmeta.optim.primitives import add_proximal
from funcmeta.options import takes_options
from funcmeta.recipes._common import RecipeResult, resolve_opt
from funcmeta.tasks import adapt_tasks, task_losses

__all__ = ["imaml"]


def _dot(a: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
    """Per-task inner products of two task-batched trees: shape ``(T,)``."""
    return sum((a[k] * b[k]).flatten(1).sum(1) for k in a)


def _per_task(scalar: Tensor, like: Tensor) -> Tensor:
    return scalar.reshape(-1, *([1] * (like.dim() - 1)))


@takes_options
def imaml(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    loss_fn: LossFn,
    support: tuple[Any, Any],
    query: tuple[Any, Any],
    *,
    steps: int,
    lam: float,
    lr: Any = None,
    opt: GradientTransformation | None = None,
    cg_steps: int = 5,
    cg_tol: float = 1e-10,
    **options: Any,
) -> RecipeResult:
    """The iMAML meta-gradient for a batch of tasks, as a surrogate for ``.backward()``.

    The inner loop is ``steps`` steps of ``opt`` (default SGD with ``lr``) on the proximal
    objective with strength ``lam``. Then ``cg_steps`` conjugate-gradient iterations solve
    ``(I + H/lam) x = grad L_query(phi*)`` per task, stopping early once the residual is
    below ``cg_tol`` relative to the right-hand side. The parameters must all be adapted
    (the option ``trainable`` is refused); the other options of
    :class:`funcmeta.AdaptOptions` apply to the inner loop. Buffers (BatchNorm) are used as
    the module holds them. ``result.residual`` and ``result.curvature_stop`` report on the
    solve.

    ``I + H/lam`` is positive definite when ``lam`` exceeds the most negative curvature of the
    support loss at ``phi*``. It need not be for a non-convex network that the inner loop has
    not brought to a minimum. Conjugate gradient then stops, per task, at the first direction
    of non-positive curvature (truncated CG) and keeps the solution reached so far. If that
    happens at the first step, the task falls back to ``x = grad L_query(phi*)``, the
    solution with ``H`` taken as 0. ``result.curvature_stop`` flags those tasks. A larger
    ``lam``, or more inner steps, avoids them.
    """
    check_model(fmodel)
    if "trainable" in options:
        raise TypeError("imaml adapts every parameter: its implicit gradient has no trainable=")
    if lam <= 0:
        raise ValueError(f"lam must be positive, got {lam}")
    if cg_steps < 1:
        raise ValueError(f"cg_steps must be at least 1, got {cg_steps}")
    theta = {k: v.detach() for k, v in params.items()}
    inner = chain(add_proximal(lam, theta), resolve_opt(opt, lr))
    with torch.no_grad():
        adapted = adapt_tasks(fmodel, theta, loss_fn, support, inner, steps=steps, **options)
    # the adapted parameters (frozen ones are held fixed and get no meta-gradient)
    frozen = set(fmodel.frozen)
    phi = {
        k: v.detach() if k in frozen else v.detach().requires_grad_()
        for k, v in adapted.params.items()
    }
    free = {k: v for k, v in phi.items() if k not in frozen}
    with torch.enable_grad():
        q_losses, _ = task_losses(fmodel, phi, loss_fn, query)
        rhs = dict(zip(free, torch.autograd.grad(q_losses.sum(), list(free.values())), strict=True))
        # differentiated again by every Hessian-vector product: kernels that allow it
        with kernels.twice_differentiable():
            s_losses, _ = task_losses(fmodel, phi, loss_fn, support)
            grads = torch.autograd.grad(s_losses.sum(), list(free.values()), create_graph=True)

    def operator(v: dict[str, Tensor]) -> dict[str, Tensor]:
        """``(I + H/lam) v`` per task (the tasks are independent: one Hessian-vector product
        of the summed support losses)."""
        dot = sum((g * v[k]).sum() for g, k in zip(grads, free, strict=True))
        hv = torch.autograd.grad(dot, list(free.values()), retain_graph=True)
        return {k: v[k] + h / lam for k, h in zip(free, hv, strict=True)}

    x = {k: torch.zeros_like(r) for k, r in rhs.items()}
    r = {k: t.clone() for k, t in rhs.items()}
    p = {k: t.clone() for k, t in rhs.items()}
    rr = _dot(r, r)
    rhs_norm = rr.sqrt().clamp_min(1e-30)
    active = torch.ones_like(rr, dtype=torch.bool)
    stopped = torch.zeros_like(active)
    for it in range(cg_steps):
        active = active & (rr.sqrt() / rhs_norm > cg_tol)
        if not bool(active.any()):
            break
        ap = operator(p)
        pap = _dot(p, ap)
        curved = pap > 0
        if it == 0:
            # No positive curvature along the right-hand side itself: fall back to x = rhs,
            # the solution with H taken as 0 (first-order).
            first = active & ~curved
            x = {k: torch.where(_per_task(first, v), rhs[k], v) for k, v in x.items()}
        stopped = stopped | (active & ~curved)
        step = active & curved
        alpha = torch.where(step, rr / torch.where(step, pap, 1.0), 0.0)
        x = {k: x[k] + _per_task(alpha, x[k]) * p[k] for k in x}
        r = {k: r[k] - _per_task(alpha, r[k]) * ap[k] for k in r}
        active = step
        rr_new = _dot(r, r)
        beta = torch.where(active, rr_new / torch.where(active, rr, 1.0), 0.0)
        p = {k: r[k] + _per_task(beta, r[k]) * p[k] for k in p}
        rr = torch.where(active, rr_new, rr)
    meta_grad = {k: v.mean(0).detach() for k, v in x.items()}
    surrogate = sum((params[k] * g).sum() for k, g in meta_grad.items())
    # the true residual of the x returned (one more product; CG's running r is not it for
    # the tasks that stopped or fell back)
    ax = operator(x)
    left = {k: rhs[k] - ax[k] for k in rhs}
    residual = (_dot(left, left).sqrt() / rhs_norm).detach()
    return RecipeResult(
        surrogate, q_losses.detach().mean(), adapted, residual=residual, curvature_stop=stopped
    )
