"""Hyperparameter optimisation by implicit differentiation: one weight decay per feature.

A linear regression on 50 features, of which 5 carry the signal, with 60 training points:
enough to overfit without regularisation. Each feature gets its own L2 penalty
``exp(log_lam_i)``. The inner problem (the penalised least squares) is solved without a graph
by any solver, here a dense solve. ``fm.implicit.root`` attaches the gradient of that solution
with respect to the penalties through the optimality condition, and Adam descends the
validation loss in the 50 penalties. No inner step is unrolled.

The baseline is the best single penalty of a sweep on the same validation set. The script
prints both test errors, and how the learned penalties split the informative features from
the others.

    python examples/hyperparameters.py                       # about 15 s on 2 CPU cores
    python examples/hyperparameters.py --solver normal_cg    # about 27 s

Both times were measured on 2 AMD EPYC cores that other work shared (2026-11-26), the
process getting half a core (7 s and 13 s of CPU time): an idle machine runs them faster.
"""

from __future__ import annotations

import argparse

import torch
from _threads import add_threads_option, use_threads

import funcmeta as fm

SOLVERS = {
    "cg": fm.implicit.CG(steps=100, tol=1e-12),
    "normal_cg": fm.implicit.NormalCG(steps=200, tol=1e-12),
}


def make_data(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    d, informative = 50, 5
    w_true = torch.zeros(d, dtype=torch.float64)
    w_true[:informative] = torch.randn(informative, generator=g, dtype=torch.float64) * 2

    def split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, d, generator=g, dtype=torch.float64)
        return x, x @ w_true + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)

    return {"train": split(60), "val": split(200), "test": split(1000)}


def solve(x: torch.Tensor, y: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The penalised least squares ``argmin ||x w - y||^2 / 2 + sum(lam * w^2) / 2``."""
    return torch.linalg.solve(x.T @ x + torch.diag(lam), x.T @ y)


def mse(w: torch.Tensor, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return (x @ w - y).pow(2).mean()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Per-feature weight decay by implicit gradients.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--solver",
        choices=sorted(SOLVERS),
        default="cg",
        help="the linear solver of fm.implicit.root's backward pass: conjugate gradients on "
        "the optimality condition's Jacobian, symmetric here (cg), or on its normal equations "
        "(normal_cg, which any non-singular Jacobian allows)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=300,
        help="Adam steps on the 50 log-penalties, one inner solve and one implicit gradient each",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data: weights and points")
    add_threads_option(
        p,
        1,
        "a 50-feature linear problem: tiny operations, which more threads only slow down",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parser().parse_args(argv)
    use_threads(args)
    data = make_data(args.seed)
    x, y = data["train"]

    # the baseline: one penalty for every feature, the best of a sweep on the validation set
    sweep = [10 ** (k / 4) for k in range(-12, 13)]
    best = min(sweep, key=lambda lam: float(mse(solve(x, y, torch.full((50,), lam)), data["val"])))
    single = solve(x, y, torch.full((50,), best, dtype=torch.float64))

    def condition(w: torch.Tensor, log_lam: torch.Tensor) -> torch.Tensor:
        return x.T @ (x @ w - y) + log_lam.exp() * w  # the inner objective's gradient

    log_lam = torch.full((50,), torch.tensor(best).log().item(), dtype=torch.float64)
    log_lam.requires_grad_()
    outer = torch.optim.Adam([log_lam], lr=0.05)
    report = fm.implicit.Report()
    for _ in range(args.iterations):
        with torch.no_grad():  # the inner solver: no graph
            w = solve(x, y, log_lam.exp())
        w = fm.implicit.root(condition, w, log_lam, solver=SOLVERS[args.solver], report=report)
        loss = mse(w, data["val"])
        outer.zero_grad()
        loss.backward()
        outer.step()
    with torch.no_grad():
        learned = solve(x, y, log_lam.exp())
        lam = log_lam.exp()
    result = {
        "single_lam": best,
        "single_test_mse": float(mse(single, data["test"])),
        "learned_test_mse": float(mse(learned, data["test"])),
        "informative_lam": float(lam[:5].median()),
        "other_lam": float(lam[5:].median()),
        "last_residual": float(report.residual),
    }
    print(
        f"one penalty for all (best of a sweep, {best:.3g}): test MSE "
        f"{result['single_test_mse']:.3f}\n"
        f"one penalty per feature, learned by implicit gradients ({args.solver}): test MSE "
        f"{result['learned_test_mse']:.3f}\n"
        f"median learned penalty: informative features {result['informative_lam']:.3g}, "
        f"the others {result['other_lam']:.3g}; last solve's residual "
        f"{result['last_residual']:.1e}"
    )
    return result


if __name__ == "__main__":
    main()
