"""fm.learned: Meta-Curvature and the learned optimizer against hand-written formulas, hand
unrolled loops and finite differences (float64); task-batched against the per-task loop;
chaining, step checkpointing and errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import funcmeta as fm

D = torch.float64


def tiny_net(hidden=5):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    ).to(D)


def regression_tasks(tasks=3, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(tasks, n, 2, generator=g, dtype=D)
    w = torch.randn(tasks, 2, 1, generator=g, dtype=D)
    xq = torch.randn(tasks, n, 2, generator=g, dtype=D)
    return (xs, torch.tanh(xs @ w)), (xq, torch.tanh(xq @ w))


def randomise(module, scale=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


# --- Meta-Curvature --------------------------------------------------------------------------


def test_meta_curvature_is_the_mode_products_and_starts_as_the_identity():
    params = {
        "conv": torch.randn(4, 3, 2, 2, dtype=D),
        "lin": torch.randn(5, 4, dtype=D),
        "bias": torch.randn(5, dtype=D),
    }
    mc = fm.learned.MetaCurvature(params).to(D)
    grads = {k: torch.randn(v.shape, dtype=D) for k, v in params.items()}
    opt = mc.transform()
    same, _ = opt.update(grads, opt.init(params), params)
    for k in grads:
        assert torch.equal(same[k], grads[k])
    randomise(mc)
    out, _ = opt.update(grads, opt.init(params), params)
    m = {k: v for k, v in mc.matrices.items()}
    conv = torch.einsum(
        "ap,bq,cr,pqr->abc", m["conv-0"], m["conv-1"], m["conv-2"], grads["conv"].reshape(4, 3, 4)
    ).reshape(4, 3, 2, 2)
    assert torch.allclose(out["conv"], conv, rtol=0, atol=1e-12)
    assert torch.allclose(out["lin"], m["lin-0"] @ grads["lin"] @ m["lin-1"].T, rtol=0, atol=1e-12)
    assert torch.allclose(out["bias"], m["bias-0"] @ grads["bias"], rtol=0, atol=1e-12)
    # a leading task axis: each task's gradient preconditioned alike
    batched = {k: torch.stack([v, 2 * v]) for k, v in grads.items()}
    both, _ = opt.update(batched, opt.init(batched), batched)
    for k in grads:
        assert torch.allclose(both[k][1], 2 * out[k], rtol=0, atol=1e-12)


def test_meta_curvature_leaves_wide_modes_as_the_identity():
    mc = fm.learned.MetaCurvature({"w": torch.zeros(3, 50)}, max_size=10)
    assert mc.modes["w"] == [3, None] and list(mc.matrices) == ["w-0"]


def unrolled_meta_curvature(net, mc, support, query, lr, steps):
    """By hand, per task: g -> M_out g M_in^T (M g for biases), SGD, second order."""
    names = [n for n, _ in net.named_parameters()]
    total = 0
    for xs, ys, xq, yq in zip(*support, *query, strict=True):
        p = [q for _, q in net.named_parameters()]
        for _ in range(steps):
            loss = F.mse_loss(
                torch.func.functional_call(net, dict(zip(names, p, strict=True)), (xs,)), ys
            )
            grads = torch.autograd.grad(loss, p, create_graph=True)
            new = []
            for n, w, g in zip(names, p, grads, strict=True):
                key = n.replace(".", "-")
                if g.dim() == 2:
                    g = mc.matrices[key + "-0"] @ g @ mc.matrices[key + "-1"].T
                else:
                    g = mc.matrices[key + "-0"] @ g
                new.append(w - lr * g)
            p = new
        out = torch.func.functional_call(net, dict(zip(names, p, strict=True)), (xq,))
        total = total + F.mse_loss(out, yq)
    return total / len(support[0])


@pytest.mark.parametrize("batched", [False, True])
def test_meta_curvature_meta_gradient_equals_a_hand_unrolled_loop(batched):
    net = tiny_net()
    fmodel = fm.functional_model(net)
    mc = randomise(fm.learned.MetaCurvature(fmodel.params).to(D), 0.2)
    support, query = regression_tasks()
    opt = fm.optim.chain(mc.transform(), fm.optim.sgd(lr=0.3))
    learnable = [*net.parameters(), *mc.parameters()]
    if batched:
        out = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, opt, steps=3)
        loss = fm.task_losses(fmodel, out.params, F.mse_loss, query)[0].mean()
    else:
        losses = []
        for xs, ys, xq, yq in zip(*support, *query, strict=True):
            out = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=3)
            losses.append(F.mse_loss(fmodel(out.params, xq), yq))
        loss = torch.stack(losses).mean()
    ours = torch.autograd.grad(loss, learnable)
    expected = unrolled_meta_curvature(net, mc, support, query, 0.3, 3)
    theirs = torch.autograd.grad(expected, learnable)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_meta_curvature_meta_gradient_matches_finite_differences():
    net = tiny_net(3)
    fmodel = fm.functional_model(net)
    mc = randomise(fm.learned.MetaCurvature(fmodel.params).to(D), 0.2)
    support, query = regression_tasks(tasks=2, n=4)
    keys = list(mc.matrices)

    def meta_loss(*matrices):
        # the transform closes over the module: swap plain tensors in for its Parameters
        saved = dict(mc.matrices)
        for k, v in zip(keys, matrices, strict=True):
            mc.matrices._parameters[k] = v
        try:
            opt = fm.optim.chain(mc.transform(), fm.optim.sgd(lr=0.3))
            out = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, opt, steps=2)
            return fm.task_losses(fmodel, out.params, F.mse_loss, query)[0].mean()
        finally:
            mc.matrices._parameters.update(saved)

    inputs = tuple(v.detach().clone().requires_grad_() for v in mc.matrices.values())
    assert torch.autograd.gradcheck(meta_loss, inputs)


# --- the learned optimizer -------------------------------------------------------------------


def hand_learned_update(lopt, g, p, history, t):
    """The learned optimizer's update by hand, for one tensor at (0-based) step t; ``history``
    holds the gradients of the earlier steps."""
    gs = [*history, g]
    b2 = lopt.beta2
    nu = sum((1 - b2) * b2 ** (t - k) * x * x for k, x in enumerate(gs))
    rms = torch.sqrt(nu / (1 - b2 ** (t + 1))) + lopt.eps
    feats = [g / rms]
    for b in lopt.decays:
        m = sum((1 - b) * b ** (t - k) * x for k, x in enumerate(gs))
        feats.append(m / (1 - b ** (t + 1)) / rms)
    feats += [torch.log(rms), p]
    feats += [torch.full_like(g, math.tanh((t + 1) / s)) for s in lopt.time_scales]
    h = torch.stack(feats, -1)
    layers = [m for m in lopt.net if isinstance(m, torch.nn.Linear)]
    for layer in layers[:-1]:
        h = torch.relu(h @ layer.weight.T + layer.bias)
    d, m = (h @ layers[-1].weight.T + layers[-1].bias).unbind(-1)
    b = math.log(20.0)  # the default max_gain
    return -(lopt.lr * g + lopt.scale * torch.tanh(d) * torch.exp(b * torch.tanh(m / b)))


def test_an_untrained_learned_optimizer_is_sgd():
    net = tiny_net()
    fmodel = fm.functional_model(net)
    support, _ = regression_tasks()
    lopt = fm.learned.LearnedOptimizer(hidden=8, lr=0.25).to(D)  # 0.25: exact in float32
    a = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, lopt.transform(), steps=3)
    b = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=0.25), steps=3)
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k])


def test_learned_optimizer_updates_equal_the_hand_written_rule():
    lopt = randomise(fm.learned.LearnedOptimizer(hidden=6, layers=2).to(D), 0.5)
    g = torch.Generator().manual_seed(2)
    params = {
        "a": torch.randn(3, 4, generator=g, dtype=D),
        "b": torch.randn(4, generator=g, dtype=D),
    }
    opt = lopt.transform()
    state = opt.init(params)
    history = {k: [] for k in params}
    for t in range(4):
        grads = {k: torch.randn(v.shape, generator=g, dtype=D) for k, v in params.items()}
        if t == 1:
            grads["b"][0] = 0.0  # an exactly zero gradient entry stays finite
        updates, state = opt.update(grads, state, params)
        for k in params:
            want = hand_learned_update(lopt, grads[k], params[k], history[k], t)
            torch.testing.assert_close(updates[k], want, rtol=1e-12, atol=1e-14)
            history[k].append(grads[k])
        params = fm.apply_updates(params, updates)


def unrolled_learned(net, lopt, support, query, steps):
    """Per task by hand: the hand-written rule, second order."""
    names = [n for n, _ in net.named_parameters()]
    total = 0
    for xs, ys, xq, yq in zip(*support, *query, strict=True):
        p = [q for _, q in net.named_parameters()]
        history = [[] for _ in p]
        for t in range(steps):
            loss = F.mse_loss(
                torch.func.functional_call(net, dict(zip(names, p, strict=True)), (xs,)), ys
            )
            grads = torch.autograd.grad(loss, p, create_graph=True)
            p = [
                w + hand_learned_update(lopt, gr, w, h, t)
                for w, gr, h in zip(p, grads, history, strict=True)
            ]
            for h, gr in zip(history, grads, strict=True):
                h.append(gr)
        total = total + F.mse_loss(
            torch.func.functional_call(net, dict(zip(names, p, strict=True)), (xq,)), yq
        )
    return total / len(support[0])


@pytest.mark.parametrize("batched", [False, True])
def test_learned_optimizer_meta_gradient_equals_a_hand_unrolled_loop(batched):
    net = tiny_net()
    fmodel = fm.functional_model(net)
    lopt = randomise(fm.learned.LearnedOptimizer(hidden=6, lr=0.1).to(D), 0.3)
    support, query = regression_tasks()
    learnable = [*net.parameters(), *lopt.parameters()]
    if batched:
        out = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, lopt.transform(), steps=3)
        loss = fm.task_losses(fmodel, out.params, F.mse_loss, query)[0].mean()
    else:
        losses = []
        for xs, ys, xq, yq in zip(*support, *query, strict=True):
            out = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), lopt.transform(), steps=3)
            losses.append(F.mse_loss(fmodel(out.params, xq), yq))
        loss = torch.stack(losses).mean()
    ours = torch.autograd.grad(loss, learnable)
    expected = unrolled_learned(net, lopt, support, query, 3)
    theirs = torch.autograd.grad(expected, learnable)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_learned_optimizer_meta_gradient_matches_finite_differences():
    net = tiny_net(3)
    fmodel = fm.functional_model(net)
    lopt = randomise(fm.learned.LearnedOptimizer(hidden=3, layers=1, lr=0.1).to(D), 0.3)
    support, query = regression_tasks(tasks=2, n=4)
    names = [n for n, _ in lopt.named_parameters()]

    def meta_loss(*values):
        # the transform closes over the module: swap plain tensors in for its Parameters
        saved = {n: p for n, p in lopt.named_parameters()}
        try:
            for n, v in zip(names, values, strict=True):
                module, _, leaf = n.rpartition(".")
                owner = lopt.get_submodule(module) if module else lopt
                owner._parameters[leaf] = v
            r = fm.adapt_tasks(
                fmodel, fmodel.params, F.mse_loss, support, lopt.transform(), steps=2
            )
            return fm.task_losses(fmodel, r.params, F.mse_loss, query)[0].mean()
        finally:
            for n, p in saved.items():
                module, _, leaf = n.rpartition(".")
                owner = lopt.get_submodule(module) if module else lopt
                owner._parameters[leaf] = p

    inputs = tuple(p.detach().clone().requires_grad_() for p in lopt.parameters())
    assert torch.autograd.gradcheck(meta_loss, inputs)


def test_learned_rules_chain_checkpoint_and_batch_exactly():
    net = tiny_net()
    fmodel = fm.functional_model(net)
    mc = randomise(fm.learned.MetaCurvature(fmodel.params).to(D), 0.1)
    lopt = randomise(fm.learned.LearnedOptimizer(hidden=6, lr=0.1).to(D), 0.3, seed=4)
    # the chained clip (and the clip option) clips each task by its own norm, as the loop does
    opt = fm.optim.chain(fm.optim.clip_by_global_norm(0.3), mc.transform(), lopt.transform())
    support, query = regression_tasks()
    learnable = [*net.parameters(), *mc.parameters(), *lopt.parameters()]

    def meta_grads(**options):
        out = fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, support, opt, steps=3, clip_grad_norm=0.5, **options
        )
        loss = fm.task_losses(fmodel, out.params, F.mse_loss, query)[0].mean()
        return torch.autograd.grad(loss, learnable)

    plain = meta_grads()
    for a, b in zip(plain, meta_grads(checkpoint_steps=True), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    losses = []
    for xs, ys, xq, yq in zip(*support, *query, strict=True):
        out = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=3, clip_grad_norm=0.5
        )
        losses.append(F.mse_loss(fmodel(out.params, xq), yq))
    loop = torch.autograd.grad(torch.stack(losses).mean(), learnable)
    for a, b in zip(plain, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_learned_rule_errors():
    params = {"w": torch.zeros(3, 2)}
    mc = fm.learned.MetaCurvature(params)
    with pytest.raises(ValueError, match="not one MetaCurvature was built for"):
        mc.transform().init({"w": torch.zeros(2, 3)})
    with pytest.raises(KeyError, match="no matrices for parameter 'v'"):
        mc.transform().update({"v": torch.zeros(3, 2)}, mc.transform().init(params))
    with pytest.raises(ValueError, match="at most one leading task axis"):
        mc.precondition("w", torch.zeros(2, 2, 3, 2))
    with pytest.raises(ValueError, match="max_size must be a positive int"):
        fm.learned.MetaCurvature(params, max_size=0)
    with pytest.raises(TypeError, match="not a floating-point tensor"):
        fm.learned.MetaCurvature({"n": torch.zeros(2, dtype=torch.long)})
    lopt = fm.learned.LearnedOptimizer()
    with pytest.raises(ValueError, match="reads the parameters"):
        lopt.transform().update(params, lopt.transform().init(params))
    with pytest.raises(ValueError, match=r"decays\[1\] must be >= 0\.0 and < 1\.0, got 1\.0"):
        fm.learned.LearnedOptimizer(decays=(0.5, 1.0))
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        fm.learned.LearnedOptimizer(hidden=0)


# --- real models -----------------------------------------------------------------------------


def _hand_preconditioned(mc, name, g):
    key = name.replace(".", "-")
    if g.dim() == 2:
        return mc.matrices[key + "-0"] @ g @ mc.matrices[key + "-1"].T
    if g.dim() == 1:
        return mc.matrices[key + "-0"] @ g
    raise AssertionError(f"no hand rule for {name} of shape {tuple(g.shape)}")


@pytest.mark.parametrize("name", ["encoder-train", "mha-sdpa", "lstm", "hf-bert"])
def test_learned_rules_on_real_models_equal_a_hand_written_unroll(name):
    """PyTorch's transformer layer and attention, an LSTM and a HuggingFace BERT from a config:
    Meta-Curvature chained before the learned optimizer, task-batched, gives the meta-gradients
    (of the model, the matrices and the optimizer) of a per-task unroll written by hand."""
    from torch.func import functional_call
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from zoo import build

    entry = build(name)
    module = entry.module
    fmodel = fm.functional_model(module)
    mc = randomise(fm.learned.MetaCurvature(fmodel.params).to(D), 0.05)
    lopt = randomise(fm.learned.LearnedOptimizer(hidden=6, lr=0.05).to(D), 0.2, seed=3)
    g = torch.Generator().manual_seed(2)
    tasks = [(entry.batch(3, g), entry.batch(3, g)) for _ in range(2)]

    def stack(parts):
        xs = [p[0] for p in parts]
        if isinstance(xs[0], dict):
            x = {k: torch.stack([v[k] for v in xs]) for k in xs[0]}
        else:
            x = torch.stack(xs)
        return x, torch.stack([p[1] for p in parts])

    def call(params, buffers, inputs):
        if isinstance(inputs, dict):
            return functional_call(module, (params, buffers), (), inputs)
        return functional_call(module, (params, buffers), (inputs,))

    support, query = stack([s for s, _ in tasks]), stack([q for _, q in tasks])
    opt = fm.optim.chain(mc.transform(), lopt.transform())
    learnable = [*module.parameters(), *mc.parameters(), *lopt.parameters()]
    out = fm.adapt_tasks(fmodel, fmodel.params, entry.loss, support, opt, steps=2)
    loss = fm.task_losses(fmodel, out.params, entry.loss, query)[0].mean()
    ours = torch.autograd.grad(loss, learnable, allow_unused=True)

    base = dict(module.named_parameters())
    with sdpa_kernel(SDPBackend.MATH):  # twice differentiable
        total = 0
        for (xs, ys), (xq, yq) in tasks:
            params, buffers = dict(base), dict(module.named_buffers())
            history = {k: [] for k in params}
            for t in range(2):
                grads = torch.autograd.grad(
                    entry.loss(call(params, buffers, xs), ys),
                    list(params.values()),
                    create_graph=True,
                )
                new = {}
                for (k, w), gr in zip(params.items(), grads, strict=True):
                    pre = _hand_preconditioned(mc, k, gr)
                    new[k] = w + hand_learned_update(lopt, pre, w, history[k], t)
                    history[k].append(pre)
                params = new
            total = total + entry.loss(call(params, buffers, xq), yq)
        theirs = torch.autograd.grad(total / len(tasks), learnable, allow_unused=True)
    for a, b in zip(ours, theirs, strict=True):
        if b is None:
            assert a is None or not a.abs().max() > 0
            continue
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
