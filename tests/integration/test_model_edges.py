"""What real research code runs into: kernel choice for second order, layers vmap cannot
batch, hooks, dropout in checkpointed layers, offload with step checkpointing, keyword
inputs, frozen parameters, and the errors for wrong arguments."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import funcmeta as fm

DTYPE = torch.float64


def _encoder(train: bool = True, dtype: torch.dtype = DTYPE) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return layer.to(dtype).train(train)


def _seq(*lead: int, dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(*lead, 5, 8, generator=g, dtype=dtype),
        torch.randn(*lead, 5, 8, generator=g, dtype=dtype),
    )


def _meta_grads(fmodel, batch, **options):
    result = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, batch, fm.optim.sgd(lr=0.1), steps=2, **options
    )
    loss = F.mse_loss(fmodel(result.params, batch[0]), batch[1])
    return torch.autograd.grad(loss, list(fmodel.params.values()))


# --- attention kernels ------------------------------------------------------------------


def test_transformer_second_order_float32_user_code():
    """nn.TransformerEncoderLayer in float32 (CPU flash attention by default), no kernel
    context: second-order MAML runs and matches the math-kernel unroll."""
    layer = _encoder(dtype=torch.float32)
    fmodel = fm.functional_model(layer)
    batch = _seq(4, dtype=torch.float32)
    got = _meta_grads(fmodel, batch)
    with sdpa_kernel(SDPBackend.MATH):
        want = _meta_grads(fmodel, batch)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("checkpoint", ["per-layer", "step", "both"])
@pytest.mark.parametrize("first_order", [False, True])
def test_user_kernel_block_then_backward_outside(checkpoint, first_order):
    """A user who wraps adapt in sdpa_kernel(MATH) and calls backward outside it: the
    recomputations run on the forward's kernel (they failed with 'Recomputed values ... have
    different metadata')."""
    layer = _encoder()
    plain = fm.functional_model(layer)
    fmodel = fm.functional_model(
        layer, checkpoint_layers=["self_attn", "linear1"] if checkpoint != "step" else None
    )
    batch = _seq(4)
    with sdpa_kernel(SDPBackend.MATH):
        result = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            batch,
            fm.optim.sgd(lr=0.1),
            steps=2,
            first_order=first_order,
            checkpoint_steps=checkpoint != "per-layer",
        )
        query = F.mse_loss(fmodel(result.params, batch[0]), batch[1])
    got = torch.autograd.grad(query, list(fmodel.params.values()))
    want = _meta_grads(plain, batch, first_order=first_order)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


class KernelRecorder(nn.Module):
    """A linear layer that records the attention kernels enabled each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1, dtype=DTYPE)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(
            (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
        )
        return self.lin(x)


def test_second_order_steps_alone_run_on_the_math_kernel():
    net = nn.Sequential(KernelRecorder())
    fmodel = fm.functional_model(net)
    x, y = torch.randn(4, 3, dtype=DTYPE), torch.randn(4, 1, dtype=DTYPE)
    opt = fm.optim.sgd(lr=0.1)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=1)
    assert net[0].seen == [(False, True)]  # second order: math only
    net[0].seen.clear()
    fmodel(result.params, x)  # the query pass: the user's (default) kernels
    fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=1, first_order=True)
    with torch.no_grad():  # evaluation: no outer graph, so nothing needs second order
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=1)
    assert net[0].seen == [(True, True), (True, True), (True, True)]
    assert torch.backends.cuda.flash_sdp_enabled()  # nothing left switched


def test_recomputation_in_outer_backward_uses_the_forward_kernels():
    net = nn.Sequential(KernelRecorder(), nn.Tanh(), nn.Linear(1, 1, dtype=DTYPE))
    fmodel = fm.functional_model(net, checkpoint_layers=["0"])
    x, y = torch.randn(4, 3, dtype=DTYPE), torch.randn(4, 1, dtype=DTYPE)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1)
    loss = F.mse_loss(fmodel(result.params, x), y)
    net[0].seen.clear()
    loss.backward()  # outside any kernel block: recomputes layer 0 of the inner step
    assert (False, True) in net[0].seen
    assert all(seen == (False, True) or seen == (True, True) for seen in net[0].seen)


def test_twice_differentiable_restores_the_choice():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with fm.checkpoint.kernels.twice_differentiable():
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled()
            assert fm.checkpoint.kernels.in_twice_differentiable()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.math_sdp_enabled()
    assert not fm.checkpoint.kernels.in_twice_differentiable()


def test_imaml_on_attention():
    layer = _encoder()
    fmodel = fm.functional_model(layer)
    support, query = _seq(2, 4), _seq(2, 4)
    result = fm.recipes.imaml(
        fmodel, fmodel.params, F.mse_loss, support, query, lam=5.0, steps=2, cg_steps=2, lr=0.01
    )
    result.loss.backward()
    assert layer.linear1.weight.grad is not None


# --- task batching: layers vmap cannot batch, hooks, dropout, eval fast path -------------


def test_forward_hook_and_pre_hook_under_task_batching():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    net[2].register_forward_hook(lambda m, i, o: o * 3 + 1)
    net[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    fmodel = fm.functional_model(net)
    per_task = {k: v.detach().expand(3, *v.shape).clone() for k, v in fmodel.params.items()}
    x = torch.randn(3, 10, 4, dtype=DTYPE)
    out = fm.apply_tasks(fmodel, per_task, x)[0]
    loop = torch.stack([fmodel({k: v[t] for k, v in per_task.items()}, x[t]) for t in range(3)])
    torch.testing.assert_close(out, loop, rtol=1e-12, atol=1e-12)


def test_global_hooks_run_once_per_call():
    calls = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: calls.append(type(m).__name__)
    )
    try:
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        fmodel = fm.functional_model(net, checkpoint_layers=["0"])
        calls.clear()
        fmodel(fmodel.params, torch.randn(3, 2))
        assert calls == ["Linear", "Linear", "Sequential"]
        per_task = {k: v.detach().expand(2, *v.shape).clone() for k, v in fmodel.params.items()}
        fm.apply_tasks(fmodel, per_task, torch.randn(2, 3, 2))  # finds out it batches
        calls.clear()
        fm.apply_tasks(fmodel, per_task, torch.randn(2, 3, 2))
    finally:
        handle.remove()
    assert calls == ["Linear", "Linear", "Sequential"]  # once each, not per stand-in too


def test_old_weight_norm_under_adapt_tasks():
    torch.manual_seed(0)
    net = nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 1))
    net = net.to(DTYPE)
    fmodel = fm.functional_model(net)
    x, y = torch.randn(3, 10, 4, dtype=DTYPE), torch.randn(3, 10, 1, dtype=DTYPE)
    result = fm.adapt_tasks(
        fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1
    )
    assert not torch.equal(result.params["0.weight_v"][0], net[0].weight_v)


def test_dropout_in_checkpointed_layer_under_task_batching():
    def run(checkpoint):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2)), nn.Linear(16, 1))
        fmodel = fm.functional_model(net.to(DTYPE), checkpoint_layers=checkpoint)
        x, y = torch.randn(3, 10, 4, dtype=DTYPE), torch.randn(3, 10, 1, dtype=DTYPE)
        torch.manual_seed(1)
        out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
        opt = fm.optim.sgd(lr=0.1)
        result = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2)
        loss = fm.task_losses(fmodel, result.params, F.mse_loss, (x, y))[0].mean()
        return out, torch.autograd.grad(loss, list(fmodel.params.values()))

    out_c, grads_c = run("sequential")
    out_u, grads_u = run(None)
    assert out_c.shape == (3, 10, 1)
    torch.testing.assert_close(out_c, out_u, rtol=0, atol=0)  # the same masks
    for c, u in zip(grads_c, grads_u, strict=True):
        torch.testing.assert_close(c, u, rtol=1e-10, atol=1e-12)


def test_eval_transformer_under_adapt_tasks_and_no_grad():
    fmodel = fm.functional_model(_encoder(train=False))
    x, y = _seq(3, 4)
    opt = fm.optim.sgd(lr=0.1)
    with torch.no_grad():
        evaluated = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2)
        out, _ = fm.apply_tasks(fmodel, evaluated.params, x)
    trained = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2)
    torch.testing.assert_close(evaluated.losses, trained.losses.detach())
    assert out.shape == x.shape


def test_recurrent_layers_under_adapt_tasks_match_loop():
    torch.manual_seed(0)
    net = nn.GRU(3, 4, batch_first=True).to(DTYPE)
    fmodel = fm.functional_model(net)
    x = torch.randn(2, 3, 5, 3, dtype=DTYPE)
    y = torch.randn(2, 3, 5, 4, dtype=DTYPE)

    def loss_fn(out, target):
        return F.mse_loss(out[0], target)

    opt = fm.optim.sgd(lr=0.1)
    result = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, (x, y), opt, steps=2)
    for t in range(2):
        one = fm.adapt(fmodel, fmodel.params, loss_fn, (x[t], y[t]), opt, steps=2)
        for k, v in one.params.items():
            torch.testing.assert_close(result.params[k][t], v, rtol=1e-10, atol=1e-12)


def test_per_task_fallback_is_reported():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1, dtype=DTYPE)

        def forward(self, x):
            if bool(x.sum() > 0):  # data-dependent control flow: no vmap
                return self.lin(x)
            return -self.lin(x)

    fmodel = fm.functional_model(DataDependent())
    assert fmodel.per_task is None
    x, y = torch.randn(3, 4, 3, dtype=DTYPE), torch.randn(3, 4, 1, dtype=DTYPE)
    with pytest.warns(UserWarning, match="once per task: the model's forward cannot run under"):
        losses = fm.task_losses(fmodel, fmodel.params, F.mse_loss, (x, y)).losses
    assert fmodel.per_task is True
    assert fmodel.per_task_layers == {
        "": "DataDependent: its forward branches on tensor values (data-dependent control flow)"
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        fm.task_losses(fmodel, fmodel.params, F.mse_loss, (x, y))
    for t in range(3):
        want = F.mse_loss(fmodel(fmodel.params, x[t]), y[t])
        torch.testing.assert_close(losses[t], want)


def test_per_task_fallback_names_the_nested_layer_that_refused():
    class Gate(nn.Module):
        def forward(self, x):
            return x * 2 if x.max().item() > 0 else x  # .item(): no vmap

    net = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Tanh(), Gate()), nn.Linear(4, 1))
    fmodel = fm.functional_model(net.to(DTYPE))
    x = torch.randn(3, 4, 3, dtype=DTYPE)
    with pytest.warns(UserWarning, match=r"layer '1\.1' cannot run under vmap \(Gate: "):
        out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
    assert list(fmodel.per_task_layers) == ["1.1"]
    for t in range(3):
        torch.testing.assert_close(out[t], fmodel(fmodel.params, x[t]), rtol=0, atol=0)


class GradOnlyBranch(nn.Module):
    """Branches on the data only when gradients are being recorded: the no-grad probe
    batches, the real run cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1, dtype=DTYPE)

    def forward(self, x):
        out = self.lin(x)
        if torch.is_grad_enabled() and bool(out.sum() > 1e6):
            return out * 2
        return out


def test_per_task_after_probe_passes_and_real_run_cannot_batch():
    fmodel = fm.functional_model(GradOnlyBranch())
    x, y = torch.randn(3, 4, 3, dtype=DTYPE), torch.randn(3, 4, 1, dtype=DTYPE)
    opt = fm.optim.sgd(lr=0.1)
    result = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2)
    assert fmodel.per_task is True
    for t in range(3):
        one = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x[t], y[t]), opt, steps=2)
        for k, v in one.params.items():
            torch.testing.assert_close(result.params[k][t], v, rtol=1e-12, atol=1e-14)


class DropoutDataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 8, dtype=DTYPE)
        self.head = nn.Linear(8, 1, dtype=DTYPE)

    def forward(self, x):
        h = F.dropout(torch.tanh(self.lin(x)), 0.3, self.training)
        if bool(x[0, 0] > 0):  # a branch the tasks disagree on: runs once per task
            h = h * 2
        return self.head(h)


def test_probe_inside_a_step_checkpoint_leaves_the_dropout_masks_alone():
    """The first task-batched call finds out, inside a step checkpoint, that the model must
    run per task. Its probe must not consume random numbers: the run equals one whose model
    had found out before, and the checkpoint's recomputation reproduces the masks."""
    x, y = torch.randn(3, 4, 3, dtype=DTYPE), torch.randn(3, 4, 1, dtype=DTYPE)
    x[0, 0, 0], x[1, 0, 0] = 1.0, -1.0

    def meta_grads(warm: bool):
        torch.manual_seed(0)
        net = DropoutDataDependent()
        fmodel = fm.functional_model(net)
        if warm:
            fm.apply_tasks(fmodel, fmodel.params, x)
            assert fmodel.per_task is True
        torch.manual_seed(1)
        opt = fm.optim.sgd(lr=0.1)
        result = fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2, checkpoint_steps=True
        )
        assert fmodel.per_task is True
        loss = result.losses.sum()
        return torch.autograd.grad(loss, list(fmodel.params.values()))

    for cold, warm in zip(meta_grads(False), meta_grads(True), strict=True):
        torch.testing.assert_close(cold, warm, rtol=0, atol=0)


# --- step checkpointing with offload ------------------------------------------------------


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1, dtype=DTYPE)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


def test_step_checkpointing_with_offload_recomputes():
    x, y = torch.randn(8, 3, dtype=DTYPE), torch.randn(8, 1, dtype=DTYPE)
    grads = {}
    for options in ({}, {"checkpoint_steps": True, "offload_activations": True}):
        torch.manual_seed(0)
        net = Counter()
        fmodel = fm.functional_model(net)
        result = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=3, **options
        )
        loss = F.mse_loss(fmodel(result.params, x), y)
        before = net.calls
        grads[bool(options)] = torch.autograd.grad(loss, list(fmodel.params.values()))
        recomputed = net.calls - before
        assert recomputed == (3 if options else 0)
    for a, b in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# --- keyword inputs -----------------------------------------------------------------------


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1, dtype=DTYPE)

    def forward(self, *, x, scale):
        return self.lin(x) * scale


def test_keyword_only_forward_everywhere():
    fmodel = fm.functional_model(KeywordOnly())
    x, y = torch.randn(2, 5, 3, dtype=DTYPE), torch.randn(2, 5, 1, dtype=DTYPE)
    scale = torch.tensor([2.0, 3.0], dtype=DTYPE)
    opt = fm.optim.sgd(lr=0.1)
    single = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, ({"x": x[1], "scale": scale[1]}, y[1]), opt, steps=2
    )
    batched = fm.adapt_tasks(
        fmodel, fmodel.params, F.mse_loss, ({"x": x, "scale": scale}, y), opt, steps=2
    )
    for k, v in single.params.items():
        torch.testing.assert_close(batched.params[k][1], v)
    losses, _, _ = fm.task_losses(
        fmodel, batched.params, F.mse_loss, (fm.Args(x=x, scale=scale), y)
    )
    out, _ = fm.apply_tasks(fmodel, batched.params, {"x": x, "scale": scale})
    torch.testing.assert_close(losses[1], F.mse_loss(out[1], y[1]))
    loss = fm.recipes.maml(
        fmodel,
        fmodel.params,
        F.mse_loss,
        ({"x": x, "scale": scale}, y),
        ({"x": x, "scale": scale}, y),
        steps=1,
        lr=0.01,
    ).loss
    loss.backward()
    assert fmodel.module.lin.weight.grad is not None


def test_args_mixes_positional_and_keyword():
    assert fm.inputs.split_inputs(fm.Args(1, mask=2)) == ((1,), {"mask": 2})
    assert fm.inputs.split_inputs((1, 2)) == ((1, 2), {})
    assert fm.inputs.split_inputs({"a": 1}) == ((), {"a": 1})
    assert fm.inputs.split_inputs(fm.Args({"a": 1})) == (({"a": 1},), {})
    with pytest.raises(TypeError, match="string keys"):
        fm.inputs.split_inputs({1: 2})


# --- frozen parameters ---------------------------------------------------------------------


def test_frozen_parameters_are_held_fixed_and_get_no_meta_gradient():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DTYPE)
    net[0].requires_grad_(False)
    fmodel = fm.functional_model(net)
    assert fmodel.frozen == ["0.weight", "0.bias"]
    x, y = torch.randn(6, 3, dtype=DTYPE), torch.randn(6, 1, dtype=DTYPE)
    opt = fm.optim.sgd(lr=0.1)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2)
    assert result.params["0.weight"] is net[0].weight
    # the same as holding them fixed with trainable=
    net[0].requires_grad_(True)
    held = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2, trainable="2")
    net[0].requires_grad_(False)
    torch.testing.assert_close(result.params["2.weight"], held.params["2.weight"])
    F.mse_loss(fmodel(result.params, x), y).backward()
    assert net[0].weight.grad is None and net[2].weight.grad is not None
    batched = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x[None], y[None]), opt, steps=2)
    assert batched.params["0.weight"] is net[0].weight
    net.requires_grad_(False)
    with pytest.raises(ValueError, match=r"frozen parameters .*requires_grad=False"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=1)


# --- errors, raised before any computation -------------------------------------------------


@pytest.fixture
def linear():
    fmodel = fm.functional_model(nn.Linear(3, 1))
    return fmodel, (torch.randn(5, 3), torch.randn(5, 1)), fm.optim.sgd(lr=0.1)


def test_error_params_as_a_list(linear):
    fmodel, batch, opt = linear
    with pytest.raises(TypeError, match=r"params must be a dict .* got list"):
        fm.adapt(fmodel, list(fmodel.params.values()), F.mse_loss, batch, opt, steps=1)


def test_error_checkpoint_true():
    with pytest.raises(TypeError, match=r"checkpoint_layers must be None, a preset name.*got True"):
        fm.functional_model(nn.Linear(3, 1), checkpoint_layers=True)
    with pytest.raises(TypeError, match="got 3"):
        fm.functional_model(nn.Linear(3, 1), checkpoint_layers=3)


def test_error_float64_data_for_float32_model(linear):
    fmodel, (x, y), opt = linear
    with pytest.raises(TypeError, match=r"dtype torch.float32: inputs\[0\] is torch.float64"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x.double(), y.double()), opt, steps=1)
    with pytest.raises(TypeError, match=r"inputs\['x'\] is torch.float64"):
        fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, ({"x": x.double()[None]}, y[None]), opt, steps=1
        )
    with pytest.raises(TypeError, match=r"torch\.float64"):
        fm.apply_tasks(fmodel, fmodel.params, x.double()[None])
    with pytest.raises(TypeError, match=r"inputs\[0\] is torch.bfloat16"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x.bfloat16(), y), opt, steps=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts for itself
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x.bfloat16(), y), opt, steps=1)


def test_error_meta_device():
    fmodel = fm.functional_model(nn.Linear(3, 1, device="meta"))
    batch = (torch.randn(5, 3), torch.randn(5, 1))
    with pytest.raises(ValueError, match=r"\['weight', 'bias'\] are on the meta device"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, batch, fm.optim.sgd(lr=0.1), steps=1)


def test_error_empty_batch_and_zero_tasks(linear):
    fmodel, (x, y), opt = linear
    with pytest.raises(ValueError, match=r"batch tensors .*'inputs\[0\]': \(0, 3\).* are empty"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x[:0], y[:0]), opt, steps=1)
    with pytest.raises(ValueError, match=r"are empty"):
        fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x[None, :0], y[None, :0]), opt, steps=1)
    with pytest.raises(ValueError, match="zero tasks"):
        fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x[None][:0], y[None][:0]), opt, steps=1)
    with pytest.raises(ValueError, match="zero tasks"):
        fm.task_losses(fmodel, fmodel.params, F.mse_loss, (x[None][:0], y[None][:0]))


def test_error_torch_optim_as_opt(linear):
    fmodel, batch, _ = linear
    opt = torch.optim.SGD(fmodel.module.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"torch.optim.SGD.*fm.optim.sgd"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, batch, opt, steps=1)
    with pytest.raises(TypeError, match="GradientTransformation"):
        fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, (batch[0][None], batch[1][None]), "sgd", steps=1
        )


def test_error_module_instead_of_functional_model(linear):
    fmodel, batch, opt = linear
    module = fmodel.module
    with pytest.raises(TypeError, match=r"got Linear; wrap it first: fmodel = fm.functional_model"):
        fm.adapt(module, dict(module.named_parameters()), F.mse_loss, batch, opt, steps=1)
    with pytest.raises(TypeError, match="FunctionalModel"):
        fm.apply_tasks(module, dict(module.named_parameters()), batch[0][None])
    with pytest.raises(TypeError, match="FunctionalModel"):
        fm.recipes.maml(module, dict(module.named_parameters()), F.mse_loss, batch, batch, steps=1)
