"""``nn.MultiheadAttention`` under task batching: on the fused attention kernel, the tasks in
its batch.

Called with ``need_weights=False`` (as ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` call it), the layer ends in ``F.scaled_dot_product_attention``
inside ``F.multi_head_attention_forward``. There the task mode
(``funcmeta._src.batching.intercept.TaskMode``) does not see the call: torch pops a
``TorchFunctionMode`` while the function that reached it runs
(``docs/decisions/task-mode-and-attention.md``),
so vmap would run the fused kernel once per example. :class:`TaskAttention` computes the
layer itself instead, as ``F.multi_head_attention_forward`` does: the packed input
projection, the masks made additive and merged, ``F.scaled_dot_product_attention`` (which the
task mode runs for all tasks at once, the task axis in the batch, on the kernel the context
allows: fused in first-order steps, query passes and evaluation, math in second-order
steps), the output projection. A per-task loop of the layer runs the same kernel on the same
numbers. Called with ``need_weights=True`` (the layer's default), it computes the layer's
explicit path the same way: the scaled scores plus the mask, their softmax (the weights,
returned per head or averaged over the heads), the weighted values.

Both run the projections on the tokens in the layout they come in. The layer itself
transposes a ``batch_first`` input first, and a model that passes sequence-first input
usually passes a transposed view: on such tokens vmap's rule for ``F.linear`` with per-task
weights made one small matrix product per task and position, and its backward one weight
gradient per position, summed (2x the loop's time for an attention classifier).

Covered: ``batch_first`` either way; ``key_padding_mask`` and ``attn_mask`` (2-D or 3-D),
bool or of the query's dtype; ``is_causal``; self-attention and separate key and value
tensors, of the layer's width or of its ``kdim``/``vdim``; dropout (in training mode each
task draws its own masks, as vmap's ``"different"`` randomness does; a checkpoint's
recomputation draws the same ones). Other calls (hooks, ``bias_k``/``bias_v``,
``add_zero_attn``, unbatched input, a bool mask beside a float one) run the layer as it is
under vmap (``need_weights=True`` for them all, the weights dropped where they were not
asked for): the same attention up to rounding, on batched matrix products.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> class Encoder(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    ...     def forward(self, x):
    ...         return self.layer(x).mean(1)
    >>> fmodel = fm.functional_model(Encoder())
    >>> x, y = torch.randn(3, 4, 5, 8), torch.randn(3, 4, 8)     # 3 tasks
    >>> r = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1)
    >>> fmodel.per_task
    False
"""

from __future__ import annotations

import math
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from funcmeta._src.core.fence import has_hooks, qkv_same_embed_dim
from funcmeta._src.core.vmap import any_batched
from funcmeta._src.module.shadow import Standin

__all__ = ["TaskAttention"]


class TaskAttention(Standin):
    """Stands in for ``nn.MultiheadAttention`` under task batching: a call with
    ``need_weights=False`` on the fused attention kernel with the tasks in its batch, with
    ``need_weights=True`` on the layer's explicit path, computed on the tokens in their own
    layout; calls it does not cover, as the layer computes them (see the module docstring)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        m = cast(torch.nn.MultiheadAttention, self.original)
        call = dict(
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        if has_hooks(m) or not any_batched(query, key, value, *self.parameters()):
            return m(query, key, value, **call)
        given = _Call(query, key, value, key_padding_mask, attn_mask, is_causal)
        if _covered(m, given):
            weights = "mean" if average_attn_weights else "heads"
            return _attention(m, given, weights if need_weights else None)
        if need_weights:
            return m(query, key, value, **call)
        call.update(need_weights=True, average_attn_weights=False)
        return m(query, key, value, **call)[0], None


class _Call(NamedTuple):
    """The tensors and flags of a call of the layer that :func:`_attention` computes."""

    query: Tensor
    key: Tensor
    value: Tensor
    key_padding_mask: Tensor | None
    attn_mask: Tensor | None
    is_causal: bool


def _covered(m: torch.nn.MultiheadAttention, call: _Call) -> bool:
    """Whether :func:`_attention` computes this call as the layer does (a call the layer
    refuses is left to it, for its own error)."""
    query, key, value, key_padding_mask, attn_mask, is_causal = call
    if is_causal and attn_mask is None:
        return False
    if m.bias_k is not None or m.add_zero_attn:
        return False
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        return False
    tgt, src, bsz = _sizes(m, call)
    if query.shape[-1] != m.embed_dim or key.shape[:-1] != value.shape[:-1]:
        return False
    if key.shape[-1] != m.kdim or value.shape[-1] != m.vdim:
        return False
    if qkv_same_embed_dim(m) and key.shape != value.shape:
        return False
    masks = [mask for mask in (key_padding_mask, attn_mask) if mask is not None]
    if any(mask.dtype not in (torch.bool, query.dtype) for mask in masks):
        return False
    if len({mask.dtype for mask in masks}) > 1:
        return False  # one bool, one float: the layer's own checks and warning
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (bsz, src):
        return False
    shapes = ((tgt, src), (bsz * m.num_heads, tgt, src))
    return attn_mask is None or tuple(attn_mask.shape) in shapes


def _sizes(m: torch.nn.MultiheadAttention, call: _Call) -> tuple[int, int, int]:
    """The query's and the key's lengths and the batch size of a call (3-D inputs)."""
    axis = 1 if m.batch_first else 0  # the sequence axis of query, key and value
    return call.query.shape[axis], call.key.shape[axis], call.query.shape[1 - axis]


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A mask as the layer uses it: bool (True: not attended) as ``-inf`` and ``0``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _attention(
    m: torch.nn.MultiheadAttention, call: _Call, weights: str | None
) -> tuple[Tensor, Tensor | None]:
    """``m(query, key, value, ...)`` for one task (vmap batches it), computed as
    ``F.multi_head_attention_forward`` computes it: with ``weights`` None
    (``need_weights=False``) by ``F.scaled_dot_product_attention``, called here, where the
    task mode sees it; else by the explicit softmax, returning the weights per head
    (``"heads"``) or their mean over the heads (``"mean"``). The projections run on the
    tokens in the layout they come in (the layer transposes a ``batch_first`` input first:
    under vmap, a matrix product over the transposed tokens of every task became one small
    product per task and position, much slower)."""
    query, key, value, key_padding_mask, attn_mask, is_causal = call
    (tgt, src, bsz), width, heads = _sizes(m, call), query.shape[-1], m.num_heads
    padding = _additive(key_padding_mask, query.dtype)
    if is_causal and padding is None and weights is None:
        attn_mask = None  # the layer lets the kernel apply the causal mask itself
    else:
        attn_mask = _additive(attn_mask, query.dtype)
        is_causal = False
    q, k, v = _in_projection(m, query, key, value)
    mask = None
    if attn_mask is not None:  # (L, S) -> (1, 1, L, S); (N * heads, L, S) -> (N, heads, L, S)
        mask = attn_mask.reshape(bsz if attn_mask.dim() == 3 else 1, -1, tgt, src)
    if padding is not None:  # (N, 1, 1, S), added to the attention mask
        padding = padding.reshape(bsz, 1, 1, src)
        mask = padding if mask is None else mask + padding

    def by_heads(x: Tensor) -> Tensor:  # (N, heads, length, width / heads)
        x = x.unflatten(-1, (heads, width // heads))
        return x.permute(0, 2, 1, 3) if m.batch_first else x.permute(1, 2, 0, 3)

    q, k, v = by_heads(q), by_heads(k), by_heads(v)
    attention, dropout = None, m.dropout if m.training else 0.0
    if weights is None:  # dropout: the task mode draws each task's masks (vmap's "different")
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    else:  # the layer's need_weights=True path: scaled query, scores plus mask, softmax
        scores = torch.matmul(q * math.sqrt(1.0 / q.shape[-1]), k.transpose(-2, -1))
        attention = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        if dropout > 0:  # the weights returned are those after dropout, as the layer's
            attention = F.dropout(attention, p=dropout)
        out = torch.matmul(attention, v)
        if weights == "mean":
            attention = attention.mean(dim=1)
    out = out.permute(0, 2, 1, 3) if m.batch_first else out.permute(2, 0, 1, 3)
    return F.linear(out.flatten(-2), m.out_proj.weight, m.out_proj.bias), attention


def _in_projection(
    m: torch.nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The input projection as ``F.multi_head_attention_forward`` makes it: with one packed
    weight, one matrix product for self-attention, two when key and value are one tensor,
    else three; with separate weights (``kdim``/``vdim``), three."""
    width, bias = q.shape[-1], m.in_proj_bias
    # tokens a model transposed (sequence-first input is often a view) made contiguous: vmap
    # runs F.linear on them as one matrix product per task, not one per task and position
    same_q, same_k = q is k, k is v
    q = q.contiguous()
    k = q if same_q else k.contiguous()
    v = k if same_k else v.contiguous()
    bs = (None, None, None) if bias is None else bias.chunk(3)
    if not qkv_same_embed_dim(m):
        return (
            F.linear(q, m.q_proj_weight, bs[0]),
            F.linear(k, m.k_proj_weight, bs[1]),
            F.linear(v, m.v_proj_weight, bs[2]),
        )
    weight = m.in_proj_weight
    if k is v:
        if q is k:
            return F.linear(q, weight, bias).chunk(3, dim=-1)  # type: ignore[return-value]
        w_q, w_kv = weight.split([width, 2 * width])
        b_q, b_kv = (None, None) if bias is None else bias.split([width, 2 * width])
        k, v = F.linear(k, w_kv, b_kv).chunk(2, dim=-1)
        return F.linear(q, w_q, b_q), k, v
    ws = weight.chunk(3)
    return (F.linear(q, ws[0], bs[0]), F.linear(k, ws[1], bs[1]), F.linear(v, ws[2], bs[2]))
