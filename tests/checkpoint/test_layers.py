"""Checkpointing: layer selection, purity, and meta-gradients equal to the unchecked run
(float64 to round-off; under bf16 autocast, bitwise-close) for per-layer, step-level and
both, with activation offload, across adapt's features."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICES, DTYPE, batches
from torch import nn

import funcmeta as fm


def blocks_net(dtype=DTYPE, dropout=0.2, batchnorm=True, seed=0):
    torch.manual_seed(seed)

    def block(a, b):
        layers = [nn.Linear(a, b)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(b))
        layers += [nn.Tanh(), nn.Dropout(dropout)]
        return nn.Sequential(*layers)

    return nn.Sequential(block(3, 12), block(12, 12), block(12, 12), nn.Linear(12, 2)).to(dtype)


# --- selection -------------------------------------------------------------------------


def test_presets_names_and_predicates():
    net = blocks_net()
    assert fm.checkpoint.select(net, "sequential") == ["0", "1", "2", "3"]
    assert fm.checkpoint.select(net, "leaves")[:3] == ["0.0", "0.1", "1.0"]
    assert fm.checkpoint.select(net, ["1", "2"]) == ["1", "2"]
    linear = fm.checkpoint.select(net, lambda name, m: isinstance(m, nn.Linear))
    assert linear == ["0.0", "1.0", "2.0", "3"]
    # a predicate matching nested modules keeps the outermost
    assert fm.checkpoint.select(net, lambda name, m: name in ("1", "1.0")) == ["1"]
    assert fm.checkpoint.select(net, None) == []


@pytest.mark.parametrize(
    "spec, match",
    [
        (["1", "7", "0.9"], r"\['7', '0\.9'\] are not submodules"),
        (["1", "1.0"], r"\['1\.0'\] lie inside"),
        (lambda name, m: isinstance(m, nn.Conv2d), "predicate matches no submodule"),
        ("every-layer", "unknown checkpoint preset"),
    ],
)
def test_selection_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        fm.functional_model(blocks_net(), checkpoint_layers=spec)


def test_preset_matching_nothing_raises():
    with pytest.raises(ValueError, match="preset 'sequential' matches no submodule"):
        fm.functional_model(nn.Linear(2, 2), checkpoint_layers="sequential")


# --- purity ----------------------------------------------------------------------------


def test_checkpointed_model_is_the_same_function_and_leaves_the_module_alone():
    net = blocks_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    modules_before = dict(net.named_modules())
    plain = fm.functional_model(net)
    ck = fm.functional_model(net, checkpoint_layers="leaves")
    assert list(ck.params) == list(plain.params)
    assert all(ck.params[k] is plain.params[k] for k in plain.params)
    x = torch.randn(6, 3, dtype=DTYPE)
    torch.manual_seed(3)
    a, bufs_a = plain.run(plain.params, plain.buffers, x)
    torch.manual_seed(3)
    b, bufs_b = ck.run(ck.params, ck.buffers, x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for k in bufs_a:
        torch.testing.assert_close(bufs_a[k], bufs_b[k], rtol=0, atol=0)
    assert dict(net.named_modules()) == modules_before
    assert all(type(m).__module__.startswith("torch.nn") for m in net.modules())
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_train_and_eval_of_the_module_are_followed():
    net = blocks_net(dropout=0.5)
    plain, ck = fm.functional_model(net), fm.functional_model(net, checkpoint_layers="sequential")
    x = torch.randn(6, 3, dtype=DTYPE)
    net.eval()
    torch.testing.assert_close(ck(ck.params, x), plain(plain.params, x), rtol=0, atol=0)
    torch.testing.assert_close(ck(ck.params, x), ck(ck.params, x), rtol=0, atol=0)  # no dropout
    net.train()
    torch.manual_seed(0)
    a = ck(ck.params, x)
    torch.manual_seed(1)
    assert not torch.equal(a, ck(ck.params, x))  # dropout is back


def test_attribute_access_through_a_checkpointed_layer():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(3, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            # reads a parameter and a plain attribute of a checkpointed child
            return self.out(self.body(x)) + self.body.bias.sum() * self.body.out_features

    torch.manual_seed(0)
    net = Head().to(DTYPE)
    ck = fm.functional_model(net, checkpoint_layers=["body"])
    x = torch.randn(5, 3, dtype=DTYPE)
    torch.testing.assert_close(ck(ck.params, x), net(x), rtol=0, atol=0)


# --- meta-gradients --------------------------------------------------------------------

SETTINGS = {
    "per-layer": dict(checkpoint="sequential"),
    "leaves": dict(checkpoint="leaves"),
    "per-step": dict(checkpoint_steps=True),
    "both": dict(checkpoint="sequential", checkpoint_steps=True),
    "offload": dict(offload_activations=True),
    "offload+both": dict(checkpoint="sequential", checkpoint_steps=True, offload_activations=True),
}

FEATURES = {
    "sgd-second-order": dict(opt="sgd"),
    "adam-second-order": dict(opt="adam"),
    "sgd-first-order": dict(opt="sgd", first_order=True),
    "adam-per-element-rates": dict(opt="adam", rates="per_element"),
    "subset-and-clip": dict(opt="sgd", trainable=["2", "3"], clip_grad_norm=0.5),
    "truncated": dict(opt="adam", truncate=1),
}


def meta_run(net, setting, feature, steps=3, seed=7):
    fmodel = fm.functional_model(net, checkpoint_layers=setting.get("checkpoint"))
    kind = feature.get("rates", "per_layer")
    rates = getattr(fm.hyper, kind)(fmodel.params, 0.05, parameterization="softplus")
    opt = (
        fm.optim.sgd(lr=rates, momentum=0.5) if feature["opt"] == "sgd" else fm.optim.adam(lr=rates)
    )
    (xs, ys), (xq, yq) = batches(2, size=8)
    kwargs = {k: v for k, v in feature.items() if k not in ("opt", "rates")}
    kwargs.update({k: v for k, v in setting.items() if k != "checkpoint"})
    torch.manual_seed(seed)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=steps, **kwargs)
    out, buffers = fmodel.run(result.params, result.buffers, xq)
    loss = F.mse_loss(out, yq)
    inputs = [*net.parameters(), *rates.parameters()]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [
        torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs, strict=True)
    ], buffers


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_meta_gradients_equal_the_unchecked_run(setting, feature):
    net = blocks_net()
    reference, ref_buffers = meta_run(net, {}, FEATURES[feature])
    ours, buffers = meta_run(net, SETTINGS[setting], FEATURES[feature])
    assert any(g.abs().sum() > 0 for g in reference)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # BatchNorm statistics: updated once per forward (3 inner + 1 query), not on recomputation
    for k in ref_buffers:
        torch.testing.assert_close(buffers[k], ref_buffers[k], rtol=0, atol=0)
    assert int(buffers["0.1.num_batches_tracked"]) == 4


def test_dropout_masks_are_reproduced_on_recomputation():
    """With dropout 0.5 and no BatchNorm, a different mask in recomputation would change the
    gradients; equal gradients mean the masks matched."""
    net = blocks_net(dropout=0.5, batchnorm=False)
    reference, _ = meta_run(net, {}, FEATURES["adam-second-order"])
    other_seed, _ = meta_run(net, {}, FEATURES["adam-second-order"], seed=8)
    assert any(not torch.allclose(a, b) for a, b in zip(reference, other_seed, strict=True))
    for setting in ("per-layer", "per-step", "both"):
        ours, _ = meta_run(net, SETTINGS[setting], FEATURES["adam-second-order"])
        for a, b in zip(ours, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_under_no_grad_step_checkpointing_is_skipped_and_results_agree():
    net = blocks_net()
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    support = batches(1, size=8)[0]
    with torch.no_grad():
        torch.manual_seed(0)
        a = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            fm.optim.sgd(lr=0.1),
            steps=2,
            checkpoint_steps=True,
        )
        torch.manual_seed(0)
        b = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, fm.optim.sgd(lr=0.1), steps=2)
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k], rtol=0, atol=0)


# --- the scenario of the issue: blocks, rates, subset, clipping, autocast --------------


def scenario(layers: bool, steps: bool, autocast: bool = True):
    torch.manual_seed(0)
    net = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(4)],
        nn.Linear(16, 3),
    )
    fmodel = fm.functional_model(net, checkpoint_layers="sequential" if layers else None)
    last = ["3", "4"]
    rates = fm.hyper.per_layer(
        {k: v for k, v in fmodel.params.items() if k.split(".")[0] in last},
        0.05,
        parameterization="softplus",
    )
    g = torch.Generator().manual_seed(1)
    xs, xq = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
    ys, yq = torch.randint(0, 3, (32,), generator=g), torch.randint(0, 3, (32,), generator=g)

    def loss_fn(out, y):
        return F.cross_entropy(out.float(), y)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        result = fm.adapt(
            fmodel,
            fmodel.params,
            loss_fn,
            (xs, ys),
            fm.optim.sgd(lr=rates),
            steps=2,
            trainable=last,
            clip_grad_norm=1.0,
            checkpoint_steps=steps,
        )
        loss = loss_fn(fmodel(result.params, xq), yq)
    inputs = [*net.parameters(), *rates.parameters()]
    return torch.autograd.grad(loss, inputs)


def test_scenario_blocks_rates_subset_clip_autocast():
    """Under bf16 autocast, step checkpointing replays the unchecked graph op for op
    (bit-identical). Per-layer checkpointing computes each layer's second-order terms in a
    graph of its own, so bf16 rounding falls differently: the differences must stay well
    below what bf16 itself changes (against the same run in float32; measured: at most
    0.3 of it)."""
    reference = scenario(layers=False, steps=False)
    float32 = scenario(layers=False, steps=False, autocast=False)
    for a, b in zip(scenario(layers=False, steps=True), reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for setting in ({"layers": True, "steps": False}, {"layers": True, "steps": True}):
        ours = scenario(**setting)
        assert ours[-1].abs().sum() > 0 and ours[0].abs().sum() > 0  # rates and the body learn
        for a, b, c in zip(ours, reference, float32, strict=True):
            assert torch.isfinite(a).all()
            assert (a - b).norm() <= 0.5 * (b - c).norm(), setting


# --- CUDA ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_meta_gradients_on_the_device_equal_the_unchecked_run(setting, device):
    net = blocks_net().to(device)
    original = batches

    def on_device(*args, **kwargs):
        return [(x.to(device), y.to(device)) for x, y in original(*args, **kwargs)]

    globals()["batches"] = on_device
    try:
        reference, _ = meta_run(net, {}, FEATURES["adam-per-element-rates"])
        ours, _ = meta_run(net, SETTINGS[setting], FEATURES["adam-per-element-rates"])
    finally:
        globals()["batches"] = original
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_autocast_with_loss_scaling_and_checkpointing(device):
    """The checkpointed run in fp16 autocast differs from the unchecked one by far less than
    fp16 itself does (against the same run in float32)."""

    def run(checkpointed, autocast=True):
        torch.manual_seed(0)
        net = nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)], nn.Linear(64, 4)
        ).to(device)
        fmodel = fm.functional_model(net, checkpoint_layers="sequential" if checkpointed else None)
        rates = fm.hyper.per_layer(fmodel.params, 0.05, parameterization="softplus")
        g = torch.Generator().manual_seed(1)
        xs, xq = (torch.randn(64, 64, generator=g).to(device) for _ in range(2))
        ys, yq = (torch.randint(0, 4, (64,), generator=g).to(device) for _ in range(2))
        with torch.autocast(device, dtype=torch.float16, enabled=autocast):
            result = fm.adapt(
                fmodel,
                fmodel.params,
                lambda o, y: F.cross_entropy(o.float(), y),
                (xs, ys),
                fm.optim.sgd(lr=rates),
                steps=2,
                loss_scale=1024.0 if autocast else None,
                checkpoint_steps=checkpointed,
                offload_activations=checkpointed,
            )
            loss = F.cross_entropy(fmodel(result.params, xq).float(), yq)
        return torch.autograd.grad(loss, [*net.parameters(), *rates.parameters()])

    reference, ours, float32 = run(False), run(True), run(False, autocast=False)
    diff = sum(((a - b) ** 2).sum() for a, b in zip(ours, reference, strict=True)).sqrt()
    effect = sum(((b - c) ** 2).sum() for b, c in zip(reference, float32, strict=True)).sqrt()
    assert all(torch.isfinite(a).all() for a in ours)
    assert diff <= 0.5 * effect, (float(diff), float(effect))
