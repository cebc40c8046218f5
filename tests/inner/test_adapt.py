"""fm.adapt against hand-written unrolls in float64: second and first order, Adam, per-step
rates, subsets (ANIL), clipping, truncation, loss scaling, non-finite handling, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, batches, mlp
from torch import nn

import funcmeta as fm
from funcmeta._src.optim.clip import clip_grads_by_global_norm

K = 3


def manual_forward(p, x):
    """The tanh MLP of helpers.mlp((3, 5, 4, 2)), written out by hand."""
    h = torch.tanh(x @ p["0.weight"].T + p["0.bias"])
    h = torch.tanh(h @ p["2.weight"].T + p["2.bias"])
    return h @ p["4.weight"].T + p["4.bias"]


def setup():
    net = mlp()
    fmodel = fm.functional_model(net)
    (xs, ys), (xq, yq) = batches(2)
    return net, fmodel, (xs, ys), (xq, yq)


def sgd_unroll(params, lrs, support, *, steps=K, detach_grads=False, keys=None, clip=None):
    """Hand-written SGD inner loop; ``lrs[k]`` is step k's rate (a number or a tensor)."""
    keys = list(params) if keys is None else keys
    p = dict(params)
    xs, ys = support
    for k in range(steps):
        loss = F.mse_loss(manual_forward(p, xs), ys)
        grads = torch.autograd.grad(loss, [p[n] for n in keys], create_graph=not detach_grads)
        if clip is not None:
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        for n, g in zip(keys, grads, strict=True):
            p[n] = p[n] - lrs[k] * g
    return p


def meta_grads(loss, inputs):
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def assert_all_close(a, b, **kw):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if y is None:
            assert x is None or torch.all(x == 0)
        else:
            torch.testing.assert_close(x, y, **kw)


@pytest.mark.parametrize("first_order", [False, True])
def test_sgd_meta_gradient_equals_hand_unroll(first_order):
    net, fmodel, support, (xq, yq) = setup()
    lr = torch.tensor(0.3, dtype=DTYPE, requires_grad=True)
    result = fm.adapt(
        fmodel,
        fmodel.params,
        F.mse_loss,
        support,
        fm.optim.sgd(lr=lr),
        steps=K,
        first_order=first_order,
    )
    ours = meta_grads(F.mse_loss(fmodel(result.params, xq), yq), [*net.parameters(), lr])
    adapted = sgd_unroll(fmodel.params, [lr] * K, support, detach_grads=first_order)
    ref = meta_grads(F.mse_loss(manual_forward(adapted, xq), yq), [*net.parameters(), lr])
    assert_all_close(ours, ref, rtol=1e-10, atol=1e-12)
    # second order really differs from first order here
    other = sgd_unroll(fmodel.params, [lr] * K, support, detach_grads=not first_order)
    other_grads = meta_grads(F.mse_loss(manual_forward(other, xq), yq), [*net.parameters()])
    assert not torch.allclose(ours[0], other_grads[0], rtol=1e-6, atol=1e-9)
    assert len(result.losses) == K and result.losses.requires_grad == (not first_order)


def test_adam_meta_gradient_equals_hand_unroll():
    net, fmodel, (xs, ys), (xq, yq) = setup()
    lr = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    b1 = torch.tensor(0.8, dtype=DTYPE, requires_grad=True)
    b2, eps = 0.95, 1e-6
    opt = fm.optim.adam(lr=lr, betas=(b1, b2), eps=eps)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=K)
    inputs = [*net.parameters(), lr, b1]
    ours = meta_grads(F.mse_loss(fmodel(result.params, xq), yq), inputs)

    p = fmodel.params
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(t) for k, t in p.items()}
    for t in range(1, K + 1):
        loss = F.mse_loss(manual_forward(p, xs), ys)
        grads = dict(
            zip(p, torch.autograd.grad(loss, list(p.values()), create_graph=True), strict=True)
        )
        new = {}
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * grads[k]
            v[k] = b2 * v[k] + (1 - b2) * grads[k] ** 2
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            new[k] = p[k] - lr * m_hat / (torch.sqrt(v_hat) + eps)
        p = new
    ref = meta_grads(F.mse_loss(manual_forward(p, xq), yq), inputs)
    assert_all_close(ours, ref, rtol=1e-9, atol=1e-12)


def test_per_step_learning_rates():
    net, fmodel, support, (xq, yq) = setup()
    lrs = fm.hyper.scalar(0.2, steps=K, dtype=DTYPE)
    with torch.no_grad():
        lrs.raw.copy_(torch.tensor([0.3, 0.1, 0.2]))
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=lrs), steps=K)
    inputs = [*net.parameters(), lrs.raw]
    ours = meta_grads(F.mse_loss(fmodel(result.params, xq), yq), inputs)
    adapted = sgd_unroll(fmodel.params, [lrs.raw[k] for k in range(K)], support)
    ref = meta_grads(F.mse_loss(manual_forward(adapted, xq), yq), inputs)
    assert_all_close(ours, ref, rtol=1e-10, atol=1e-12)
    assert torch.all(ours[-1] != 0)


def test_subset_adaptation_anil():
    net, fmodel, support, (xq, yq) = setup()
    head = ["4.weight", "4.bias"]
    lrs = fm.hyper.per_tensor({k: fmodel.params[k] for k in head}, 0.3)
    result = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=lrs), steps=K, trainable="4"
    )
    for k in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert result.params[k] is fmodel.params[k]
    assert not torch.equal(result.params["4.weight"], fmodel.params["4.weight"])
    assert result.state[0].count == K
    inputs = [*net.parameters(), lrs.raw]
    ours = meta_grads(F.mse_loss(fmodel(result.params, xq), yq), inputs)
    rates = lrs()
    adapted = dict(fmodel.params)
    xs, ys = support
    for _ in range(K):
        loss = F.mse_loss(manual_forward(adapted, xs), ys)
        grads = torch.autograd.grad(loss, [adapted[k] for k in head], create_graph=True)
        for k, g in zip(head, grads, strict=True):
            adapted[k] = adapted[k] - rates[k] * g
    ref = meta_grads(F.mse_loss(manual_forward(adapted, xq), yq), inputs)
    assert_all_close(ours, ref, rtol=1e-10, atol=1e-12)
    assert torch.all(ours[0] != 0)  # the unadapted body still gets its outer gradient


def test_gradient_clipping_matches_torch_and_hand_unroll():
    net, fmodel, (xs, ys), (xq, yq) = setup()
    # one step's clipped gradient equals torch.nn.utils.clip_grad_norm_
    ref_net = mlp()
    F.mse_loss(ref_net(xs), ys).backward()
    torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 0.05)
    loss = F.mse_loss(fmodel(fmodel.params, xs), ys)
    grads = dict(
        zip(fmodel.params, torch.autograd.grad(loss, list(fmodel.params.values())), strict=True)
    )
    clipped = clip_grads_by_global_norm(grads, 0.05)
    for name, p in ref_net.named_parameters():
        torch.testing.assert_close(clipped[name], p.grad, rtol=1e-12, atol=1e-14)
    # and the meta-gradient through clipping matches a hand-written unroll
    max_norm = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    lr = torch.tensor(0.3, dtype=DTYPE, requires_grad=True)
    result = fm.adapt(
        fmodel,
        fmodel.params,
        F.mse_loss,
        (xs, ys),
        fm.optim.sgd(lr=lr),
        steps=K,
        clip_grad_norm=max_norm,
    )
    inputs = [*net.parameters(), lr, max_norm]
    ours = meta_grads(F.mse_loss(fmodel(result.params, xq), yq), inputs)
    adapted = sgd_unroll(fmodel.params, [lr] * K, (xs, ys), clip=max_norm)
    ref = meta_grads(F.mse_loss(manual_forward(adapted, xq), yq), inputs)
    assert_all_close(ours, ref, rtol=1e-10, atol=1e-12)
    assert ours[-1] != 0


@pytest.mark.parametrize("truncate", [0, 1, 2, K])
def test_truncation(truncate):
    net, fmodel, support, (xq, yq) = setup()
    lr = torch.tensor(0.3, dtype=DTYPE, requires_grad=True)
    result = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=lr), steps=K, truncate=truncate
    )
    inputs = [*net.parameters(), lr]
    ours = meta_grads(F.mse_loss(fmodel(result.params, xq), yq), inputs)
    # reference: the first `truncate` steps on detached tensors, then a straight-through
    # re-entry, then second-order steps
    start = fmodel.params
    with torch.no_grad():
        lr_value = lr.item()
    p = {k: v.detach().requires_grad_() for k, v in start.items()}
    xs, ys = support
    for _ in range(truncate):
        loss = F.mse_loss(manual_forward(p, xs), ys)
        grads = torch.autograd.grad(loss, list(p.values()))
        p = {
            k: (v - lr_value * g).detach().requires_grad_()
            for (k, v), g in zip(p.items(), grads, strict=True)
        }
    p = {k: v.detach() + (start[k] - start[k].detach()) for k, v in p.items()}
    if truncate < K:
        p = sgd_unroll(p, [lr] * (K - truncate), support, steps=K - truncate)
    ref = meta_grads(F.mse_loss(manual_forward(p, xq), yq), inputs)
    assert_all_close(ours, ref, rtol=1e-10, atol=1e-12)
    if truncate == K:
        assert ours[-1] is None
    if truncate == 0:
        full = sgd_unroll(fmodel.params, [lr] * K, support)
        assert_all_close(ours, meta_grads(F.mse_loss(manual_forward(full, xq), yq), inputs))


def test_loss_scaling_gives_the_same_meta_gradients():
    net, fmodel, support, (xq, yq) = setup()
    lr = torch.tensor(0.3, dtype=DTYPE, requires_grad=True)
    inputs = [*net.parameters(), lr]
    plain = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=lr), steps=K)
    scaled = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=lr), steps=K, loss_scale=1024.0
    )
    a = meta_grads(F.mse_loss(fmodel(plain.params, xq), yq), inputs)
    b = meta_grads(F.mse_loss(fmodel(scaled.params, xq), yq), inputs)
    assert_all_close(a, b, rtol=1e-12, atol=1e-14)


class NanOnCall:
    """A loss that is NaN on its ``bad``-th call (0-based)."""

    def __init__(self, bad):
        self.bad, self.calls = bad, 0

    def __call__(self, out, y):
        loss = F.mse_loss(out, y)
        self.calls += 1
        return loss * float("nan") if self.calls - 1 == self.bad else loss


def test_nonfinite_raises_naming_the_step():
    _, fmodel, support, _ = setup()
    with pytest.raises(fm.NonFiniteError, match=r"inner step 1: non-finite loss"):
        fm.adapt(
            fmodel,
            fmodel.params,
            NanOnCall(1),
            support,
            fm.optim.sgd(lr=0.1),
            steps=K,
            loss_scale=256.0,
        )
    x, y = support
    bad_x = x.clone()
    bad_x[0, 0] = float("inf")
    with pytest.raises(fm.NonFiniteError, match="inner step 0"):
        fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (bad_x, y),
            fm.optim.sgd(lr=0.1),
            steps=K,
            on_nonfinite="raise",
        )
    # without a check nothing is raised (and no host sync happens)
    result = fm.adapt(fmodel, fmodel.params, NanOnCall(1), support, fm.optim.sgd(lr=0.1), steps=K)
    assert torch.isnan(result.params["0.weight"]).all()


def test_nonfinite_skip_leaves_that_step_out():
    _net, fmodel, support, (_xq, _yq) = setup()
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)
    fbn = fm.functional_model(bn)
    for fm_model in (fmodel, fbn):
        opt = fm.optim.adam(lr=0.1)
        skipped = fm.adapt(
            fm_model,
            fm_model.params,
            NanOnCall(1),
            support,
            opt,
            steps=3,
            on_nonfinite="skip",
            loss_scale=8.0,
        )
        clean = fm.adapt(fm_model, fm_model.params, F.mse_loss, support, opt, steps=2)
        assert skipped.skipped == (1,)
        assert skipped.state[0].count == 2
        for k in clean.params:
            torch.testing.assert_close(skipped.params[k], clean.params[k], rtol=1e-12, atol=1e-14)
        for k in clean.buffers:
            torch.testing.assert_close(skipped.buffers[k], clean.buffers[k])


def test_unused_parameters_raise_or_get_zero_gradients():
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.unused = nn.Linear(3, 2)

        def forward(self, x):
            return self.used(x)

    fmodel = fm.functional_model(Partial().to(DTYPE))
    support = batches(1)[0]
    with pytest.raises(ValueError, match=r"\['unused\.bias', 'unused\.weight'\].*allow_unused"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=0.1), steps=1)
    result = fm.adapt(
        fmodel,
        fmodel.params,
        F.mse_loss,
        support,
        fm.optim.sgd(lr=0.1, weight_decay=0.5),
        steps=1,
        allow_unused=True,
    )
    torch.testing.assert_close(
        result.params["unused.weight"], fmodel.params["unused.weight"] * (1 - 0.1 * 0.5)
    )


def test_module_tensors_unchanged_and_batchnorm_buffers_returned():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}
    fmodel = fm.functional_model(net)
    support, (xq, yq) = batches(2)
    for first_order in (False, True):
        result = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            fm.optim.adam(lr=0.1),
            steps=K,
            first_order=first_order,
        )
        F.mse_loss(fmodel.run(result.params, result.buffers, xq)[0], yq).backward()
        assert int(result.buffers["1.num_batches_tracked"]) == K
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_works_under_no_grad_for_evaluation():
    _, fmodel, support, _ = setup()
    with torch.no_grad():
        evaluated = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=0.3), steps=K
        )
    trained = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=0.3), steps=K)
    for k in trained.params:
        assert not evaluated.params[k].requires_grad
        torch.testing.assert_close(
            evaluated.params[k], trained.params[k].detach(), rtol=1e-12, atol=0
        )


def test_gradcheck_end_to_end_including_learning_rates():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).to(DTYPE)
    fmodel = fm.functional_model(net)
    (xs, ys), (xq, yq) = batches(2, inputs=2, outputs=1, size=5)
    keys = list(fmodel.params)
    inputs = tuple(v.detach().clone().requires_grad_() for v in fmodel.params.values())
    lrs = tuple(
        torch.tensor(0.2 + 0.05 * i, dtype=DTYPE, requires_grad=True) for i in range(len(keys))
    )
    momentum = torch.tensor(0.5, dtype=DTYPE, requires_grad=True)

    def meta_loss(*flat):
        params = dict(zip(keys, flat[: len(keys)], strict=True))
        lr_tree = dict(zip(keys, flat[len(keys) : 2 * len(keys)], strict=True))
        opt = fm.optim.sgd(lr=lr_tree, momentum=flat[-1])
        result = fm.adapt(fmodel, params, F.mse_loss, (xs, ys), opt, steps=2)
        return F.mse_loss(fmodel(result.params, xq), yq)

    assert torch.autograd.gradcheck(meta_loss, (*inputs, *lrs, momentum))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(steps=-1), ValueError, "steps"),
        (dict(steps=2, truncate=3), ValueError, "truncate"),
        (dict(steps=1, loss_scale=0.0), ValueError, "loss_scale"),
        (dict(steps=1, on_nonfinite="ignore"), ValueError, "on_nonfinite"),
        (dict(steps=1, clip_grad_norm=torch.ones(2)), ValueError, "clip_grad_norm"),
        (dict(steps=1, trainable=lambda path, x: False), ValueError, "selected none"),
        (dict(steps=1, trainable="head"), ValueError, "match no parameter"),
    ],
)
def test_argument_errors(kwargs, error, match):
    _, fmodel, support, _ = setup()
    with pytest.raises(error, match=match):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=0.1), **kwargs)


def test_batch_and_loss_errors():
    _, fmodel, (x, y), _ = setup()
    opt = fm.optim.sgd(lr=0.1)
    with pytest.raises(TypeError, match="pair"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, x, opt, steps=1)
    with pytest.raises(ValueError, match="scalar"):
        fm.adapt(fmodel, fmodel.params, lambda o, t: (o - t) ** 2, (x, y), opt, steps=1)
    bad_lr = {"0.weight": 0.1}
    with pytest.raises(fm.tree.TreeMismatchError, match="lr gives no value"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=bad_lr), steps=1)
    wrong_shape = {k: torch.ones(7, dtype=DTYPE) for k in fmodel.params}
    with pytest.raises(ValueError, match=r"lr for parameter '0\.bias' has shape \(7,\)"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=wrong_shape), steps=1)


def test_continuing_from_a_state_equals_one_longer_run():
    _, fmodel, support, _ = setup()
    opt = fm.optim.adam(lr=0.05)
    first = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, opt, steps=2)
    second = fm.adapt(fmodel, first.params, F.mse_loss, support, opt, steps=2, state=first.state)
    whole = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, opt, steps=4)
    for k in whole.params:
        torch.testing.assert_close(second.params[k], whole.params[k], rtol=1e-12, atol=1e-14)
