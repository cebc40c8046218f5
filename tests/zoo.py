"""The model zoo of the real-model tests: small versions of what researchers meta-train.

Each entry builds, in float64, a module, a batch for ``n`` examples (the inputs as
:func:`funcmeta.adapt` takes them: a tensor, a tuple, a dict of keywords or ``fm.Args``), a
loss ``(output, targets) -> scalar`` and the layers to checkpoint. Dropout is 0 so that every
path is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import funcmeta as fm

D = 8  # model width
L = 5  # sequence length


@dataclass
class Entry:
    module: nn.Module
    batch: Callable[[int, torch.Generator], tuple[Any, Any]]
    loss: Callable[[Any, Any], Tensor]
    checkpoint: Any
    # relative tolerance of the float64 comparisons: 1e-8, or looser for a model that rounds
    # to float32 inside (T5's RMS norm computes its variance in float32 whatever the input)
    rtol: float = 1e-8


def _normal(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _seq_batch(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    return _normal(g, n, L, D), _normal(g, n, L, D)


def _mse_first(out: Any, y: Tensor) -> Tensor:
    return F.mse_loss(out[0] if isinstance(out, tuple) else out, y)


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` as self-attention; ``need_weights`` picks its path (False:
    ``F.scaled_dot_product_attention``; True: the explicit softmax)."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, dropout=0.0)
        self.norm = nn.LayerNorm(D)
        self.need_weights = need_weights

    def forward(self, x: Tensor) -> Tensor:
        out = self.attn(x, x, x, need_weights=self.need_weights)[0]
        return self.norm(x + out)


class CausalAttention(nn.Module):
    """A hand-written causal attention layer on ``F.scaled_dot_product_attention``."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        n, length, _ = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, D // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(out.transpose(1, 2).reshape(n, length, D))


class RecurrentHead(nn.Module):
    """An RNN over the sequence and a linear head on its last output."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class TiedLM(nn.Module):
    """Embedding and output head sharing one weight."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _tokens_batch(vocab: int) -> Callable[[int, torch.Generator], tuple[Any, Any]]:
    def batch(n: int, g: torch.Generator) -> tuple[Any, Any]:
        ids = torch.randint(0, vocab, (n, L), generator=g)
        return ids, torch.randint(0, vocab, (n, L), generator=g)

    return batch


def _token_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _image_batch(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    return _normal(g, n, 1, 6, 6), torch.randint(0, 3, (n,), generator=g)


def _vector_batch(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    return _normal(g, n, 4), _normal(g, n, 1)


def _decoder_batch(n: int, g: torch.Generator) -> tuple[Any, Any]:
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    tgt, memory = _normal(g, n, L, D), _normal(g, n, L + 1, D)
    # the mask is a keyword input; under task batching every input carries the task axis
    return fm.Args(tgt, memory, tgt_mask=mask), _normal(g, n, L, D)


def _hf_batch(vocab: int) -> Callable[[int, torch.Generator], tuple[Any, Any]]:
    def batch(n: int, g: torch.Generator) -> tuple[Any, Any]:
        ids = torch.randint(0, vocab, (n, L), generator=g)
        mask = torch.ones(n, L, dtype=torch.long)
        mask[:, -2:] = 0  # padded positions
        return {"input_ids": ids, "attention_mask": mask}, _normal(g, n, L, D)

    return batch


def _hf_loss(out: Any, y: Tensor) -> Tensor:
    return F.mse_loss(out.last_hidden_state, y)


def _encoder(train: bool) -> Entry:
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    return Entry(layer.train(train), _seq_batch, F.mse_loss, ["self_attn", "linear1", "norm2"])


def _decoder(train: bool) -> Entry:
    layer = nn.TransformerDecoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    return Entry(
        layer.train(train), _decoder_batch, F.mse_loss, ["self_attn", "multihead_attn", "linear2"]
    )


def _hooked() -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    net[2].register_forward_hook(lambda m, i, o: o * 3 + 1)
    net[4].register_forward_pre_hook(lambda m, args: (args[0] * 0.5 - 0.25,))
    return net


def _bert() -> nn.Module:
    pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=13,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertModel(config, add_pooling_layer=False)


def _gpt2() -> nn.Module:
    pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        vocab_size=13,
        n_embd=D,
        n_layer=2,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        # A KV cache is state the forward appends to: a recomputed (checkpointed) block would
        # append again. Training does not use it (HuggingFace turns it off for checkpointing).
        use_cache=False,
    )
    return GPT2Model(config)


def _t5() -> nn.Module:
    pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=13,
        d_model=D,
        d_kv=4,
        d_ff=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,  # see _gpt2
    )
    return T5ForConditionalGeneration(config)


def _t5_batch(n: int, g: torch.Generator) -> tuple[Any, Any]:
    """An encoder-decoder batch with both masks and ``labels=``: the model computes its own
    loss (the targets are the labels again, for the tests' per-task slicing)."""
    ids = torch.randint(1, 13, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[:, -1:] = 0
    decoder_ids = torch.randint(1, 13, (n, L - 1), generator=g)
    decoder_mask = torch.ones(n, L - 1, dtype=torch.long)
    decoder_mask[:, -1:] = 0
    labels = torch.randint(1, 13, (n, L - 1), generator=g)
    inputs = {
        "input_ids": ids,
        "attention_mask": mask,
        "decoder_input_ids": decoder_ids,
        "decoder_attention_mask": decoder_mask,
        "labels": labels,
    }
    return inputs, labels


def _own_loss(out: Any, _labels: Tensor) -> Tensor:
    return out.loss


def _entry(name: str) -> Entry:
    if name == "encoder-train":
        return _encoder(True)
    if name == "encoder-eval":
        return _encoder(False)
    if name == "decoder-train":
        return _decoder(True)
    if name == "decoder-eval":
        return _decoder(False)
    if name in ("mha-sdpa", "mha-weights"):
        return Entry(SelfAttention(name == "mha-weights"), _seq_batch, F.mse_loss, ["attn"])
    if name == "causal-sdpa":
        net = nn.Sequential(CausalAttention(), nn.LayerNorm(D), CausalAttention())
        return Entry(net, _seq_batch, F.mse_loss, "sequential")
    if name == "lstm":
        net = RecurrentHead(nn.LSTM(D, 6, batch_first=True))
        return Entry(net, lambda n, g: (_normal(g, n, L, D), _normal(g, n, 1)), F.mse_loss, ["rnn"])
    if name == "gru":
        net = RecurrentHead(nn.GRU(D, 6, num_layers=2, batch_first=True))
        return Entry(net, lambda n, g: (_normal(g, n, L, D), _normal(g, n, 1)), F.mse_loss, ["rnn"])
    if name == "conv-batchnorm":
        net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 36, 3),
        )
        return Entry(net, _image_batch, F.cross_entropy, "sequential")
    if name == "groupnorm":
        net = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 3)
        )
        return Entry(net, _image_batch, F.cross_entropy, "sequential")
    if name == "tied":
        return Entry(TiedLM(), _tokens_batch(11), _token_loss, ["mix", "head"])
    if name == "parametrized":
        P = nn.utils.parametrizations
        net = nn.Sequential(
            P.weight_norm(nn.Linear(4, 8)),
            nn.Tanh(),
            P.orthogonal(nn.Linear(8, 8)),
            nn.Tanh(),
            nn.Linear(8, 1),
        )
        return Entry(net, _vector_batch, F.mse_loss, "sequential")
    if name == "old-weight-norm":
        net = nn.Sequential(
            nn.utils.weight_norm(nn.Linear(4, 8)), nn.Tanh(), nn.utils.weight_norm(nn.Linear(8, 1))
        )
        return Entry(net, _vector_batch, F.mse_loss, "sequential")
    if name == "hooks":
        return Entry(_hooked(), _vector_batch, F.mse_loss, "sequential")
    if name == "hf-bert":
        return Entry(_bert(), _hf_batch(13), _hf_loss, "sequential")
    if name == "hf-gpt2":
        return Entry(_gpt2(), _hf_batch(13), _hf_loss, "sequential")
    if name == "hf-t5":
        # per-layer checkpointing of each block: the decoder's first block returns a position
        # bias with no gradient history (a constant)
        return Entry(_t5(), _t5_batch, _own_loss, "sequential", rtol=1e-5)
    raise KeyError(name)


NAMES = [
    "encoder-train",
    "encoder-eval",
    "decoder-train",
    "decoder-eval",
    "mha-sdpa",
    "mha-weights",
    "causal-sdpa",
    "lstm",
    "gru",
    "conv-batchnorm",
    "groupnorm",
    "tied",
    "parametrized",
    "old-weight-norm",
    "hooks",
    "hf-bert",
    "hf-gpt2",
    "hf-t5",
]


def build(name: str, seed: int = 0) -> Entry:
    """The zoo entry ``name``, its parameters drawn in float64 from ``seed``."""
    torch.manual_seed(seed)
    with _float64():
        return _entry(name)


class _float64:
    def __enter__(self) -> None:
        self.before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.before)


class SequenceNet(nn.Module):
    """Token ids -> a real sequence model -> mean over positions -> head (``ways=None``: the
    embedding alone)."""

    def __init__(self, kind: str, ways: int | None) -> None:
        super().__init__()
        self.kind = kind
        if kind == "hf":
            transformers = pytest.importorskip(
                "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
            )
            config = transformers.BertConfig(
                vocab_size=30,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=16,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
            self.body = transformers.BertModel(config, add_pooling_layer=False)
        else:
            self.embed = nn.Embedding(30, 16)
            self.body = (
                nn.LSTM(16, 16, batch_first=True)
                if kind == "lstm"
                else nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            )
        self.head = nn.Linear(16, ways) if ways else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "hf":
            h = self.body(input_ids=ids).last_hidden_state
        elif self.kind == "lstm":
            h = self.body(self.embed(ids))[0]
        else:
            h = self.body(self.embed(ids))
        h = h.mean(1)
        return h if self.head is None else self.head(h)
