"""fm.optim.from_torch: a configured torch.optim optimizer, its parameter groups and their
hyperparameters included, becomes the funcmeta optimizer with the same steps (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, batches, mlp, trajectory

import funcmeta as fm

STEPS = 12

# two groups (the first layer, the rest) with different hyperparameters
GROUPED = {
    "sgd": (
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        dict(lr=0.02, momentum=0.5, weight_decay=0.0),
    ),
    "sgd-nesterov": (
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, nesterov=True),
        dict(lr=0.01, momentum=0.7, nesterov=True),
    ),
    "adam": (
        torch.optim.Adam,
        dict(lr=0.01, betas=(0.9, 0.999), weight_decay=0.05, amsgrad=True),
        dict(lr=0.003, betas=(0.8, 0.95), eps=1e-6, amsgrad=True),
    ),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), dict(lr=0.02, weight_decay=0)),
    "rmsprop": (
        torch.optim.RMSprop,
        dict(lr=0.005, alpha=0.9, momentum=0.8, centered=True),
        dict(lr=0.002, alpha=0.99, weight_decay=0.02, centered=True),
    ),
    "adagrad": (
        torch.optim.Adagrad,
        dict(lr=0.05, lr_decay=0.01),
        dict(lr=0.02, weight_decay=0.02, eps=1e-8),
    ),
}


def groups(net, first, rest):
    return [
        {"params": net[0].parameters(), **first},
        {"params": [p for m in list(net)[1:] for p in m.parameters()], **rest},
    ]


def torch_trajectory(opt_cls, first, rest, data):
    net = mlp()
    opt = opt_cls(groups(net, first, rest))
    out = []
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in net.named_parameters()})
    return out


def converted_trajectory(opt_cls, first, rest, data):
    net = mlp()
    fmodel = fm.functional_model(net)
    return trajectory(fmodel, fm.optim.from_torch(opt_cls(groups(net, first, rest)), fmodel), data)


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_groups_match_torch_optim_step_for_step(name):
    opt_cls, first, rest = GROUPED[name]
    data = batches(STEPS)
    ours = converted_trajectory(opt_cls, first, rest, data)
    theirs = torch_trajectory(opt_cls, first, rest, data)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-12, msg=f"step {step} {k}")


def test_one_group_keeps_numbers_and_tensor_hyperparameters_learnable():
    net = mlp()
    fmodel = fm.functional_model(net)
    lr = torch.tensor(0.1, dtype=DTYPE, requires_grad=True)
    opt = fm.optim.from_torch(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9), fmodel)
    (x, y), (xq, yq) = batches(2)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=3)
    F.mse_loss(fmodel(result.params, xq), yq).backward()
    assert lr.grad is not None and lr.grad.abs() > 0  # the rate is learned through from_torch
    # the same meta-gradient as the funcmeta optimizer written by hand
    lr2 = torch.tensor(0.1, dtype=DTYPE, requires_grad=True)
    hand = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr2, 0.9), steps=3)
    F.mse_loss(fmodel(hand.params, xq), yq).backward()
    torch.testing.assert_close(lr.grad, lr2.grad, rtol=1e-12, atol=0)


def test_adagrad_starts_from_the_constructors_accumulator():
    net, data = mlp(), batches(STEPS)
    theirs_opt = torch.optim.Adagrad(net.parameters(), lr=0.05, initial_accumulator_value=0.1)
    fmodel = fm.functional_model(mlp())
    ours = fm.optim.from_torch(
        torch.optim.Adagrad(fmodel.module.parameters(), lr=0.05, initial_accumulator_value=0.1),
        fmodel,
    )
    ours_params = trajectory(fmodel, ours, data)[-1]
    for x, y in data:
        theirs_opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        theirs_opt.step()
    for k, v in net.named_parameters():
        torch.testing.assert_close(ours_params[k], v.detach(), rtol=1e-10, atol=1e-12)


def test_params_outside_the_groups_need_trainable():
    net = mlp()
    fmodel = fm.functional_model(net)
    opt = fm.optim.from_torch(torch.optim.SGD(net[0].parameters(), lr=0.1), fmodel)
    batch = batches(1)[0]
    with pytest.raises(ValueError, match=r"no value for the parameters at paths .*2\.weight"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, batch, opt, steps=1)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, batch, opt, steps=1, trainable="0")
    assert result.params["2.weight"] is fmodel.params["2.weight"]


@pytest.mark.skipif(
    "decoupled_weight_decay" not in torch.optim.Adam(mlp().parameters()).param_groups[0],
    reason="Adam(decoupled_weight_decay=...) is torch >= 2.6",
)
def test_adam_with_decoupled_weight_decay_is_adamw():
    kw = dict(lr=0.01, weight_decay=0.1)
    data = batches(STEPS)
    both = dict(decoupled_weight_decay=True, **kw)
    ours = converted_trajectory(torch.optim.Adam, both, both, data)
    theirs = torch_trajectory(torch.optim.AdamW, kw, kw, data)
    for a, b in zip(ours, theirs, strict=True):
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-12)


def test_errors_name_the_problem():
    net = mlp()
    names = dict(net.named_parameters())
    with pytest.raises(TypeError, match=r"from_torch supports torch.optim.SGD.*got .*LBFGS"):
        fm.optim.from_torch(torch.optim.LBFGS(net.parameters()), names)
    with pytest.raises(ValueError, match=r"maximize=True"):
        fm.optim.from_torch(torch.optim.SGD(net.parameters(), lr=0.1, maximize=True), names)
    mixed = groups(net, dict(momentum=0.9, nesterov=True), dict(momentum=0.9))
    with pytest.raises(ValueError, match="nesterov differs between parameter groups"):
        fm.optim.from_torch(torch.optim.SGD(mixed, lr=0.1), names)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"group 0 holds tensors that params does not name"):
        fm.optim.from_torch(torch.optim.SGD(other.parameters(), lr=0.1), names)
    with pytest.raises(TypeError, match="needs the parameters' names"):
        fm.optim.from_torch(torch.optim.SGD(net.parameters(), lr=0.1), list(net.parameters()))
    odd = groups(net, dict(initial_accumulator_value=0.1), {})
    with pytest.raises(ValueError, match=r"groups \[0\] set initial_accumulator_value"):
        fm.optim.from_torch(torch.optim.Adagrad(odd, lr=0.1), names)
    tagged = torch.optim.SGD([{"params": net.parameters(), "name": "all"}], lr=0.1)
    fm.optim.from_torch(tagged, net)  # a string tag on a group is the user's own


def hf_style_groups(module):
    """The usual transformer fine-tuning groups: weight decay on matrices, none on biases and
    norms."""
    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm)
    skip = {id(p) for m in module.modules() if isinstance(m, norms) for p in m.parameters(False)}
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in skip]
    rest = [p for p in params if p.dim() < 2 or id(p) in skip]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("name", ["encoder-train", "gru", "hf-bert"])
def test_real_models_adapt_like_torch_optim(name):
    """A transformer layer on PyTorch's attention, a GRU and a HuggingFace BERT built from a
    config: K steps of fm.adapt with the converted AdamW equal K torch.optim.AdamW steps."""
    import zoo

    theirs, ours = zoo.build(name, seed=3), zoo.build(name, seed=3)
    batch = theirs.batch(4, torch.Generator().manual_seed(4))
    args, kwargs = fm.inputs.split_inputs(batch[0])
    torch_opt = torch.optim.AdamW(hf_style_groups(theirs.module), lr=0.01, betas=(0.8, 0.95))
    for _ in range(4):
        torch_opt.zero_grad()
        theirs.loss(theirs.module(*args, **kwargs), batch[1]).backward()
        torch_opt.step()
    fmodel = fm.functional_model(ours.module)
    opt = fm.optim.from_torch(
        torch.optim.AdamW(hf_style_groups(ours.module), lr=0.01, betas=(0.8, 0.95)), fmodel
    )
    result = fm.adapt(fmodel, fmodel.params, ours.loss, batch, opt, steps=4, first_order=True)
    # atol 1e-10: attention's key bias has a zero gradient up to round-off (softmax ignores a
    # shift), which Adam's normalisation turns into steps of 1e-12; all else agrees to 1e-15
    for k, v in theirs.module.named_parameters():
        torch.testing.assert_close(result.params[k], v.detach(), rtol=1e-10, atol=1e-10, msg=k)
