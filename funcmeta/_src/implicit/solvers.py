"""Matrix-free linear solvers on pytrees: conjugate gradient, normal-equation CG, Neumann series.

Each solver is a small frozen dataclass, configured once and called as
``solver(matvec, b, rmatvec=None, batch_dims=0)``. ``matvec(v)`` applies a linear operator
``A`` to a tree shaped like ``b`` (a Hessian-vector product, a vector-Jacobian product);
``rmatvec(w)`` applies ``A^T`` (only :class:`NormalCG` needs it). The call returns a
:class:`Solution`: ``x`` with ``A x ~ b``, the relative residual of the ``x`` returned, the
number of iterations taken and, for conjugate gradient, the systems that met non-positive
curvature.

``batch_dims=1`` solves one independent system per index of the leading axis of every leaf
(one per task): inner products, step sizes and stopping are per system, and the report has
one entry per system. The operator must not mix systems (a sum of per-task losses gives such
Hessians).

Every solver takes ``damping``: a multiple of the identity added to the system, which
conditions a nearly singular or indefinite operator at the price of a biased solution.

Example:
    >>> import torch, funcmeta as fm
    >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    >>> b = {"v": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    >>> sol = fm.implicit.CG(steps=10)(lambda v: {"v": A @ v["v"]}, b)
    >>> sol.x["v"].tolist() == torch.linalg.solve(A, b["v"]).tolist()
    True
    >>> bool(sol.residual < 1e-12), int(sol.iterations)
    (True, 2)
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_choice, check_int, check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree

__all__ = ["CG", "ConvergenceWarning", "Neumann", "NormalCG", "Solution", "Solver"]

MatVec = Callable[[Tree], Tree]


@exposed_in("funcmeta.implicit")
class ConvergenceWarning(RuntimeWarning):
    """A linear solve (or the inner optimisation it rests on) did not reach the accuracy asked
    for; the gradient it gives is not the implicit gradient. Turn it into an error with
    ``warnings.simplefilter("error", fm.implicit.ConvergenceWarning)``."""


@exposed_in("funcmeta.implicit")
class Solution(NamedTuple):
    """What a solver returns.

    Attributes:
        x: the solution, a tree shaped like the right-hand side.
        residual: ``||b - A x|| / ||b||`` of the ``x`` returned (damping included in ``A``;
            :class:`NormalCG` reports the undamped system), one per system: shape
            ``b``'s leading ``batch_dims`` axes.
        iterations: iterations taken per system, an integer tensor of that shape (conjugate
            gradient steps, or terms of the Neumann series).
        curvature_stop: the systems where conjugate gradient met a direction of
            non-positive curvature and stopped there (always ``False`` for the others).
    """

    x: Tree
    residual: Tensor
    iterations: Tensor
    curvature_stop: Tensor


def _dot(a: list[Tensor], b: list[Tensor], batch_dims: int) -> Tensor:
    """Inner products per system: shape of the leading ``batch_dims`` axes."""
    # a tensor: _System refuses an empty right-hand side, so the sum has a term
    return cast(Tensor, sum((u * v).flatten(batch_dims).sum(-1) for u, v in zip(a, b, strict=True)))


def _expand(s: Tensor, like: Tensor) -> Tensor:
    """A per-system scalar ``s`` shaped to broadcast against a leaf ``like``."""
    return s.reshape(tuple(s.shape) + (1,) * (like.dim() - s.dim()))


def leaves_like(out: Tree, spec: Any, like: list[Tensor], what: str) -> list[Tensor]:
    """The leaves of ``out``, which must have structure ``spec`` and the shapes of ``like``
    (what an operator or a condition returns for a tree of the solution's shape)."""
    leaves, got = tree.flatten(out)
    if got != spec:
        raise ValueError(f"{what} returned a tree of structure {got}, not {spec}")
    for v, x in zip(leaves, like, strict=True):
        if not isinstance(v, Tensor) or v.shape != x.shape:
            shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(
                f"{what} returned a leaf of shape {shape} where one of shape "
                f"{tuple(x.shape)} belongs"
            )
    return leaves


def _check_damping(damping: float) -> None:
    check_real(damping, "damping", low=0.0)


def _check_steps(steps: int) -> None:
    check_int(steps, "steps", low=1, what="a positive int")


class _System:
    """The flattened right-hand side and the damped operator, on leaf lists."""

    def __init__(self, matvec: MatVec, b: Tree, damping: float, batch_dims: int) -> None:
        check_choice(batch_dims, "batch_dims", (0, 1))
        self.leaves, self.spec = tree.flatten(b)
        if not self.leaves or not all(isinstance(v, Tensor) for v in self.leaves):
            raise TypeError("the right-hand side must be a non-empty tree of tensors")
        if batch_dims and len({v.shape[0] if v.dim() else None for v in self.leaves}) != 1:
            raise ValueError(
                "batch_dims=1 needs every leaf of the right-hand side to share its leading "
                f"axis; got shapes {[tuple(v.shape) for v in self.leaves]}"
            )
        self.matvec, self.damping, self.batch_dims = matvec, damping, batch_dims

    def apply(self, v: list[Tensor], fn: MatVec | None = None) -> list[Tensor]:
        out = (fn or self.matvec)(tree.unflatten(self.spec, v))
        leaves = leaves_like(out, self.spec, v, "the operator")
        if fn is None and self.damping:
            leaves = [a + self.damping * u for a, u in zip(leaves, v, strict=True)]
        return leaves

    def dot(self, a: list[Tensor], b: list[Tensor]) -> Tensor:
        return _dot(a, b, self.batch_dims)

    def norm(self, a: list[Tensor]) -> Tensor:
        return self.dot(a, a).sqrt()


@exposed_in("funcmeta.implicit")
class Solver(abc.ABC):
    """The interface of the solvers here: ``solver(matvec, b, rmatvec=None, batch_dims=0)``.
    An abstract base: :func:`funcmeta.implicit.root` accepts its subclasses."""

    damping: float

    @abc.abstractmethod
    def __call__(
        self, matvec: MatVec, b: Tree, rmatvec: MatVec | None = None, batch_dims: int = 0
    ) -> Solution: ...


@dataclass(frozen=True)
class _Krylov(Solver):
    """The settings of the conjugate-gradient solvers: at most ``steps`` iterations, stopping
    at a residual below ``tol`` relative to the right-hand side; ``damping``."""

    steps: int = 100
    tol: float = 1e-10
    damping: float = 0.0

    def __post_init__(self) -> None:
        _check_steps(self.steps)
        _check_damping(self.damping)
        check_real(self.tol, "tol", low=0.0)


@exposed_in("funcmeta.implicit")
@dataclass(frozen=True)
class CG(_Krylov):
    """Conjugate gradient for ``(A + damping I) x = b`` with ``A`` symmetric positive definite
    (a Hessian at a minimum).

    At most ``steps`` iterations, stopping a system early once its residual is below ``tol``
    relative to ``b``. Truncated CG: a system whose search direction meets non-positive
    curvature (``A`` not positive definite there) stops and keeps the solution reached so far;
    if that happens at the first step its solution is ``b`` itself (``A`` taken as the
    identity, the first-order fallback). :attr:`Solution.curvature_stop` flags them.

    Example:
        >>> import torch, funcmeta as fm
        >>> H = torch.tensor([[2.0, 0.0], [0.0, 8.0]], dtype=torch.float64)
        >>> sol = fm.implicit.CG(steps=5, damping=2.0)(lambda v: H @ v, torch.ones(2, dtype=torch.float64))
        >>> [round(v, 12) for v in sol.x.tolist()]          # (H + 2 I)^-1 1
        [0.25, 0.1]
    """

    def __call__(
        self, matvec: MatVec, b: Tree, rmatvec: MatVec | None = None, batch_dims: int = 0
    ) -> Solution:
        s = _System(matvec, b, self.damping, batch_dims)
        rhs = s.leaves
        x = [torch.zeros_like(v) for v in rhs]
        r = [v.clone() for v in rhs]
        p = [v.clone() for v in rhs]
        rr = s.dot(r, r)
        rhs_norm = rr.sqrt().clamp_min(1e-30)
        active = torch.ones_like(rr, dtype=torch.bool)
        stopped = torch.zeros_like(active)
        iterations = torch.zeros_like(rr, dtype=torch.long)
        for it in range(self.steps):
            active = active & (rr.sqrt() / rhs_norm > self.tol)
            if not bool(active.any()):
                break
            ap = s.apply(p)
            iterations = iterations + active.long()
            pap = s.dot(p, ap)
            curved = pap > 0
            if it == 0:
                # no positive curvature along b itself: x = b, A taken as the identity
                first = active & ~curved
                x = [torch.where(_expand(first, v), u, v) for u, v in zip(rhs, x, strict=True)]
            stopped = stopped | (active & ~curved)
            step = active & curved
            alpha = torch.where(step, rr / torch.where(step, pap, 1.0), 0.0)
            x = [v + _expand(alpha, v) * d for v, d in zip(x, p, strict=True)]
            r = [v - _expand(alpha, v) * d for v, d in zip(r, ap, strict=True)]
            active = step
            rr_new = s.dot(r, r)
            beta = torch.where(active, rr_new / torch.where(active, rr, 1.0), 0.0)
            p = [v + _expand(beta, v) * d for v, d in zip(r, p, strict=True)]
            rr = torch.where(active, rr_new, rr)
        # the true residual of the x returned (CG's running r is not it for the systems that
        # stopped or fell back)
        ax = s.apply(x)
        left = [u - v for u, v in zip(rhs, ax, strict=True)]
        residual = s.norm(left) / rhs_norm
        return Solution(tree.unflatten(s.spec, x), residual, iterations, stopped)


@exposed_in("funcmeta.implicit")
@dataclass(frozen=True)
class NormalCG(_Krylov):
    """Conjugate gradient on the normal equations ``(A^T A + damping I) x = A^T b``: any
    non-singular ``A``, symmetric or not (a Jacobian of a general optimality condition).
    Needs ``rmatvec`` (``A^T``). Squares the condition number: prefer :class:`CG` when ``A``
    is symmetric positive definite. The residual reported is that of ``A x = b``.

    Example:
        >>> import torch, funcmeta as fm
        >>> A = torch.tensor([[1.0, 2.0], [0.0, 1.0]], dtype=torch.float64)
        >>> b = torch.tensor([5.0, 2.0], dtype=torch.float64)
        >>> sol = fm.implicit.NormalCG(steps=10)(lambda v: A @ v, b, rmatvec=lambda v: A.T @ v)
        >>> [round(v, 10) for v in sol.x.tolist()]
        [1.0, 2.0]
    """

    def __call__(
        self, matvec: MatVec, b: Tree, rmatvec: MatVec | None = None, batch_dims: int = 0
    ) -> Solution:
        if rmatvec is None:
            raise TypeError("NormalCG needs rmatvec, the transposed operator A^T")
        s = _System(matvec, b, 0.0, batch_dims)

        def normal(v: Tree) -> Tree:
            return rmatvec(matvec(v))

        atb = tree.unflatten(s.spec, s.apply(s.leaves, rmatvec))
        inner = CG(self.steps, self.tol, self.damping)(normal, atb, batch_dims=batch_dims)
        x = tree.leaves(inner.x)
        left = [u - v for u, v in zip(s.leaves, s.apply(x), strict=True)]
        residual = s.norm(left) / s.norm(s.leaves).clamp_min(1e-30)
        return Solution(inner.x, residual, inner.iterations, inner.curvature_stop)


@exposed_in("funcmeta.implicit")
@dataclass(frozen=True)
class Neumann(Solver):
    """The truncated Neumann series ``x = alpha sum_{k<steps} (I - alpha (A + damping I))^k b``
    (the hypergradient approximation of Lorraine et al., 2020). It converges to the solution
    of ``(A + damping I) x = b`` when the eigenvalues of ``alpha (A + damping I)`` lie in
    ``(0, 2)``; truncated early it is a biased, well-behaved approximation. ``alpha`` must be
    below ``2 / lambda_max``.

    Example:
        >>> import torch, funcmeta as fm
        >>> A = torch.tensor([[1.0, 0.0], [0.0, 0.5]], dtype=torch.float64)
        >>> sol = fm.implicit.Neumann(steps=200, alpha=1.0)(lambda v: A @ v, torch.ones(2, dtype=torch.float64))
        >>> [round(v, 8) for v in sol.x.tolist()]
        [1.0, 2.0]
    """

    steps: int = 50
    alpha: float = 1.0
    damping: float = 0.0

    def __post_init__(self) -> None:
        _check_steps(self.steps)
        _check_damping(self.damping)
        check_real(self.alpha, "alpha", low=0.0, low_open=True)

    def __call__(
        self, matvec: MatVec, b: Tree, rmatvec: MatVec | None = None, batch_dims: int = 0
    ) -> Solution:
        s = _System(matvec, b, self.damping, batch_dims)
        term = [self.alpha * v for v in s.leaves]
        x = list(term)
        for _ in range(self.steps - 1):
            at = s.apply(term)
            term = [t - self.alpha * a for t, a in zip(term, at, strict=True)]
            x = [u + t for u, t in zip(x, term, strict=True)]
        left = [u - v for u, v in zip(s.leaves, s.apply(x), strict=True)]
        rhs_norm = s.norm(s.leaves).clamp_min(1e-30)
        residual = s.norm(left) / rhs_norm
        iterations = torch.full_like(residual, self.steps, dtype=torch.long)
        return Solution(
            tree.unflatten(s.spec, x), residual, iterations, torch.zeros_like(iterations).bool()
        )
