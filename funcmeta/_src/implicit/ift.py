"""Implicit differentiation of a solution through its optimality condition.

:func:`root` takes an optimality condition ``F(x, params) = 0`` (typically the gradient of an
inner objective with respect to ``x``) and a solution ``x*`` found by any means (a closed form,
an inner optimizer, a library solver, without a graph), and returns ``x*`` carrying the
gradient the implicit function theorem gives it:

    dx*/dparams = -(dF/dx)^{-1} dF/dparams,

so a loss of ``x*`` backpropagates into ``params`` without unrolling the solver. In backward,
``(dF/dx)^T u = v`` is solved for the incoming cotangent ``v`` with a matrix-free solver
(:class:`~funcmeta.implicit.CG` by default) on vector-Jacobian products of ``F``, and
``-(dF/dparams)^T u`` is what ``params`` receive.

Example: ridge regression ``x* = argmin ||A x - y||^2 / 2 + lam ||x||^2 / 2``, whose condition
is its gradient; the implicit gradient with respect to ``lam`` equals the closed form's.

    >>> import torch, funcmeta as fm
    >>> g = torch.Generator().manual_seed(0)
    >>> A, y = torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    >>> lam = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    >>> def condition(x, p):
    ...     return A.T @ (A @ x - y) + p["lam"] * x
    >>> with torch.no_grad():                       # any solver, no graph
    ...     x_star = torch.linalg.solve(A.T @ A + lam * torch.eye(3, dtype=torch.float64), A.T @ y)
    >>> x = fm.implicit.root(condition, x_star, {"lam": lam})
    >>> (g,) = torch.autograd.grad(x.sum(), lam)
    >>> exact = torch.linalg.solve(A.T @ A + lam * torch.eye(3, dtype=torch.float64), A.T @ y)
    >>> (g_exact,) = torch.autograd.grad(exact.sum(), lam)
    >>> bool(torch.allclose(g, g_exact, rtol=0, atol=1e-12))
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_choice, check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import inside_transform
from funcmeta._src.core.tree import Tree
from funcmeta._src.implicit.solvers import CG, ConvergenceWarning, Solver, _dot, leaves_like

__all__ = ["ConvergenceError", "Report", "root"]

Condition = Callable[[Tree, Tree], Tree]
OnUnsolved = Literal["raise", "warn", "ignore"]


@exposed_in("funcmeta.implicit")
class ConvergenceError(RuntimeError):
    """The linear solve of an implicit gradient left a residual above ``max_residual``."""


@exposed_in("funcmeta.implicit")
class Report:
    """What :func:`root` found out, filled in as it runs (pass one as ``report=``).

    Attributes:
        condition: ``||F(x*, params)||`` per system at the solution given, set when
            :func:`root` is called: how far ``x*`` is from satisfying its condition. The
            implicit gradient is the gradient of the *exact* root; a large value means ``x*``
            is not one.
        residual: the relative residual of the backward linear solve per system (``None``
            until a backward has run; the last backward's).
        iterations: the solver's iterations per system.
        curvature_stop: the systems where conjugate gradient met non-positive curvature.
        solves: how many backward solves have run.

    Example:
        >>> import torch, funcmeta as fm
        >>> report = fm.implicit.Report()
        >>> w = torch.tensor(2.0, requires_grad=True)
        >>> x = fm.implicit.root(lambda x, p: x - p, w.detach(), w, report=report)
        >>> x.backward()
        >>> report.solves, float(report.residual), float(w.grad)
        (1, 0.0, 1.0)
    """

    def __init__(self) -> None:
        self.condition: Tensor | None = None
        self.residual: Tensor | None = None
        self.iterations: Tensor | None = None
        self.curvature_stop: Tensor | None = None
        self.solves = 0

    def __repr__(self) -> str:
        return (
            f"Report(condition={self.condition}, residual={self.residual}, "
            f"iterations={self.iterations}, curvature_stop={self.curvature_stop}, "
            f"solves={self.solves})"
        )


@dataclass
class _Problem:
    """A root and its condition, evaluated once at the call with its graph kept: ``f`` is
    ``condition(xs, params)`` on graph leaves ``xs`` (the solution) and ``diff`` (the
    parameters that receive gradients)."""

    x_spec: Any
    xs: list[Tensor]
    diff: list[Tensor]
    f: list[Tensor]
    solver: Solver
    batch_dims: int
    max_residual: float | None
    on_unsolved: OnUnsolved
    report: Report | None


def _check_graph(outs: list[Tensor], xs: list[Tensor], params: list[Tensor]) -> None:
    """Refuse a condition that reaches tensors requiring grad other than ``x`` and ``params``
    (they would silently get no implicit gradient), or that does not reach ``x``."""
    mine = {id(t) for t in xs + params}
    solution = {id(t) for t in xs}
    reached = False
    seen: dict[int, Any] = {}  # holds the nodes: a freed wrapper's id can be reused
    stack: list[torch.autograd.graph.Node | None] = [
        t.grad_fn for t in outs if t.grad_fn is not None
    ]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        reached = reached or (variable is not None and id(variable) in solution)
        if variable is not None and id(variable) not in mine:
            raise ValueError(
                "the condition uses a tensor that requires grad and is neither the solution "
                f"nor in params (shape {tuple(variable.shape)}); it would get no implicit "
                "gradient: pass it in params, or detach it"
            )
        stack.extend(n for n, _ in node.next_functions)
    if not reached:
        raise ValueError("the condition does not depend on the solution")


class _Root(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, problem: _Problem, *diff_theta: Tensor) -> tuple[Tensor, ...]:
        ctx.problem = problem
        return tuple(x.detach().clone() for x in problem.xs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fm.implicit.root gives first-order gradients: a backward through it with "
                "create_graph=True (a second-order meta-gradient) is not supported"
            )
        pb: _Problem = ctx.problem
        xs = pb.xs
        v = [torch.zeros_like(x) if c is None else c for c, x in zip(cotangents, xs, strict=True)]
        f_idx = [i for i, t in enumerate(pb.f) if t.requires_grad]
        f_diff = [pb.f[i] for i in f_idx]

        def vjp(wrt: list[Tensor], u: list[Tensor], create: bool = False) -> list[Tensor]:
            got = torch.autograd.grad(
                f_diff,
                wrt,
                [u[i] for i in f_idx],
                retain_graph=True,
                create_graph=create,
                allow_unused=True,
            )
            return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt, strict=True)]

        def matvec(u: Tree) -> Tree:  # (dF/dx)^T u
            return tree.unflatten(pb.x_spec, vjp(xs, tree.leaves(u)))

        jvp_graph: list[Any] = []

        def rmatvec(w: Tree) -> Tree:  # (dF/dx) w, by differentiating the VJP in its cotangent
            if not jvp_graph:
                z = [torch.zeros_like(t).requires_grad_() for t in pb.f]
                with torch.enable_grad():
                    jvp_graph.extend([z, vjp(xs, z, create=True)])
            z, g = jvp_graph
            got = torch.autograd.grad(g, z, tree.leaves(w), retain_graph=True, allow_unused=True)
            return tree.unflatten(
                pb.x_spec,
                [torch.zeros_like(t) if d is None else d for d, t in zip(got, z, strict=True)],
            )

        sol = pb.solver(matvec, tree.unflatten(pb.x_spec, v), rmatvec, pb.batch_dims)
        _record(pb, sol)
        grads = vjp(pb.diff, tree.leaves(sol.x))
        return (None, *(-g for g in grads))


def _record(pb: _Problem, sol: Any) -> None:
    if pb.report is not None:
        pb.report.residual = sol.residual.detach()
        pb.report.iterations = sol.iterations
        pb.report.curvature_stop = sol.curvature_stop
        pb.report.solves += 1
    if pb.max_residual is None or pb.on_unsolved == "ignore":
        return
    bad = ~(sol.residual <= pb.max_residual)
    if not bool(bad.any()):
        return
    where = bad.nonzero().flatten().tolist() if bad.dim() else []
    worst = float(sol.residual.max())
    message = (
        f"implicit gradient: the linear solve left a relative residual of {worst:.3g} "
        f"(max_residual={pb.max_residual:g})"
        + (f" in systems {where[:8]}" if where else "")
        + f" with {type(pb.solver).__name__}: raise its steps, add damping, or check that the "
        "Jacobian of the condition is non-singular (positive definite for CG)"
    )
    if pb.on_unsolved == "raise":
        raise ConvergenceError(message)
    warnings.warn(message, ConvergenceWarning, stacklevel=2)


@exposed_in("funcmeta.implicit")
def root(
    condition: Condition,
    solution: Tree,
    params: Tree,
    *,
    solver: Solver | None = None,
    batch_dims: int = 0,
    max_residual: float | None = 1e-4,
    on_unsolved: OnUnsolved = "raise",
    report: Report | None = None,
) -> Tree:
    """``solution`` with the implicit-function-theorem gradient to ``params`` attached.

    Args:
        condition: ``condition(x, params) -> tree shaped like x``, zero at the solution: the
            gradient of an inner objective, or any optimality or fixed-point residual. It
            must be differentiable in ``x`` and ``params``, and may read other tensors that
            do not require grad (data); one that requires grad is refused, since it would get
            no gradient.
        solution: the root ``x*`` (a tree of floating tensors), found by any means; it is
            detached: the implicit gradient replaces any graph it has.
        params: a tree of tensors (or numbers); those that require grad receive the gradient.
        solver: how ``(dF/dx)^T u = v`` is solved in backward: :class:`CG` (default; ``dF/dx``
            symmetric positive definite, as for the gradient of an objective at a minimum),
            :class:`NormalCG` (any non-singular Jacobian) or :class:`Neumann`; their
            ``damping`` adds a multiple of the identity.
        batch_dims: ``1`` when every leaf of ``x`` has a leading axis of independent systems
            (tasks) and the condition does not mix them: one solve, step size and report
            entry per task, in one batched computation.
        max_residual: the largest relative residual of the backward solve accepted (``None``:
            no check).
        on_unsolved: ``"raise"`` a :class:`ConvergenceError` (default), ``"warn"`` with a
            :class:`ConvergenceWarning`, or ``"ignore"`` when the residual is above it.
        report: a :class:`Report` to fill in.

    The condition is evaluated once, at the call: its structure, its dependence on the
    solution and the tensors it reads are checked there, and its graph is kept for the
    backward solve (the memory of one evaluation, until the output's graph is freed). The
    gradient is first order: a backward with ``create_graph=True`` through it raises rather
    than give a second derivative of zero.
    Call it outside ``torch.func`` transforms; for many tasks, give them a leading axis and
    ``batch_dims=1``.
    """
    if inside_transform():
        raise RuntimeError(
            "fm.implicit.root runs outside torch.func transforms (vmap, grad): give the tasks "
            "a leading axis and pass batch_dims=1 instead"
        )
    if not callable(condition):
        raise TypeError(f"condition must be callable, got {type(condition).__name__}")
    if solver is None:
        solver = CG()
    if not isinstance(solver, Solver):
        raise TypeError(f"solver must be a CG, NormalCG or Neumann, got {type(solver).__name__}")
    check_choice(on_unsolved, "on_unsolved", ("raise", "warn", "ignore"))
    if max_residual is not None and max_residual != math.inf:  # inf: no limit, as None
        check_real(max_residual, "max_residual", low=0.0, low_open=True)
    x, x_spec = tree.flatten(solution)
    if not x or not all(isinstance(t, Tensor) and t.is_floating_point() for t in x):
        raise TypeError("the solution must be a non-empty tree of floating-point tensors")
    check_choice(batch_dims, "batch_dims", (0, 1))
    if batch_dims and len({t.shape[0] if t.dim() else None for t in x}) != 1:
        raise ValueError(
            "batch_dims=1 needs every leaf of the solution to share its leading (task) axis; "
            f"got shapes {[tuple(t.shape) for t in x]}"
        )
    theta, theta_spec = tree.flatten(params)
    idx = [i for i, t in enumerate(theta) if isinstance(t, Tensor) and t.requires_grad]
    differentiable = bool(idx) and torch.is_grad_enabled()
    # The condition is evaluated once, on graph leaves, with grad enabled (it may take
    # gradients of an inner loss); the backward differentiates this same graph.
    with torch.enable_grad():
        xs = [t.detach().requires_grad_() for t in x]
        thetas = [t.detach() if isinstance(t, Tensor) else t for t in theta]
        for i in idx if differentiable else []:
            thetas[i].requires_grad_()
        f = leaves_like(
            condition(tree.unflatten(x_spec, xs), tree.unflatten(theta_spec, thetas)),
            x_spec,
            x,
            "the condition",
        )
    diff = [thetas[i] for i in idx] if differentiable else []
    if differentiable:
        _check_graph([t for t in f if t.requires_grad], xs, diff)
    norm = _dot([t.detach() for t in f], [t.detach() for t in f], batch_dims).sqrt()
    if report is not None:
        report.condition = norm
    if not differentiable:
        return tree.unflatten(x_spec, [t.detach() for t in x])
    problem = _Problem(x_spec, xs, diff, f, solver, batch_dims, max_residual, on_unsolved, report)
    out = _Root.apply(problem, *(theta[i] for i in idx))
    return tree.unflatten(x_spec, out)
