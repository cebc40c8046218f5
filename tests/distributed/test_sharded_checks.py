"""A sharded model cannot be silently wrong: every way of computing a loss on it, with data
that differs between the ranks that split its parameters, raises ShardingError on every
rank (fm.adapt, a direct call of the functional model or of the module, fm.task_losses,
fm.apply_tasks, the recipes; inputs, targets or random draws that differ); the same data
passes; a functional model built before shard_model is refused at its next use; and a LoRA
adapter with norms inside, on a frozen sharded base, with uneven task shares through
gather_params, gives one process's float64 meta-gradients on 2 and 3 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import NEEDS_SHARDED, spawn_gloo, tiny_llama
from torch import nn

import funcmeta as fm

pytestmark = [NEEDS_SHARDED, pytest.mark.xdist_group("sharded")]


def _net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Dropout(dropout), nn.Linear(6, 2)).double()


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _data():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(8, n, generator=g, dtype=torch.float64) for n in (3, 2, 3, 2))


def _mine(t: torch.Tensor) -> torch.Tensor:
    """``t`` made different on each rank."""
    return t + dist.get_rank()


def _adapted(fmodel, xs, ys):
    return fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=2)


def _llama(world: int):
    """A transformers Llama from a config (2 blocks, float64), sharded; its functional model
    (its output a ModelOutput) and a batch of token ids, the same on every rank."""
    model = tiny_llama(2)
    net = fm.distributed.shard_model(model, _mesh(world))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    return net, fm.functional_model(net), tokens


def _next_token(out, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _ways(world: int) -> dict:
    """Each way of computing a loss, with data that differs between ranks (or the same, for
    the cases named "same"): the ShardingError's message, or None."""
    xs, ys, xq, yq = _data()
    tasks = lambda t: t.expand(2, -1, -1)  # noqa: E731 - two tasks of one batch

    def fresh(dropout: float = 0.0):
        net = fm.distributed.shard_model(_net(dropout), _mesh(world))
        return net, fm.functional_model(net, checkpoint_layers="sequential")

    def adapt_support():
        _, fmodel = fresh()
        _adapted(fmodel, _mine(xs), ys)

    def direct_inputs():
        _, fmodel = fresh()
        result = _adapted(fmodel, xs, ys)
        F.mse_loss(fmodel(result.params, _mine(xq)), yq).backward()

    def direct_targets():
        _, fmodel = fresh()
        result = _adapted(fmodel, xs, ys)
        F.mse_loss(fmodel(result.params, xq), _mine(yq)).backward()

    def direct_extra_term():
        _, fmodel = fresh()
        result = _adapted(fmodel, xs, ys)
        out = fmodel(result.params, xq)
        (F.mse_loss(out, yq) + dist.get_rank() * out.pow(2).mean()).backward()

    def module_inputs():
        net, _ = fresh()
        F.mse_loss(net(_mine(xq)), yq).backward()

    def module_targets():
        net, _ = fresh()
        F.mse_loss(net(xq), _mine(yq)).backward()

    def run_targets():
        _, fmodel = fresh()
        out, _ = fmodel.run(fmodel.params, fmodel.buffers, xq)
        F.mse_loss(out, _mine(yq)).backward()

    def task_losses_query():
        _, fmodel = fresh()
        result = fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, (tasks(xs), tasks(ys)), fm.optim.sgd(lr=0.1), steps=1
        )
        batch = (tasks(xq), tasks(_mine(yq)))
        fm.task_losses(fmodel, result.params, F.mse_loss, batch).losses.mean().backward()

    def apply_tasks_targets():
        _, fmodel = fresh()
        out, _ = fm.apply_tasks(fmodel, fmodel.params, tasks(xq))
        F.mse_loss(out, tasks(_mine(yq))).backward()

    def maml_query():
        _, fmodel = fresh()
        support, query = (tasks(xs), tasks(ys)), (tasks(_mine(xq)), tasks(yq))
        fm.recipes.maml(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=0.1
        ).loss.backward()

    def metasgd_support():
        net, fmodel = fresh()
        rates = fm.distributed.shard_hyper(fm.recipes.metasgd_rates(fmodel.params), net)
        support, query = (tasks(_mine(xs)), tasks(ys)), (tasks(xq), tasks(yq))
        fm.recipes.metasgd(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=rates
        ).loss.backward()

    def part_targets():
        net, _ = fresh()
        head = fm.functional_model(net[3])  # a part of the sharded model, made functional
        hidden = torch.tanh(xq @ torch.ones(3, 6, dtype=torch.float64))
        F.mse_loss(head(head.params, hidden), _mine(yq)).backward()

    def llama_targets():
        _, llama, tokens = _llama(world)
        out = llama(llama.params, input_ids=tokens)
        F.cross_entropy(out.logits.flatten(0, 1), _mine(tokens).flatten() % 32).backward()

    def llama_same():
        _, llama, tokens = _llama(world)
        result = fm.adapt(
            llama, llama.params, _next_token, (tokens, tokens), fm.optim.sgd(lr=0.1), steps=1
        )
        _next_token(llama(result.params, input_ids=tokens), tokens).backward()

    def dropout_draws():
        torch.manual_seed(100 + dist.get_rank())  # each rank draws its own masks
        _, fmodel = fresh(dropout=0.5)
        torch.manual_seed(100 + dist.get_rank())
        _adapted(fmodel, xs, ys)

    def same_everywhere():
        net, fmodel = fresh()
        result = _adapted(fmodel, xs, ys)
        F.mse_loss(fmodel(result.params, xq), yq).backward()
        F.mse_loss(net(xq), yq).backward()
        out, _ = fm.apply_tasks(fmodel, fmodel.params, tasks(xq))
        F.mse_loss(out, tasks(yq)).backward()
        support, query = (tasks(xs), tasks(ys)), (tasks(xq), tasks(yq))
        fm.recipes.maml(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=0.1
        ).loss.backward()

    def same_without_grad():
        net, fmodel = fresh()
        with torch.no_grad():  # no gradient, nothing to get wrong: no check
            net(_mine(xq))
            fmodel(fmodel.params, _mine(xq))

    said: dict = {}
    for name, way in {
        "fm.adapt, support": adapt_support,
        "direct call, query inputs": direct_inputs,
        "direct call, query targets": direct_targets,
        "direct call, a term of the loss": direct_extra_term,
        "the module's call, inputs": module_inputs,
        "the module's call, targets": module_targets,
        "fmodel.run, targets": run_targets,
        "fm.task_losses, query": task_losses_query,
        "fm.apply_tasks, targets": apply_tasks_targets,
        "fm.recipes.maml, query": maml_query,
        "fm.recipes.metasgd, support": metasgd_support,
        "a part made functional, targets": part_targets,
        "a Llama's direct call, targets": llama_targets,
        "random draws in the inner loop": dropout_draws,
        "same": same_everywhere,
        "same, a Llama": llama_same,
        "same, no grad": same_without_grad,
    }.items():
        try:
            way()
            said[name] = None
        except fm.distributed.ShardingError as error:
            said[name] = str(error)
    return said


def _before(world: int) -> dict:
    """A functional model built before shard_model: each use is refused by name."""
    xs, ys, xq, yq = _data()
    net = _net()
    fmodel = fm.functional_model(net)
    params = fmodel.params  # taken before: whole tensors the shards no longer are
    fm.distributed.shard_model(net, _mesh(world))
    said: dict = {}
    for name, use in {
        "fmodel.params": lambda: fmodel.params,
        "fm.adapt": lambda: _adapted(fmodel, xs, ys),
        "a call": lambda: fmodel(params, xq),
        "fm.task_losses": lambda: fm.task_losses(fmodel, params, F.mse_loss, (xq[None], yq[None])),
    }.items():
        try:
            use()
            said[name] = None
        except fm.distributed.ShardingError as error:
            said[name] = str(error)
    # built after: fine, and its meta-gradients reach the shards
    after = fm.functional_model(net)
    F.mse_loss(after(_adapted(after, xs, ys).params, xq), yq).backward()
    said["built after: shards with .grad"] = sum(p.grad is not None for p in net.parameters())
    return said


class _Adapted(nn.Module):
    """A frozen base with a trainable low-rank adapter, LayerNorm and RMSNorm inside."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(3, 8).requires_grad_(False)
        self.down = nn.Linear(3, 2, bias=False)
        self.up = nn.Linear(2, 8, bias=False)
        self.layer_norm = nn.LayerNorm(8)
        self.rms_norm = nn.RMSNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer_norm(self.base(x) + self.up(self.down(x)))
        return self.head(torch.tanh(self.rms_norm(h)))


def _uneven_batch():
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randn(5, 6, n, generator=g, dtype=torch.float64) for n in (3, 2, 3, 2))


def _lora_meta(net: nn.Module, batch, count) -> None:
    fmodel = fm.functional_model(net, checkpoint_layers=["layer_norm", "rms_norm"])
    params = fm.distributed.gather_params(fmodel.params, count) if count else fmodel.params
    xs, ys, xq, yq = batch
    fm.recipes.maml(fmodel, params, F.mse_loss, (xs, ys), (xq, yq), steps=2, lr=0.1).loss.backward()


def _lora_uneven(world: int) -> tuple:
    """Each rank its own share of 5 tasks (uneven) through gather_params, against one process
    on all 5: the meta-gradients of the adapter, the norms and the head."""
    torch.manual_seed(3)
    net = fm.distributed.shard_model(_Adapted().double(), _mesh(world))
    share, count = fm.distributed.shard(_uneven_batch())
    _lora_meta(net, share, count)
    sharded = [p.grad.full_tensor() if p.grad is not None else None for p in net.parameters()]
    torch.manual_seed(3)
    whole = _Adapted().double()
    _lora_meta(whole, _uneven_batch(), 0)
    return count, sharded, [p.grad for p in whole.parameters()]


@pytest.mark.parametrize("world", [2, 4])
def test_data_that_differs_between_ranks_raises_on_every_rank_through_every_way(world):
    """Different inputs, targets, loss terms or random draws on the ranks of the shard axis,
    through each way of computing a loss: ShardingError on every rank (none hangs); the same
    data passes, and a call without grad is not checked."""
    every = spawn_gloo(world, _ways)
    assert all(e == every[0] for e in every)  # the same verdicts and messages on every rank
    said = every[0]
    assert said["same"] is None and said["same, no grad"] is None, said
    wrong = {k: v for k, v in said.items() if not k.startswith("same")}
    assert all(v is not None for v in wrong.values()), wrong
    for name in ("fm.adapt, support", "direct call, query inputs", "fm.task_losses, query"):
        assert "hold different batches" in said[name], said[name]
    for name in (
        "direct call, query targets",
        "the module's call, targets",
        "fm.apply_tasks, targets",
    ):
        assert "gradient reaching a sharded model's outputs differs" in said[name], said[name]
    assert "an inner step's loss differs" in said["random draws in the inner loop"]


def test_a_functional_model_built_before_sharding_is_refused_at_its_next_use():
    said = spawn_gloo(2, _before)[0]
    for name in ("fmodel.params", "fm.adapt", "a call", "fm.task_losses"):
        assert said[name] is not None, name
        assert "was sharded (fm.distributed.shard_model) after fm.functional_model" in said[name]
    assert said["built after: shards with .grad"] == 4  # every shard of the two layers


@pytest.mark.parametrize("world", [2, 3])
def test_lora_with_norms_and_uneven_shares_gives_one_process_meta_gradients(world):
    """5 tasks over 2 ranks (3, 2) and 3 ranks (2, 2, 1), float64: each rank's gathered
    meta-gradient, reduced into the shards, equals one process's on all 5 tasks."""
    results = spawn_gloo(world, _lora_uneven)
    assert sorted(r[0] for r in results) == ([2, 3] if world == 2 else [1, 2, 2])
    for _, sharded, whole in results:
        for s, w in zip(sharded, whole, strict=True):
            if w is None:  # the frozen base
                assert s is None
                continue
            torch.testing.assert_close(s, w, rtol=0, atol=1e-12)


def test_the_batch_checksum_is_exact_in_chunks_and_sees_one_changed_bit():
    """The checksum of a tensor larger than one chunk equals the one-shot sum of its bit
    patterns weighted by position; one changed element, a swapped pair or another NaN
    payload changes it."""
    from funcmeta._src.distributed import runtime

    x = torch.randn(runtime._DIGEST_CHUNK * 2 + 7, generator=torch.Generator().manual_seed(0))
    bits = x.view(torch.int32).to(torch.int64)
    reference = (bits * (torch.arange(bits.numel()) % 1021 + 1)).sum()
    assert int(runtime.digest(x)) == int(reference)
    changed = x.clone()
    changed[runtime._DIGEST_CHUNK + 3] = torch.nextafter(
        changed[runtime._DIGEST_CHUNK + 3], x.new_tensor(9.0)
    )
    swapped = x.clone()
    swapped[[0, 1]] = x[[1, 0]]
    nans = torch.full((4,), float("nan"))
    other_nan = nans.clone().view(torch.int32)
    other_nan[2] += 1  # another NaN payload: the same value to ==, other bits
    digests = {int(runtime.digest(t)) for t in (x, changed, swapped)}
    assert len(digests) == 3
    assert int(runtime.digest(nans)) == int(runtime.digest(nans.clone()))
    assert int(runtime.digest(nans)) != int(runtime.digest(other_nan.view(torch.float32)))
