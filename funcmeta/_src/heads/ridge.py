"""Ridge regression in closed form and the R2D2 head: the implementation of
:mod:`funcmeta.heads`."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.core.checks import check_choice, check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.implicit.ift import root
from funcmeta._src.implicit.solvers import CG, Solver

__all__ = ["RidgeHead", "ridge"]

Method = Literal["exact", "implicit"]
_METHODS = ("exact", "implicit")


def _solve(features: Tensor, targets: Tensor, lam: Tensor) -> Tensor:
    """``(X^T X + lam I)^{-1} X^T Y``, through the smaller of the two systems (Woodbury)."""
    n, d = features.shape[-2:]
    lam = lam[..., None, None]
    if n < d:  # X^T (X X^T + lam I_n)^{-1} Y: n x n, as in R2D2
        gram = features @ features.mT
        eye = torch.eye(n, dtype=gram.dtype, device=gram.device)
        return features.mT @ torch.linalg.solve(gram + lam * eye, targets)
    gram = features.mT @ features
    eye = torch.eye(d, dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + lam * eye, features.mT @ targets)


def _condition(w: Tensor, p: dict[str, Tensor]) -> Tensor:
    """The gradient of ``||X W - Y||^2 / 2 + lam ||W||^2 / 2`` in ``W``."""
    x = p["features"]
    return x.mT @ (x @ w - p["targets"]) + p["lam"][..., None, None] * w


@exposed_in("funcmeta.heads")
def ridge(
    features: Tensor,
    targets: Tensor,
    lam: float | Tensor,
    *,
    method: Method = "exact",
    solver: Solver | None = None,
) -> Tensor:
    """The ridge-regression weights ``W = argmin ||X W - Y||^2 + lam ||W||^2``.

    ``features`` ``X`` is ``(n, d)`` or ``(T, n, d)`` (one problem per task), ``targets`` ``Y``
    ``(n, c)`` or ``(T, n, c)``; ``lam`` a positive number, or a tensor of shape ``()`` or
    ``(T,)``. Returns ``W``, ``(d, c)`` or ``(T, d, c)``, differentiable in all three.

    ``method="exact"`` differentiates the closed form
    ``(X^T X + lam I)^{-1} X^T Y = X^T (X X^T + lam I)^{-1} Y``, solving the smaller of the
    ``n x n`` and ``d x d`` systems (few-shot tasks have ``n << d``). ``method="implicit"``
    computes the same solution without a graph and attaches the implicit gradient of its
    optimality condition ``X^T (X W - Y) + lam W = 0`` (:func:`funcmeta.implicit.root`),
    solved by ``solver``: by default conjugate gradient with ``2 (n + 1)`` steps, enough in
    exact arithmetic, since ``X^T X + lam I`` has at most ``n + 1`` distinct eigenvalues.

    Example:
        >>> import torch, funcmeta as fm
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
        >>> Y = torch.tensor([[1.0], [2.0], [2.0]], dtype=torch.float64)
        >>> [round(v, 6) for v in fm.heads.ridge(X, Y, 1e-9).flatten().tolist()]  # X W = Y
        [1.0, 1.0]
    """
    if not (isinstance(features, Tensor) and features.is_floating_point()):
        raise TypeError("features must be a floating-point tensor (n, d) or (T, n, d)")
    if features.dim() not in (2, 3):
        raise ValueError(f"features must be (n, d) or (T, n, d), got {tuple(features.shape)}")
    if not isinstance(targets, Tensor) or targets.shape[:-1] != features.shape[:-1]:
        got = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(
            f"targets must be {tuple(features.shape[:-1])} + (c,) to match the features "
            f"{tuple(features.shape)}, got {got}"
        )
    check_choice(method, "method", _METHODS)
    if isinstance(lam, Tensor):
        if lam.dim() > 1 or (lam.dim() == 1 and (features.dim() != 3 or len(lam) != len(features))):
            raise ValueError(
                f"lam must be a number, a 0-d tensor or one value per task, got {tuple(lam.shape)}"
            )
    else:
        check_real(lam, "lam", low=0.0, low_open=True)
    lam = torch.as_tensor(lam, dtype=features.dtype, device=features.device)
    if features.dim() == 3:
        lam = lam.expand(features.shape[0])
    targets = targets.to(features.dtype)
    if method == "exact":
        return _solve(features, targets, lam)
    with torch.no_grad():
        w = _solve(features, targets, lam)
    n = features.shape[-2]
    return root(
        _condition,
        w,
        {"features": features, "targets": targets, "lam": lam},
        solver=solver or CG(steps=2 * (n + 1), tol=1e-12),
        batch_dims=features.dim() - 2,
    )


@exposed_in("funcmeta.heads")
class RidgeHead(nn.Module):
    """The R2D2 head: ridge regression of one-hot labels on the support embeddings, then
    ``logits = scale * (z_query @ W) + bias``.

    ``lam`` (kept as its log, so it stays positive), ``scale`` and ``bias`` are Parameters:
    hand ``head.parameters()`` to the outer optimizer with the embedding's (``learn=False``
    keeps them fixed). ``method`` and ``solver`` are those of :func:`ridge`. Called as
    ``head(z_support (T, S, D), y_support (T, S), z_query (T, Q, D), ways)``, it returns
    ``(T, Q, ways)`` logits: the signature of
    :func:`funcmeta.recipes.prototype_logits`, so it serves as ``fm.evaluate``'s ``method``.

    Example:
        >>> import funcmeta as fm
        >>> fm.heads.RidgeHead(lam=0.5, scale=4.0, method="implicit")
        RidgeHead(lam=0.5, scale=4, bias=0, method='implicit')
    """

    def __init__(
        self,
        lam: float = 1.0,
        scale: float = 1.0,
        bias: float = 0.0,
        *,
        learn: bool = True,
        method: Method = "exact",
        solver: Solver | None = None,
    ) -> None:
        super().__init__()
        lam = check_real(lam, "lam", low=0.0, low_open=True)
        check_choice(method, "method", _METHODS)
        self.log_lam = nn.Parameter(torch.tensor(math.log(lam)), requires_grad=learn)
        self.scale = nn.Parameter(torch.tensor(float(scale)), requires_grad=learn)
        self.bias = nn.Parameter(torch.tensor(float(bias)), requires_grad=learn)
        self.method: Method = method
        self.solver = solver

    @property
    def lam(self) -> Tensor:
        return self.log_lam.exp()

    def forward(self, z_support: Tensor, y_support: Tensor, z_query: Tensor, ways: int) -> Tensor:
        if z_support.dim() != 3 or z_query.dim() != 3:
            raise ValueError(
                "the head takes embeddings (T, S, D) and (T, Q, D), got "
                f"{tuple(z_support.shape)} and {tuple(z_query.shape)}"
            )
        if y_support.shape != z_support.shape[:2] or y_support.is_floating_point():
            raise ValueError(
                f"support labels must be integers of shape {tuple(z_support.shape[:2])}, "
                f"got {tuple(y_support.shape)} {y_support.dtype}"
            )
        onehot = F.one_hot(y_support, ways).to(z_support.dtype)
        lam = self.lam.to(z_support.dtype)
        w = ridge(z_support, onehot, lam, method=self.method, solver=self.solver)
        return self.scale.to(z_query.dtype) * (z_query @ w) + self.bias.to(z_query.dtype)

    def extra_repr(self) -> str:
        return (
            f"lam={self.lam.item():.3g}, scale={self.scale.item():.3g}, "
            f"bias={self.bias.item():.3g}, method={self.method!r}"
        )
