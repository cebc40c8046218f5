"""Task batching where vmap refuses or loops (funcmeta._src.batching.intercept): Python values of
batched tensors that every task agrees on, fused attention with the task axis in the batch,
and HuggingFace models batched end to end; each exact against a loop over the tasks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm
import funcmeta._src.batching.intercept as intercept

DTYPE = torch.float64
T = 3


def _grads(fmodel, loss_fn, inputs, y, batched, *, first_order=False, steps=2):
    """Meta-gradients of the query loss (the support set again) after ``steps`` SGD steps,
    task-batched or by a loop of fm.adapt."""
    opt = fm.optim.sgd(lr=0.3)
    params = list(fmodel.params.values())
    if batched:
        r = fm.adapt_tasks(
            fmodel, fmodel.params, loss_fn, (inputs, y), opt, steps=steps, first_order=first_order
        )
        loss = fm.task_losses(fmodel, r.params, loss_fn, (inputs, y))[0].sum()
    else:
        loss = 0
        for t in range(T):
            one = fm.tree.tree_map(lambda v, t=t: v[t], inputs)
            r = fm.adapt(
                fmodel,
                fmodel.params,
                loss_fn,
                (one, y[t]),
                opt,
                steps=steps,
                first_order=first_order,
            )
            out = fmodel(r.params, **one) if isinstance(one, dict) else fmodel(r.params, one)
            loss = loss + loss_fn(out, y[t])
    return loss, torch.autograd.grad(loss, params, allow_unused=True)


def _assert_same(a, b, rtol=1e-10, atol=1e-12):
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=0)
    for x, y in zip(grads_a, grads_b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.fixture
def strict_warnings():
    """torch's per-example fallback ("There is a performance drop ...") and funcmeta's
    fallback notes are errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        yield


# --- Python values of batched tensors --------------------------------------------------------


class Branchy(nn.Module):
    """Branches on its data and reads a number from it: what vmap refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1, dtype=DTYPE)

    def forward(self, x):
        out = self.lin(x)
        if bool((x[:, 0] > 100).any()):  # never, in any task
            out = out * 2
        return out + x[:, 1].abs().max().ceil().item() * 0  # every task reads the same item


def test_values_every_task_agrees_on_run_batched_and_exact(strict_warnings):
    x = torch.randn(T, 5, 3, dtype=DTYPE)
    x[:, :, 1] = 0.5  # so that every task's item is 1.0
    y = torch.randn(T, 5, 1, dtype=DTYPE)
    fmodel = fm.functional_model(Branchy())
    batched = _grads(fmodel, F.mse_loss, x, y, True)
    assert fmodel.per_task is False
    _assert_same(batched, _grads(fmodel, F.mse_loss, x, y, False))


@pytest.mark.parametrize("odd", ["branch", "nan"])
def test_values_the_tasks_disagree_on_run_once_per_task(odd):
    x = torch.randn(T, 5, 3, dtype=DTYPE)
    x[:, :, 1] = 0.5
    if odd == "branch":
        x[1, 0, 0] = 1000.0  # task 1 takes the other branch
    else:
        x[2, 0, 1] = float("nan")  # NaN agrees with nothing
    fmodel = fm.functional_model(Branchy())
    with pytest.warns(UserWarning, match="cannot run under vmap .*data-dependent control flow"):
        out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
    assert fmodel.per_task is True
    assert list(fmodel.per_task_layers) == [""]
    for t in range(T):
        torch.testing.assert_close(
            out[t], fmodel(fmodel.params, x[t]), rtol=0, atol=0, equal_nan=True
        )


def test_the_mode_answers_only_what_every_task_agrees_on():
    def f(x):
        return x * 2 if bool(x.sum() > 0) else -x

    agree = torch.ones(3, 2)
    with intercept.TaskMode() as mode:
        torch.testing.assert_close(torch.func.vmap(f)(agree), agree * 2)
    assert mode.used["values"] == 1
    disagree = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    with intercept.TaskMode(), pytest.raises(RuntimeError, match="data-dependent control flow"):
        torch.func.vmap(f)(disagree)


# --- fused attention ---------------------------------------------------------------------------


class Attention(nn.Module):
    """Projections, then F.scaled_dot_product_attention with a mask of the given kind."""

    def __init__(self, mask: str, causal: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, dtype=DTYPE)
        self.out = nn.Linear(8, 1, dtype=DTYPE)
        self.mask, self.causal = mask, causal

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = None
        if self.mask == "bool-4d":
            mask = keep[:, None, None, :]
        elif self.mask == "float-4d":
            mask = torch.where(keep, 0.0, -1e9).to(x.dtype)[:, None, None, :]
        elif self.mask == "bool-2d":
            mask = keep[0][None, :].expand(n, n)  # one (L, S) mask for every sequence
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.out(out.transpose(1, 2).reshape(b, n, 8)).mean(1)


@pytest.mark.parametrize(
    "mask,causal",
    [("none", False), ("none", True), ("bool-4d", False), ("float-4d", False), ("bool-2d", False)],
)
@pytest.mark.parametrize("first_order", [False, True])
def test_attention_runs_with_the_tasks_in_the_batch(mask, causal, first_order, monkeypatch):
    calls = []
    real = intercept._attention
    monkeypatch.setattr(intercept, "_attention", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    fmodel = fm.functional_model(Attention(mask, causal))
    x = torch.randn(T, 4, 6, 8, dtype=DTYPE)
    keep = torch.ones(T, 4, 6, dtype=torch.bool)
    keep[:, :, -2:] = False
    keep[1, 2, 3] = False
    y = torch.randn(T, 4, 1, dtype=DTYPE)
    inputs = {"x": x, "keep": keep}

    def loss_fn(out, target):
        return F.mse_loss(out, target)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no per-example fallback from torch
        batched = _grads(fmodel, loss_fn, inputs, y, True, first_order=first_order)
    assert calls, "attention did not take the merged path"
    assert fmodel.per_task is False
    _assert_same(batched, _grads(fmodel, loss_fn, inputs, y, False, first_order=first_order))


def _count_attention(monkeypatch) -> list[int]:
    """A list that grows by one at each fused attention call the task mode merges."""
    calls: list[int] = []
    real = intercept._attention
    monkeypatch.setattr(
        intercept,
        "_attention",
        lambda *a: calls.append(1) or real(*a),  # type: ignore
    )
    return calls


CAUSAL = torch.triu(torch.full((5, 5), float("-inf"), dtype=DTYPE), 1)


def _mha_masks(mask: str, pad: torch.Tensor) -> dict:
    """The mask keywords of an attention call over 5 positions, by kind (``pad``: True at
    the keys left out, per sequence)."""
    kw: dict = {}
    if mask in ("key-padding", "both"):
        kw["key_padding_mask"] = pad
    if mask in ("float-padding", "causal-padding"):
        kw["key_padding_mask"] = torch.where(pad, -1e4, 0.0).to(DTYPE)
    if mask in ("attn-mask", "both"):
        kw["attn_mask"] = pad[0].unsqueeze(0).expand(5, 5)  # shared by the rows
    if mask == "per-head":  # (N * heads, L, S): each sequence and head its own
        kw["attn_mask"] = pad.repeat_interleave(2, 0).unsqueeze(1).expand(8, 5, 5)
    if mask in ("causal", "causal-padding"):
        kw.update(attn_mask=CAUSAL, is_causal=True)
    return kw


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention(8, 2)`` over ``x`` (sequence-first input passed as a
    transposed view, as models pass it), masked by kind; with ``need_weights``, the weights
    (averaged over the heads or per head) reach the output."""

    def __init__(self, batch_first: bool, mask: str, need_weights: bool, average: bool = True):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, dtype=DTYPE)
        self.batch_first, self.mask = batch_first, mask
        self.need_weights, self.average = need_weights, average

    def forward(self, x, pad):
        if not self.batch_first:
            x = x.transpose(0, 1)
        kw = _mha_masks(self.mask, pad)
        if self.need_weights:
            kw["average_attn_weights"] = self.average
        out, weights = self.mha(x, x, x, need_weights=self.need_weights, **kw)
        out = (out if self.batch_first else out.transpose(0, 1)).mean(1)
        if weights is None:
            return out
        w = weights if self.average else weights.mean(1)
        return out + (w * torch.arange(5, dtype=DTYPE)).sum((1, 2)).unsqueeze(-1)


def _mha_data() -> tuple[dict, torch.Tensor]:
    """Inputs for :class:`SelfAttention` (4 sequences of 5 per task, the last key padding,
    one more in one task) and targets."""
    pad = torch.zeros(T, 4, 5, dtype=torch.bool)
    pad[:, :, -1] = True
    pad[1, 2, 2] = True  # the tasks differ
    x = torch.randn(T, 4, 5, 8, dtype=DTYPE)
    return {"x": x, "pad": pad}, torch.randn(T, 4, 8, dtype=DTYPE)


class Around(nn.Module):
    """A model around an attention layer ``net`` (its ``mha``): ``forward`` is
    ``call(self.mha, ...)`` with the inputs, so that the stand-in takes the layer's place."""

    def __init__(self, net: nn.MultiheadAttention, call) -> None:
        super().__init__()
        self.mha, self.call = net, call

    def forward(self, *inputs, **named):
        return self.call(self.mha, *inputs, **named)


def _pooled(out: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """An attention layer's output pooled over the positions, plus its weights if any (so
    that they reach the loss)."""
    pooled = out.mean(1)
    return pooled if weights is None else pooled + weights.sum((1, 2)).unsqueeze(-1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "mask",
    ["key-padding", "float-padding", "attn-mask", "per-head", "both", "causal", "causal-padding"],
)
@pytest.mark.parametrize("first_order", [False, True])
def test_multihead_attention_layer_on_the_fused_kernel(
    batch_first, mask, first_order, strict_warnings, monkeypatch
):
    """need_weights=False: the attention kernel once for all tasks (the task axis in its
    batch), no per-example fallback, exact against the loop; masks per task and shared,
    bool and float, 2-D and per head, causal; first and second order."""
    torch.manual_seed(1)
    fmodel = fm.functional_model(SelfAttention(batch_first, mask, need_weights=False))
    inputs, y = _mha_data()
    calls = _count_attention(monkeypatch)
    batched = _grads(fmodel, F.mse_loss, inputs, y, True, first_order=first_order)
    assert calls, "the attention did not run on the kernel with the tasks in its batch"
    assert fmodel.per_task is False
    _assert_same(batched, _grads(fmodel, F.mse_loss, inputs, y, False, first_order=first_order))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("mask", ["none", "key-padding", "causal"])
@pytest.mark.parametrize("first_order", [False, True])
def test_multihead_attention_weights_as_the_loop(
    batch_first, average, mask, first_order, strict_warnings
):
    """need_weights=True (the default): the output and the weights, averaged over the heads
    or per head, exact against the loop; the weights reach the loss."""
    torch.manual_seed(7)
    fmodel = fm.functional_model(SelfAttention(batch_first, mask, True, average))
    inputs, y = _mha_data()
    batched = _grads(fmodel, F.mse_loss, inputs, y, True, first_order=first_order)
    assert fmodel.per_task is False
    # atol: the key bias's exact gradient is 0 (a softmax ignores a shift of its scores), and
    # both sides round it to a few 1e-12
    loop = _grads(fmodel, F.mse_loss, inputs, y, False, first_order=first_order)
    _assert_same(batched, loop, atol=1e-11)
    out, _ = fm.apply_tasks(fmodel, fmodel.params, inputs)
    for t in range(T):
        one = fmodel(fmodel.params, inputs["x"][t], inputs["pad"][t])
        torch.testing.assert_close(out[t], one, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("inputs", ["cross", "three", "kdim-vdim"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_other_query_key_value(
    inputs, need_weights, strict_warnings, monkeypatch
):
    """Cross-attention (key is value), three separate tensors, and keys and values of their
    own widths (kdim, vdim: separate projection weights): the layer's two and three input
    projections, on the fused kernel (or with the weights), exact against the loop."""
    torch.manual_seed(4)
    widths = (6, 7) if inputs == "kdim-vdim" else (None, None)
    net = nn.MultiheadAttention(8, 2, batch_first=True, kdim=widths[0], vdim=widths[1], dtype=DTYPE)

    def cross(mha, x, memory):
        key = memory[..., : widths[0] or 8]
        value = {"cross": key, "three": memory.flip(1)}.get(inputs, memory[..., 1:8])
        return _pooled(*mha(x, key, value, need_weights=need_weights))

    fmodel = fm.functional_model(Around(net, cross))
    data = {
        "x": torch.randn(T, 4, 5, 8, dtype=DTYPE),
        "memory": torch.randn(T, 4, 6, 8, dtype=DTYPE),
    }
    y = torch.randn(T, 4, 8, dtype=DTYPE)
    calls = _count_attention(monkeypatch)
    batched = _grads(fmodel, F.mse_loss, data, y, True)
    assert bool(calls) != need_weights and fmodel.per_task is False
    _assert_same(batched, _grads(fmodel, F.mse_loss, data, y, False), atol=1e-11)


@pytest.mark.parametrize("kind", ["bias_kv", "zero_attn", "mixed-masks"])
def test_multihead_attention_steps_aside_exactly(kind, monkeypatch):
    """Layers and calls the fused path does not cover take the layer's batched path (no
    merged kernel call), exact against the loop."""
    torch.manual_seed(5)
    net = nn.MultiheadAttention(
        8,
        2,
        batch_first=True,
        add_bias_kv=kind == "bias_kv",
        add_zero_attn=kind == "zero_attn",
        dtype=DTYPE,
    )

    def attend(mha, x, pad):
        kw = {}
        if kind == "mixed-masks":
            kw = {"key_padding_mask": pad, "attn_mask": torch.zeros(5, 5, dtype=DTYPE)}
        return mha(x, x, x, need_weights=False, **kw)[0].mean(1)

    fmodel = fm.functional_model(Around(net, attend))
    pad = torch.zeros(T, 4, 5, dtype=torch.bool)
    pad[:, :, -1] = True
    data = {"x": torch.randn(T, 4, 5, 8, dtype=DTYPE), "pad": pad}
    y = torch.randn(T, 4, 8, dtype=DTYPE)
    calls = _count_attention(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own note on mixed masks
        batched = _grads(fmodel, F.mse_loss, data, y, True)
        assert not calls and fmodel.per_task is False
        _assert_same(batched, _grads(fmodel, F.mse_loss, data, y, False))


@pytest.mark.parametrize("bad", ["causal-without-mask", "mask-shape", "padding-shape"])
def test_multihead_attention_refuses_as_the_layer_does(bad):
    """A call the layer refuses raises the layer's own error under task batching too."""
    net = nn.MultiheadAttention(8, 2, batch_first=True, dtype=DTYPE)

    def attend(mha, x):
        kw: dict = {"is_causal": True} if bad == "causal-without-mask" else {}
        if bad == "mask-shape":
            kw["attn_mask"] = torch.zeros(4, 4, dtype=DTYPE)
        if bad == "padding-shape":
            kw["key_padding_mask"] = torch.zeros(4, 3, dtype=torch.bool)
        return mha(x, x, x, need_weights=False, **kw)[0]

    fmodel = fm.functional_model(Around(net, attend))
    x = torch.randn(T, 4, 5, 8, dtype=DTYPE)
    with pytest.raises((RuntimeError, AssertionError)) as plain:
        fmodel(fmodel.params, x[0])
    with pytest.raises(type(plain.value)) as batched:
        fm.apply_tasks(fmodel, fmodel.params, x)
    assert str(plain.value).split(".")[0] in str(batched.value)


def test_transformer_encoder_layer_without_fallback(strict_warnings, monkeypatch):
    """nn.TransformerEncoderLayer calls its attention with need_weights=False: the stand-in
    runs it on the fused kernel for all tasks instead of vmap's per-example fallback, exact
    to rounding."""
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=DTYPE)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer
            self.head = nn.Linear(8, 2, dtype=DTYPE)

        def forward(self, x, pad):
            return self.head(self.layer(x, src_key_padding_mask=pad).mean(1))

    fmodel = fm.functional_model(Encoder())
    assert type(fmodel.executor.runner.layer.self_attn).__name__ == "TaskAttention"
    calls = _count_attention(monkeypatch)
    x = torch.randn(T, 4, 5, 8, dtype=DTYPE)
    pad = torch.zeros(T, 4, 5, dtype=torch.bool)
    pad[:, :, -2:] = True
    y = torch.randint(0, 2, (T, 4))
    inputs = {"x": x, "pad": pad}
    for first_order in (False, True):
        batched = _grads(fmodel, F.cross_entropy, inputs, y, True, first_order=first_order)
        _assert_same(
            batched, _grads(fmodel, F.cross_entropy, inputs, y, False, first_order=first_order)
        )
    assert calls, "the attention did not run on the kernel with the tasks in its batch"


def test_transformer_encoder_decoder_on_the_fused_kernel(strict_warnings, monkeypatch):
    """nn.Transformer (encoder and decoder): self-attention with the source's padding, causal
    self-attention of the target, cross-attention to the memory with its padding; every
    attention on the merged kernel, exact against the loop in first and second order."""
    torch.manual_seed(9)

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True, dtype=DTYPE)
            self.head = nn.Linear(8, 3, dtype=DTYPE)

        def forward(self, src, tgt, pad):
            causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=DTYPE)
            out = self.t(
                src,
                tgt,
                tgt_mask=causal,
                tgt_is_causal=True,
                src_key_padding_mask=pad,
                memory_key_padding_mask=pad,
            )
            return self.head(out)

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))

    pad = torch.zeros(T, 4, 6, dtype=torch.bool)
    pad[:, :, -1] = True
    pad[1, 0, 3] = True
    inputs = {
        "src": torch.randn(T, 4, 6, 8, dtype=DTYPE),
        "tgt": torch.randn(T, 4, 5, 8, dtype=DTYPE),
        "pad": pad,
    }
    y = torch.randint(0, 3, (T, 4, 5))
    fmodel = fm.functional_model(Seq2Seq())
    calls = _count_attention(monkeypatch)
    for first_order in (False, True):
        batched = _grads(fmodel, loss_fn, inputs, y, True, first_order=first_order, steps=1)
        loop = _grads(fmodel, loss_fn, inputs, y, False, first_order=first_order, steps=1)
        _assert_same(batched, loop)
    assert len(calls) >= 3 and fmodel.per_task is False  # three attentions a forward


def test_transformer_encoder_layer_evaluation_with_dropout(strict_warnings, monkeypatch):
    """In evaluation mode a layer's dropout is off: apply_tasks runs the fused kernel for
    all tasks and equals the layer called on each task."""
    torch.manual_seed(6)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True, dtype=DTYPE)
    layer.eval()
    fmodel = fm.functional_model(layer)
    x = torch.randn(T, 4, 5, 8, dtype=DTYPE)
    calls = _count_attention(monkeypatch)
    out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
    assert calls and fmodel.per_task is False
    for t in range(T):
        torch.testing.assert_close(out[t], layer(x[t]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_dropout_per_task_and_recomputed(need_weights, monkeypatch):
    """Train-mode attention dropout on the stand-in's path: each task draws its own masks
    (the same input in every task gives different outputs), the weights returned are those
    after dropout (rows no longer sum to 1), and a checkpoint's recomputation draws the same
    masks (step checkpointing gives the meta-gradients of the run without it)."""
    torch.manual_seed(8)
    net = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, dtype=DTYPE)

    fmodel = fm.functional_model(
        Around(net, lambda mha, x: _pooled(*mha(x, x, x, need_weights=need_weights)))
    )
    x = torch.randn(1, 4, 5, 8, dtype=DTYPE).expand(T, -1, -1, -1)  # one input, every task
    y = torch.randn(T, 4, 8, dtype=DTYPE)
    calls = _count_attention(monkeypatch)
    out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
    assert not torch.allclose(out[0], out[1])  # each task its own masks
    assert fmodel.per_task is False and bool(calls) != need_weights
    if need_weights:
        of_weights = fm.functional_model(Around(net, lambda mha, x: mha(x, x, x)[1]))
        weights, _ = fm.apply_tasks(of_weights, of_weights.params, x)
        assert not torch.allclose(weights.sum(-1), torch.ones((), dtype=DTYPE))

    def meta(**kw):
        torch.manual_seed(3)
        r = fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.3), steps=2, **kw
        )
        return torch.autograd.grad(r.losses.sum(), list(fmodel.params.values()))

    for a, b in zip(meta(), meta(checkpoint_steps=True), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    net.eval()
    still, _ = fm.apply_tasks(fmodel, fmodel.params, x)
    torch.testing.assert_close(still[0], still[1], rtol=1e-12, atol=1e-12)  # no dropout


# --- HuggingFace models ------------------------------------------------------------------------

V, N, L = 40, 4, 7


def _hf(name: str) -> nn.Module:
    tr = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    small = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
    if name == "bert":
        cfg = tr.BertConfig(
            vocab_size=V,
            hidden_size=16,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **small,
        )
        return tr.BertForSequenceClassification(cfg)
    if name == "distilbert":
        cfg = tr.DistilBertConfig(
            vocab_size=V,
            dim=16,
            n_layers=2,
            n_heads=2,
            hidden_dim=24,
            num_labels=3,
            dropout=0.0,
            attention_dropout=0.0,
            seq_classif_dropout=0.0,
        )
        return tr.DistilBertForSequenceClassification(cfg)
    if name == "gpt2":
        cfg = tr.GPT2Config(
            vocab_size=V,
            n_embd=16,
            n_layer=2,
            n_head=2,
            num_labels=3,
            pad_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return tr.GPT2ForSequenceClassification(cfg)
    if name in ("llama", "qwen2"):
        kind = {
            "llama": (tr.LlamaConfig, tr.LlamaForSequenceClassification),
            "qwen2": (tr.Qwen2Config, tr.Qwen2ForSequenceClassification),
        }[name]
        cfg = kind[0](
            vocab_size=V,
            hidden_size=16,
            num_key_value_heads=1,
            num_labels=3,
            pad_token_id=0,
            **small,
        )
        return kind[1](cfg)
    cfg = tr.T5Config(
        vocab_size=V,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return tr.T5ForConditionalGeneration(cfg)


def _hf_batch(name: str, seed: int = 0, unpadded_task: int | None = None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (T, N, L), generator=g)
    mask = torch.ones(T, N, L, dtype=torch.long)
    for t in range(T):
        if t == unpadded_task:
            continue
        for n in range(N):
            k = int(torch.randint(3, L, (), generator=g))
            mask[t, n, k:] = 0
            ids[t, n, k:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name == "t5":
        labels = torch.randint(1, V, (T, N, 3), generator=g)
        return {**inputs, "labels": labels}, labels, lambda out, y: out.loss
    y = torch.randint(0, 3, (T, N), generator=g)
    return inputs, y, lambda out, y: F.cross_entropy(out.logits, y)


HF = ["bert", "distilbert", "gpt2", "llama", "qwen2", "t5"]


@pytest.mark.parametrize("name", HF)
@pytest.mark.parametrize("first_order", [False, True])
def test_huggingface_models_run_batched_and_exact(name, first_order, strict_warnings):
    torch.manual_seed(0)
    fmodel = fm.functional_model(_hf(name).to(DTYPE))
    inputs, y, loss_fn = _hf_batch(name)
    batched = _grads(fmodel, loss_fn, inputs, y, True, first_order=first_order)
    assert fmodel.per_task is False, fmodel.per_task_layers
    _assert_same(batched, _grads(fmodel, loss_fn, inputs, y, False, first_order=first_order))


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_huggingface_outputs_under_apply_tasks(name, strict_warnings):
    torch.manual_seed(0)
    net = _hf(name).to(DTYPE).eval()
    fmodel = fm.functional_model(net)
    inputs, _, _ = _hf_batch(name)
    out, _ = fm.apply_tasks(fmodel, fmodel.params, inputs)
    for t in range(T):
        ref = net(**{k: v[t] for k, v in inputs.items()})
        torch.testing.assert_close(out.logits[t], ref.logits, rtol=1e-12, atol=1e-12)


def test_a_task_without_padding_runs_the_model_once_per_task():
    """HuggingFace drops the mask when a task has no padding: the tasks disagree on that
    question, so the model runs once per task, says so, and stays exact."""
    torch.manual_seed(0)
    fmodel = fm.functional_model(_hf("bert").to(DTYPE))
    inputs, y, loss_fn = _hf_batch("bert", unpadded_task=1)
    with pytest.warns(UserWarning, match="once per task"):
        batched = _grads(fmodel, loss_fn, inputs, y, True)
    assert fmodel.per_task is True
    assert "data-dependent control flow" in "".join(fmodel.per_task_layers.values())
    _assert_same(batched, _grads(fmodel, loss_fn, inputs, y, False))


@pytest.mark.parametrize("checkpoint", [None, "leaves"])
def test_hidden_states_of_later_plain_calls_are_unchanged(checkpoint):
    """HuggingFace installs its output-capturing hooks lazily, on the first call that asks
    for hidden states, and marks the model. A call through funcmeta's shadow tree must mark
    the user's model, or the next plain call hooks every layer twice."""
    torch.manual_seed(0)
    net = _hf("bert").to(DTYPE).eval()
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint)
    inputs, _, _ = _hf_batch("bert")
    one = {k: v[0] for k, v in inputs.items()}
    out, _ = fm.apply_tasks(fmodel, fmodel.params, {**inputs, "output_hidden_states": True})
    plain = net(**one, output_hidden_states=True)
    assert len(plain.hidden_states) == len(out.hidden_states) == 3
    for a, b in zip(out.hidden_states, plain.hidden_states, strict=True):
        torch.testing.assert_close(a[0], b, rtol=1e-12, atol=1e-12)
    single = fmodel(fmodel.params, **one, output_hidden_states=True)
    assert len(single.hidden_states) == 3


def test_attention_dropout_runs_batched_and_recomputes_its_masks():
    """Train-mode attention dropout: the merged call draws every task's masks at once, and a
    checkpoint's recomputation draws the same ones (the generator is restored): step and
    layer checkpointing give the meta-gradients of the run without them."""
    tr = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    cfg = tr.BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.3,
    )
    inputs, y, loss_fn = _hf_batch("bert")

    def run(**kw):
        torch.manual_seed(0)
        net = tr.BertForSequenceClassification(cfg).to(DTYPE)
        fmodel = fm.functional_model(net, checkpoint_layers=kw.pop("layers", None))
        torch.manual_seed(1)
        opt = fm.optim.sgd(lr=0.3)
        r = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, (inputs, y), opt, steps=2, **kw)
        assert fmodel.per_task is False, fmodel.per_task_layers
        return torch.autograd.grad(r.losses.sum(), list(fmodel.params.values()), allow_unused=True)

    plain = run()
    for other in (run(checkpoint_steps=True), run(layers="sequential")):
        for a, b in zip(plain, other, strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_what_a_forward_sets_on_its_module_reaches_the_module_but_no_batched_tensor():
    """The task runner's shallow copies write back what a run sets on them (flags, counters),
    but not tensors: those are batched, and would leak out of vmap into the user's module."""

    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1, dtype=DTYPE)

        def forward(self, x):
            out = self.lin(x)
            self.last = out
            self.calls = getattr(self, "calls", 0) + 1
            return out

    net = Keeps()
    fmodel = fm.functional_model(net)
    fm.apply_tasks(fmodel, fmodel.params, torch.randn(T, 4, 3, dtype=DTYPE))
    assert net.calls == 2  # the probe and the run: written back
    assert not hasattr(net, "last")


# --- index_select with each task's own indices ----------------------------------------------


class Permuted(nn.Module):
    """Reorders its rows by each task's own permutation (as pack_padded_sequence sorts a
    batch), then weighs them by position."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=DTYPE)

    def forward(self, x, order):
        weights = torch.arange(1, x.shape[0] + 1, dtype=DTYPE).unsqueeze(1)
        return self.lin(x).index_select(0, order) * weights


def _permuted_data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, 5, 3, generator=g, dtype=DTYPE)
    order = torch.stack([torch.randperm(5, generator=g) for _ in range(T)])
    return {"x": x, "order": order}, torch.randn(T, 5, 2, generator=g, dtype=DTYPE)


def _saved_shapes(fmodel, inputs) -> set[tuple[int, ...]]:
    shapes: set[tuple[int, ...]] = set()

    def pack(t):
        shapes.add(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fm.apply_tasks(fmodel, fmodel.params, inputs)
    return shapes


@pytest.mark.parametrize("first_order", [False, True], ids=["second", "first"])
def test_index_select_with_per_task_indices_equals_the_loop(first_order, strict_warnings):
    torch.manual_seed(0)
    fmodel = fm.functional_model(Permuted())
    inputs, y = _permuted_data()
    reference = _grads(fmodel, F.mse_loss, inputs, y, False, first_order=first_order)
    ours = _grads(fmodel, F.mse_loss, inputs, y, True, first_order=first_order)
    _assert_same(ours, reference)


@pytest.mark.parametrize("ours", [True, False], ids=["index", "vmap-rule"])
def test_index_select_with_per_task_indices_keeps_only_the_indices(ours, monkeypatch):
    """vmap's rule gathers, and the gather's backward saves the whole source for all tasks;
    the advanced index saves the indices only. The control (vmap's rule) keeps it."""
    if not ours:
        monkeypatch.setattr(intercept, "_index_select", lambda *args: None)
    torch.manual_seed(0)
    fmodel = fm.functional_model(Permuted())
    inputs, _ = _permuted_data()
    source = {(T, 5, 2), (5, 2)}  # the linear layer's output, under vmap or not
    assert bool(_saved_shapes(fmodel, inputs) & source) is not ours
