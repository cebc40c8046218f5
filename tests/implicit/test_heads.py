"""fm.heads.ridge and the R2D2 recipe: closed forms in float64, exact against implicit,
task-batched against a loop, a hand-written reference, and real Omniglot data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import shared_file

import funcmeta as fm

D = torch.float64


def data(n, d, c=3, tasks=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tasks, n, d, generator=g, dtype=D, requires_grad=True)
    y = torch.randn(*tasks, n, c, generator=g, dtype=D, requires_grad=True)
    return x, y


def closed_form(x, y, lam):
    """(X^T X + lam I)^{-1} X^T Y, the d x d system, one task."""
    return torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1], dtype=D), x.T @ y)


@pytest.mark.parametrize("n, d", [(5, 12), (12, 5)])  # the Woodbury branch, and the other
@pytest.mark.parametrize("method", ["exact", "implicit"])
def test_ridge_and_its_gradients_equal_the_closed_form(n, d, method):
    x, y = data(n, d)
    lam = torch.tensor(0.8, dtype=D, requires_grad=True)
    w = fm.heads.ridge(x, y, lam, method=method)
    want = closed_form(x, y, lam)
    assert torch.allclose(w, want, rtol=0, atol=1e-10)
    probe = torch.randn(w.shape, generator=torch.Generator().manual_seed(5), dtype=D)
    got = torch.autograd.grad((w * probe).sum(), (x, y, lam))
    expected = torch.autograd.grad((want * probe).sum(), (x, y, lam))
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-8)
    # d W / d lam = -(X^T X + lam I)^{-1} W, by hand
    (g_lam,) = torch.autograd.grad(fm.heads.ridge(x, y, lam, method=method).sum(), lam)
    M = x.T @ x + lam * torch.eye(d, dtype=D)
    assert torch.allclose(g_lam, -torch.linalg.solve(M, want).sum(), rtol=0, atol=1e-8)


@pytest.mark.parametrize("method", ["exact", "implicit"])
def test_ridge_passes_gradcheck(method):
    x, y = data(4, 6, c=2, seed=1)
    lam = torch.tensor(0.5, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, y, lam: fm.heads.ridge(x, y, lam, method=method), (x, y, lam)
    )


@pytest.mark.parametrize("method", ["exact", "implicit"])
@pytest.mark.parametrize("per_task", [False, True])
def test_task_batched_ridge_equals_the_loop(method, per_task):
    T = 4
    x, y = data(6, 9, tasks=(T,), seed=2)
    lam = torch.linspace(0.3, 3.0, T, dtype=D) if per_task else torch.tensor(1.0, dtype=D)
    lam.requires_grad_()
    w = fm.heads.ridge(x, y, lam, method=method)
    probe = torch.randn(w.shape, generator=torch.Generator().manual_seed(3), dtype=D)
    got = torch.autograd.grad((w * probe).sum(), (x, y, lam))
    loop = [torch.zeros_like(x), torch.zeros_like(y), torch.zeros_like(lam)]
    for t in range(T):
        wt = closed_form(x[t], y[t], lam[t] if per_task else lam)
        assert torch.allclose(w[t], wt, rtol=0, atol=1e-10)
        grads = torch.autograd.grad((wt * probe[t]).sum(), (x, y, lam))
        for acc, g in zip(loop, grads, strict=True):
            acc += g
    for a, b in zip(got, loop, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-8)


def test_ridge_errors():
    x, y = data(4, 3)
    with pytest.raises(ValueError, match=r"lam must be > 0\.0, got 0\.0"):
        fm.heads.ridge(x, y, 0.0)
    with pytest.raises(ValueError, match="targets must be"):
        fm.heads.ridge(x, y[:3], 1.0)
    with pytest.raises(ValueError, match=r"features must be \(n, d\)"):
        fm.heads.ridge(x[0], y[0], 1.0)
    with pytest.raises(ValueError, match="method must be"):
        fm.heads.ridge(x, y, 1.0, method="cg")
    with pytest.raises(ValueError, match="one value per task"):
        fm.heads.ridge(x, y, torch.ones(4))
    with pytest.raises(TypeError, match="floating-point"):
        fm.heads.ridge(x.long(), y, 1.0)
    with pytest.raises(ValueError, match=r"lam must be > 0\.0, got -1\.0"):
        fm.heads.RidgeHead(lam=-1.0)


def small_conv4():
    torch.manual_seed(0)
    return fm.models.conv4(None, hidden=4, image_size=16).to(D)


def episodes(tasks=3, ways=3, shots=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(ways, 1, 16, 16, generator=g, dtype=D)

    def part(k):
        y = torch.arange(ways).repeat_interleave(k).repeat(tasks, 1)
        x = means[y] + 0.5 * torch.randn(tasks, ways * k, 1, 16, 16, generator=g, dtype=D)
        return x, y

    return part(shots), part(2)


def r2d2_reference(net, head, support, query, ways):
    """One task at a time by hand: embed support and query together, solve the d x d ridge
    system on one-hot labels, scale and shift, cross-entropy; the mean over tasks."""
    losses = []
    for xs, ys, xq, yq in zip(*support, *query, strict=True):
        z = net(torch.cat([xs, xq])).flatten(1)
        zs, zq = z[: len(xs)], z[len(xs) :]
        w = closed_form(zs, F.one_hot(ys, ways).to(D), head.log_lam.exp())
        losses.append(F.cross_entropy(head.scale * zq @ w + head.bias, yq))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("method", ["exact", "implicit"])
def test_r2d2_matches_a_hand_written_reference(method):
    net = small_conv4()
    fmodel = fm.functional_model(net)
    head = fm.heads.RidgeHead(lam=0.7, scale=3.0, bias=0.1, method=method).to(D)
    support, query = episodes()
    out = fm.recipes.r2d2(fmodel, fmodel.params, F.cross_entropy, support, query, head=head)
    assert type(out) is fm.recipes.RecipeResult  # the base: R2D2 has no extras
    learnable = [*net.parameters(), *head.parameters()]
    ours = torch.autograd.grad(out.loss, learnable)
    expected = r2d2_reference(net, head, support, query, 3)
    theirs = torch.autograd.grad(expected, learnable)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    assert out.logits.shape == (3, 6, 3) and out.adapted is None
    with pytest.raises(TypeError, match="head must be"):
        fm.recipes.r2d2(fmodel, fmodel.params, F.cross_entropy, support, query, head=None)


def test_evaluate_takes_a_head():
    net = small_conv4()
    fmodel = fm.functional_model(net)
    head = fm.heads.RidgeHead(lam=0.7, scale=3.0).to(D)
    (xs, ys), (xq, yq) = episodes(tasks=5)
    batch = fm.data.EpisodeBatch(xs, ys, xq, yq, torch.arange(3).repeat(5, 1))
    ev = fm.evaluate(fmodel, fmodel.params, F.cross_entropy, batch, method=head)
    with torch.no_grad():
        logits = fm.recipes.r2d2(
            fmodel, fmodel.params, F.cross_entropy, (xs, ys), (xq, yq), head=head
        ).logits
    expected = (logits.argmax(-1) == yq).double().mean(-1)
    assert torch.equal(ev.per_episode, expected)
    with pytest.raises(TypeError, match="a head adapts nothing"):
        fm.evaluate(fmodel, fmodel.params, F.cross_entropy, batch, method=head, steps=1)


def test_r2d2_learns_real_omniglot_characters():
    """Meta-training conv4 through the ridge head (implicit gradients) on real Omniglot
    characters lifts held-out 5-way 1-shot accuracy well above the untrained embedding's."""
    archive = shared_file("omniglot/images_background_small1.zip")
    images, labels, _ = fm.data.load_omniglot(archive, size=20)
    train, held = fm.data.split_classes(
        labels, [96, 40], generator=torch.Generator().manual_seed(0)
    )
    kwargs = dict(ways=5, shots=1, query=5)
    train_eps = fm.data.Episodes(images, labels, classes=train, **kwargs)
    held_eps = fm.data.Episodes(images, labels, classes=held, **kwargs)
    torch.manual_seed(0)
    net = fm.models.conv4(None, hidden=16, image_size=20)
    fmodel = fm.functional_model(net)
    head = fm.heads.RidgeHead(lam=1.0, scale=5.0, method="implicit")
    outer = torch.optim.Adam([*net.parameters(), *head.parameters()], lr=3e-3)

    def accuracy():
        return fm.evaluate(
            fmodel, fmodel.params, F.cross_entropy, held_eps, method=head, num_episodes=100, seed=1
        ).accuracy

    before = accuracy()
    rng = torch.Generator().manual_seed(0)
    for _ in range(60):
        b = train_eps.sample(8, generator=rng)
        out = fm.recipes.r2d2(fmodel, fmodel.params, F.cross_entropy, b.support, b.query, head=head)
        outer.zero_grad()
        out.loss.backward()
        outer.step()
    after = accuracy()
    assert after > before + 0.1 and after > 0.6, (before, after)


@pytest.mark.parametrize("kind", ["encoder", "lstm", "hf"])
def test_r2d2_on_real_sequence_models(kind):
    """PyTorch's transformer layer (fused attention), an LSTM and a HuggingFace BERT from a
    config as the embedding: R2D2's loss and gradients, exact and implicit, equal the
    hand-written per-task reference."""
    from zoo import SequenceNet

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (60, 8), generator=g)
    episodes = fm.data.Episodes(
        ids, torch.arange(10).repeat_interleave(6), ways=4, shots=2, query=2
    )
    b = episodes.sample(3, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = SequenceNet(kind, None).to(D)
    fmodel = fm.functional_model(net)
    expected = None
    for method in ("exact", "implicit"):
        head = fm.heads.RidgeHead(lam=0.5, scale=2.0, bias=0.1, method=method).to(D)
        learnable = [*net.parameters(), *head.parameters()]
        out = fm.recipes.r2d2(fmodel, fmodel.params, F.cross_entropy, b.support, b.query, head=head)
        ours = torch.autograd.grad(out.loss, learnable, allow_unused=True)
        if expected is None:
            ref = r2d2_reference(net, head, b.support, b.query, 4)
            expected = (ref, torch.autograd.grad(ref, learnable, allow_unused=True))
        torch.testing.assert_close(out.loss, expected[0], rtol=1e-12, atol=0)
        for a, e in zip(ours, expected[1], strict=True):
            if e is None:
                assert a is None
                continue
            torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-10)
