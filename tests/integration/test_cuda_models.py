"""The model zoo in float32 on the device's default kernels (on CUDA: flash, memory-efficient
and cuDNN attention, cuDNN RNNs), single-task and task-batched: plain user code gives the
meta-gradients of a hand-written unroll on the same device run on the math attention kernel
without cuDNN. Each runs on the CPU too (CI has no GPU), so CI sees the same code with the
device's tensors; what only cuDNN shows (its LSTM has no double backward) is asserted on CUDA."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICES
from test_models import LR, MODES, STEPS, _call, _fmodel, _options, _stack, reference
from zoo import build

import funcmeta as fm

CUDA_NAMES = ["encoder-train", "decoder-eval", "mha-sdpa", "causal-sdpa", "lstm", "gru", "hf-bert"]


def _to(value: Any, device: str) -> Any:
    """``value``'s tensors on ``device``, floating ones in float32."""
    if isinstance(value, torch.Tensor):
        return value.to(device).float() if value.is_floating_point() else value.to(device)
    if isinstance(value, fm.Args):
        return fm.Args(*_to(value.args, device), **_to(value.kwargs, device))
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def _reference(entry: Any, tasks: list[Any]) -> list[torch.Tensor]:
    with torch.backends.cudnn.flags(enabled=False):
        return reference(entry, tasks)


# One task of sequences (N, L, D) with per-position targets: the shape fm.TaskAxisWarning asks about.
@pytest.mark.filterwarnings("ignore::funcmeta.TaskAxisWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CUDA_NAMES)
def test_zoo_default_kernels(name, mode, batched, device):
    entry = build(name)
    entry.module = entry.module.float().to(device)
    g = torch.Generator().manual_seed(4)
    count = 2 if batched else 1
    tasks = [_to((entry.batch(4, g), entry.batch(4, g)), device) for _ in range(count)]
    want = _reference(entry, tasks)

    fmodel = _fmodel(entry, mode)
    opt = fm.optim.sgd(lr=LR)
    if batched:
        support, query = _stack([s for s, _ in tasks]), _stack([q for _, q in tasks])
        result = fm.adapt_tasks(
            fmodel, fmodel.params, entry.loss, support, opt, steps=STEPS, **_options(mode)
        )
        loss = fm.task_losses(fmodel, result.params, entry.loss, query)[0].mean()
    else:
        (support, query) = tasks[0]
        result = fm.adapt(
            fmodel, fmodel.params, entry.loss, support, opt, steps=STEPS, **_options(mode)
        )
        args, kwargs = _call(query[0])
        loss = entry.loss(fmodel(result.params, *args, **kwargs), query[1])
    got = torch.autograd.grad(loss, list(fmodel.params.values()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_lstm_second_order_without_funcmeta_needs_cudnn_off(device):
    """The premise (on CUDA): cuDNN's LSTM has no double backward; funcmeta turns cuDNN off
    for its second-order steps only, and leaves it on after them."""
    lstm = torch.nn.LSTM(4, 8, batch_first=True).to(device)
    x = torch.randn(2, 5, 4, device=device)
    if device == "cuda":
        out = lstm(x)[0].pow(2).sum()
        grads = torch.autograd.grad(out, list(lstm.parameters()), create_graph=True)
        with pytest.raises(RuntimeError):
            torch.autograd.grad(sum(g.sum() for g in grads), list(lstm.parameters()))
    fmodel = fm.functional_model(lstm)
    result = fm.adapt(
        fmodel,
        fmodel.params,
        lambda o, y: F.mse_loss(o[0], y),
        (x, torch.zeros(2, 5, 8, device=device)),
        fm.optim.sgd(lr=0.1),
        steps=2,
    )
    fmodel(result.params, x)[0].sum().backward()
    assert torch.backends.cudnn.enabled
    assert lstm.weight_ih_l0.grad is not None
