"""Layers computed on their shards: the implementation of
``fm.distributed.shard_model(..., compute_on_shards=...)``.

A sharded ``nn.Embedding`` holds a slice of the vocabulary's rows on each rank, a sharded
``nn.Linear`` a slice of its output features. Gathered, each is one whole matrix; a language
model's embedding and head are larger than any of its decoder layers. Computed on the shards
instead, no rank ever holds the whole matrix:

- an embedding looks up the ids that fall in this rank's rows (zeros for the others), and
  the ranks sum the rows they found: one all-reduce of the output;
- a linear layer computes this rank's slice of the output features, and the ranks
  concatenate the slices: one all-gather of the output.

Both cost a collective of the output (tokens x features) instead of the weight: less where
the tokens are fewer than the weight's other dimension, as in meta-learning batches.

The four autograd functions below move tensors between the two kinds the ranks hold: a
*replicated* tensor, the same on every rank (the model's activations: every rank computes
the same data), and a *per-rank* one (a shard's share: an embedding's partial rows, a linear
layer's output slice). Each one's backward is the transpose of its forward, computed by the
other of its pair, so that the double backward of second-order meta-gradients is exact too:

- :class:`_Sum` (per-rank partial sums to their replicated sum: an all-reduce) and
  :class:`_Copy` (a replicated tensor used per rank: the identity, whose gradient sums the
  ranks' uses: an all-reduce);
- :class:`_Join` (per-rank slices of the last axis to the replicated whole: an all-gather)
  and :class:`_Slice` (a replicated tensor's slice for this rank: no communication).

The linear layer is one autograd function of them (:class:`_LinearOnShards`), whose forward
and backward keep whole what they save (``ShardedRuntime.keeping_whole``): a shard, or a
rank's slice of a gradient, differs between the ranks, where the replicated activations
around the layer keep only each rank's slice.

Example (one process; under ``torchrun`` every rank runs the same code):
    >>> import tempfile, torch, torch.distributed as dist
    >>> import funcmeta as fm
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    >>> net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    >>> net = fm.distributed.shard_model(net, init_device_mesh("cpu", (1,)), compute_on_shards=["0", "1"])
    >>> tuple(net(torch.tensor([[1, 2, 3]])).shape)
    (1, 3, 10)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import difflib
import functools
import math
import types
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.core.sharding import ShardingError, is_sharded
from funcmeta._src.distributed import comm, crossing

__all__ = ["choose_on_shards", "install_on_shards", "on_shards"]


# ------------------------------------------------------------------ replicated and per-rank


class _Sum(torch.autograd.Function):
    """Per-rank partial sums to their sum, the same on every rank (an all-reduce); the
    gradient of each rank's part is the replicated gradient itself (:class:`_Copy`)."""

    @staticmethod
    def forward(ctx: Any, runtime: Any, part: Tensor, what: str) -> Tensor:
        ctx.runtime, ctx.what = runtime, what
        total = part.contiguous().clone()
        return comm.all_reduce(total, runtime.group, runtime.timeout, what)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        return None, _Copy.apply(ctx.runtime, grad, ctx.what), None


class _Copy(torch.autograd.Function):
    """A replicated tensor used by each rank on its shard: the identity, whose gradient sums
    the ranks' parts (:class:`_Sum`)."""

    @staticmethod
    def forward(ctx: Any, runtime: Any, x: Tensor, what: str) -> Tensor:
        ctx.runtime, ctx.what = runtime, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        return None, _Sum.apply(ctx.runtime, grad, f"the gradient of the input of {ctx.what}"), None


def _sizes(total: int, ranks: int) -> list[int]:
    """Each rank's share of ``total`` along a ``Shard`` axis (``torch.chunk``'s split, as
    ``DTensor`` places it; the last ranks may hold fewer, or none)."""
    chunk = -(-total // ranks) if total else 0
    return [max(0, min(chunk, total - r * chunk)) for r in range(ranks)]


def _join(runtime: Any, piece: Tensor, sizes: list[int], what: str) -> Tensor:
    """The ranks' slices of the last axis (this rank's is ``piece``), concatenated in rank
    order: one all-gather of slices padded to the largest."""
    most = max(sizes)
    lead = piece.movedim(-1, 0)
    if lead.shape[0] < most:
        lead = torch.cat([lead, lead.new_zeros((most - lead.shape[0], *lead.shape[1:]))])
    lead = lead.contiguous()
    out = lead.new_empty((len(sizes) * most, *lead.shape[1:]))
    comm.all_gather_into(out, lead, runtime.group, runtime.timeout, what)
    if any(n != most for n in sizes):
        out = torch.cat([out[r * most : r * most + n] for r, n in enumerate(sizes)])
    return out.movedim(0, -1).contiguous()


class _Join(torch.autograd.Function):
    """Per-rank slices of the last axis to the whole, the same on every rank (an
    all-gather); the gradient of each rank's slice is its slice of the replicated gradient
    (:class:`_Slice`)."""

    @staticmethod
    def forward(ctx: Any, runtime: Any, piece: Tensor, sizes: list[int], what: str) -> Tensor:
        ctx.runtime, ctx.sizes, ctx.what = runtime, sizes, what
        return _join(runtime, piece, sizes, what)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        return None, _Slice.apply(ctx.runtime, grad, ctx.sizes, ctx.what), None, None


class _Slice(torch.autograd.Function):
    """This rank's slice of the last axis of a replicated tensor (no communication); the
    gradient of the replicated tensor concatenates the ranks' slices' (:class:`_Join`)."""

    @staticmethod
    def forward(ctx: Any, runtime: Any, whole: Tensor, sizes: list[int], what: str) -> Tensor:
        ctx.runtime, ctx.sizes, ctx.what = runtime, sizes, what
        me = comm.rank(runtime.group)
        start = sum(sizes[:me])
        return whole.narrow(-1, start, sizes[me]).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        what = f"the gradient of {ctx.what}"
        return None, _Join.apply(ctx.runtime, grad, ctx.sizes, what), None, None


# ------------------------------------------------------------------ the layers


def _local_rows(runtime: Any, weight: Any, what: str) -> tuple[int, int, list[int]]:
    """Where this rank's shard of ``weight`` (sharded along its first axis) begins, how many
    rows it holds, and every rank's count."""
    sizes = _sizes(int(weight.shape[0]), runtime.ranks)
    me = comm.rank(runtime.group)
    held = int(weight.to_local().shape[0])
    if held != sizes[me]:  # pragma: no cover - a placement torch changed
        raise ShardingError(
            f"{what}: rank {me} holds {held} of {weight.shape[0]} rows where torch.chunk's "
            f"split gives it {sizes[me]}; leave it out of compute_on_shards"
        )
    return sum(sizes[:me]), sizes[me], sizes


def _embedding(runtime: Any, what: str, layer: nn.Embedding, ids: Tensor) -> Tensor:
    """``layer(ids)`` on this rank's rows of the vocabulary, the ranks' rows summed."""
    weight = cast(Any, layer.weight)
    if not is_sharded(weight):  # whole (gather_params): the layer's own forward
        return nn.Embedding.forward(layer, ids)
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{what} takes integer ids, got {ids.dtype}")
    low, high = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
    # unsharded, torch's lookup raises; masked, nothing would
    if ids.numel() and (low < 0 or high >= weight.shape[0]):
        raise IndexError(
            f"{what}: id {low if low < 0 else high} is out of range for an embedding of "
            f"{weight.shape[0]} rows"
        )
    start, count, _ = _local_rows(runtime, weight, what)
    local = crossing.local(weight)
    inside = (ids >= start) & (ids < start + count)
    pad = layer.padding_idx
    mine = pad - start if pad is not None and start <= pad < start + count else None
    if count:
        rows = F.embedding(torch.where(inside, ids - start, 0), local, mine)
        rows = torch.where(inside.unsqueeze(-1), rows, rows.new_zeros(()))
    else:  # no rows here: zeros, tied to the (empty) shard for its (empty) gradient
        rows = local.sum() * 0 + local.new_zeros((*ids.shape, weight.shape[1]))
    return _Sum.apply(runtime, rows, f"summing the rows of {what} across the mesh")


#: Dtypes whose products a split layer computes in float32: each rank's partial sum of the
#: input's gradient would otherwise round before the ranks add them.
_NARROW = (torch.bfloat16, torch.float16)


def _linear(runtime: Any, what: str, layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)``: this rank's slice of the output features, the ranks' slices joined."""
    weight, bias = cast(Any, layer.weight), cast(Any, layer.bias)
    if not is_sharded(weight):  # whole (gather_params): the layer's own forward
        return nn.Linear.forward(layer, x)
    _, _, sizes = _local_rows(runtime, weight, what)
    local = crossing.local(weight)
    local_bias = None if bias is None else crossing.local(bias)
    # what autograd saves of this rank's part (its shard, the slice of the gradient that
    # reaches it) differs between the ranks: kept whole, where the replicated activations
    # around it keep only a slice (ShardedRuntime.splitting)
    with runtime.keeping_whole():
        return _LinearOnShards.apply(runtime, x, local, local_bias, sizes, what)


class _LinearOnShards(torch.autograd.Function):
    """``F.linear`` of a replicated input on this rank's slice of the output features, the
    ranks' slices joined (:class:`_Join`); its backward takes this rank's slice of the
    replicated gradient (:class:`_Slice`), the input's gradient summed across the ranks
    (:class:`_Sum`). The backward is made of differentiable operations (its double backward
    is exact), run under :meth:`ShardedRuntime.keeping_whole`: what a second-order graph
    saves of them is this rank's own, never split. In bfloat16 and float16 the products are
    computed in float32: each rank's partial sum of the input's gradient would otherwise
    round before the ranks add them."""

    @staticmethod
    def forward(
        ctx: Any,
        runtime: Any,
        x: Tensor,
        local: Tensor,
        bias: Tensor | None,
        sizes: list[int],
        what: str,
    ) -> Tensor:
        wide = x.dtype in _NARROW and local.dtype == x.dtype
        ctx.runtime, ctx.sizes, ctx.what, ctx.wide = runtime, sizes, what, wide
        ctx.dtype = x.dtype
        # the input is read by the weight's gradient only: a frozen layer keeps none of it
        # (its gradient for the input, and that gradient's own derivative, read the shard)
        ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, local, bias)
        piece = F.linear(*_widened(wide, x, local, bias))
        out = _join(runtime, piece, sizes, f"joining the outputs of {what} across the mesh")
        return out.to(local.dtype) if wide else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        runtime = ctx.runtime
        x, local, bias = ctx.saved_tensors
        wide = ctx.wide
        want_x, want_w, want_b = ctx.needs_input_grad[1:4]
        with runtime.keeping_whole():
            wide_x, wide_w = _widened(wide, x, local)
            g = _Slice.apply(runtime, grad.float() if wide else grad, ctx.sizes, ctx.what)
            gx = gw = gb = None
            if want_x:
                what = f"the gradient of the input of {ctx.what}"
                gx = _Sum.apply(runtime, g.matmul(wide_w), what).to(ctx.dtype)
            if want_w:  # the input, replicated, used by each rank (its gradient summed)
                used = _Copy.apply(runtime, wide_x, ctx.what)
                gw = _rows(g).t().matmul(_rows(used)).to(local.dtype)
            if want_b:
                gb = _rows(g).sum(0).to(bias.dtype)
        return None, gx, gw, gb, None, None


def _rows(t: Tensor) -> Tensor:
    """``t`` as a matrix of its last axis (rows of every leading index; one for a vector)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _widened(wide: bool, *tensors: Tensor | None) -> list[Any]:
    """``tensors`` in float32 where ``wide`` (a product in bfloat16 or float16)."""
    return [t.float() if wide and t is not None else t for t in tensors]


def _check_embedding(layer: nn.Embedding, name: str) -> None:
    for option, why in (
        ("max_norm", "renormalizes the rows it looks up in place"),
        ("scale_grad_by_freq", "scales its gradient by counts over the whole vocabulary"),
        ("sparse", "gives a sparse gradient"),
    ):
        if getattr(layer, option):
            raise ShardingError(
                f"compute_on_shards: {name!r} is an nn.Embedding with {option}=, which "
                f"{why}: it cannot run on its shards; leave it out (it is gathered whole)"
            )


_KINDS: dict[type, Any] = {nn.Embedding: _embedding, nn.Linear: _linear}


def choose_on_shards(module: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    """The layers of ``module`` named in ``names``, checked: each an ``nn.Embedding`` or an
    ``nn.Linear`` with their own forward. Raises :class:`ShardingError` for a name that is
    no layer, a layer of another kind (or a subclass with a forward of its own), and an
    embedding whose options need the whole vocabulary."""
    if isinstance(names, str) or not isinstance(names, Sequence | set | frozenset):
        raise TypeError(
            "compute_on_shards takes a list of layer names (e.g. ['model.embed_tokens', "
            f"'lm_head']), got {type(names).__name__}"
            + (f" {names!r}: put it in a list" if isinstance(names, str) else "")
        )
    layers = dict(module.named_modules())
    chosen: dict[str, nn.Module] = {}
    for name in names:
        layer = layers.get(name) if isinstance(name, str) else None
        if layer is None:
            near = difflib.get_close_matches(str(name), [n for n in layers if n], n=3)
            raise ShardingError(
                f"compute_on_shards: {name!r} is not a layer of the module"
                + (f" (did you mean {near}?)" if near else "")
            )
        base: Any = next((k for k in _KINDS if isinstance(layer, k)), None)
        if base is None or type(layer).forward is not base.forward:
            raise ShardingError(
                f"compute_on_shards: {name!r} is a {type(layer).__name__}; only an "
                "nn.Embedding (its rows split) and an nn.Linear (its output features split), "
                "with their own forward, compute on their shards. Name the nn.Linear inside "
                "it (a LoRA layer's base_layer), or leave it out (it is gathered whole)"
            )
        if isinstance(layer, nn.Embedding):
            _check_embedding(layer, name)
        chosen[name] = layer
    return chosen


def install_on_shards(chosen: dict[str, nn.Module], runtime: Any) -> None:
    """Make each layer of ``chosen`` (:func:`choose_on_shards`) compute on its shards, with
    the collectives of ``runtime``, once its parameters are sharded."""
    for name, layer in chosen.items():
        kind = next(k for k in _KINDS if isinstance(layer, k))
        what = f"{type(layer).__name__} {name!r}"
        step = functools.partial(_KINDS[kind], runtime, what)
        layer.forward = types.MethodType(step, layer)


def on_shards(layer: nn.Module) -> tuple[Any, str] | None:
    """The runtime and name of ``layer`` where :func:`install_on_shards` made it compute on
    its shards (read from its forward), else None."""
    forward = layer.__dict__.get("forward")
    step = getattr(forward, "__func__", None)
    if isinstance(step, functools.partial) and step.func in _KINDS.values():
        runtime, what = step.args
        return runtime, what
    return None
