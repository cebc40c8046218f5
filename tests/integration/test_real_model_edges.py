"""Real-model edges where a result could be silently wrong: each checked in float64 against
the per-task loop or a hand-written unroll of ``functional_call`` and ``autograd.grad``.

Embeddings with a padding index under task batching, ``None`` inputs in a task batch, layers
that return constants under per-layer checkpointing, hooks under recomputation, buffers after
adaptation, and key/value caches under per-layer checkpointing.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import funcmeta as fm

D = torch.float64


def _meta(fmodel, support, query, *, tasks, steps=2, lr=0.5, first_order=False, task_chunk="auto"):
    """(adapted params, meta-gradients) of the mean query loss, task-batched (``task_chunk``
    tasks at a time, the query pass on the inner loop's chunk) or single."""
    opt = fm.optim.sgd(lr=lr)
    if tasks:
        r = fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            opt,
            steps=steps,
            first_order=first_order,
            task_chunk=task_chunk,
        )
        if task_chunk != "auto":
            assert r.chunk.chunk == task_chunk
        loss = fm.task_losses(
            fmodel, r.params, F.mse_loss, query, buffers=r.buffers, task_chunk=r.chunk
        )[0].mean()
    else:
        r = fm.adapt(fmodel, fmodel.params, F.mse_loss, support, opt, steps=steps)
        loss = F.mse_loss(fmodel.run(r.params, r.buffers, query[0])[0], query[1])
    params = list(fmodel.params.values())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return r.params, [
        torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)
    ]


def _hand_loop(net, support, query, steps=2, lr=0.5):
    """The per-task loop written out: plain functional_call and autograd.grad."""
    base = dict(net.named_parameters())
    total, adapted = 0.0, []
    for t in range(support[0].shape[0]):
        p = dict(base)
        for _ in range(steps):
            loss = F.mse_loss(functional_call(net, p, (support[0][t],)), support[1][t])
            g = torch.autograd.grad(loss, list(p.values()), create_graph=True)
            p = {k: v - lr * gi for (k, v), gi in zip(p.items(), g, strict=True)}
        adapted.append(p)
        total = total + F.mse_loss(functional_call(net, p, (query[0][t],)), query[1][t])
    grads = torch.autograd.grad(total / support[0].shape[0], list(base.values()))
    stacked = {k: torch.stack([a[k] for a in adapted]) for k in base}
    return stacked, list(grads)


def _token_tasks(vocab, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 4, 6), generator=g)
    ids[:, :, -2:] = pad  # padded positions in every example
    qids = torch.randint(0, vocab, (3, 4, 6), generator=g)
    qids[:, 0, :3] = pad
    y = torch.randn(3, 4, 6, 3, generator=g, dtype=D)
    qy = torch.randn(3, 4, 6, 3, generator=g, dtype=D)
    return (ids, y), (qids, qy)


@pytest.mark.parametrize("chunk", [None, 2, 1])
@pytest.mark.parametrize("freq", [False, True])
def test_embedding_padding_row_stays_fixed_under_task_batching(chunk, freq):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(7, 3, padding_idx=2, scale_grad_by_freq=freq), nn.Tanh()).to(D)
    support, query = _token_tasks(7, 2)
    fmodel = fm.functional_model(net)
    adapted, grads = _meta(fmodel, support, query, tasks=True, task_chunk=chunk)
    want_params, want_grads = _hand_loop(net, support, query)
    # the padding row is never adapted, and the meta-gradients are the loop's
    assert torch.equal(adapted["0.weight"][:, 2], net[0].weight[2].expand(3, 3))
    torch.testing.assert_close(adapted["0.weight"], want_params["0.weight"], rtol=1e-12, atol=0)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)


def test_embedding_padding_row_with_a_shared_embedding_and_a_negative_index():
    """A shared (not adapted) embedding still gets the loop's meta-gradient, padding row
    excluded; a negative padding index means the same row."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Embedding(7, 3, padding_idx=-5), nn.Linear(3, 3)).to(D)
    support, query = _token_tasks(7, 2, seed=3)
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.5)
    r = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, support, opt, steps=2, trainable="1")
    loss = fm.task_losses(fmodel, r.params, F.mse_loss, query)[0].mean()
    got = torch.autograd.grad(loss, list(fmodel.params.values()))
    # the loop: only the head adapts
    base = dict(net.named_parameters())
    total = 0.0
    for t in range(3):
        p = dict(base)
        for _ in range(2):
            loss = F.mse_loss(functional_call(net, p, (support[0][t],)), support[1][t])
            gw, gb = torch.autograd.grad(loss, [p["1.weight"], p["1.bias"]], create_graph=True)
            p = {**p, "1.weight": p["1.weight"] - 0.5 * gw, "1.bias": p["1.bias"] - 0.5 * gb}
        total = total + F.mse_loss(functional_call(net, p, (query[0][t],)), query[1][t])
    want = torch.autograd.grad(total / 3, list(base.values()))
    assert got[0][2].abs().max() == 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)


def test_embedding_bag_first_order_matches_the_loop():
    """EmbeddingBag (torch has no double backward for it) under task batching, first order,
    padding index and frequency scaling included."""
    torch.manual_seed(2)
    net = nn.Sequential(
        nn.EmbeddingBag(7, 3, mode="sum", padding_idx=0, scale_grad_by_freq=True)
    ).to(D)
    ids = torch.tensor([[[1, 2, 0], [0, 0, 3]], [[3, 0, 0], [1, 1, 2]]])
    y = torch.randn(2, 2, 3, dtype=D)
    results = []
    for chunk in (None, 1):
        fmodel = fm.functional_model(net)
        results.append(
            _meta(fmodel, (ids, y), (ids, y), tasks=True, first_order=True, task_chunk=chunk)
        )
    (p0, g0), (p1, g1) = results
    torch.testing.assert_close(p0["0.weight"], p1["0.weight"], rtol=1e-12, atol=0)
    torch.testing.assert_close(g0[0], g1[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"max_norm": 1.0}, "max_norm"), ({"sparse": True}, "sparse=True")],
)
@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
def test_embeddings_that_write_their_weight_or_give_sparse_gradients_are_refused(
    kind, kwargs, named
):
    net = nn.Sequential(nn.Linear(2, 2), kind(7, 3, **kwargs))
    before = net[1].weight.detach().clone()
    with pytest.raises(ValueError, match=named) as info:
        fm.functional_model(net)
    assert "'1'" in str(info.value) and "Build it with" in str(info.value)
    assert torch.equal(net[1].weight, before)


class _OwnLoss(nn.Module):
    """A model that computes its own loss from ``labels=`` (the HuggingFace pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, labels=None, extra=None):
        out = self.lin(x)
        if extra is not None:
            out = out + extra
        return out, (None if labels is None else F.mse_loss(out, labels))


def _own_loss(out, targets):
    assert targets is None
    return out[1]


@pytest.mark.parametrize("chunk", [None, 1])
def test_none_inputs_and_targets_in_a_task_batch(chunk):
    torch.manual_seed(3)
    net = _OwnLoss().to(D)
    fmodel = fm.functional_model(net)
    x, lab = torch.randn(2, 4, 3, dtype=D), torch.randn(2, 4, 2, dtype=D)
    batch = ({"x": x, "labels": lab, "extra": None}, None)
    opt = fm.optim.sgd(lr=0.3)
    r = fm.adapt_tasks(fmodel, fmodel.params, _own_loss, batch, opt, steps=2, task_chunk=chunk)
    assert r.chunk.chunk == chunk
    losses = fm.task_losses(fmodel, r.params, _own_loss, batch, task_chunk=r.chunk).losses
    got = torch.autograd.grad(losses.mean(), list(fmodel.params.values()))
    outs, _ = fm.apply_tasks(
        fmodel, r.params, {"x": x, "labels": lab, "extra": None}, task_chunk=chunk
    )
    torch.testing.assert_close(outs[1], losses)
    base = dict(net.named_parameters())
    total = 0.0
    for t in range(2):
        p = dict(base)
        for _ in range(2):
            loss = functional_call(net, p, (x[t],), {"labels": lab[t]})[1]
            g = torch.autograd.grad(loss, list(p.values()), create_graph=True)
            p = {k: v - 0.3 * gi for (k, v), gi in zip(p.items(), g, strict=True)}
        total = total + functional_call(net, p, (x[t],), {"labels": lab[t]})[1]
    want = torch.autograd.grad(total / 2, list(base.values()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)


class _WithConstant(nn.Module):
    """Returns an output with no gradient history next to the real one (as T5's decoder
    block returns its zero cross-attention position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.tanh(self.lin(x)), torch.zeros(x.shape[0], 2, dtype=x.dtype)


class _UsesConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _WithConstant()
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        h, bias = self.block(x)
        return self.head(h) + bias.sum(-1, keepdim=True)


@pytest.mark.parametrize("first_order", [True, False])
def test_checkpointed_layer_returning_a_constant(first_order):
    torch.manual_seed(4)
    net = _UsesConstant().to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 1, dtype=D)
    grads = []
    for layers in (None, ["block"]):
        fmodel = fm.functional_model(net, checkpoint_layers=layers)
        opt = fm.optim.sgd(lr=0.2)
        r = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2, first_order=first_order
        )
        loss = F.mse_loss(fmodel(r.params, x), y)
        grads.append(torch.autograd.grad(loss, list(fmodel.params.values())))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_hooks_rerun_at_recomputations_and_recomputing_tells_them_apart():
    """docs/models.md: a hook runs at every run of its layer, recomputations included; with
    ``fm.recomputing()`` it acts once per real call."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).to(D)
    every, real = [], []

    def hook(module, inputs, output):
        every.append(output.shape)
        if not fm.recomputing():
            real.append(output.shape)

    net[0].register_forward_hook(hook)
    x, y = torch.randn(5, 2, dtype=D), torch.randn(5, 1, dtype=D)
    for layers, runs in ((None, 3), ("sequential", 8)):
        every.clear(), real.clear()
        fmodel = fm.functional_model(net, checkpoint_layers=layers)
        r = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=2)
        F.mse_loss(fmodel(r.params, x), y).backward()
        # 2 inner steps and the query: 3 real calls; checkpointed: each second-order inner
        # step's layer reruns twice in the outer backward (its inner gradient uses the
        # forward's graph), the query's once
        assert len(real) == 3
        assert len(every) == runs
    assert not fm.recomputing()


def test_buffers_read_by_the_forward_are_exact_only_when_passed():
    """spectral_norm updates its power-iteration vectors (buffers) in every training forward:
    after adaptation, ``fmodel.run(result.params, result.buffers, x)`` is the per-task
    reference; ``fmodel(result.params, x)`` uses the module's own buffers."""
    torch.manual_seed(6)
    net = nn.Sequential(nn.utils.spectral_norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 1))
    net = net.to(D)
    x, y = torch.randn(6, 3, dtype=D), torch.randn(6, 1, dtype=D)
    fmodel = fm.functional_model(net)
    r = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.2), steps=2)
    exact = F.mse_loss(fmodel.run(r.params, r.buffers, x)[0], y)
    # reference: the buffers carried from call to call by hand
    params, buffers = dict(net.named_parameters()), {k: b.clone() for k, b in net.named_buffers()}
    for _ in range(2):
        loss = F.mse_loss(functional_call(net, (params, buffers), (x,)), y)
        g = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {k: v - 0.2 * gi for (k, v), gi in zip(params.items(), g, strict=True)}
    want = F.mse_loss(functional_call(net, (params, buffers), (x,)), y)
    torch.testing.assert_close(exact, want, rtol=1e-13, atol=0)
    stale = F.mse_loss(fmodel(r.params, x), y)
    assert not torch.allclose(stale, want, rtol=1e-12, atol=0)


def _llama(use_cache: bool):
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    config = transformers.LlamaConfig(
        vocab_size=13,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        use_cache=use_cache,
    )
    torch.manual_seed(7)
    return transformers.LlamaModel(config).to(D)


def _hidden_loss(out, y):
    return F.mse_loss(out.last_hidden_state, y)


@pytest.mark.parametrize("tasks", [False, True])
def test_a_key_value_cache_under_per_layer_checkpointing_is_refused(tasks):
    """With ``use_cache=True`` each recomputation appended to the cache again: meta-gradients
    were off by 0.78 with no error. Now the call names ``use_cache``; with the cache off the
    gradients are the unchecked model's."""
    net = _llama(use_cache=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 13, (2, 2, 5), generator=g)
    y = torch.randn(2, 2, 5, 8, generator=g, dtype=D)
    if not tasks:
        ids, y = ids[0], y[0]
    adapt = fm.adapt_tasks if tasks else fm.adapt
    opt = fm.optim.sgd(lr=0.1)
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    with pytest.raises(ValueError, match="use_cache=False") as info:
        adapt(fmodel, fmodel.params, _hidden_loss, ({"input_ids": ids}, y), opt, steps=1)
    message = str(info.value)
    # the keyword the layer was given: past_key_values, named cache from transformers 5.24
    assert "'layers.0'" in message and re.search(r"\((past_key_values|cache)=\w*Cache\)", message)
    grads = []
    for layers in (None, "sequential"):
        fmodel = fm.functional_model(net, checkpoint_layers=layers)
        batch = ({"input_ids": ids, "use_cache": False}, y)
        r = adapt(fmodel, fmodel.params, _hidden_loss, batch, opt, steps=2)
        if tasks:
            loss = fm.task_losses(fmodel, r.params, _hidden_loss, batch)[0].mean()
        else:
            loss = _hidden_loss(fmodel(r.params, input_ids=ids, use_cache=False), y)
        grads.append(torch.autograd.grad(loss, list(fmodel.params.values())))
    # Llama's RMS norm rounds to float32 inside, whatever the input: float32 round-off
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
