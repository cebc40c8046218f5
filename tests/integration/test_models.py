"""Real models, end to end: exact second-order meta-gradients for the model zoo (tests/zoo.py).

Each model, in float64, with no checkpointing, per-layer checkpointing, step checkpointing and
activation offload, is checked against an independent reference: a hand-written unroll of
``torch.func.functional_call`` and ``torch.autograd.grad(create_graph=True)`` on the math
attention kernel. Single-task ``fm.adapt`` is compared with one such unroll, task-batched
``fm.adapt_tasks`` with a loop of them. The funcmeta side is plain user code: no kernel
context, the outer gradient taken after ``adapt`` returns.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch.func import functional_call as torch_functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from zoo import NAMES, build

import funcmeta as fm

MODES = ["none", "per-layer", "step", "offload"]
LR, STEPS, N, T = 0.1, 2, 4, 2


def _call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The reference's own reading of a batch's inputs."""
    if isinstance(inputs, fm.Args):
        return inputs.args, inputs.kwargs
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (inputs,), {}


def _task(batch: tuple[Any, Any], t: int) -> tuple[Any, Any]:
    """Task ``t`` of a task-batched batch."""
    inputs, y = batch
    args, kwargs = _call(inputs)
    args_t = tuple(a[t] for a in args)
    kwargs_t = {k: v[t] for k, v in kwargs.items()}
    if isinstance(inputs, fm.Args):
        return fm.Args(*args_t, **kwargs_t), y[t]
    return (kwargs_t if isinstance(inputs, Mapping) else args_t[0]), y[t]


def _stack(batches: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """Task-batched inputs from per-task ones."""
    calls = [_call(b[0]) for b in batches]
    args = tuple(torch.stack(parts) for parts in zip(*(c[0] for c in calls), strict=True))
    kwargs = {k: torch.stack([c[1][k] for c in calls]) for k in calls[0][1]}
    y = torch.stack([b[1] for b in batches])
    first = batches[0][0]
    if isinstance(first, fm.Args):
        return fm.Args(*args, **kwargs), y
    return (kwargs if isinstance(first, Mapping) else args[0]), y


def reference(entry: Any, tasks: list[tuple[tuple[Any, Any], tuple[Any, Any]]]) -> list[Any]:
    """Meta-gradients of the mean query loss after STEPS steps of SGD, per task, by hand.

    It runs on a copy of the module: torch 2.5's ``functional_call`` with non-leaf tensors in
    place of tied weights unties them in the module for good (T5's ``lm_head.weight`` becomes
    a parameter of its own), which would change the model under test. (A module with the old
    ``nn.utils.weight_norm`` cannot be copied; it has no tied weights.)"""
    try:
        module = copy.deepcopy(entry.module)
    except RuntimeError:
        module = entry.module
    base = dict(module.named_parameters())
    # every name of a tied weight gets its tensor explicitly (tie_weights=False): torch 2.5's
    # own tie handling misplaces non-leaf tensors
    first: dict[int, str] = {}
    alias = {
        name: first.setdefault(id(t), name)
        for name, t in module.named_parameters(remove_duplicate=False)
    }

    def functional_call(module, tensors, args, kwargs):
        params, buffers = tensors
        every = {name: params[key] for name, key in alias.items()}
        return torch_functional_call(module, (every, buffers), args, kwargs, tie_weights=False)

    with sdpa_kernel(SDPBackend.MATH):
        total = 0.0
        for support, query in tasks:
            params = dict(base)
            buffers = {k: b.clone() for k, b in module.named_buffers()}
            args, kwargs = _call(support[0])
            for _ in range(STEPS):
                out = functional_call(module, (params, buffers), args, kwargs)
                loss = entry.loss(out, support[1])
                grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
                params = {k: v - LR * g for (k, v), g in zip(params.items(), grads, strict=True)}
            qargs, qkwargs = _call(query[0])
            out = functional_call(module, (params, buffers), qargs, qkwargs)
            total = total + entry.loss(out, query[1])
        return list(torch.autograd.grad(total / len(tasks), list(base.values())))


def _options(mode: str) -> dict[str, bool]:
    return {"checkpoint_steps": mode == "step", "offload_activations": mode == "offload"}


def _fmodel(entry: Any, mode: str) -> fm.FunctionalModel:
    return fm.functional_model(
        entry.module, checkpoint_layers=entry.checkpoint if mode == "per-layer" else None
    )


def _close(got: list[Any], want: list[Any], rtol: float = 1e-8) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_single_task_matches_hand_unroll(name, mode):
    entry = build(name)
    g = torch.Generator().manual_seed(1)
    support, query = entry.batch(N, g), entry.batch(N, g)
    want = reference(entry, [(support, query)])

    fmodel = _fmodel(entry, mode)
    opt = fm.optim.sgd(lr=LR)
    result = fm.adapt(
        fmodel, fmodel.params, entry.loss, support, opt, steps=STEPS, **_options(mode)
    )
    args, kwargs = _call(query[0])
    loss = entry.loss(fmodel(result.params, *args, **kwargs), query[1])
    got = torch.autograd.grad(loss, list(fmodel.params.values()))
    _close(got, want, entry.rtol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_task_batched_matches_per_task_loop(name, mode):
    entry = build(name)
    g = torch.Generator().manual_seed(2)
    tasks = [(entry.batch(N, g), entry.batch(N, g)) for _ in range(T)]
    want = reference(entry, tasks)

    fmodel = _fmodel(entry, mode)
    support = _stack([s for s, _ in tasks])
    query = _stack([q for _, q in tasks])
    opt = fm.optim.sgd(lr=LR)
    result = fm.adapt_tasks(
        fmodel, fmodel.params, entry.loss, support, opt, steps=STEPS, **_options(mode)
    )
    losses = fm.task_losses(fmodel, result.params, entry.loss, query).losses
    got = torch.autograd.grad(losses.mean(), list(fmodel.params.values()))
    _close(got, want, entry.rtol)
    assert _task(support, 1)[1].shape == tasks[1][0][1].shape


@pytest.mark.parametrize("name", ["hf-bert", "decoder-eval", "lstm"])
def test_apply_tasks_with_keyword_inputs_matches_loop(name):
    entry = build(name)
    g = torch.Generator().manual_seed(3)
    batches = [entry.batch(N, g) for _ in range(T)]
    inputs, _ = _stack(batches)
    fmodel = fm.functional_model(entry.module)
    per_task = {k: torch.stack([v, v * 0.9]) for k, v in fmodel.params.items()}
    args, kwargs = _call(inputs)
    out, _ = fm.apply_tasks(fmodel, per_task, fm.Args(*args, **kwargs))
    for t in range(T):
        targs, tkwargs = _call(_task((inputs, torch.zeros(T)), t)[0])
        one = fmodel({k: v[t] for k, v in per_task.items()}, *targs, **tkwargs)
        if name == "hf-bert":
            out_t, one = out.last_hidden_state[t], one.last_hidden_state
        else:
            out_t = out[t]
        torch.testing.assert_close(out_t, one, rtol=1e-10, atol=1e-12)
