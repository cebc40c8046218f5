"""Implicit differentiation: gradients of solutions defined by an optimality condition.

:func:`root` attaches the implicit-function-theorem gradient to a solution found by any
means; :class:`CG`, :class:`NormalCG` and :class:`Neumann` solve the linear systems it needs
(and any other matrix-free system: iMAML uses :class:`CG` directly), each with damping and a
per-system convergence report. Hyperparameter optimisation, bilevel problems, closed-form
heads (:func:`funcmeta.heads.ridge`) and iMAML all rest on it.

Example: a quadratic bilevel problem. The inner solution ``x*(t) = argmin_x (x - t)^T Q (x - t) / 2
+ x^T x / 2`` is ``(Q + I)^{-1} Q t``; its implicit gradient matches.

    >>> import torch, funcmeta as fm
    >>> Q = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    >>> t = torch.tensor([1.0, -1.0], dtype=torch.float64, requires_grad=True)
    >>> condition = lambda x, t: Q @ (x - t) + x              # the inner gradient
    >>> x_star = torch.linalg.solve(Q + torch.eye(2, dtype=torch.float64), Q @ t).detach()
    >>> x = fm.implicit.root(condition, x_star, t, solver=fm.implicit.CG(steps=10))
    >>> x.pow(2).sum().backward()                             # an outer loss of x*
    >>> M = torch.linalg.solve(Q + torch.eye(2, dtype=torch.float64), Q)
    >>> bool(torch.allclose(t.grad, M.T @ (2 * x_star), rtol=0, atol=1e-12))
    True
"""

from funcmeta._src.implicit.ift import ConvergenceError, Report, root
from funcmeta._src.implicit.solvers import (
    CG,
    ConvergenceWarning,
    Neumann,
    NormalCG,
    Solution,
    Solver,
)

__all__ = [
    "CG",
    "ConvergenceError",
    "ConvergenceWarning",
    "Neumann",
    "NormalCG",
    "Report",
    "Solution",
    "Solver",
    "root",
]
