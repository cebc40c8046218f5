"""functional_model: purity, parameters by reference, buffers, tied weights, precise errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, detached, mlp
from torch import nn

import funcmeta as fm


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_unchanged(module, before):
    after = module.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k


def test_matches_module_and_params_by_reference():
    net = mlp()
    fmodel = fm.functional_model(net)
    x = torch.randn(4, 3, dtype=DTYPE)
    torch.testing.assert_close(fmodel(fmodel.params, x), net(x), rtol=0, atol=0)
    for name, p in net.named_parameters():
        assert fmodel.params[name] is p
    fmodel.params.clear()  # a fresh dict each time: the model is not affected
    assert len(fmodel.params) == len(list(net.parameters()))


def test_other_params_change_the_output_not_the_module():
    net = mlp()
    before = snapshot(net)
    fmodel = fm.functional_model(net)
    zeros = {k: torch.zeros_like(v) for k, v in fmodel.params.items()}
    out = fmodel(zeros, torch.randn(4, 3, dtype=DTYPE))
    assert torch.equal(out, torch.zeros_like(out))
    assert_unchanged(net, before)


def test_meta_gradient_reaches_module_grad_for_outer_optimizer():
    net = mlp()
    fmodel = fm.functional_model(net)
    outer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, dtype=DTYPE), torch.randn(4, 2, dtype=DTYPE)
    F.mse_loss(fmodel(fmodel.params, x), y).backward()
    reference = mlp()
    F.mse_loss(reference(x), y).backward()
    for (_, p), (_, q) in zip(net.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    outer.step()


def test_key_and_shape_errors_name_the_keys():
    fmodel = fm.functional_model(mlp())
    x = torch.randn(2, 3, dtype=DTYPE)
    params = detached(fmodel.params)
    missing = {k: v for k, v in params.items() if k != "2.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['2\.bias'\]"):
        fmodel(missing, x)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        fmodel({**params, "extra": torch.zeros(1)}, x)
    wrong = {**params, "0.weight": torch.zeros(3, 5, dtype=DTYPE)}
    with pytest.raises(ValueError, match=r"params\['0\.weight'\] has shape \(3, 5\).*\(5, 3\)"):
        fmodel(wrong, x)
    with pytest.raises(TypeError, match="dict of tensors"):
        fmodel(list(params.values()), x)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fm.functional_model(lambda x: x)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.embed(idx)))


def test_tied_weights_appear_once_and_stay_tied():
    torch.manual_seed(0)
    net = Tied().to(DTYPE)
    fmodel = fm.functional_model(net)
    assert list(fmodel.params) == ["embed.weight"]
    idx = torch.tensor([0, 3, 4])
    torch.testing.assert_close(fmodel(fmodel.params, idx), net(idx), rtol=0, atol=0)
    new = {"embed.weight": torch.randn(5, 3, dtype=DTYPE)}
    manual = torch.tanh(new["embed.weight"][idx]) @ new["embed.weight"].T
    torch.testing.assert_close(fmodel(new, idx), manual)
    # the gradient of the tied weight sums both uses, as the module's own backward does
    fmodel(fmodel.params, idx).sum().backward()
    ours = net.embed.weight.grad.clone()
    net.zero_grad()
    net(idx).sum().backward()
    torch.testing.assert_close(ours, net.embed.weight.grad)


def bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).to(DTYPE)


def test_batchnorm_buffers_come_back_new_and_nothing_is_mutated():
    net = bn_net()
    before = snapshot(net)
    fmodel = fm.functional_model(net)
    x = torch.randn(8, 3, dtype=DTYPE)
    given = {k: v.clone() for k, v in fmodel.buffers.items()}
    given_before = {k: v.clone() for k, v in given.items()}
    out, new = fmodel.run(fmodel.params, given, x)
    reference = bn_net()
    torch.testing.assert_close(out, reference(x))
    for k in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        torch.testing.assert_close(new[k], reference.state_dict()[k])
        assert new[k] is not given[k]
        assert torch.equal(given[k], given_before[k])
    assert not torch.equal(new["1.running_mean"], given["1.running_mean"])
    fmodel(fmodel.params, x)
    assert_unchanged(net, before)


def test_buffers_are_checked_too():
    fmodel = fm.functional_model(bn_net())
    with pytest.raises(
        ValueError, match=r"buffers do not match.*missing keys \['1\.num_batches_tracked'\]"
    ):
        buffers = {k: v for k, v in fmodel.buffers.items() if k != "1.num_batches_tracked"}
        fmodel.run(fmodel.params, buffers, torch.randn(4, 3, dtype=DTYPE))


def test_module_registered_twice_and_buffer_reassigned_in_forward():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls = self.calls + 1  # replaces the buffer instead of writing into it
            return x

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            shared = nn.Linear(3, 3)
            self.a, self.b = shared, shared  # one module under two names
            self.counter = Counter()

        def forward(self, x):
            return self.counter(self.b(torch.tanh(self.a(x))))

    torch.manual_seed(0)
    net = Twice().to(DTYPE)
    fmodel = fm.functional_model(net)
    assert list(fmodel.params) == ["a.weight", "a.bias"]
    new = {k: torch.randn_like(v) for k, v in fmodel.params.items()}
    x = torch.randn(4, 3, dtype=DTYPE)
    out, buffers = fmodel.run(new, fmodel.buffers, x)
    expected = F.linear(
        torch.tanh(F.linear(x, new["a.weight"], new["a.bias"])), new["a.weight"], new["a.bias"]
    )
    torch.testing.assert_close(out, expected)
    assert int(buffers["counter.calls"]) == 1
    assert int(net.counter.calls) == 0
    assert net.a.weight is net.b.weight and isinstance(net.a.weight, nn.Parameter)
    torch.testing.assert_close(fmodel(fmodel.params, x), net(x))
