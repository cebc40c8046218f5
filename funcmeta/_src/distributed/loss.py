"""A linear head's cross-entropy computed on its shards: the implementation of
``fm.heads.linear_cross_entropy`` for a head that ``fm.distributed.shard_model(...,
compute_on_shards=[...])`` computes on its shards.

Such a head holds a slice of the vocabulary's rows on each rank. Its own forward joins the
ranks' slices of the logits into the whole (tokens x vocabulary) tensor on every rank, and
the cross-entropy's backward makes more of that size (the log-probabilities, the logits'
gradient). Here each rank keeps only its slice (*vocabulary-parallel*, as Megatron-LM's
cross-entropy): per token, with ``z`` the logits, ``t`` the target and ``m`` the largest
logit over the ranks,

    loss = m + log(sum over the ranks of sum_v exp(z_v - m)) - z_t

one all-gather of each rank's largest logit per token, one all-reduce of the sums and one of
the target's logit (found on the rank that holds it). Its gradient for the logits is
``softmax(z) - onehot(t)``, each rank's columns of it.

The loss is one autograd function (:class:`_CrossEntropyOnShards`) whose backward recomputes
the rank's logits from the saved input and shard with differentiable operations, the ranks'
sums through :class:`~funcmeta._src.distributed.parallel._Sum` and
:class:`~funcmeta._src.distributed.parallel._Copy`: the double backward of second-order
meta-gradients is exact, and both run under :meth:`ShardedRuntime.keeping_whole` (what they
save of the rank's own columns differs between the ranks, and must not be split).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.distributed import comm, crossing
from funcmeta._src.distributed.parallel import _NARROW, _Copy, _local_rows, _Sum, _widened

__all__ = ["cross_entropy_on_shards"]


def cross_entropy_on_shards(
    runtime: Any, what: str, head: nn.Linear, hidden: Tensor, targets: Tensor, ignore_index: int
) -> Tensor:
    """Each token's cross-entropy of ``head``'s logits (``hidden``: ``(N, in)``, ``targets``:
    ``(N,)``, both the same on every rank) on the head's shards; 0 where the target is
    ``ignore_index``. Every target must be a row of the head or ``ignore_index`` (the
    caller checks)."""
    weight, bias = cast(Any, head.weight), cast(Any, head.bias)
    start, _, _ = _local_rows(runtime, weight, what)
    local = crossing.local(weight)
    local_bias = None if bias is None else crossing.local(bias)
    with runtime.keeping_whole():
        return _CrossEntropyOnShards.apply(
            runtime, hidden, local, local_bias, targets, start, ignore_index, what
        )


def _largest(runtime: Any, logits: Tensor, what: str) -> Tensor:
    """Each row's largest logit over every rank's columns (a constant shift: the loss and
    its derivatives do not depend on it)."""
    rows = logits.shape[0]
    mine = logits.max(-1).values if logits.shape[-1] else logits.new_full((rows,), float("-inf"))
    every = comm.all_gather(mine.contiguous(), runtime.group, runtime.timeout, what)
    return every.max(0).values


def _target_columns(
    targets: Tensor, start: int, count: int, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Which rows' targets fall in this rank's ``count`` columns from ``start`` (and are not
    ignored), and each row's column there (0 for the others)."""
    inside = (targets >= start) & (targets < start + count) & (targets != ignore_index)
    return inside, torch.where(inside, targets - start, 0).clamp(max=max(count - 1, 0))


class _CrossEntropyOnShards(torch.autograd.Function):
    """Per-token cross-entropy of ``F.linear(hidden, local, bias)`` over the ranks' columns
    together (see the module's docstring). In bfloat16 and float16 the logits and sums are
    computed in float32, as a split layer's products are."""

    @staticmethod
    def forward(
        ctx: Any,
        runtime: Any,
        hidden: Tensor,
        local: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        start: int,
        ignore_index: int,
        what: str,
    ) -> Tensor:
        wide = hidden.dtype in _NARROW and local.dtype == hidden.dtype
        logits = F.linear(*_widened(wide, hidden, local, bias))
        shift = _largest(runtime, logits, f"the largest logit of {what} across the mesh")
        exps = torch.exp(logits - shift[:, None])
        total = comm.all_reduce(
            exps.sum(-1), runtime.group, runtime.timeout, f"the softmax sums of {what}"
        )
        del exps
        count = logits.shape[-1]
        inside, column = _target_columns(targets, start, count, ignore_index)
        picked = (
            logits.gather(-1, column[:, None])[:, 0] if count else logits.new_zeros(len(targets))
        )
        target = comm.all_reduce(
            torch.where(inside, picked, 0.0),
            runtime.group,
            runtime.timeout,
            f"the target logits of {what}",
        )
        losses = torch.where(targets != ignore_index, shift + total.log() - target, 0.0)
        ctx.save_for_backward(hidden, local, bias, targets)
        ctx.runtime, ctx.start, ctx.ignore, ctx.what, ctx.wide = (
            runtime,
            start,
            ignore_index,
            what,
            wide,
        )
        ctx.shift = shift
        return losses.to(local.dtype) if wide else losses

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        runtime, what, wide = ctx.runtime, ctx.what, ctx.wide
        hidden, local, bias, targets = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[1:4]
        with runtime.keeping_whole():
            h, w, b = _widened(wide, hidden, local, bias)
            # replicated tensors used in this rank's columns: their gradients sum the ranks'
            used = _Copy.apply(runtime, h, what)
            g = grad.float() if wide else grad
            if g.requires_grad:
                g = _Copy.apply(runtime, g, f"the loss of {what}")
            logits = F.linear(used, w, b)
            exps = torch.exp(logits - ctx.shift[:, None])
            total = _Sum.apply(runtime, exps.sum(-1), f"the softmax sums of {what}")
            probs = exps / _Copy.apply(runtime, total, what)[:, None]
            count = logits.shape[-1]
            inside, column = _target_columns(targets, ctx.start, count, ctx.ignore)
            onehot = torch.zeros_like(probs, requires_grad=False)
            if count:
                onehot.scatter_(-1, column[:, None], inside[:, None].to(probs.dtype))
            weight = g * (targets != ctx.ignore).to(g.dtype)
            delta = (probs - onehot) * weight[:, None]
            gh = gw = gb = None
            if want_h:
                gh = _Sum.apply(runtime, delta.matmul(w), f"the gradient of the input of {what}")
                gh = gh.to(hidden.dtype)
            if want_w:
                gw = delta.t().matmul(used).to(local.dtype)
            if want_b:
                gb = delta.sum(0).to(bias.dtype)
        return None, gh, gw, gb, None, None, None, None
