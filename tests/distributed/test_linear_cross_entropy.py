"""fm.heads.linear_cross_entropy: F.cross_entropy of a linear head's logits in one process
(every reduction, ignored targets, the errors), and on a head computed on its shards
(vocabulary-parallel) the unsharded run's adapted parameters and second-order
meta-gradients in float64 on 2 and 4 gloo ranks: a vocabulary that does not split evenly, a
rank with no rows, ignored targets, each reduction, a trainable or frozen head, checkpointed
layers or steps, every replicated activation split across the ranks, bfloat16, inf and NaN; no rank makes a
tokens x vocabulary tensor; a target out of range raises on every rank."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import NEEDS_SHARDED, spawn_gloo
from torch import nn

import funcmeta as fm

pytestmark = NEEDS_SHARDED

IGNORE = -100
#: The layers computed on their shards: no whole-vocabulary weight is ever gathered.
ON_SHARDS = ["embed", "head"]


class _LM(nn.Module):
    """An embedding, a hidden layer and a head over ``vocab`` ids; ``forward`` returns the
    next-token loss (per position for ``reduction="none"``)."""

    def __init__(self, vocab: int, reduction: str = "mean", bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vocab, self.reduction = vocab, reduction
        self.embed = nn.Embedding(vocab, 5)
        self.hidden = nn.Linear(5, 5)
        self.head = nn.Linear(5, vocab, bias=bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(ids[..., :-1])))
        targets = ids[..., 1:].clone()
        targets[..., 0] = IGNORE  # the first target of every row counts for nothing
        return fm.heads.linear_cross_entropy(
            h, self.head, targets, ignore_index=IGNORE, reduction=self.reduction
        )


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, shape.numel(), dtype=torch.float64).reshape(shape)


def _loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # "none" gives a loss a position: weighted unevenly, so that each position's gradient counts
    return out if out.dim() == 0 else (out * _weights(out.shape)).sum()


def _ids(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (3, 5), generator=g) for _ in range(2)]


def _meta(
    net: _LM, how: str, frozen: bool, watch: contextlib.AbstractContextManager | None = None
) -> list[torch.Tensor]:
    """fm.adapt (3 steps, second order) and the query loss's backward, under ``watch``: the
    adapted parameters, then the meta-gradients (whole tensors)."""
    if frozen:
        for p in net.head.parameters():
            p.requires_grad_(False)
    layers = ["hidden", "head"] if how == "layers" else None
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    support, query = _ids(net.vocab)
    with watch or contextlib.nullcontext():
        result = fm.adapt(
            fmodel,
            fmodel.params,
            _loss,
            (support, support),
            fm.optim.sgd(lr=0.5),
            steps=3,
            checkpoint_steps=how == "steps",
        )
        _loss(fmodel(result.params, query), query).backward()

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return [whole(t).detach() for t in result.params.values()] + [
        whole(p.grad) for p in net.parameters() if p.requires_grad
    ]


#: (vocabulary, reduction, bias, how, head frozen): 11 rows split 6 + 5 on 2 ranks and
#: 3 + 3 + 3 + 2 on 4; 3 rows leave the fourth rank none.
RUNS = [
    (11, "mean", True, "plain", False),
    (11, "sum", False, "layers", False),
    (11, "none", True, "steps", False),
    (11, "mean", True, "steps", True),
    (3, "mean", True, "plain", False),
]


def _case(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from funcmeta._src.distributed import runtime

    mesh = init_device_mesh("cpu", (world,))
    results: dict = {"whole": set()}

    class _Whole(torch.utils._python_dispatch.TorchDispatchMode):
        """Notes the shape of every tensor made with an axis of the whole vocabulary (a
        DTensor's global shape aside: its own dispatch makes the rank's part)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if type(t) is torch.Tensor and 11 in t.shape:
                    results["whole"].add((str(func), tuple(t.shape)))
            return out

    threshold = runtime._SPLIT_MIN
    runtime._SPLIT_MIN = 1  # every replicated activation split: per-rank ones must not be
    try:
        for vocab, reduction, bias, how, frozen in RUNS:
            net = fm.distributed.shard_model(
                _LM(vocab, reduction, bias).double(), mesh, compute_on_shards=ON_SHARDS
            )
            watch = _Whole() if vocab == 11 else None
            results[(vocab, reduction, bias, how, frozen)] = _meta(net, how, frozen, watch)
    finally:
        runtime._SPLIT_MIN = threshold
    results["bf16"] = _bf16(
        fm.distributed.shard_model(_LM(11).bfloat16(), mesh, compute_on_shards=ON_SHARDS)
    )
    results["non-finite"] = _non_finite(
        fm.distributed.shard_model(_LM(11).double(), mesh, compute_on_shards=ON_SHARDS)
    )
    net = fm.distributed.shard_model(_LM(11).double(), mesh, compute_on_shards=ON_SHARDS)
    for bad in (11, -1):
        try:
            net(torch.tensor([[0, 1, bad]]))
        except IndexError as error:
            results[f"target {bad}"] = str(error)
    return results


def _non_finite(net: _LM) -> list[torch.Tensor]:
    """Each position's loss where one hidden value is inf and another NaN (a direct call)."""
    net.reduction = "none"
    ids = _ids(net.vocab)[0]

    def poison(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[0, 1, 0], out[1, 2, 3] = float("inf"), float("nan")
        return out

    handle = net.hidden.register_forward_hook(poison)
    try:
        return net(ids).detach()
    finally:
        handle.remove()


def _bf16(net: _LM) -> list[torch.Tensor]:
    """A bfloat16 model's loss and its gradients (whole), first order."""
    loss = net(_ids(net.vocab)[0])
    loss.backward()
    grads = [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in net.parameters()
    ]
    return [loss.detach(), *grads]


@pytest.mark.parametrize("world", [2, 4])
def test_on_the_heads_shards_it_gives_the_unsharded_meta_gradients(world):
    results = spawn_gloo(world, _case)
    for vocab, reduction, bias, how, frozen in RUNS:
        key = (vocab, reduction, bias, how, frozen)
        theirs = _meta(_LM(vocab, reduction, bias).double(), how, frozen)
        for ours in results:
            for a, b in zip(ours[key], theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=str(key))
    # inf and NaN hidden values give the plain path's losses, NaN where it has NaN
    plain_losses = _non_finite(_LM(11).double())
    assert plain_losses.isnan().any() and not plain_losses.isnan().all()
    for ours in results:
        torch.testing.assert_close(ours["non-finite"], plain_losses, equal_nan=True)
    # bfloat16: the columns and sums in float32 on the shards, as one process's bf16 run
    # rounds them, within bfloat16's precision
    plain = _bf16(_LM(11).bfloat16())
    for ours in results:
        for a, b in zip(ours["bf16"], plain, strict=True):
            assert a.dtype == b.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    for ours in results:
        # no rank made a tensor of the whole vocabulary: the head's columns only
        assert not ours["whole"], sorted(ours["whole"])
        for bad in (11, -1):
            assert f"target {bad} is out of range for a head of 11 rows" in ours[f"target {bad}"]


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_it_is_cross_entropy_of_the_heads_logits(reduction):
    torch.manual_seed(0)
    head = nn.Linear(4, 9).double()
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 9, (2, 3))
    ids[0, 1] = IGNORE
    ours = fm.heads.linear_cross_entropy(
        hidden, head, ids, ignore_index=IGNORE, reduction=reduction
    )
    theirs = F.cross_entropy(
        head(hidden).flatten(0, 1), ids.flatten(), ignore_index=IGNORE, reduction=reduction
    )
    torch.testing.assert_close(ours, theirs.reshape(ids.shape) if reduction == "none" else theirs)
    assert ours.shape == (ids.shape if reduction == "none" else ())


def test_on_one_rank_the_loss_on_the_heads_shards_is_the_plain_one():
    """On a mesh of one rank the head computes on its shards (the vocabulary-parallel
    function runs, with its collectives) and gives the plain loss."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from funcmeta._src.distributed.parallel import on_shards

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        net = fm.distributed.shard_model(
            _LM(7).double(), init_device_mesh("cpu", (1,)), compute_on_shards=ON_SHARDS
        )
        assert on_shards(net.head) is not None
        assert on_shards(net.hidden) is None
        ids = _ids(7)[0]
        torch.testing.assert_close(net(ids), _LM(7).double()(ids), rtol=1e-14, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("hidden", "head", "targets", "error", "match"),
    [
        (torch.randn(2, 4), nn.Conv1d(4, 9, 1), torch.zeros(2).long(), TypeError, "nn.Linear"),
        (torch.randn(2, 5), nn.Linear(4, 9), torch.zeros(2).long(), ValueError, "in_features"),
        (torch.zeros(2, 4).long(), nn.Linear(4, 9), torch.zeros(2).long(), TypeError, "floating"),
        (torch.randn(2, 4), nn.Linear(4, 9), torch.zeros(2), TypeError, "integer"),
        (torch.randn(2, 4), nn.Linear(4, 9), torch.zeros(3).long(), ValueError, r"shape \(2,\)"),
        (torch.randn(2, 4), nn.Linear(4, 9), torch.zeros(2).bool(), ValueError, "integer ids"),
        (None, nn.Linear(4, 9), torch.zeros(2).long(), TypeError, "got NoneType"),
        (torch.randn(2, 4), nn.Linear(4, 9), None, TypeError, "got NoneType"),
        (torch.randn(2, 4), None, torch.zeros(2).long(), TypeError, "got NoneType"),
    ],
)
def test_bad_input_is_named(hidden, head, targets, error, match):
    with pytest.raises(error, match=match):
        fm.heads.linear_cross_entropy(hidden, head, targets)


def test_an_unknown_reduction_is_named():
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none'"):
        fm.heads.linear_cross_entropy(
            torch.randn(2, 4), nn.Linear(4, 9), torch.zeros(2).long(), reduction="avg"
        )
