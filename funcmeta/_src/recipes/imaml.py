"""iMAML (Rajeswaran et al., 2019): implicit meta-gradients through a proximal inner problem.

Each task's inner loop minimises ``L_support(phi) + lam/2 * ||phi - theta||^2``, taken
without a graph. At its minimiser ``phi*``, the meta-gradient of the query loss with respect
to ``theta`` is ``x = (I + H/lam)^{-1} grad L_query(phi*)``, where ``H`` is the Hessian of the
support loss at ``phi*``. :func:`imaml` solves for ``x`` by conjugate gradient with
Hessian-vector products from autograd. It never differentiates through the inner path, so
memory does not grow with the number of inner steps. It returns a surrogate scalar whose
gradient with respect to ``theta`` is the mean of the tasks' ``x``, as ``result.loss``.

By default it solves the damped system of the authors' implementation,
``((1 + damping) I + H / (lam + lam_damping)) x = grad L_query(phi*)`` with ``damping = 1`` and
``lam_damping = 10``: far better conditioned on non-convex networks, at the price of a biased
(shrunk) meta-gradient. ``damping=0, lam_damping=0`` is the exact implicit gradient.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(4, 10, 10)
    >>> out = fm.recipes.imaml(fmodel, fmodel.params, F.mse_loss, b.support, b.query,
    ...                        steps=20, lam=2.0, lr=0.01)
    >>> out.loss.backward()
    >>> bool(out.residual.max() < 1e-2)       # conjugate gradient converged for every task
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor
from typing_extensions import Unpack

from funcmeta._src.core import kernels
from funcmeta._src.core.checks import check_int, check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.types import LossFn
from funcmeta._src.implicit.solvers import CG, ConvergenceWarning
from funcmeta._src.inner.options import AdaptKeywords, takes_options
from funcmeta._src.inner.tasks import adapt_tasks, task_losses
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation, chain
from funcmeta._src.optim.primitives import add_proximal
from funcmeta._src.recipes.common import check_recipe, resolve_opt
from funcmeta._src.recipes.results import ImamlResult
from funcmeta._src.runtime.place import at

__all__ = ["DAMPING", "LAM_DAMPING", "ConvergenceWarning", "imaml"]

DAMPING = 1.0
"""``c`` of the authors' damped system ``(1 + c) v + H v / (lam + d)``."""
LAM_DAMPING = 10.0
"""``d`` of the authors' damped system ``(1 + c) v + H v / (lam + d)``."""


@exposed_in("funcmeta.recipes")
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
    damping: float = DAMPING,
    lam_damping: float = LAM_DAMPING,
    max_residual: float = 1e-2,
    task_chunk: int | str | None = "auto",
    **options: Unpack[AdaptKeywords],
) -> ImamlResult:
    """The iMAML meta-gradient for a batch of tasks, as a surrogate for ``.backward()``.

    The inner loop is ``steps`` steps of ``opt`` (or SGD with ``lr``; one of them is required) on the proximal
    objective with strength ``lam``. Then ``cg_steps`` conjugate-gradient iterations solve
    ``((1 + damping) I + H / (lam + lam_damping)) x = grad L_query(phi*)`` per task, stopping
    early once the residual is below ``cg_tol`` relative to the right-hand side. The defaults
    (``DAMPING``, ``LAM_DAMPING``) are the authors'; ``damping=0, lam_damping=0``
    solves ``(I + H/lam) x = grad L_query(phi*)``, the exact implicit gradient. The parameters must all be adapted
    (the option ``trainable`` is refused); the other options of
    :class:`funcmeta.AdaptOptions` apply to the inner loop. Buffers (BatchNorm) are used as
    the module holds them. ``result.residual`` and ``result.curvature_stop`` report on the
    solve. ``task_chunk`` is :func:`funcmeta.adapt_tasks`'; the query and support passes run
    on the inner loop's chunk.

    A :class:`funcmeta.implicit.ConvergenceWarning` names the tasks whose returned solution has a relative
    residual above ``max_residual`` (or a non-finite one), and the tasks whose inner loop
    ended with a larger proximal objective than it started with (a diverging inner
    optimizer: lower its learning rate); the meta-gradient of such a task is not the
    method's.

    The system is positive definite when ``lam`` exceeds the most negative curvature of the
    support loss at ``phi*``. It need not be for a non-convex network that the inner loop has
    not brought to a minimum. Conjugate gradient then stops, per task, at the first direction
    of non-positive curvature (truncated CG) and keeps the solution reached so far. If that
    happens at the first step, the task falls back to ``x = grad L_query(phi*)``, the
    solution with ``H`` taken as 0. ``result.curvature_stop`` flags those tasks. A larger
    ``lam``, or more inner steps, avoids them.
    """
    check_recipe(fmodel, support, query)
    if "trainable" in options:
        raise TypeError("imaml adapts every parameter: its implicit gradient has no trainable=")
    check_real(lam, "lam (the proximal strength)", low=0.0, low_open=True)
    check_int(cg_steps, "cg_steps", low=1)
    check_real(cg_tol, "cg_tol", low=0.0)
    check_real(damping, "damping", low=0.0)
    check_real(lam_damping, "lam_damping", low=0.0)
    check_real(max_residual, "max_residual", low=0.0, low_open=True)
    theta = {k: v.detach() for k, v in params.items()}
    inner = chain(add_proximal(lam, theta), resolve_opt(opt, lr))
    with torch.no_grad():
        adapted = adapt_tasks(
            fmodel, theta, loss_fn, support, inner, steps=steps, task_chunk=task_chunk, **options
        )
    # the adapted parameters (frozen ones are held fixed and get no meta-gradient)
    frozen = set(fmodel.frozen)
    phi = {
        k: v.detach() if k in frozen else v.detach().requires_grad_()
        for k, v in adapted.params.items()
    }
    free = {k: v for k, v in phi.items() if k not in frozen}
    with torch.enable_grad():
        with at("the query batch"):
            q_losses, _, logits = task_losses(
                fmodel, phi, loss_fn, query, return_outputs=True, task_chunk=adapted.chunk
            )
        rhs = dict(zip(free, torch.autograd.grad(q_losses.sum(), list(free.values())), strict=True))
        # differentiated again by every Hessian-vector product: kernels that allow it
        with kernels.twice_differentiable():
            with at("the support batch"):
                s_losses = task_losses(
                    fmodel, phi, loss_fn, support, task_chunk=adapted.chunk
                ).losses
            grads = torch.autograd.grad(s_losses.sum(), list(free.values()), create_graph=True)

    def operator(v: dict[str, Tensor]) -> dict[str, Tensor]:
        """``(1 + damping) v + H v / (lam + lam_damping)`` per task (the tasks are
        independent: one Hessian-vector product of the summed support losses)."""
        # a tensor: free holds a parameter (adapt_tasks refuses a call without one)
        dot = cast(Tensor, sum((g * v[k]).sum() for g, k in zip(grads, free, strict=True)))
        hv = torch.autograd.grad(dot, list(free.values()), retain_graph=True)
        return {
            k: (1 + damping) * v[k] + h / (lam + lam_damping) for k, h in zip(free, hv, strict=True)
        }

    # one system per task (the leading axis): truncated CG with its first-order fallback
    solution = CG(steps=cg_steps, tol=cg_tol)(operator, rhs, batch_dims=1)
    x = solution.x
    meta_grad = {k: v.mean(0).detach() for k, v in x.items()}
    surrogate = sum((params[k] * g).sum() for k, g in meta_grad.items())
    residual = solution.residual.detach()
    _check_convergence(residual, max_residual, s_losses.detach(), free, theta, lam, adapted)
    return ImamlResult(
        surrogate,
        q_losses.detach().mean(),
        adapted,
        residual=residual,
        curvature_stop=solution.curvature_stop,
        logits=logits.detach(),
    )


def _check_convergence(
    residual: Tensor,
    max_residual: float,
    support_losses: Tensor,
    free: Mapping[str, Tensor],
    theta: Mapping[str, Tensor],
    lam: float,
    adapted: Any,
) -> None:
    """Warn about the tasks where the method's assumptions failed (one host sync)."""
    unsolved = (~(residual <= max_residual)).nonzero().flatten().tolist()
    if unsolved:
        found = ", ".join(f"task {t}: {residual[t].item():.3g}" for t in unsolved[:8])
        warnings.warn(
            f"iMAML: conjugate gradient did not converge for {len(unsolved)} of "
            f"{len(residual)} tasks (relative residual above max_residual={max_residual:g}; "
            f"{found}). Their meta-gradient is not the implicit gradient: raise cg_steps, "
            "lam or the damping, or run the inner loop closer to its minimum.",
            ConvergenceWarning,
            stacklevel=3,
        )
    if adapted.losses.shape[0] == 0:
        return
    start = adapted.losses[0].detach()
    # a tensor: free holds a parameter (adapt_tasks refuses a call without one)
    proximal = cast(
        Tensor, sum((free[k].detach() - theta[k]).pow(2).flatten(1).sum(1) for k in free)
    )
    proximal = proximal * (lam / 2)
    end = support_losses + proximal
    rising = (~(end <= start)).nonzero().flatten().tolist()
    if rising:
        found = ", ".join(
            f"task {t}: {start[t].item():.3g} -> {end[t].item():.3g}" for t in rising[:8]
        )
        warnings.warn(
            f"iMAML: the inner loop ended above where it started for {len(rising)} of "
            f"{len(start)} tasks (proximal objective {found}): the inner optimizer diverges; "
            "lower its learning rate.",
            ConvergenceWarning,
            stacklevel=3,
        )
