"""The few-shot toolkit: the standard backbones, Prototypical Networks against a hand-written
reference, and the evaluation protocol (seeded episodes, fixed runs, batched or one by one,
wide heads, 95% intervals). Float64 where numbers are compared."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from zoo import SequenceNet

import funcmeta as fm
from funcmeta._src.evaluation import protocol

DTYPE = torch.float64


def small_conv4(out_features, hidden=4):
    torch.manual_seed(0)
    return fm.models.conv4(out_features, hidden=hidden, image_size=16).to(DTYPE)


def toy_images(classes=10, per_class=6, side=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # class-dependent means so that adaptation has something to find
    means = torch.randn(classes, 1, side, side, generator=g, dtype=DTYPE)
    x = means.repeat_interleave(per_class, 0)
    x = x + 0.5 * torch.randn(x.shape, generator=g, dtype=DTYPE)
    return x, torch.arange(classes).repeat_interleave(per_class)


# --- backbones ------------------------------------------------------------------------------


def test_backbone_names_shapes_and_sizes():
    net = fm.models.conv4_omniglot(20)
    names = list(dict(net.named_parameters()))
    assert names[:4] == [
        "features.0.conv.weight",
        "features.0.conv.bias",
        "features.0.norm.weight",
        "features.0.norm.bias",
    ]
    assert names[-2:] == ["head.weight", "head.bias"]
    assert sum(p.numel() for p in net.parameters()) == 113_236  # the standard Omniglot conv4
    assert dict(net.named_buffers()) == {}  # batch statistics, as MAML's reference code
    mini = fm.models.conv4_miniimagenet(5)
    assert mini(torch.zeros(2, 3, 84, 84)).shape == (2, 5)
    assert mini.head.in_features == 800 and sum(p.numel() for p in mini.parameters()) == 32_901
    res = fm.models.resnet12(5)
    assert round(sum(p.numel() for p in res.parameters()) / 1e6, 1) == 12.4
    res_names = dict(res.named_parameters())
    for name in (
        "features.0.conv1.weight",
        "features.3.norm3.bias",
        "features.2.shortcut.conv.weight",
    ):
        assert name in res_names
    assert fm.models.resnet12(None, in_channels=1, channels=(4, 4, 4, 8))(
        torch.zeros(3, 1, 28, 28)
    ).shape == (3, 8)
    tracked = fm.models.conv4_omniglot(5, track_running_stats=True)
    assert "features.0.norm.running_mean" in dict(tracked.named_buffers())
    assert fm.models.conv4_omniglot(None)(torch.zeros(2, 1, 28, 28)).shape == (2, 64)


def test_backbone_errors():
    with pytest.raises(ValueError, match="image_size 8 is too small for 4 2x2 poolings"):
        fm.models.conv4(5, image_size=8)
    with pytest.raises(ValueError, match="channels must give 4 widths"):
        fm.models.resnet12(5, channels=(8, 8))
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        fm.models.conv4_omniglot(0)
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        fm.models.conv4(5, hidden=0)


def test_backbone_names_drive_filters_exactly():
    """The documented names select the head (ANIL) and the blocks (checkpointing); a
    checkpointed run gives the meta-gradients of the plain one."""
    x, y = toy_images(5, 2)
    support = (x[::2].unsqueeze(0), y[::2].unsqueeze(0))
    query = (x[1::2].unsqueeze(0), y[1::2].unsqueeze(0))
    grads = []
    for layers in (None, ["features.0", "features.1", "features.2", "features.3"]):
        net = small_conv4(5)
        fmodel = fm.functional_model(net, checkpoint_layers=layers)
        out = fm.recipes.maml(
            fmodel, fmodel.params, F.cross_entropy, support, query, steps=2, lr=0.1
        )
        out.loss.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    net = small_conv4(5)
    fmodel = fm.functional_model(net)
    out = fm.recipes.anil(
        fmodel, fmodel.params, F.cross_entropy, support, query, steps=1, trainable="head", lr=0.01
    )
    adapted = {k: tuple(v.shape) for k, v in out.adapted.params.items()}
    for name, p in fmodel.params.items():  # the head per task, the rest shared and unchanged
        assert adapted[name] == ((1, *p.shape) if name.startswith("head") else tuple(p.shape))


# --- Prototypical Networks -------------------------------------------------------------------


def protonet_reference(net, support, query, ways):
    """One task at a time, by hand: embed support and query together, class means, negative
    squared distances, cross-entropy; the mean over tasks."""
    losses = []
    for xs, ys, xq, yq in zip(*support, *query, strict=True):
        z = net(torch.cat([xs, xq])).flatten(1)
        zs, zq = z[: len(xs)], z[len(xs) :]
        protos = torch.stack([zs[ys == c].mean(0) for c in range(ways)])
        logits = torch.stack([-((q - protos) ** 2).sum(1) for q in zq])
        losses.append(F.cross_entropy(logits, yq))
    return torch.stack(losses).mean()


def test_protonet_matches_a_hand_written_reference():
    x, y = toy_images(6, 4)
    g = torch.Generator().manual_seed(1)
    episodes = fm.data.Episodes(x, y, ways=3, shots=2, query=2)
    b = episodes.sample(4, generator=g)
    net = small_conv4(None)
    fmodel = fm.functional_model(net)
    out = fm.recipes.protonet(fmodel, fmodel.params, F.cross_entropy, b.support, b.query)
    out.loss.backward()
    ours = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    expected = protonet_reference(net, b.support, b.query, 3)
    expected.backward()
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    for a, e in zip(ours, (p.grad for p in net.parameters()), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-13)
    assert out.logits.shape == (4, 6, 3) and out.adapted is None
    assert type(out) is fm.recipes.RecipeResult and not hasattr(out, "residual")


def test_protonet_errors():
    net = small_conv4(None)
    fmodel = fm.functional_model(net)
    xs = torch.randn(2, 3, 1, 16, 16, dtype=DTYPE)
    ys = torch.tensor([[0, 0, 2], [0, 1, 2]])
    with pytest.raises(ValueError, match="task 0 has no support example of class 1"):
        fm.recipes.protonet(fmodel, fmodel.params, F.cross_entropy, (xs, ys), (xs, ys))
    with pytest.raises(ValueError, match="integer class labels"):
        fm.recipes.protonet(fmodel, fmodel.params, F.cross_entropy, (xs, ys.double()), (xs, ys))
    with pytest.raises(ValueError, match="support has 2 tasks but query has 1"):
        fm.recipes.protonet(fmodel, fmodel.params, F.cross_entropy, (xs, ys), (xs[:1], ys[:1]))


# --- the evaluation protocol -----------------------------------------------------------------


def test_mean_ci_is_the_t_interval():
    values = torch.tensor([0.5, 0.7, 0.9, 0.6, 0.8])
    mean, half = fm.evaluation.mean_ci(values)
    assert mean == pytest.approx(0.7)
    sem = values.double().std().item() / math.sqrt(5)
    assert half == pytest.approx(2.776 * sem, rel=3e-3)  # t(0.975, 4) = 2.7764
    for dof, exact in ((10, 2.2281), (19, 2.0930), (599, 1.9640)):
        assert protocol._t_quantile(dof) == pytest.approx(exact, abs=1e-3)
    assert fm.evaluation.mean_ci(torch.tensor([1.0]))[1] == math.inf


def test_evaluate_batched_equals_one_by_one_and_a_hand_loop():
    x, y = toy_images(8, 5)
    episodes = fm.data.Episodes(x, y, ways=4, shots=1, query=3)
    net = small_conv4(4)
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.3)
    kwargs = dict(steps=2, num_episodes=10, seed=3)
    batched = fm.evaluate(
        fmodel, fmodel.params, F.cross_entropy, episodes, opt, batch_tasks=4, **kwargs
    )
    single = fm.evaluate(
        fmodel, fmodel.params, F.cross_entropy, episodes, opt, batch_tasks=1, **kwargs
    )
    assert torch.equal(batched.per_episode, single.per_episode)
    # by hand: the same 10 episodes (4 + 4 + 2 drawn in turn from one seeded generator)
    g = torch.Generator().manual_seed(3)
    draws = [episodes.sample(n, generator=g) for n in (4, 4, 2)]
    expected = []
    for b in draws:
        for t in range(len(b.y_support)):
            params = {k: v.detach().clone().requires_grad_() for k, v in fmodel.params.items()}
            for _ in range(2):
                loss = F.cross_entropy(
                    torch.func.functional_call(net, params, b.x_support[t]), b.y_support[t]
                )
                grads = torch.autograd.grad(loss, list(params.values()))
                params = {
                    k: (v - 0.3 * g_).detach().requires_grad_()
                    for (k, v), g_ in zip(params.items(), grads, strict=True)
                }
            with torch.no_grad():
                pred = torch.func.functional_call(net, params, b.x_query[t]).argmax(-1)
            expected.append((pred == b.y_query[t]).double().mean())
    assert torch.equal(batched.per_episode, torch.stack(expected))
    mean, half = fm.evaluation.mean_ci(batched.per_episode)
    assert (batched.accuracy, batched.ci95) == (mean, half)
    assert batched.error == pytest.approx(1 - mean)
    again = fm.evaluate(fmodel, fmodel.params, F.cross_entropy, episodes, opt, **kwargs)
    assert torch.equal(again.per_episode, batched.per_episode)  # seeded: the same episodes
    with torch.no_grad():  # works inside no_grad, with the same numbers
        inside = fm.evaluate(fmodel, fmodel.params, F.cross_entropy, episodes, opt, **kwargs)
    assert torch.equal(inside.per_episode, batched.per_episode)
    assert all(p.grad is None for p in net.parameters())


def test_evaluate_scores_a_wide_head_on_its_first_columns():
    """A model with an 8-way head on 4-way episodes gives what the same model with its first
    4 head rows gives."""
    x, y = toy_images(8, 5)
    episodes = fm.data.Episodes(x, y, ways=4, shots=1, query=3)
    wide = small_conv4(8)
    narrow = small_conv4(4)
    with torch.no_grad():
        for name, p in narrow.named_parameters():
            p.copy_(
                dict(wide.named_parameters())[name][: p.shape[0]]
                if name.startswith("head")
                else dict(wide.named_parameters())[name]
            )
    results = []
    for net in (wide, narrow):
        fmodel = fm.functional_model(net)
        results.append(
            fm.evaluate(
                fmodel,
                fmodel.params,
                F.cross_entropy,
                episodes,
                fm.optim.sgd(lr=0.3),
                steps=2,
                num_episodes=8,
            )
        )
    assert torch.equal(results[0].per_episode, results[1].per_episode)


def test_evaluate_prototypes_and_fixed_episodes():
    x, y = toy_images(8, 5)
    episodes = fm.data.Episodes(x, y, ways=4, shots=2, query=2)
    net = small_conv4(None)
    fmodel = fm.functional_model(net)
    fixed = episodes.sample(7, generator=torch.Generator().manual_seed(0))
    result = fm.evaluate(
        fmodel, fmodel.params, F.cross_entropy, fixed, method="prototypes", batch_tasks=3
    )
    logits = fm.recipes.protonet(
        fmodel, fmodel.params, F.cross_entropy, fixed.support, fixed.query
    ).logits
    expected = (logits.argmax(-1) == fixed.y_query).double().mean(-1)
    assert torch.equal(result.per_episode, expected)  # all 7, in chunks of 3


def test_evaluate_errors():
    x, y = toy_images(8, 5)
    episodes = fm.data.Episodes(x, y, ways=4, shots=1, query=2)
    fmodel = fm.functional_model(small_conv4(4))
    opt = fm.optim.sgd(lr=0.1)
    call = (fmodel, fmodel.params, F.cross_entropy, episodes)
    with pytest.raises(ValueError, match="method must be one of"):
        fm.evaluate(*call, opt, method="nearest")
    with pytest.raises(TypeError, match="method='adapt' needs the inner optimizer"):
        fm.evaluate(*call, steps=1)
    with pytest.raises(TypeError, match="method='prototypes' adapts nothing"):
        fm.evaluate(*call, opt, method="prototypes")
    with pytest.raises(ValueError, match="num_episodes must be an int >= 1"):
        fm.evaluate(*call, opt, steps=1, num_episodes=0)
    with pytest.raises(TypeError, match=r"episodes must be a funcmeta\.data\.Episodes"):
        fm.evaluate(fmodel, fmodel.params, F.cross_entropy, (x, y), opt, steps=1)


@pytest.mark.parametrize("kind", ["encoder", "lstm", "hf"])
def test_evaluate_and_protonet_on_real_sequence_models(kind):
    """PyTorch's transformer layer (fused attention), an LSTM and a HuggingFace BERT from a
    config: fm.evaluate gives the same scores batched and one by one, and ProtoNets the
    hand-written reference's loss and gradients."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (60, 8), generator=g)
    episodes = fm.data.Episodes(
        ids, torch.arange(10).repeat_interleave(6), ways=4, shots=1, query=2
    )
    torch.manual_seed(0)
    fmodel = fm.functional_model(SequenceNet(kind, 6).to(DTYPE))
    scores = [
        fm.evaluate(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            episodes,
            fm.optim.sgd(lr=0.5),
            steps=2,
            num_episodes=6,
            batch_tasks=n,
        ).per_episode
        for n in (3, 1)
    ]
    assert torch.equal(scores[0], scores[1])
    net = SequenceNet(kind, None).to(DTYPE)
    embed = fm.functional_model(net)
    b = episodes.sample(3, generator=torch.Generator().manual_seed(1))
    out = fm.recipes.protonet(embed, embed.params, F.cross_entropy, b.support, b.query)
    out.loss.backward()
    ours = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    expected = protonet_reference(net, b.support, b.query, 4)
    expected.backward()
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    for a, e in zip(ours, (p.grad for p in net.parameters()), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
