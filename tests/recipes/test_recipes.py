"""Each recipe against an independent reference (hand-written unrolls of a hand-written MLP
forward, or a closed form), float64, plus each method's defining property."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

DTYPE = torch.float64
T, K = 3, 2


def net_and_tasks(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    b = fm.data.Sinusoid().sample(T, 5, 7, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    return net, (b.x_support, b.y_support), (b.x_query, b.y_query)


def hand_forward(p, x):
    h = torch.tanh(x @ p["0.weight"].T + p["0.bias"])
    return h @ p["2.weight"].T + p["2.bias"]


def hand_unroll(params, x, y, rate, steps, *, second=True, keys=None):
    """SGD by hand; ``rate(k, name)`` gives step k's rate for a parameter."""
    p = dict(params)
    keys = list(p) if keys is None else keys
    for k in range(steps):
        loss = F.mse_loss(hand_forward(p, x), y)
        grads = torch.autograd.grad(loss, [p[n] for n in keys], create_graph=second)
        for n, g in zip(keys, grads, strict=True):
            p[n] = p[n] - rate(k, n) * g
    return p


def hand_meta_loss(params, support, query, rate, steps, **kwargs):
    losses = []
    for t in range(T):
        p = hand_unroll(params, support[0][t], support[1][t], rate, steps, **kwargs)
        losses.append(F.mse_loss(hand_forward(p, query[0][t]), query[1][t]))
    return torch.stack(losses).mean()


def grads_of(loss, inputs):
    return [
        torch.zeros_like(i) if g is None else g
        for g, i in zip(torch.autograd.grad(loss, inputs, allow_unused=True), inputs, strict=True)
    ]


def assert_close_all(a, b, rtol=1e-10, atol=1e-12):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("first_order", [False, True])
def test_maml_and_fomaml(first_order):
    net, support, query = net_and_tasks()
    fmodel = fm.functional_model(net)
    lr = torch.tensor(0.3, dtype=DTYPE, requires_grad=True)
    recipe = fm.recipes.fomaml if first_order else fm.recipes.maml
    ours = grads_of(
        recipe(fmodel, fmodel.params, F.mse_loss, support, query, lr=lr, steps=K).loss,
        [*net.parameters(), lr],
    )
    ref = hand_meta_loss(fmodel.params, support, query, lambda k, n: lr, K, second=not first_order)
    assert_close_all(ours, grads_of(ref, [*net.parameters(), lr]))


def test_metasgd_rates_learn_per_element():
    net, support, query = net_and_tasks()
    fmodel = fm.functional_model(net)
    rates = fm.recipes.metasgd_rates(fmodel.params, generator=torch.Generator().manual_seed(3))
    values = rates()
    assert all(((v >= 0.005) & (v <= 0.1)).all() for v in values.values())
    inputs = [*net.parameters(), *rates.parameters()]
    ours = grads_of(
        fm.recipes.metasgd(
            fmodel, fmodel.params, F.mse_loss, support, query, lr=rates, steps=K
        ).loss,
        inputs,
    )
    ref = hand_meta_loss(fmodel.params, support, query, lambda k, n: values[n], K)
    assert_close_all(ours, grads_of(ref, inputs))
    for g in ours[len(list(net.parameters())) :]:
        assert (
            g.shape != () and (g != 0).any()
        )  # one learned rate per element, all receive gradients


def test_anil_adapts_only_the_head():
    net, support, query = net_and_tasks()
    fmodel = fm.functional_model(net)
    inputs = list(net.parameters())
    ours = grads_of(
        fm.recipes.anil(
            fmodel, fmodel.params, F.mse_loss, support, query, trainable="2", lr=0.3, steps=K
        ).loss,
        inputs,
    )
    ref = hand_meta_loss(
        fmodel.params, support, query, lambda k, n: 0.3, K, keys=["2.weight", "2.bias"]
    )
    assert_close_all(ours, grads_of(ref, inputs))
    assert (ours[0] != 0).any()  # the body learns through the query loss
    result = fm.adapt_tasks(
        fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=0.3), steps=K, trainable="2"
    )
    assert result.params["0.weight"] is fmodel.params["0.weight"]


def test_reptile_gradient_is_the_average_displacement():
    net, support, _ = net_and_tasks()
    fmodel = fm.functional_model(net)
    fm.recipes.reptile(fmodel, fmodel.params, F.mse_loss, support, steps=4, lr=0.1).loss.backward()
    with torch.enable_grad():
        adapted = []
        for t in range(T):
            p = {k: v.detach().requires_grad_() for k, v in fmodel.params.items()}
            p = hand_unroll(p, support[0][t], support[1][t], lambda k, n: 0.1, 4, second=False)
            adapted.append({k: v.detach() for k, v in p.items()})
    for name, param in net.named_parameters():
        mean = torch.stack([a[name] for a in adapted]).mean(0)
        torch.testing.assert_close(param.grad, param.detach() - mean, rtol=1e-10, atol=1e-12)
    # an outer SGD step of size eps moves theta a fraction eps towards the average
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    torch.optim.SGD(net.parameters(), lr=0.5).step()
    for name, param in net.named_parameters():
        mean = torch.stack([a[name] for a in adapted]).mean(0)
        torch.testing.assert_close(param.detach(), before[name] + 0.5 * (mean - before[name]))


def test_mamlpp_against_hand_unroll():
    net, support, query = net_and_tasks()
    fmodel = fm.functional_model(net)
    rates = fm.hyper.per_layer(fmodel.params, 0.2, steps=K)
    with torch.no_grad():
        rates.raw.copy_(torch.tensor([[0.3, 0.1], [0.2, 0.25]], dtype=DTYPE))
    weights = torch.tensor([0.3, 0.7], dtype=DTYPE)
    for first_order in (False, True):
        out = fm.recipes.mamlpp(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            query,
            lr=rates,
            steps=K,
            step_weights=weights,
            first_order=first_order,
        )
        inputs = [*net.parameters(), rates.raw]
        ours = grads_of(out.loss, inputs)

        def rate(k, n):
            return rates.raw[k, 0 if n.startswith("0.") else 1]

        total = 0
        for t in range(T):
            p = dict(fmodel.params)
            for k in range(K):
                p = hand_unroll(
                    p,
                    support[0][t],
                    support[1][t],
                    lambda _k, n, k=k: rate(k, n),
                    1,
                    second=not first_order,
                )
                total = total + weights[k] * F.mse_loss(hand_forward(p, query[0][t]), query[1][t])
        assert_close_all(ours, grads_of(total / T, inputs))


def test_mamlpp_step_weights_schedule():
    w0 = fm.recipes.mamlpp_step_weights(5, epoch=0, msl_epochs=10)
    torch.testing.assert_close(w0, torch.full((5,), 0.2, dtype=DTYPE))
    w5 = fm.recipes.mamlpp_step_weights(5, epoch=5, msl_epochs=10)
    assert (w5[:-1] < 0.2).all() and w5[-1] > 0.2
    late = fm.recipes.mamlpp_step_weights(5, epoch=100, msl_epochs=10)
    torch.testing.assert_close(late[:-1], torch.full((4,), 0.006, dtype=DTYPE))
    torch.testing.assert_close(late.sum(), torch.tensor(1.0, dtype=DTYPE))
    with pytest.raises(ValueError):
        fm.recipes.mamlpp_step_weights(0, epoch=0, msl_epochs=10)


def test_mamlpp_keeps_batchnorm_statistics_per_step():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    _, support, query = net_and_tasks()
    fmodel = fm.functional_model(net)
    rates = fm.hyper.per_layer(fmodel.params, 0.1, steps=3)
    weights = fm.recipes.mamlpp_step_weights(3, 0, 10)
    out = fm.recipes.mamlpp(
        fmodel, fmodel.params, F.mse_loss, support, query, lr=rates, steps=3, step_weights=weights
    )
    assert len(out.step_buffers) == 3
    means = [b["1.running_mean"] for b in out.step_buffers]
    assert means[0].shape == (8,) and not torch.allclose(means[0], means[2])
    again = fm.recipes.mamlpp(
        fmodel,
        fmodel.params,
        F.mse_loss,
        support,
        query,
        lr=rates,
        steps=3,
        step_weights=weights,
        step_buffers=out.step_buffers,
    )
    assert int(again.step_buffers[0]["1.num_batches_tracked"]) == 2
    assert int(net[1].num_batches_tracked) == 0
    with pytest.raises(ValueError, match="step_weights"):
        fm.recipes.mamlpp(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            query,
            lr=rates,
            steps=3,
            step_weights=weights[:2],
        )


def linear_problem(seed=0, dims=4):
    g = torch.Generator().manual_seed(seed)
    net = nn.Linear(dims, 1, bias=False).to(DTYPE)
    with torch.no_grad():
        net.weight.copy_(torch.randn(1, dims, generator=g, dtype=DTYPE))
    xs, xq = (
        torch.randn(T, 12, dims, generator=g, dtype=DTYPE),
        torch.randn(T, 9, dims, generator=g, dtype=DTYPE),
    )
    ys, yq = (
        torch.randn(T, 12, 1, generator=g, dtype=DTYPE),
        torch.randn(T, 9, 1, generator=g, dtype=DTYPE),
    )
    return net, (xs, ys), (xq, yq)


def imaml_closed_form(theta, support, query, lam, damping=0.0, lam_damping=0.0):
    """phi* = (A + lam I)^-1 (b + lam theta); meta-gradient
    ((1 + damping) I + A / (lam + lam_damping))^-1 grad L_q(phi*) (undamped: lam (A + lam I)^-1
    grad L_q(phi*))."""
    dims = theta.numel()
    grads = []
    for t in range(T):
        x, y = support[0][t], support[1][t]
        a = 2 / x.shape[0] * x.T @ x
        b = 2 / x.shape[0] * x.T @ y
        m = a + lam * torch.eye(dims, dtype=DTYPE)
        phi = torch.linalg.solve(m, b + lam * theta.T)
        xq, yq = query[0][t], query[1][t]
        gq = 2 / xq.shape[0] * xq.T @ (xq @ phi - yq)
        damped = (1 + damping) * torch.eye(dims, dtype=DTYPE) + a / (lam + lam_damping)
        grads.append(torch.linalg.solve(damped, gq))
    return torch.stack(grads).mean(0).T


@pytest.mark.parametrize(
    "damping", [(0.0, 0.0), (1.0, 10.0), (0.5, 3.0)], ids=["exact", "default", "other"]
)
def test_imaml_matches_the_closed_form_and_ignores_the_inner_path(damping):
    lam = 2.0
    found = []
    given = {} if damping == (1.0, 10.0) else dict(damping=damping[0], lam_damping=damping[1])
    for lr, steps in ((0.1, 600), (0.05, 1200)):
        net, support, query = linear_problem()
        fmodel = fm.functional_model(net)
        out = fm.recipes.imaml(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            query,
            lam=lam,
            steps=steps,
            lr=lr,
            cg_steps=4,
            **given,
        )
        out.loss.backward()
        expected = imaml_closed_form(net.weight.detach(), support, query, lam, *damping)
        torch.testing.assert_close(net.weight.grad, expected, rtol=1e-7, atol=1e-9)
        assert (out.residual < 1e-8).all()
        found.append(net.weight.grad.clone())
    torch.testing.assert_close(found[0], found[1], rtol=1e-7, atol=1e-9)


def test_imaml_errors():
    net, support, query = linear_problem()
    fmodel = fm.functional_model(net)
    with pytest.raises(ValueError, match="lam"):
        fm.recipes.imaml(fmodel, fmodel.params, F.mse_loss, support, query, steps=20, lam=0.0)
    with pytest.raises(ValueError, match="cg_steps"):
        fm.recipes.imaml(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=20, lam=1.0, cg_steps=0
        )
    with pytest.raises(ValueError, match=r"damping must be >= 0.0, got -1"):
        fm.recipes.imaml(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=2, lam=1.0, damping=-1
        )
    with pytest.raises(ValueError, match=r"max_residual must be > 0.0"):
        fm.recipes.imaml(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=2, lam=1.0, max_residual=0
        )


def test_imaml_warns_when_cg_or_the_inner_loop_fails():
    net, support, query = linear_problem()
    fmodel = fm.functional_model(net)
    run = functools.partial(fm.recipes.imaml, fmodel, fmodel.params, F.mse_loss, support, query)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fm.recipes.ConvergenceWarning)
        run(steps=300, lam=2.0, lr=0.1, cg_steps=4)  # converged: silent
        # one CG step cannot solve the undamped system to 1e-12
        with pytest.raises(
            fm.recipes.ConvergenceWarning,
            match=r"conjugate gradient did not converge for 3 of 3 tasks .*task 0: ",
        ):
            run(
                steps=300, lam=2.0, lr=0.1, cg_steps=1, damping=0, lam_damping=0, max_residual=1e-12
            )
        # an inner learning rate far past 2 / curvature: the proximal objective grows
        with pytest.raises(
            fm.recipes.ConvergenceWarning, match="the inner loop ended above where it started"
        ):
            run(steps=20, lam=2.0, lr=3.0)


def test_imaml_doc_example_is_stable_across_seeds():
    """The recipe page's loop, as a new user runs it: 8 seeds, no warning, converged CG,
    bounded losses (with the undamped solve and lr 0.05, 2 of 8 seeds blew up)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", fm.recipes.ConvergenceWarning)
        for seed in range(8):
            torch.manual_seed(seed)
            net = torch.nn.Sequential(
                torch.nn.Linear(1, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)
            )
            fmodel = fm.functional_model(net)
            outer = torch.optim.Adam(net.parameters(), lr=1e-3)
            tasks = fm.data.Sinusoid()
            for _ in range(10):  # the old blow-ups showed from the first iteration
                b = tasks.sample(8, support=10, query=10)
                out = fm.recipes.imaml(
                    fmodel,
                    fmodel.params,
                    F.mse_loss,
                    b.support,
                    b.query,
                    steps=20,
                    lam=2.0,
                    lr=0.01,
                )
                outer.zero_grad()
                out.loss.backward()
                outer.step()
                assert out.residual.max() < 1e-2 and not out.curvature_stop.any()
                assert out.query_loss < 20 and out.adapted.losses.max() < 20


def test_add_proximal_is_the_gradient_of_the_proximal_term():
    anchor = {"w": torch.tensor([1.0, -1.0], dtype=DTYPE)}
    params = {"w": torch.tensor([0.5, 2.0], dtype=DTYPE, requires_grad=True)}
    opt = fm.optim.add_proximal(3.0, anchor)
    updates, _ = opt.update({"w": torch.zeros(2, dtype=DTYPE)}, opt.init(params), params)
    term = 1.5 * (params["w"] - anchor["w"]).pow(2).sum()
    torch.testing.assert_close(updates["w"], torch.autograd.grad(term, params["w"])[0])
    with pytest.raises(fm.tree.TreeMismatchError, match="anchor"):
        fm.optim.add_proximal(1.0, {"v": anchor["w"]}).init(params)


def test_imaml_stops_at_non_positive_curvature_and_stays_finite():
    """A concave support loss (negative MSE) makes I + H/lam indefinite for small lam:
    conjugate gradient must stop there, not divide by a non-positive curvature."""
    net, support, query = linear_problem()
    fmodel = fm.functional_model(net)

    def concave(out, y):
        return -F.mse_loss(out, y)

    with pytest.warns(fm.recipes.ConvergenceWarning, match="did not converge"):
        out = fm.recipes.imaml(
            fmodel,
            fmodel.params,
            concave,
            support,
            query,
            lam=0.1,
            steps=3,
            lr=0.01,
            cg_steps=4,
            damping=0,  # undamped: indefinite (the default damping makes it definite)
            lam_damping=0,
        )
    out.loss.backward()
    assert out.curvature_stop.all()
    assert torch.isfinite(net.weight.grad).all()
    assert torch.isfinite(out.residual).all()


@pytest.mark.parametrize(
    "name", ["maml", "fomaml", "anil", "metasgd", "mamlpp", "reptile", "imaml", "protonet"]
)
def test_every_recipe_returns_its_query_logits(name):
    """``result.logits`` are the query outputs after adaptation, as a hand-written forward
    of the adapted parameters gives them, and ``query_loss`` is their loss."""
    net, support, query = net_and_tasks()
    fmodel = fm.functional_model(net)
    params = fmodel.params
    own = {"steps": 2, "lr": 0.1}
    if name == "anil":
        own["trainable"] = "2"
    elif name == "metasgd":
        own["lr"] = fm.recipes.metasgd_rates(params, generator=torch.Generator().manual_seed(0))
    elif name == "imaml":
        own["lam"] = 2.0
    elif name == "mamlpp":
        own["lr"] = fm.hyper.per_layer(params, 0.1, steps=2)
        own["step_weights"] = fm.recipes.mamlpp_step_weights(2, 0, msl_epochs=3)
    elif name == "protonet":
        own = {}
        labels = torch.arange(2).repeat(2)  # 2 ways, 2 shots; 7 queries
        support = (support[0][:, :4], labels.expand(T, 4))
        query = (query[0], torch.tensor([0, 1] * 3 + [0]).expand(T, 7))
    loss_fn = F.cross_entropy if name == "protonet" else F.mse_loss
    out = getattr(fm.recipes, name)(fmodel, params, loss_fn, support, query, **own)
    assert out.logits is not None
    if name == "protonet":
        z_s = torch.stack([hand_forward(params, x) for x in support[0]])
        z_q = torch.stack([hand_forward(params, x) for x in query[0]])
        proto = torch.stack([z_s[:, support[1][0] == c].mean(1) for c in range(2)], 1)
        expected = -(z_q.unsqueeze(2) - proto.unsqueeze(1)).pow(2).sum(-1)
        torch.testing.assert_close(out.logits, expected, rtol=1e-12, atol=1e-12)
    else:
        adapted = out.adapted.params
        for t in range(T):
            p = {k: v[t] if v.dim() > params[k].dim() else v for k, v in adapted.items()}
            torch.testing.assert_close(
                out.logits[t], hand_forward(p, query[0][t]), rtol=1e-12, atol=1e-12
            )
    losses = torch.stack([loss_fn(out.logits[t], query[1][t]) for t in range(T)])
    torch.testing.assert_close(out.query_loss, losses.mean().detach(), rtol=1e-12, atol=1e-12)


def test_reptile_without_a_query_set_has_no_logits():
    net, support, _ = net_and_tasks()
    fmodel = fm.functional_model(net)
    out = fm.recipes.reptile(fmodel, fmodel.params, F.mse_loss, support, steps=1, lr=0.1)
    assert out.logits is None and out.query_loss is None


def test_reptile_with_inner_minibatches_against_a_hand_loop():
    """inner_batch=b: step k of task t takes the next b examples of t's random order (a new
    order when one runs out), as Nichol et al.'s mini-batches do."""
    net, support, query = net_and_tasks()
    fmodel = fm.functional_model(net)
    steps, b, n = 4, 2, support[0].shape[1]  # 4 steps of 2 of 5 examples: wraps once
    out = fm.recipes.reptile(
        fmodel,
        fmodel.params,
        F.mse_loss,
        support,
        query,
        steps=steps,
        lr=0.1,
        inner_batch=b,
        generator=torch.Generator().manual_seed(3),
    )
    g = torch.Generator().manual_seed(3)
    orders = torch.cat([torch.rand(T, n, generator=g).argsort(1) for _ in range(2)], 1)
    params = {k: v.detach() for k, v in fmodel.params.items()}
    for t in range(T):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        for k in range(steps):
            idx = orders[t, k * b : (k + 1) * b]
            loss = F.mse_loss(hand_forward(p, support[0][t][idx]), support[1][t][idx])
            grads = torch.autograd.grad(loss, list(p.values()))
            p = {
                name: (v - 0.1 * gr).detach().requires_grad_()
                for (name, v), gr in zip(p.items(), grads, strict=True)
            }
        for name, v in p.items():
            torch.testing.assert_close(
                out.adapted.params[name][t], v.detach(), rtol=1e-12, atol=1e-12
            )
    assert out.adapted.losses.shape == (steps, T)
    out.loss.backward()
    phi_mean = {k: v.mean(0) for k, v in out.adapted.params.items()}
    for name, prm in net.named_parameters():
        torch.testing.assert_close(prm.grad, prm.detach() - phi_mean[name], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="inner_batch must be an int in"):
        fm.recipes.reptile(
            fmodel, fmodel.params, F.mse_loss, support, steps=1, lr=0.1, inner_batch=9
        )


# --- ANIL, both ways, against learn2learn's semantics by hand --------------------------------


def _anil_setup():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU()).to(DTYPE)
    head = nn.Linear(8, 3).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    ys = torch.arange(3).repeat(3, 2)
    xs, xq = (torch.randn(3, 6, 4, generator=g, dtype=DTYPE) for _ in range(2))
    return body, head, (xs, ys), (xq, ys.clone())


def _l2l_anil(body, head, support, query, joint, steps=3, lr=0.5):
    """learn2learn's ANIL loop written out: clone() = the head's parameters as non-leaf
    copies, adapt() = p - lr * grad with create_graph; the mean over tasks. ``joint``: the
    body runs once on support and query together (learn2learn's example); else on the
    support set at every step and on the query set alone."""
    total = 0
    for t in range(support[0].shape[0]):
        (xs, ys), (xq, yq) = (support[0][t], support[1][t]), (query[0][t], query[1][t])
        w, b = head.weight.clone(), head.bias.clone()
        if joint:
            z = body(torch.cat([xs, xq]))
            zs, zq = z[: len(xs)], z[len(xs) :]
        for _ in range(steps):
            feats = zs if joint else body(xs)
            inner = F.cross_entropy(F.linear(feats, w, b), ys)
            gw, gb = torch.autograd.grad(inner, (w, b), create_graph=True)
            w, b = w - lr * gw, b - lr * gb
        feats = zq if joint else body(xq)
        total = total + F.cross_entropy(F.linear(feats, w, b), yq) / support[0].shape[0]
    return torch.autograd.grad(total, [*body.parameters(), *head.parameters()])


def _relative(a, b):
    fa, fb = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((fa - fb).norm() / fb.norm())


def test_anil_with_the_body_on_support_and_query_together_equals_learn2learn():
    body, head, support, query = _anil_setup()
    reference = _l2l_anil(body, head, support, query, joint=True)
    fbody, fhead = fm.functional_model(body), fm.functional_model(head)
    out = fm.recipes.anil(
        fhead, fhead.params, F.cross_entropy, support, query, steps=3, lr=0.5, body=fbody
    )
    ours = torch.autograd.grad(out.loss, [*body.parameters(), *head.parameters()])
    assert _relative(ours, reference) < 1e-12


def test_anil_with_a_trainable_head_runs_support_and_query_apart():
    body, head, support, query = _anil_setup()
    reference = _l2l_anil(body, head, support, query, joint=False)
    net = nn.Sequential(body, head)
    fmodel = fm.functional_model(net)
    out = fm.recipes.anil(
        fmodel, fmodel.params, F.cross_entropy, support, query, steps=3, lr=0.5, trainable="1"
    )
    ours = torch.autograd.grad(out.loss, list(net.parameters()))
    assert _relative(ours, reference) < 1e-12
    # with BatchNorm the two ways differ (without it they would agree)
    joint = _l2l_anil(body, head, support, query, joint=True)
    assert _relative(joint, reference) > 1e-3


def test_anil_takes_one_of_trainable_and_body():
    body, head, support, query = _anil_setup()
    fbody, fhead = fm.functional_model(body), fm.functional_model(head)
    for both in ({}, {"trainable": "weight", "body": fbody}):
        with pytest.raises(TypeError, match=r"trainable= .* or body= .*exactly one"):
            fm.recipes.anil(
                fhead, fhead.params, F.cross_entropy, support, query, steps=1, lr=0.5, **both
            )
