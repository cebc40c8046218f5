"""fm.implicit: implicit gradients against closed forms, finite differences and unrolled
solvers (float64); the linear solvers against dense solves; task batching against a loop."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import funcmeta as fm

D = torch.float64
SOLVERS = {
    "cg": fm.implicit.CG(steps=50, tol=1e-14),
    "normal_cg": fm.implicit.NormalCG(steps=50, tol=1e-14),
    "neumann": fm.implicit.Neumann(steps=400, alpha=0.05),
}


def ridge_data(seed: int = 0, n: int = 8, d: int = 4, tasks: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(*tasks, n, d, generator=g, dtype=D)
    y = torch.randn(*tasks, n, generator=g, dtype=D)
    return A, y


def ridge_closed(A, y, lam):
    eye = torch.eye(A.shape[-1], dtype=D)
    lam = torch.as_tensor(lam, dtype=D)
    M = A.mT @ A + lam[..., None, None] * eye
    return torch.linalg.solve(M, (A.mT @ y[..., None]))[..., 0]


def ridge_condition(x, p):
    """The gradient of ||A x - y||^2 / 2 + lam ||x||^2 / 2 (batched over leading axes)."""
    A, y, lam = p["A"], p["y"], p["lam"]
    r = (A @ x[..., None])[..., 0] - y
    return (A.mT @ r[..., None])[..., 0] + lam[..., None] * x


def ridge_implicit(A, y, lam, solver, batch_dims=0, **kwargs):
    with torch.no_grad():
        x_star = ridge_closed(A, y, lam)
    return fm.implicit.root(
        ridge_condition,
        x_star,
        {"A": A, "y": y, "lam": lam},
        solver=solver,
        batch_dims=batch_dims,
        **kwargs,
    )


def jacobians(fn, inputs):
    """Full Jacobians of fn(*inputs) (a vector) by backward passes with basis cotangents."""
    out = fn(*inputs)
    rows = []
    for i in range(out.numel()):
        e = torch.zeros_like(out).flatten()
        e[i] = 1
        rows.append(torch.autograd.grad(out, inputs, e.view_as(out), retain_graph=True))
    return [torch.stack([r[j] for r in rows]) for j in range(len(inputs))]


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_ridge_implicit_gradients_equal_the_closed_forms(name):
    A, y = ridge_data()
    A.requires_grad_()
    y.requires_grad_()
    lam = torch.tensor(1.5, dtype=D, requires_grad=True)
    j_a, j_y, j_lam = jacobians(
        lambda A, y, lam: ridge_implicit(A, y, lam, SOLVERS[name]), (A, y, lam)
    )
    with torch.no_grad():
        M = A.T @ A + lam * torch.eye(4, dtype=D)
        x = torch.linalg.solve(M, A.T @ y)
        # analytic: dx/dlam = -M^-1 x; dx/dy = M^-1 A^T; dx/dA_ij = M^-1 (e_j r_i - A^T e_i x_j)
        assert torch.allclose(j_lam, -torch.linalg.solve(M, x), rtol=0, atol=1e-8)
        assert torch.allclose(j_y, torch.linalg.solve(M, A.T), rtol=0, atol=1e-8)
        r = y - A @ x
        Minv = torch.linalg.inv(M)
        expected = torch.einsum("kj,i->kij", Minv, r) - torch.einsum("kl,il,j->kij", Minv, A, x)
    assert torch.allclose(j_a, expected, rtol=0, atol=1e-8)
    # and the exact derivative of the closed form (autograd through the dense solve)
    j_exact = jacobians(lambda A, y, lam: ridge_closed(A, y, lam), (A, y, lam))
    for got, want in zip((j_a, j_y, j_lam), j_exact, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-8)


def test_ridge_implicit_gradient_passes_gradcheck():
    A, y = ridge_data(1, n=5, d=3)
    lam = torch.tensor(0.7, dtype=D)
    for t in (A, y, lam):
        t.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda A, y, lam: ridge_implicit(A, y, lam, SOLVERS["cg"]), (A, y, lam)
    )


def quadratic_bilevel(seed: int = 0, d: int = 5):
    """Inner: x*(t) = argmin_x x^T Q x / 2 - t^T B x; outer: ||C x* - z||^2 / 2."""
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(d, d, generator=g, dtype=D)
    Q = R @ R.T / d + torch.eye(d, dtype=D)  # well conditioned, positive definite
    B = torch.randn(3, d, generator=g, dtype=D)
    C = torch.randn(4, d, generator=g, dtype=D)
    z = torch.randn(4, generator=g, dtype=D)
    t = torch.randn(3, generator=g, dtype=D, requires_grad=True)
    return Q, B, C, z, t


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_quadratic_bilevel_hypergradient_equals_closed_form_and_unrolled(name):
    Q, B, C, z, t = quadratic_bilevel()

    def condition(x, t):
        return Q @ x - B.T @ t

    x_star = torch.linalg.solve(Q, B.T @ t).detach()
    x = fm.implicit.root(condition, x_star, t, solver=SOLVERS[name])
    (g,) = torch.autograd.grad(0.5 * (C @ x - z).pow(2).sum(), t)
    # closed form: d/dt = B Q^-1 C^T (C x* - z)
    expected = B @ torch.linalg.solve(Q, C.T @ (C @ x_star - z))
    assert torch.allclose(g, expected, rtol=0, atol=1e-8)
    # gradient descent unrolled to convergence, differentiated through every step
    x = torch.zeros(5, dtype=D)
    step = 1 / torch.linalg.eigvalsh(Q).max()
    for _ in range(400):
        x = x - step * condition(x, t)
    (g_unrolled,) = torch.autograd.grad(0.5 * (C @ x - z).pow(2).sum(), t)
    assert torch.allclose(g, g_unrolled, rtol=0, atol=1e-8)


def test_a_non_symmetric_fixed_point_with_normal_cg_matches_finite_differences():
    """x = tanh(W x + t): the Jacobian of x - tanh(W x + t) is not symmetric."""
    g = torch.Generator().manual_seed(2)
    W = 0.3 * torch.randn(4, 4, generator=g, dtype=D)
    t = torch.randn(4, generator=g, dtype=D, requires_grad=True)

    def condition(x, p):
        return x - torch.tanh(p["W"] @ x + p["t"])

    def solve(W, t):
        x = torch.zeros(4, dtype=D)
        with torch.no_grad():
            for _ in range(200):
                x = torch.tanh(W @ x + t)
        return fm.implicit.root(
            condition, x, {"W": W, "t": t}, solver=fm.implicit.NormalCG(steps=40, tol=1e-14)
        )

    W.requires_grad_()
    assert torch.autograd.gradcheck(solve, (W, t))
    # CG on a non-symmetric Jacobian is not the method: its answer differs
    x = solve(W, t).detach()
    wrong = fm.implicit.root(
        condition, x, {"W": W, "t": t}, solver=fm.implicit.CG(steps=40), on_unsolved="ignore"
    )
    right = solve(W, t)
    (g_wrong,) = torch.autograd.grad(wrong.sum(), t)
    (g_right,) = torch.autograd.grad(right.sum(), t)
    assert not torch.allclose(g_wrong, g_right, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SOLVERS))
@pytest.mark.parametrize("per_task_lam", [False, True])
def test_task_batched_root_equals_the_per_task_loop(name, per_task_lam):
    T = 5
    A, y = ridge_data(3, tasks=(T,))
    lam = (
        torch.linspace(0.5, 2.0, T, dtype=D) if per_task_lam else torch.tensor(1.0, dtype=D)
    ).requires_grad_()
    A.requires_grad_()
    weights = torch.randn(T, 4, generator=torch.Generator().manual_seed(9), dtype=D)
    report = fm.implicit.Report()
    x = ridge_implicit(
        A, y, lam.expand(T) if not per_task_lam else lam, SOLVERS[name], 1, report=report
    )
    batched = torch.autograd.grad((x * weights).sum(), (A, lam))
    loop = [torch.zeros_like(A), torch.zeros_like(lam)]
    for i in range(T):
        li = lam[i] if per_task_lam else lam
        xi = ridge_implicit(A[i], y[i], li, SOLVERS[name])
        ga, gl = torch.autograd.grad((xi * weights[i]).sum(), (A, lam))
        loop[0] += ga
        loop[1] += gl
    for got, want in zip(batched, loop, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-10)
    assert report.residual.shape == (T,) and report.condition.shape == (T,)
    assert bool((report.residual < 1e-8).all()) and bool((report.condition < 1e-10).all())
    assert report.solves == 1


def test_solvers_equal_dense_solves_with_damping_and_per_system():
    g = torch.Generator().manual_seed(4)
    R = torch.randn(3, 6, 6, generator=g, dtype=D)
    S = R @ R.mT / 6 + 0.5 * torch.eye(6, dtype=D)  # three SPD systems
    N = torch.randn(3, 6, 6, generator=g, dtype=D) + 3 * torch.eye(6, dtype=D)  # non-symmetric
    b = torch.randn(3, 6, generator=g, dtype=D)
    eye = torch.eye(6, dtype=D)

    def mv(M):
        return lambda v: (M @ v[..., None])[..., 0]

    for damping in (0.0, 0.3):
        want = torch.linalg.solve(S + damping * eye, b)
        cg = fm.implicit.CG(steps=30, damping=damping)(mv(S), b, batch_dims=1)
        assert torch.allclose(cg.x, want, rtol=0, atol=1e-10)
        assert cg.residual.shape == (3,) and bool((cg.residual < 1e-10).all())
        lmax = float(torch.linalg.eigvalsh(S + damping * eye).max())
        neu = fm.implicit.Neumann(steps=2000, alpha=1 / lmax, damping=damping)(
            mv(S), b, batch_dims=1
        )
        assert torch.allclose(neu.x, want, rtol=0, atol=1e-8)
        for i in range(3):  # one system at a time: the same answer
            one = fm.implicit.CG(steps=30, damping=damping)(mv(S[i]), b[i])
            assert torch.allclose(one.x, cg.x[i], rtol=0, atol=1e-12)
    ncg = fm.implicit.NormalCG(steps=60)(mv(N), b, rmatvec=mv(N.mT), batch_dims=1)
    assert torch.allclose(ncg.x, torch.linalg.solve(N, b), rtol=0, atol=1e-9)
    # damped normal equations: (N^T N + d I) x = N^T b
    ncg = fm.implicit.NormalCG(steps=60, damping=0.3)(mv(N), b, rmatvec=mv(N.mT), batch_dims=1)
    want = torch.linalg.solve(N.mT @ N + 0.3 * eye, (N.mT @ b[..., None])[..., 0])
    assert torch.allclose(ncg.x, want, rtol=0, atol=1e-9)


def test_cg_on_an_indefinite_system_stops_and_falls_back():
    H = torch.diag(torch.tensor([-1.0, 2.0], dtype=D))
    b = torch.tensor([1.0, 0.0], dtype=D)  # along the negative direction: fallback x = b
    sol = fm.implicit.CG(steps=5)(lambda v: H @ v, b)
    assert bool(sol.curvature_stop) and sol.x.tolist() == [1.0, 0.0]
    assert float(sol.residual) == pytest.approx(2.0)
    both = torch.stack([b, torch.tensor([0.0, 1.0], dtype=D)])
    sol = fm.implicit.CG(steps=5)(lambda v: v @ H, both, batch_dims=1)
    assert sol.curvature_stop.tolist() == [True, False]
    assert torch.allclose(sol.x[1], torch.tensor([0.0, 0.5], dtype=D))
    assert sol.iterations.tolist() == [1, 1]


def test_solver_errors():
    with pytest.raises(ValueError, match="steps must be a positive int"):
        fm.implicit.CG(steps=0)
    with pytest.raises(ValueError, match="damping must be >= 0"):
        fm.implicit.Neumann(damping=-1.0)
    with pytest.raises(ValueError, match=r"alpha must be > 0\.0, got 0\.0"):
        fm.implicit.Neumann(alpha=0.0)
    with pytest.raises(TypeError, match="NormalCG needs rmatvec"):
        fm.implicit.NormalCG()(lambda v: v, torch.ones(2))
    with pytest.raises(ValueError, match="returned a leaf of shape"):
        fm.implicit.CG()(lambda v: v[:1], torch.ones(2))
    with pytest.raises(ValueError, match="share its leading axis"):
        fm.implicit.CG()(lambda v: v, {"a": torch.ones(2, 3), "b": torch.ones(3)}, batch_dims=1)
    with pytest.raises(ValueError, match="batch_dims must be 0 or 1"):
        fm.implicit.CG()(lambda v: v, torch.ones(2), batch_dims=2)


def test_root_errors_are_precise():
    t = torch.tensor([1.0, 2.0], dtype=D, requires_grad=True)
    hidden = torch.tensor(2.0, dtype=D, requires_grad=True)
    with pytest.raises(ValueError, match="neither the solution nor in params"):
        fm.implicit.root(lambda x, t: hidden * x - t, (t / 2).detach(), t)  # at the call
    with pytest.raises(ValueError, match="structure"):
        fm.implicit.root(lambda x, t: (x - t, x), t.detach(), t)
    with pytest.raises(ValueError, match="shape"):
        fm.implicit.root(lambda x, t: (x - t).sum(), t.detach(), t)
    with pytest.raises(TypeError, match="floating-point"):
        fm.implicit.root(lambda x, t: x, torch.ones(2, dtype=torch.long), t)
    with pytest.raises(TypeError, match="solver must be"):
        fm.implicit.root(lambda x, t: x - t, t.detach(), t, solver="cg")
    with pytest.raises(ValueError, match="on_unsolved"):
        fm.implicit.root(lambda x, t: x - t, t.detach(), t, on_unsolved="maybe")
    with pytest.raises(RuntimeError, match=r"outside torch\.func transforms"):
        torch.func.vmap(lambda s: fm.implicit.root(lambda x, t: x - t, s, s))(torch.ones(3, 2))
    with pytest.raises(ValueError, match="does not depend on the solution"):
        fm.implicit.root(lambda x, t: t * 1.0, t.detach(), t).sum().backward()


def test_root_unsolved_raises_warns_or_is_ignored():
    Q, B, _, _, t = quadratic_bilevel(d=8)
    x_star = torch.linalg.solve(Q, B.T @ t).detach()
    few = fm.implicit.CG(steps=1)

    def run(**kwargs):
        x = fm.implicit.root(lambda x, t: Q @ x - B.T @ t, x_star, t, solver=few, **kwargs)
        return torch.autograd.grad(x.sum(), t)

    with pytest.raises(fm.implicit.ConvergenceError, match="relative residual"):
        run()
    with pytest.warns(fm.implicit.ConvergenceWarning, match="max_residual"):
        run(on_unsolved="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(on_unsolved="ignore")
        run(max_residual=None)


def test_root_is_first_order_and_steps_aside_without_grad():
    t = torch.tensor([1.0, 2.0], dtype=D, requires_grad=True)
    x = fm.implicit.root(lambda x, t: x - t * t, (t * t).detach(), t)
    (g,) = torch.autograd.grad(x.sum(), t)
    assert torch.allclose(g, 2 * t.detach())
    with pytest.raises(RuntimeError, match="first-order gradients"):
        torch.autograd.grad(x.sum(), t, create_graph=True)
    with torch.no_grad():
        y = fm.implicit.root(lambda x, t: x - t, t.detach(), t)
    assert y.grad_fn is None
    report = fm.implicit.Report()
    fm.implicit.root(lambda x, t: x - t, t.detach() + 1, t.detach(), report=report)
    assert float(report.condition) == pytest.approx(2**0.5) and report.residual is None


def test_imaml_exact_meta_gradient_equals_root_on_the_proximal_condition():
    """iMAML with no damping is the implicit gradient of the proximal inner problem: the same
    meta-gradient through fm.implicit.root on its optimality condition."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    net = net.double()
    fmodel = fm.functional_model(net)
    b = fm.data.Sinusoid().sample(4, 10, 10, generator=torch.Generator().manual_seed(1))
    support = (b.support[0].double(), b.support[1].double())
    query = (b.query[0].double(), b.query[1].double())
    lam = 2.0
    run = functools.partial(
        fm.recipes.imaml,
        fmodel,
        fmodel.params,
        F.mse_loss,
        support,
        query,
        steps=200,
        lam=lam,
        lr=0.05,
        damping=0.0,
        lam_damping=0.0,
        cg_steps=60,
        cg_tol=1e-14,
    )
    out = run()
    out.loss.backward()
    expected = {k: v.grad.clone() for k, v in net.named_parameters()}
    net.zero_grad()
    theta = dict(fmodel.params)

    def condition(phi, theta):
        losses = fm.task_losses(fmodel, phi, F.mse_loss, support).losses
        grads = torch.autograd.grad(losses.sum(), list(phi.values()), create_graph=True)
        return {k: g + lam * (phi[k] - theta[k]) for k, g in zip(phi, grads, strict=True)}

    phi = fm.implicit.root(
        condition,
        out.adapted.params,
        theta,
        solver=fm.implicit.CG(steps=60, tol=1e-14),
        batch_dims=1,
        max_residual=1e-8,
    )
    fm.task_losses(fmodel, phi, F.mse_loss, query)[0].mean().backward()
    for k, v in net.named_parameters():
        assert torch.allclose(v.grad, expected[k], rtol=0, atol=1e-10), k
