"""fm.distributed.shard_model: a model's parameters sharded across gloo processes, gathered a
layer at a time. Second-order meta-gradients land in the shards and equal the unsharded run's
(float64), plain and with per-layer checkpointing, for SGD and Adam inner loops; with
checkpointing a rank holds one layer's full parameters at a time; task-batched calls and the
recipes run a sharded model's tasks one at a time with the same meta-gradients; learnable
rates placed by shard_hyper get theirs; what cannot take a sharded model says so by name."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils.checkpoint
from helpers import NEEDS_SHARDED, init_gloo
from torch import nn

import funcmeta as fm

# one pytest-xdist worker runs this module (make test: --dist loadgroup), so that each rank
# count's bundle of cases (BUNDLES) is spawned once
pytestmark = [NEEDS_SHARDED, pytest.mark.xdist_group("sharded")]

WIDTH = 6  # uneven over 4 ranks on purpose


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, 2),
    ).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(8, n, generator=g, dtype=torch.float64) for n in (3, 2, 3, 2))


def _meta(net: nn.Module, checkpoint_layers, opt_name: str):
    """fm.adapt (3 steps, second order), the query loss's backward: the adapted parameters
    (full) and the meta-gradients (full), in the order of net.named_parameters()."""
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint_layers)
    xs, ys, xq, yq = _data()
    opt = fm.optim.sgd(lr=0.1) if opt_name == "sgd" else fm.optim.adam(lr=0.05)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=3)
    F.mse_loss(fmodel(result.params, xq), yq).backward()

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    adapted = [full(t).detach() for t in result.params.values()]
    grads = [full(p.grad) for p in net.parameters()]
    return adapted, grads


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _worker(rank, world, rendezvous, out, case, args):
    torch.set_num_threads(1)
    init_gloo(rank, rendezvous, world)
    try:
        result = CASES[case](world, *args)
    except Exception:  # reported to the test, which judges it
        result = ("raised", traceback.format_exc())
    # written before the teardown: with a peer gone on purpose, gloo's teardown can abort the
    # process ("terminate called without an active exception") after the case has ended
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    try:
        # no rank tears its process group down while a peer's last collective is in flight
        # (gloo aborted the process with "terminate called without an active exception")
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    except RuntimeError:  # a peer that exited on purpose (the peer-gone case)
        pass
    finally:
        dist.destroy_process_group()


def _run(folder: Path, world: int, case: str, args: tuple) -> list:
    mp.spawn(
        _worker, args=(world, str(folder / "rendezvous"), str(folder), case, args), nprocs=world
    )
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


#: Bundled results, per rank count: the cases of BUNDLES run in one spawn (one start of the
#: processes and their process group per rank count, not one per test).
_BUNDLED: dict[int, list[dict]] = {}


def _spawn(tmp_path, world: int, case: str, *args):
    """Every rank's result of ``case`` on ``world`` gloo ranks: from its rank count's bundle
    when it is one of BUNDLES, else from a spawn of its own."""
    key = (case, repr(args))
    if key in {(c, repr(a)) for c, a in BUNDLES.get(world, [])}:
        if world not in _BUNDLED:
            _BUNDLED[world] = _run(Path(tempfile.mkdtemp()), world, "bundle", ())
        results = [r if r and isinstance(r, tuple) else r[key] for r in _BUNDLED[world]]
    else:
        results = _run(tmp_path, world, case, args)
    for r in results:
        if isinstance(r, tuple) and r and r[0] == "raised":
            pytest.fail(r[1])
    return results


# ------------------------------------------------------------------------------ the cases


def _case_meta_gradients(world, checkpoint_layers, opt_name):
    net = fm.distributed.shard_model(_net(), _mesh(world))
    kinds = sorted({type(p).__name__ for p in net.parameters()})
    local = [p.to_local().shape for p in net.parameters()]
    adapted, grads = _meta(net, checkpoint_layers, opt_name)
    return kinds, local, adapted, grads, type(net[0].weight.grad).__name__


def _case_gathered(world, checkpoint_layers, reshard=True):
    """The most gathered bytes alive right after any gather (a layer's forward, its
    recomputation, a backward reading a saved parameter), over the forward, the inner steps
    and the backward; the adapted parameters and meta-gradients (full)."""
    from funcmeta._src.distributed import comm

    net = fm.distributed.shard_model(_net(), _mesh(world), reshard_after_forward=reshard)
    most = [0]
    gather_whole = comm.gather_whole

    one_layer = max(sum(p.numel() * 8 for p in m.parameters()) for m in _net())

    def counted(shard, what):
        full = gather_whole(shard, what)
        if "the gradient of" in what:  # a gradient's gather in the backward, no parameter
            return full
        # the new storage counts once the gather returns; alive with the others until then
        alive = fm.distributed.gathered_bytes()
        # once, in a loaded run, a bias's storage was still alive here (384 against 336
        # bytes; not reproduced since). This thread holds still while it pauses, so what a
        # pause frees was held by another thread (gloo's workers, suspected), not the graph
        for pause in (0.001, 0.004, 0.016, 0.064):
            if alive + full.untyped_storage().nbytes() <= one_layer:
                break
            time.sleep(pause)
            alive = min(alive, fm.distributed.gathered_bytes())
        most[0] = max(most[0], alive + full.untyped_storage().nbytes())
        return full

    comm.gather_whole = counted
    try:
        adapted, grads = _meta(net, checkpoint_layers, "sgd")
    finally:
        comm.gather_whole = gather_whole
    return most[0], adapted, grads


def _case_refusals(world):
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net)
    xs, ys, *_ = _data()
    said = {}
    tasks = (xs.expand(2, -1, -1), ys.expand(2, -1, -1))
    for name, call in {
        "tune_task_chunk": lambda: fm.tune_task_chunk(
            fmodel, fmodel.params, F.mse_loss, tasks, fm.optim.sgd(lr=0.1), steps=1
        ),
        "adapt_tasks with on_nonfinite": lambda: fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.mse_loss,
            tasks,
            fm.optim.sgd(lr=0.1),
            steps=1,
            on_nonfinite="raise",
        ),
        "adapt_tasks with a learnable rate": lambda: fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.mse_loss,
            tasks,
            fm.optim.sgd(lr=torch.tensor(0.1, dtype=torch.float64, requires_grad=True)),
            steps=1,
        ),
        "compile_meta_step": lambda: fm.compile_meta_step(
            fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=1
        ),
        "again": lambda: fm.distributed.shard_model(net, _mesh(world)),
    }.items():
        try:
            call()
            said[name] = None
        except fm.distributed.ShardingError as error:
            said[name] = str(error)
    for name, rate in {
        "learnable rate": torch.tensor(0.1, dtype=torch.float64, requires_grad=True),
        "learnable rates": torch.full((WIDTH, 3), 0.1, dtype=torch.float64, requires_grad=True),
    }.items():
        rates = {
            k: rate if v.shape == rate.shape or rate.dim() == 0 else 0.1
            for k, v in _net().named_parameters()
        }
        try:
            fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=rates), steps=1)
            said[name] = None
        except fm.distributed.ShardingError as error:
            said[name] = str(error)
    for option, value in {"on_nonfinite": "raise", "loss_scale": 128.0}.items():
        try:
            fm.adapt(
                fmodel,
                fmodel.params,
                F.mse_loss,
                (xs, ys),
                fm.optim.sgd(lr=0.1),
                steps=1,
                **{option: value},
            )
            said[option] = None
        except fm.distributed.ShardingError as error:
            said[option] = str(error)
    plain = _net()
    placed = fm.distributed.shard_hyper(fm.hyper.per_layer(fmodel.params, 0.1), net)
    for name, call in {
        "rates of an unsharded model": lambda: fm.distributed.shard_hyper(
            fm.hyper.per_layer(dict(plain.named_parameters()), 0.1), plain
        ),
        "rates placed twice": lambda: fm.distributed.shard_hyper(placed, net),
        "rates of another model": lambda: fm.distributed.shard_hyper(
            fm.hyper.per_element({"0.weight": torch.zeros(WIDTH, 4)}, 0.1), net
        ),
        "rates of another shape": lambda: fm.distributed.shard_hyper(
            fm.hyper.per_element({"2.weight": torch.zeros(WIDTH, 4)}, 0.1), net
        ),
        "rates of no parameter": lambda: fm.distributed.shard_hyper(
            fm.hyper.per_element({"head.weight": torch.zeros(2)}, 0.1), net
        ),
    }.items():
        try:
            call()
            said[name] = None
        except fm.distributed.ShardingError as error:
            said[name] = str(error)
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    try:
        fm.distributed.shard_model(tied, _mesh(world))
        said["tied"] = None
    except fm.distributed.ShardingError as error:
        said["tied"] = str(error)
    try:
        fm.distributed.shard_model(_net(), _mesh(world), reshard_after_forward="yes")
        said["reshard"] = None
    except TypeError as error:
        said["reshard"] = str(error)
    try:
        fm.distributed.shard_model(_net(), _mesh(world), split_activations=1)
        said["split"] = None
    except TypeError as error:
        said["split"] = str(error)
    # a layer computed on its shards keeps its own part whole, the rest still splits
    lm = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    fm.distributed.shard_model(lm, _mesh(world), compute_on_shards=["1"])
    said["split in force"] = (
        fm.functional_model(fm.distributed.shard_model(_net(), _mesh(world))).runtime.split,
        fm.functional_model(lm).runtime.split,
    )
    return said


class _Borrower(nn.Module):
    """A head that computes with its neighbour's weight (outside that layer's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.scale = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x) @ self.body.weight


def _case_borrowed_weight(world):
    net = fm.distributed.shard_model(_Borrower().double(), _mesh(world))
    fmodel = fm.functional_model(net)
    x = torch.ones(3, 2, dtype=torch.float64)
    try:
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, x), fm.optim.sgd(lr=0.1), steps=1)
    except fm.distributed.ShardingError as error:
        return str(error)
    return None


def _train(net: nn.Module, opt: torch.optim.Optimizer, iterations: range) -> None:
    """Meta-iterations of second-order MAML on the checkpointed sharded model, Adam outside;
    iteration i's data comes from seed i (the same on every rank), so a resumed run draws
    what the uninterrupted one drew."""
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    for i in iterations:
        g = torch.Generator().manual_seed(100 + i)
        xs, xq = (torch.randn(8, 3, generator=g, dtype=torch.float64) for _ in range(2))
        ys, yq = xs[:, :2].sin(), xq[:, :2].sin()
        opt.zero_grad()
        result = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=2
        )
        F.mse_loss(fmodel(result.params, xq), yq).backward()
        opt.step()


def _case_dcp(world, phase, folder):
    """Save a sharded run with torch.distributed.checkpoint after 2 meta-iterations and go
    on for 2 ("save"), or resume it from the files on this many ranks and run the same 2
    ("resume"): the full parameters and the optimizer's state after them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0 if phase == "save" else 7)  # the resumed model starts elsewhere
    net = fm.distributed.shard_model(_net(), _mesh(world)) if phase == "save" else None
    if net is None:
        fresh = _net()
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(1.0)  # nothing of the saved run's weights before the load
        net = fm.distributed.shard_model(fresh, _mesh(world))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    if phase == "save":
        _train(net, opt, range(2))
        model_state, optim_state = get_state_dict(net, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    else:
        model_state, optim_state = get_state_dict(net, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(net, opt, range(2, 4))
    params = [p.full_tensor().detach() for p in net.parameters()]
    moments = [opt.state[p]["exp_avg_sq"].full_tensor() for p in net.parameters()]
    return params, moments


def _case_mismatch(world):
    """Rank 1 shards a model of another width."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    net = _net() if rank == 0 else nn.Sequential(nn.Linear(3, WIDTH + 1)).double()
    try:
        fm.distributed.shard_model(net, _mesh(world), timeout=30)
    except fm.distributed.MismatchError as error:
        return str(error)
    return None


def _case_peer_gone(world):
    """Rank 1 exits when its forward reaches the second linear layer, mid-run; rank 0's
    gather of that layer meets no peer."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    if dist.get_rank() == 1:
        net[2].register_forward_pre_hook(lambda *_: os._exit(0))
    fmodel = fm.functional_model(net)
    xs, ys, *_ = _data()
    try:
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=1)
    except fm.distributed.PeerError as error:
        return str(error)
    return None


def _case_peer_gone_in_a_layer_on_its_shards(world):
    """An embedding and a head computed on their shards; rank 1 exits when its forward
    reaches the head: rank 0's all-gather of the head's outputs meets no peer."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7)).double()
    net = fm.distributed.shard_model(net, _mesh(world), compute_on_shards=["0", "1"], timeout=20)
    if dist.get_rank() == 1:
        net[1].register_forward_pre_hook(lambda *_: os._exit(0))
    try:
        net(torch.tensor([[1, 2, 3]]))
    except fm.distributed.PeerError as error:
        return str(error)
    return None


def _case_peer_gone_before_a_backward_gathers_again(world):
    """Without checkpointing, the backward gathers a saved weight again; rank 1 exits before
    it. The query loss through fm.task_losses (no check of the outputs' gradient first)."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net)
    xs, ys, xq, yq = _data()
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=1)
    losses = fm.task_losses(fmodel, result.params, F.mse_loss, (xq[None], yq[None])).losses
    return _backward_with_rank_one_gone(losses.mean())


def _backward_with_rank_one_gone(loss: torch.Tensor) -> str | None:
    """Rank 1 exits; rank 0 runs ``loss``'s backward alone: its PeerError's message."""
    if dist.get_rank() == 1:
        os._exit(0)
    try:
        loss.backward()
    except fm.distributed.PeerError as error:
        return str(error)
    return None


def _case_peer_gone_before_backward(world):
    """Each rank adapts its own tasks on gathered parameters (gather_params); rank 1 exits
    before the outer backward, whose reduce-scatter rank 0 then runs alone."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net)
    share, count = fm.distributed.shard(_split_batch())
    whole = fm.distributed.gather_params(fmodel.params, count)
    xs, ys, xq, yq = share
    result = fm.adapt_tasks(fmodel, whole, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=1)
    loss = fm.task_losses(fmodel, result.params, F.mse_loss, (xq, yq)).losses.mean()
    return _backward_with_rank_one_gone(loss)


def _case_peer_gone_with_a_kept_frozen_base(world):
    """gather_params(keep_frozen=True) keeps a frozen body; rank 1 exits before the next
    call, which on rank 0 then gathers no frozen parameter and finds the peer gone in the
    all-reduce that carries the counts and the marks, instead of handing back what it kept."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    for name, p in net.named_parameters():
        p.requires_grad_(name.startswith("4."))
    fmodel = fm.functional_model(net)
    fm.distributed.gather_params(fmodel.params, 1, keep_frozen=True)
    if dist.get_rank() == 1:
        os._exit(0)
    try:
        fm.distributed.gather_params(fmodel.params, 1, keep_frozen=True, timeout=20)
    except fm.distributed.PeerError as error:
        return str(error)
    return None


def _case_peer_gone_before_a_direct_calls_check(world):
    """The same task on both ranks, the query loss through a direct call; rank 1 exits before
    the outer backward, whose first collective is the comparison of the gradient reaching
    the model's outputs: rank 0 runs it alone."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net)
    xs, ys, xq, yq = _data()
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=1)
    return _backward_with_rank_one_gone(F.mse_loss(fmodel(result.params, xq), yq))


def _case_peer_gone_in_an_activations_gather(world):
    """The same tasks on both ranks, checkpointed layers keeping slices of what they save
    (the size threshold lowered to 1 element); rank 1 exits before the outer backward, whose
    first gather of a saved tensor rank 0 then runs alone. (The query loss comes from
    fm.task_losses, which checks its batch up front: a direct call's first collective in the
    backward would be its check of the outputs' gradient.)"""
    from funcmeta._src.distributed import runtime

    runtime._SPLIT_MIN = 1
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    xs, ys, xq, yq = _data()
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=1)
    loss = fm.task_losses(fmodel, result.params, F.mse_loss, (xq[None], yq[None])).losses.sum()
    return _backward_with_rank_one_gone(loss)


def _case_peer_stalls(world, where):
    """Rank 1 stalls (30 s) when its forward reaches the second linear layer (``"layer"``) or
    before its fm.adapt call (``"batch"``). The model is sharded with timeout=5 on a mesh
    whose group also waits 5 s, made after an equal mesh that waits 30 minutes was used
    (torch then puts the shards back on that equal mesh, whose group would wait it out):
    rank 0's collective gives up after 5 s and says which one, with no hang. Returns rank
    0's message and seconds."""
    import time
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    earlier = _mesh(world)  # the default group's timeout
    distribute_tensor(torch.ones(4, 2), earlier, [Shard(0)]).full_tensor()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=5))
    mesh = DeviceMesh.from_group(group, "cpu")
    assert mesh == earlier  # torch's equality ignores the process group
    stall = lambda *_: time.sleep(30)  # noqa: E731
    if where in ("head", "loss"):  # an embedding and a head on their shards, called directly
        torch.manual_seed(0)
        tokens = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7)).double()
        tokens = fm.distributed.shard_model(tokens, mesh, timeout=5, compute_on_shards=["0", "1"])
        ids = torch.tensor([[1, 2, 3]])
        if where == "head":  # rank 1 stalls before the head
            if dist.get_rank() == 1:
                tokens[1].register_forward_pre_hook(stall)
            call = lambda: tokens(ids)  # noqa: E731
        else:  # rank 1 stalls after the embedding, before the loss on the head's shards
            if dist.get_rank() == 1:
                tokens[0].register_forward_hook(stall)
            call = lambda: fm.heads.linear_cross_entropy(tokens[0](ids), tokens[1], ids)  # noqa: E731
        started = time.monotonic()
        try:
            call()
        except fm.distributed.PeerError as error:
            return str(error), time.monotonic() - started
        return None, time.monotonic() - started
    net = fm.distributed.shard_model(_net(), mesh, timeout=5)
    if dist.get_rank() == 1 and where == "layer":
        net[2].register_forward_pre_hook(stall)
    fmodel = fm.functional_model(net)
    xs, ys, *_ = _data()
    if dist.get_rank() == 1 and where == "batch":
        stall()
    started = time.monotonic()
    try:
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=1)
    except fm.distributed.PeerError as error:
        return str(error), time.monotonic() - started
    return None, time.monotonic() - started


def _tasks_batch():
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(4, 6, n, generator=g, dtype=torch.float64) for n in (3, 2, 3, 2))


def _meta_over_tasks(net: nn.Module, batch) -> None:
    """Second-order MAML, one task at a time with fm.adapt (checkpointed layers), backward on
    the mean query loss of the tasks given."""
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    xs, ys, xq, yq = batch
    losses = []
    for t in range(xs.shape[0]):
        opt = fm.optim.sgd(lr=0.1)
        result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs[t], ys[t]), opt, steps=2)
        losses.append(F.mse_loss(fmodel(result.params, xq[t]), yq[t]))
    torch.stack(losses).mean().backward()


def _case_two_axes(world, layers="sequential", every=False):
    """A 2 x 2 mesh: tasks split along "tasks", parameters along "shards" (``every``: every
    saved activation split over "shards", the size threshold at 1 element; with the count
    of slices kept)."""
    from torch.distributed.device_mesh import init_device_mesh

    kept, restore = _counting_pieces() if every else ([0], lambda: None)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tasks", "shards"))
        net = fm.distributed.shard_model(_net(), mesh, mesh_dim="shards")
        tasks = mesh.get_group("tasks")
        (xs, ys, xq, yq), count = fm.distributed.shard(_tasks_batch(), group=tasks)
        fmodel = fm.functional_model(net, checkpoint_layers=layers)
        # this group's tasks: fm.recipes.maml (fm.adapt_tasks, one task at a time on shards)
        out = fm.recipes.maml(
            fmodel, fmodel.params, F.mse_loss, (xs, ys), (xq, yq), steps=2, lr=0.1
        )
        out.loss.backward()
        fm.distributed.average_gradients(dict(net.named_parameters()), count, group=tasks)
    finally:
        restore()
    local = [tuple(p.grad.to_local().shape) for p in net.parameters()]
    grads = [p.grad.full_tensor() for p in net.parameters()]
    return (grads, local, count, kept[0]) if every else (grads, local, count)


def _case_different_data(world):
    """Rank 1 adapts on other data than rank 0, on a model sharded over both."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net)
    xs, ys, *_ = _data()
    if dist.get_rank() == 1:
        xs = xs.flip(0)  # the same values in another order
    try:
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=1)
    except fm.distributed.ShardingError as error:
        return str(error)
    return None


class _SelfCheckpointed(nn.Module):
    """Checkpoints its own layers (funcmeta's takeover runs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False))
        x = torch.tanh(torch.utils.checkpoint.checkpoint(self.b, x, use_reentrant=False))
        return self.c(x)


class _LoRA(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(3, WIDTH).requires_grad_(False)
        self.down = nn.Linear(3, 2, bias=False)
        self.up = nn.Linear(2, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x) + self.up(self.down(x))))


#: name -> (model, checkpoint_layers, inner optimizer, fm.adapt options); an inner
#: optimizer "rates: <kind>" learns its rates (fm.hyper.<kind>, placed by shard_hyper)
COMBINATIONS = {
    "checkpoint_steps": (_net, None, "sgd", {"checkpoint_steps": True}),
    "the takeover": (_SelfCheckpointed, None, "sgd", {}),
    "first order, checkpointed": (_net, "sequential", "sgd", {"first_order": True}),
    "LoRA on a frozen base": (_LoRA, None, "sgd", {}),
    "clip_grad_norm": (_net, None, "sgd", {"clip_grad_norm": 0.5}),
    "momentum": (_net, "sequential", "momentum", {}),
    "per-layer rates": (_net, None, "rates: per_layer", {}),
    "per-element rates per step, checkpointed": (_net, "sequential", "rates: per_element", {}),
    "per-tensor rates, step checkpoints": (
        _net,
        None,
        "rates: per_tensor",
        {"checkpoint_steps": True},
    ),
}

RATE_COMBINATIONS = [name for name in COMBINATIONS if "rates" in name]
SPLIT_COMBINATIONS = list(COMBINATIONS)  # checkpointed or not: every one saves activations
UNCHECKED_COMBINATIONS = ["LoRA on a frozen base", "clip_grad_norm", "per-layer rates"]


def _rates(kind: str, fmodel) -> torch.nn.Module:
    """Learnable rates of ``kind``, softplus, per step for per_element (Meta-SGD, MAML++)."""
    build = getattr(fm.hyper, kind)
    steps = 2 if kind == "per_element" else None
    return build(fmodel.params, 0.1, steps=steps, parameterization="softplus")


def _combination(name: str, mesh, split: bool = True) -> list:
    """The meta-gradients of the parameters (full), then of the rates (full), if any
    (``split``: ``shard_model(split_activations=)``)."""
    make, checkpoint_layers, opt_name, options = COMBINATIONS[name]
    torch.manual_seed(0)
    net = make().double()
    if mesh is not None:
        fm.distributed.shard_model(net, mesh, split_activations=split)
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint_layers)
    xs, ys, xq, yq = _data()
    rates = None
    if opt_name.startswith("rates: "):
        rates = _rates(opt_name.removeprefix("rates: "), fmodel).double()
        if mesh is not None:
            fm.distributed.shard_hyper(rates, net)
        opt = fm.optim.sgd(lr=rates)
    elif opt_name == "momentum":
        opt = fm.optim.sgd(lr=0.1, momentum=0.9)
    else:
        opt = fm.optim.sgd(lr=0.1)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), opt, steps=2, **options)
    F.mse_loss(fmodel(result.params, xq), yq).backward()
    learnable = [*net.parameters(), *(rates.parameters() if rates is not None else [])]
    return [
        None if p.grad is None else (p.grad.full_tensor() if mesh is not None else p.grad)
        for p in learnable
    ]


def _task_batches():
    """3 tasks of 8 support and 8 query rows (float64)."""
    g = torch.Generator().manual_seed(2)
    xs, ys, xq, yq = (torch.randn(3, 8, n, generator=g, dtype=torch.float64) for n in (3, 2, 3, 2))
    return (xs, ys), (xq, yq)


def _recipe(name: str, mesh, checkpoint_layers=None) -> list:
    """One meta-iteration of recipe ``name`` on 3 tasks: the meta-gradients of the
    parameters, then of the learnable rates (full tensors)."""
    net = _net()
    if mesh is not None:
        fm.distributed.shard_model(net, mesh)
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint_layers)
    support, query = _task_batches()
    rates = None
    if name == "maml":
        out = fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, support, query, steps=2, lr=0.1)
    elif name == "fomaml":
        out = fm.recipes.fomaml(fmodel, fmodel.params, F.mse_loss, support, query, steps=2, lr=0.1)
    elif name == "anil":
        out = fm.recipes.anil(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=2, lr=0.1, trainable="4"
        )
    elif name == "metasgd":
        rates = fm.recipes.metasgd_rates(fmodel.params, generator=torch.Generator().manual_seed(3))
        if mesh is not None:
            fm.distributed.shard_hyper(rates, net)
        out = fm.recipes.metasgd(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=2, lr=rates
        )
    elif name == "mamlpp":
        rates = fm.hyper.per_layer(fmodel.params, 0.1, steps=2).double()
        if mesh is not None:
            fm.distributed.shard_hyper(rates, net)
        weights = fm.recipes.mamlpp_step_weights(2, epoch=1, msl_epochs=4)
        out = fm.recipes.mamlpp(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            query,
            steps=2,
            lr=rates,
            step_weights=weights,
        )
    else:  # fm.adapt_tasks (Adam), fm.task_losses and fm.apply_tasks themselves
        result = fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            fm.optim.adam(lr=0.05),
            steps=2,
        )
        losses = fm.task_losses(fmodel, result.params, F.mse_loss, query).losses
        outputs, _ = fm.apply_tasks(fmodel, result.params, query[0])
        out = types.SimpleNamespace(loss=losses.mean() + outputs.square().mean())
    out.loss.backward()
    learnable = [*net.parameters(), *(rates.parameters() if rates is not None else [])]
    return [
        None if p.grad is None else (p.grad.full_tensor() if mesh is not None else p.grad)
        for p in learnable
    ]


RECIPES = ["adapt_tasks", "maml", "fomaml", "anil", "metasgd", "mamlpp"]


def _case_recipes(world, checkpoint_layers):
    mesh = _mesh(world)
    return {name: _recipe(name, mesh, checkpoint_layers) for name in RECIPES}


def _case_combinations(world, names=None):
    mesh = _mesh(world)
    return {name: _combination(name, mesh) for name in names or COMBINATIONS}


def _case_layer_norm_alone(world):
    """A LayerNorm checkpointed as a layer of its own, and the same LayerNorm inside a
    checkpointed block: both give the unsharded meta-gradients (torch's own DTensor crossing
    failed the first inside torch, '_local_tensor', before funcmeta's crossing took its
    place)."""

    def make(mesh, checkpoint_layers):
        torch.manual_seed(0)
        body = nn.Sequential(nn.Linear(3, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh())
        net = nn.Sequential(body, nn.Linear(WIDTH, 2)).double()
        if mesh is not None:
            fm.distributed.shard_model(net, mesh)
        return net, fm.functional_model(net, checkpoint_layers=checkpoint_layers)

    xs, ys, xq, yq = _data()
    grads = []
    for mesh, layers in ((_mesh(world), ["0.1"]), (_mesh(world), ["0"]), (None, ["0"])):
        net, fmodel = make(mesh, layers)
        result = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=2
        )
        F.mse_loss(fmodel(result.params, xq), yq).backward()
        grads.append([p.grad.full_tensor() if mesh else p.grad for p in net.parameters()])
    return grads


def _counting_pieces():
    """Lower the split's size threshold to 1 element and count the slices kept: returns the
    counter (a one-element list) and the function that puts both back."""
    from funcmeta._src.distributed import runtime

    kept = [0]
    original, threshold = runtime._Piece.__init__, runtime._SPLIT_MIN

    def counting(self, *args):
        kept[0] += 1
        original(self, *args)

    def restore():
        runtime._SPLIT_MIN, runtime._Piece.__init__ = threshold, original

    runtime._SPLIT_MIN, runtime._Piece.__init__ = 1, counting
    return kept, restore


def _case_split_activations(world):
    """With every saved activation split across the ranks (the size threshold lowered to 1
    element), the meta-gradients of each combination and recipe, checkpointed or not: the
    unsharded run's are compared by the test. Counts the slices kept by each, to show they
    were; then the unchecked combinations with split_activations=False, and their counts."""
    kept, restore = _counting_pieces()
    counts, out, off = {}, {}, {}
    try:
        mesh = _mesh(world)
        for name in SPLIT_COMBINATIONS:
            before = kept[0]
            out[name] = _combination(name, mesh)
            counts[name] = kept[0] - before
        for name, layers in (("maml", "sequential"), ("metasgd", "sequential"), ("maml", None)):
            key = f"{name}, {layers}"
            before = kept[0]
            out[key] = _recipe(name, mesh, layers)
            counts[key] = kept[0] - before
        for name in UNCHECKED_COMBINATIONS:
            before = kept[0]
            off[name] = (_combination(name, mesh, split=False), kept[0] - before)
    finally:
        restore()
    return out, counts, off


def _split_batch():
    """5 tasks: uneven over 2 ranks (3 and 2) and over 4 (2, 1, 1, 1)."""
    g = torch.Generator().manual_seed(5)
    return tuple(torch.randn(5, 6, n, generator=g, dtype=torch.float64) for n in (3, 2, 3, 2))


def _split_meta(fmodel, params, batch, rates) -> None:
    """Second-order fm.adapt_tasks (all tasks at once) with learnable per-layer rates, then
    the backward of the mean query loss of the tasks given."""
    xs, ys, xq, yq = batch
    opt = fm.optim.sgd(lr=rates)
    result = fm.adapt_tasks(fmodel, params, F.mse_loss, (xs, ys), opt, steps=2)
    fm.task_losses(fmodel, result.params, F.mse_loss, (xq, yq)).losses.mean().backward()


def _split_rates(fmodel):
    return fm.hyper.per_layer(fmodel.params, 0.1, parameterization="softplus")


def _case_split_tasks(world, shape):
    """Each rank adapts its own share of the tasks on whole parameters gathered once
    (fm.distributed.gather_params over a 1-D or 2-D mesh); the rates' gradients averaged with
    average_gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape)
    net = fm.distributed.shard_model(_net(), mesh, mesh_dim=len(shape) - 1)
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    rates = _split_rates(fmodel)
    share, count = fm.distributed.shard(_split_batch())
    whole = fm.distributed.gather_params(fmodel.params, count)
    kinds = sorted({type(t).__name__ for t in whole.values()})
    _split_meta(fmodel, whole, share, rates)
    fm.distributed.average_gradients(list(rates.parameters()), count)
    grads = [p.grad.full_tensor() for p in net.parameters()]
    return kinds, count, grads, [r.grad for r in rates.parameters()]


def _split_partial_losses(fmodel, params, share, rank: int):
    """Rank 0: the MAML query loss of its tasks; rank 1: a loss of the head's weight alone
    (the other parameters get no gradient on that rank)."""
    if rank == 1:
        return (params["4.weight"] ** 2).sum()
    xs, ys, xq, yq = share
    result = fm.adapt_tasks(fmodel, params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=0.1), steps=2)
    return fm.task_losses(fmodel, result.params, F.mse_loss, (xq, yq)).losses.mean()


def _case_split_partial_use(world):
    """gather_params where one rank's loss reaches only some of the parameters."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net)
    share, count = fm.distributed.shard(_split_batch())
    whole = fm.distributed.gather_params(fmodel.params, count)
    _split_partial_losses(fmodel, whole, share, dist.get_rank()).backward()
    return [p.grad.full_tensor() for p in net.parameters()]


def _case_average_groups(world):
    """average_gradients on a 2 x 2 mesh's shards: over the task axis (valid, also for a model
    sharded over the sub-mesh of the shard axis) and over the shard axis (refused)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tasks", "shards"))
    said = {}
    for name, sharded in (
        ("2-D", fm.distributed.shard_model(_net(), mesh, mesh_dim="shards")),
        ("sub-mesh", fm.distributed.shard_model(_net(), mesh["shards"])),
    ):
        for p in sharded.parameters():
            p.grad = torch.ones_like(p)
        for axis in ("tasks", "shards"):
            try:
                fm.distributed.average_gradients(
                    dict(sharded.named_parameters()), group=mesh.get_group(axis)
                )
                said[name, axis] = None
            except fm.distributed.ShardingError as error:
                said[name, axis] = str(error)
    return said


def _case_split_refusals(world):
    """What gather_params and average_gradients refuse on a sharded model."""
    net = fm.distributed.shard_model(_net(), _mesh(world))
    fmodel = fm.functional_model(net)
    said = {}
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    try:  # a 1-D mesh's default group holds ranks with different shards
        fm.distributed.average_gradients(dict(net.named_parameters()))
        said["average shards"] = None
    except fm.distributed.ShardingError as error:
        said["average shards"] = str(error)
    try:
        fm.distributed.gather_params(fmodel.params, count=dist.get_rank())  # rank 0: none
        said["no task"] = None
    except ValueError as error:
        said["no task"] = str(error)
    placed = fm.distributed.shard_hyper(_split_rates(fmodel), net)
    share, count = fm.distributed.shard(_split_batch())
    try:  # rates placed beside the shards meet the whole parameters in the inner step
        _split_meta(fmodel, fm.distributed.gather_params(fmodel.params, count), share, placed)
        said["placed rates on whole parameters"] = None
    except fm.distributed.ShardingError as error:
        said["placed rates on whole parameters"] = str(error)
    extra = {**fmodel.params, "extra": torch.zeros(2, requires_grad=True)}
    try:
        fm.distributed.gather_params(extra, 1)
        said["plain beside shards"] = None
    except fm.distributed.ShardingError as error:
        said["plain beside shards"] = str(error)
    return said


def _case_bundle(world):
    """The cases of BUNDLES[world], one after another in this process group: ``{(case,
    repr(args)): result}``, a case that raised giving ``("raised", traceback)``."""
    out = {}
    for case, args in BUNDLES[world]:
        try:
            out[(case, repr(args))] = CASES[case](world, *args)
        except Exception:  # reported to the test of that case
            out[(case, repr(args))] = ("raised", traceback.format_exc())
    return out


CASES = {
    "split_tasks": _case_split_tasks,
    "split_refusals": _case_split_refusals,
    "split_partial_use": _case_split_partial_use,
    "average_groups": _case_average_groups,
    "split_activations": _case_split_activations,
    "layer_norm_alone": _case_layer_norm_alone,
    "bundle": _case_bundle,
    "recipes": _case_recipes,
    "combinations": _case_combinations,
    "different_data": _case_different_data,
    "two_axes": _case_two_axes,
    "mismatch": _case_mismatch,
    "peer_gone": _case_peer_gone,
    "peer_gone_before_backward": _case_peer_gone_before_backward,
    "peer_gone_with_a_kept_frozen_base": _case_peer_gone_with_a_kept_frozen_base,
    "peer_gone_before_a_regather": _case_peer_gone_before_a_backward_gathers_again,
    "peer_gone_on_shards": _case_peer_gone_in_a_layer_on_its_shards,
    "peer_gone_in_an_activations_gather": _case_peer_gone_in_an_activations_gather,
    "peer_stalls": _case_peer_stalls,
    "peer_gone_before_a_direct_calls_check": _case_peer_gone_before_a_direct_calls_check,
    "dcp": _case_dcp,
    "meta_gradients": _case_meta_gradients,
    "gathered": _case_gathered,
    "refusals": _case_refusals,
    "borrowed": _case_borrowed_weight,
}


#: The cases that share one spawn per rank count (the gathered-bytes cases first: they count
#: the gathered storages alive in the process); their tests read their part.
BUNDLES: dict[int, list[tuple[str, tuple]]] = {
    2: [
        ("gathered", (None, True)),
        ("gathered", ("sequential", True)),
        ("gathered", (None, False)),
        ("gathered", ("sequential", False)),
        ("meta_gradients", (None, "sgd")),
        ("meta_gradients", ("sequential", "sgd")),
        ("meta_gradients", ("sequential", "adam")),
        ("refusals", ()),
        ("borrowed", ()),
        ("different_data", ()),
        ("layer_norm_alone", ()),
        ("split_activations", ()),
        ("combinations", (list(COMBINATIONS),)),
        ("recipes", (None,)),
        ("split_tasks", ((2,),)),
        ("split_refusals", ()),
        ("split_partial_use", ()),
        ("written_after_saving", ()),
    ],
    4: [
        ("two_axes", ()),
        ("two_axes", (None, True)),
        ("split_activations", ()),
        ("combinations", (RATE_COMBINATIONS,)),
        ("recipes", ("sequential",)),
        ("split_tasks", ((4,),)),
        ("split_tasks", ((2, 2),)),
        ("average_groups", ()),
    ],
}

# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize(
    ("world", "checkpoint_layers", "opt_name"),
    [(2, None, "sgd"), (2, "sequential", "sgd"), (2, "sequential", "adam"), (1, None, "sgd")],
)
def test_sharded_meta_gradients_equal_the_unsharded_run(
    tmp_path, world, checkpoint_layers, opt_name
):
    reference_adapted, reference = _meta(_net(), checkpoint_layers, opt_name)
    for kinds, local, adapted, grads, grad_kind in _spawn(
        tmp_path, world, "meta_gradients", checkpoint_layers, opt_name
    ):
        assert kinds == ["DTensor"] and grad_kind == "DTensor"
        if world == 2:  # each rank holds its part: 6 rows split 3 and 3, 2 rows 1 and 1
            assert [s[0] for s in local] == [3, 3, 3, 3, 1, 1]
        for ours, theirs in zip(adapted + grads, reference_adapted + reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("checkpoint_layers", [None, "sequential"])
@pytest.mark.parametrize("reshard", [True, False])
def test_a_rank_holds_one_layers_full_parameters_at_a_time(tmp_path, checkpoint_layers, reshard):
    """The graphs (the forward's, the second-order inner gradients') keep the shards of the
    gathered parameters they save and gather them again when a backward reads them: the
    whole parameters alive never exceed one layer's, checkpointed or not (1552 bytes here
    against 336 without it). reshard_after_forward=False keeps what they save whole: without
    checkpointing every layer's, once per pass. The same meta-gradients either way."""
    layers = [sum(p.numel() * 8 for p in m.parameters()) for m in _net() if list(m.parameters())]
    reference_adapted, reference = _meta(_net(), checkpoint_layers, "sgd")
    for most, adapted, grads in _spawn(tmp_path, 2, "gathered", checkpoint_layers, reshard):
        if reshard or checkpoint_layers:
            assert most <= max(layers)
        else:
            assert most >= 2 * sum(layers)
        for ours, theirs in zip(adapted + grads, reference_adapted + reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_what_cannot_take_a_sharded_model_says_so(tmp_path):
    (said, _) = _spawn(tmp_path, 2, "refusals")
    assert "there is no chunk to choose" in (said["tune_task_chunk"] or "")
    assert (said["adapt_tasks with on_nonfinite"] or "").startswith(
        "fm.adapt_tasks with on_nonfinite= cannot take a sharded"
    )
    assert "shard_hyper" in (said["adapt_tasks with a learnable rate"] or "")
    assert said["compile_meta_step"] is not None
    assert said["compile_meta_step"].startswith("fm.compile_meta_step cannot take a sharded model")
    assert "use fm.adapt_tasks or the recipes" in said["compile_meta_step"]
    assert "sharded already" in (said["again"] or "")
    assert "'0.weight' is held by 2 layers" in (said["tied"] or "")
    assert (said["reshard"] or "").startswith("reshard_after_forward must be True")
    assert (said["split"] or "").startswith("split_activations must be True")
    assert said["split in force"] == (True, True)
    assert "got str" in (said["reshard"] or "")
    for option in ("on_nonfinite", "loss_scale"):
        assert (said[option] or "").startswith(f"fm.adapt with {option}= cannot take a sharded")
    # a learnable rate's gradient would be this rank's partial sum, silently: refused
    for name in ("learnable rate", "learnable rates"):
        assert said[name] is not None, name
        assert "its gradient would sum this rank's shard alone" in said[name]
        assert "fm.distributed.shard_hyper(rates, model)" in said[name]
    assert "has no sharded parameter" in (said["rates of an unsharded model"] or "")
    assert "placed already" in (said["rates placed twice"] or "")
    assert "has shape (6, 4), its parameter (6, 3)" in (said["rates of another model"] or "")
    assert "has shape (6, 4), its parameter (6, 6)" in (said["rates of another shape"] or "")
    assert "'head.weight' names no parameter" in (said["rates of no parameter"] or "")


def test_a_layer_reading_another_layers_weight_is_named(tmp_path):
    (said, _) = _spawn(tmp_path, 2, "borrowed")
    assert said is not None
    assert "computed with a parameter it does not own" in said
    assert "own the weight in the layer that uses it" in said


class _WritesAfterSaving(nn.Module):
    """A forward that changes a tensor in place after an operation saved it for its
    backward, then reads it again (``writing`` off: the same function, out of place)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, width), nn.Linear(width, 2)
        self.writing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * 2
        out = (torch.tanh(h) * h).sum(-1, keepdim=True)  # saves h
        if self.writing:
            h.mul_(3)
            return out + self.b(h)
        return out + self.b(3 * h)


def _written_after_saving(world, width, layers, on_shards, steps_too, write):
    """The meta-gradients of two steps of MAML on the sharded model (the write, if any, in
    the inner steps' forwards: the query pass computes the same function out of place), or
    the error raised."""
    torch.manual_seed(0)
    module = _WritesAfterSaving(width).double()
    net = fm.distributed.shard_model(module, _mesh(world), compute_on_shards=on_shards)
    fmodel = fm.functional_model(net, checkpoint_layers=list(layers) if layers else None)
    x, y = torch.randn(64, 4, dtype=torch.float64), torch.randn(64, 2, dtype=torch.float64)
    opt = fm.optim.sgd(lr=0.1)
    try:
        module.writing = write
        result = fm.adapt(
            fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2, checkpoint_steps=steps_too
        )
        module.writing = False
        F.mse_loss(fmodel(result.params, x), y).backward()
    except RuntimeError as error:
        return str(error)
    return [p.grad.full_tensor() for p in net.parameters()]


WRITTEN_AFTER_SAVING = (  # width, checkpoint_layers, compute_on_shards, checkpoint_steps
    (8, None, (), False),
    (8, ("b",), (), False),
    (8, None, ("b",), False),
    (8, None, (), True),
    (256, None, (), False),
    (256, ("b",), (), False),
    (256, None, ("b",), False),
    (256, None, (), True),
)


def _case_written_after_saving(world):
    """Each way of running such a model sharded (small and split activations, per-layer
    checkpointing, a layer computed on its shards, step checkpointing): what it gave, and
    what the model without the write gives."""
    return {
        config: (
            _written_after_saving(world, *config, write=True),
            _written_after_saving(world, *config, write=False),
        )
        for config in WRITTEN_AFTER_SAVING
    }


CASES["written_after_saving"] = _case_written_after_saving


def test_a_tensor_changed_in_place_after_its_save_never_gives_a_wrong_gradient(tmp_path):
    """autograd refuses a saved tensor changed in place after the save; under the sharded
    runtime's saved-tensor hooks (and a step checkpoint's) it leaves that check to them. A
    tensor they keep as it is (one too small to split) must be refused as autograd would;
    one kept as this rank's slice (a copy made at the save) gives the gradient of what ran,
    the function without the write. Never the gradient computed with the changed values."""
    for said in _spawn(tmp_path, 2, "written_after_saving"):
        for key, (got, want) in said.items():
            width = key[0]
            assert not isinstance(want, str), (key, want)
            if width == 8 or isinstance(got, str):
                assert isinstance(got, str), key
                assert "modified by an inplace operation" in got, (key, got)
                continue
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _case_mesh2d(world):
    from torch.distributed.device_mesh import init_device_mesh

    try:
        fm.distributed.shard_model(_net(), init_device_mesh("cpu", (1, 1)))
    except fm.distributed.ShardingError as error:
        return str(error)
    return None


CASES["mesh2d"] = _case_mesh2d


def test_a_run_saved_on_four_ranks_resumes_on_two_bit_for_bit(tmp_path):
    """torch.distributed.checkpoint saves a sharded run (model and Adam state, each rank its
    shards) and loads it into a model sharded over another number of ranks: the resumed
    run's parameters and optimizer state equal the uninterrupted run's, bit for bit."""
    folder = str(tmp_path / "run")
    (tmp_path / "save").mkdir()
    (tmp_path / "resume").mkdir()
    uninterrupted = _spawn(tmp_path / "save", 4, "dcp", "save", folder)
    resumed = _spawn(tmp_path / "resume", 2, "dcp", "resume", folder)
    for ours in resumed:
        for mine, theirs in zip(
            ours[0] + ours[1], uninterrupted[0][0] + uninterrupted[0][1], strict=True
        ):
            assert torch.equal(mine, theirs)
    # the resumed model began elsewhere: the load, not the start, made them equal
    assert not torch.equal(_net().state_dict()["0.weight"] + 1.0, resumed[0][0][0])


def test_ranks_that_shard_different_models_are_told_on_every_rank(tmp_path):
    said = _spawn(tmp_path, 2, "mismatch")
    for text in said:
        assert text is not None and "the ranks disagree on the model they shard" in text
        assert "0.weight" in text
    assert said[0] == said[1]


def test_a_peer_gone_mid_run_raises_peer_error_naming_the_layer(tmp_path):
    said = _peer_gone(tmp_path, "peer_gone")
    assert "gathering Linear parameter 'weight' across the mesh failed" in said


def _peer_gone(tmp_path, case: str) -> str:
    """Rank 0's message from ``case`` on 2 ranks, rank 1 having exited on purpose (no
    bundle: its process is gone); with no hang."""
    import time

    started = time.monotonic()
    try:
        mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path), case, ()), nprocs=2)
    except mp.ProcessExitedException:
        # rank 0 ended its case (its result is written first) and then died in gloo's
        # teardown of a group whose peer is gone: its result is judged below
        if not (tmp_path / "rank0.pt").exists():
            raise
    said = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert isinstance(said, str), said
    assert "a peer process is gone or stalled" in said
    assert time.monotonic() - started < 120  # no hang
    return said


def test_a_peer_gone_before_a_backward_gathers_a_saved_weight_again_is_named(tmp_path):
    """A backward that gathers a saved parameter again (reshard_after_forward) with a peer
    gone raises PeerError naming the parameter and why it gathers, without hanging."""
    said = _peer_gone(tmp_path, "peer_gone_before_a_regather")
    assert "again for a backward that reads it" in said, said
    assert "parameter 'weight'" in said, said


def test_a_peer_gone_while_a_layer_computes_on_its_shards_is_named(tmp_path):
    said = _peer_gone(tmp_path, "peer_gone_on_shards")
    assert "joining the outputs of Linear '1' across the mesh failed" in said, said
    assert "a peer process is gone or stalled" in said, said


def test_a_peer_gone_before_the_backward_of_gathered_parameters_is_named(tmp_path):
    """gather_params: the backward's reduce-scatter with a peer gone raises PeerError naming
    the parameter (the first one: one node reduces them all, in order)."""
    said = _peer_gone(tmp_path, "peer_gone_before_backward")
    assert "reducing the meta-gradient of parameter '0.weight'" in said


def test_a_peer_gone_before_gather_params_reuses_a_kept_frozen_base_is_named(tmp_path):
    """keep_frozen=True: the call after a peer is gone raises PeerError from the counts'
    all-reduce (which carries the ranks' marks) rather than returning the kept tensors."""
    said = _peer_gone(tmp_path, "peer_gone_with_a_kept_frozen_base")
    assert "summing the task counts" in said


def test_a_peer_gone_before_a_direct_calls_check_in_the_backward_is_named(tmp_path):
    said = _peer_gone(tmp_path, "peer_gone_before_a_direct_calls_check")
    assert "comparing the gradient reaching the model's outputs failed" in said, said


def test_a_peer_gone_while_a_backward_gathers_a_saved_activation_is_named(tmp_path):
    """A checkpointed layer of a sharded model keeps a slice of each tensor it saves; the
    backward's all-gather of it with a peer gone raises PeerError, not gloo's own error."""
    said = _peer_gone(tmp_path, "peer_gone_in_an_activations_gather")
    assert "gathering a saved activation (shape (8, " in said


@pytest.mark.slow  # waits out a 5 s collective timeout and a 30 s stall, twice
@pytest.mark.parametrize(
    ("where", "named"),
    [
        ("layer", "gathering Linear parameter 'weight' across the mesh failed"),
        ("batch", "comparing the batches given to fm.adapt failed or did not finish within 5 s"),
        ("head", "joining the outputs of Linear '1' across the mesh failed"),
        ("loss", "the largest logit of Linear '1' across the mesh failed"),
    ],
)
def test_a_peer_stalled_mid_run_raises_peer_error_after_shard_models_timeout(
    tmp_path, where, named
):
    """A rank that stalls inside a run (not gone) leaves its peer waiting in a collective for
    shard_model's timeout (5 s), also where an equal mesh with a 30-minute group was made and
    used first; then PeerError names the collective: no hang (the target: within the timeout
    plus 10 s)."""
    said, seconds = _spawn(tmp_path, 2, "peer_stalls", where)[0]
    assert said is not None, "rank 0 finished although its peer stalled"
    assert named in said
    assert "a peer process is gone or stalled" in said
    assert seconds < 15  # shard_model's 5 s timeout (plus 10 s), not the peer's 30 s stall


def test_tasks_on_one_mesh_axis_and_shards_on_the_other_equal_one_process(tmp_path):
    """A 2 x 2 mesh (4 gloo ranks): each task group adapts 2 of the 4 tasks at once
    (fm.recipes.maml, checkpointed layers) on parameters sharded over its 2 ranks;
    average_gradients over the task axis gives every rank's shards the meta-gradient of the
    mean over all 4 tasks, as one process computes it with a loop of fm.adapt."""
    net = _net()
    _meta_over_tasks(net, _tasks_batch())
    reference = [p.grad for p in net.parameters()]
    for grads, local, count in _spawn(tmp_path, 4, "two_axes"):
        assert count == 2
        assert [s[0] for s in local] == [3, 3, 3, 3, 1, 1]  # half of each parameter
        for ours, theirs in zip(grads, reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_on_a_two_dimensional_mesh_the_activations_split_over_the_shard_axis(tmp_path):
    """Unchecked layers on a 2 x 2 mesh, every saved activation split (threshold 1 element)
    over the shard axis only, where the ranks hold the same data: the meta-gradient of the
    mean over all 4 tasks, as one process computes it."""
    net = _net()
    _meta_over_tasks(net, _tasks_batch())
    reference = [p.grad for p in net.parameters()]
    for grads, _, count, kept in _spawn(tmp_path, 4, "two_axes", None, True):
        assert count == 2 and kept > 0
        for ours, theirs in zip(grads, reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_a_two_dimensional_mesh_needs_the_shard_axis(tmp_path):
    (said,) = _spawn(tmp_path, 1, "mesh2d")
    assert said is not None and "needs mesh_dim=" in said and "(1, 1)" in said


def test_ranks_adapting_on_different_data_are_told_on_every_rank(tmp_path):
    """full_tensor()'s backward sums nothing across ranks: ranks that split the parameters
    but hold different batches would get wrong gradients silently; fm.adapt compares an
    exact checksum of the batch first."""
    for said in _spawn(tmp_path, 2, "different_data"):
        assert said is not None and "hold different batches" in said


@pytest.mark.parametrize("world", [2, 4])
def test_sharding_combines_with_the_inner_loops_options(tmp_path, world):
    """Step checkpointing, a model's own checkpoints (the takeover), first order, LoRA on a
    frozen sharded base, clipped inner gradients, momentum, and learnable rates placed by
    shard_hyper (per layer and per tensor replicated, per element and per step sharded):
    on 2 ranks every one, on 4 (uneven shards: 6 rows split 2, 2, 2, 0) the rates, give the
    unsharded run's meta-gradients of the parameters and of the rates (float64); a frozen
    parameter gets none, sharded or not."""
    names = list(COMBINATIONS) if world == 2 else RATE_COMBINATIONS
    for ours in _spawn(tmp_path, world, "combinations", names):
        for name in names:
            theirs = _combination(name, None)
            assert len(ours[name]) == len(theirs), name
            for a, b in zip(ours[name], theirs, strict=True):
                assert (a is None) == (b is None), name
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize(("world", "checkpoint_layers"), [(2, None), (4, "sequential")])
def test_task_batched_calls_and_recipes_take_a_sharded_model(tmp_path, world, checkpoint_layers):
    """fm.adapt_tasks (Adam), fm.task_losses, fm.apply_tasks and the recipes (MAML,
    FOMAML, ANIL, Meta-SGD and MAML++ with their rates placed by shard_hyper) on a sharded
    model run the tasks one at a time (the per-task runtime) and give the unsharded run's
    meta-gradients of the parameters and of the rates, on 2 ranks and on 4 (uneven shards,
    checkpointed layers), float64."""
    for ours in _spawn(tmp_path, world, "recipes", checkpoint_layers):
        for name in RECIPES:
            theirs = _recipe(name, None, checkpoint_layers)
            assert len(ours[name]) == len(theirs), name
            for a, b in zip(ours[name], theirs, strict=True):
                assert (a is None) == (b is None), name
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)


def test_a_layer_norm_checkpointed_alone_or_inside_a_block_is_exact(tmp_path):
    """A checkpointed LayerNorm's VJP differentiated again with respect to its shards (torch's
    own crossing failed inside DTensor: '_local_tensor', torch 2.13), alone and inside a
    checkpointed block: the unsharded run's meta-gradients."""
    for alone, block, theirs in _spawn(tmp_path, 2, "layer_norm_alone"):
        for a, b, c in zip(alone, block, theirs, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_split_the_saved_activations_checkpointed_or_not(tmp_path, world):
    """A sharded model's ranks hold the same activations: each keeps only its slice of each
    tensor autograd saves in the inner loop (a checkpointed layer's inputs and incoming
    gradients; unchecked, every activation of the forward and of the second-order inner
    gradient) and gathers them in the backward. With every saved tensor split (uneven over 4
    ranks: padded slices), the meta-gradients equal the unsharded run's (float64) in every
    combination and recipe; split_activations=False keeps the unchecked ones whole, with
    the same meta-gradients."""
    for ours, counts, off in _spawn(tmp_path, world, "split_activations"):
        assert all(n > 0 for n in counts.values()), counts  # slices were kept in each
        for name in SPLIT_COMBINATIONS:
            for a, b in zip(ours[name], _combination(name, None), strict=True):
                assert (a is None) == (b is None), name
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
        for name, layers in (("maml", "sequential"), ("metasgd", "sequential"), ("maml", None)):
            key = f"{name}, {layers}"
            for a, b in zip(ours[key], _recipe(name, None, layers), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=key)
        for name, (grads, count) in off.items():
            assert count == 0, name  # nothing split
            for a, b in zip(grads, _combination(name, None), strict=True):
                assert (a is None) == (b is None), name
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize(("world", "shape"), [(2, (2,)), (4, (4,)), (4, (2, 2))])
def test_ranks_with_their_own_tasks_get_the_mean_meta_gradient_in_their_shards(
    tmp_path, world, shape
):
    """fm.distributed.gather_params: each rank adapts its own, uneven share of 5 tasks
    (fm.adapt_tasks, checkpointed layers, learnable per-layer rates) on whole parameters; the
    backward's reduce-scatter leaves in the shards the meta-gradient of the mean over all 5
    tasks, as one process computes it (float64), on a 1-D mesh and on both axes of a 2-D one;
    the rates' gradients averaged by average_gradients equal the process's too."""
    net = _net()
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    rates = _split_rates(fmodel)
    _split_meta(fmodel, fmodel.params, _split_batch(), rates)
    reference = [p.grad for p in net.parameters()]
    rate_reference = [r.grad for r in rates.parameters()]
    counts = []
    for kinds, count, grads, rate_grads in _spawn(tmp_path, world, "split_tasks", shape):
        assert kinds == ["Tensor"]  # whole, plain tensors: the unsharded inner loop
        counts.append(count)
        for ours, theirs in zip(grads + rate_grads, reference + rate_reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert counts == ([3, 2] if world == 2 else [2, 1, 1, 1])


def test_gather_params_and_average_gradients_refuse_what_would_be_wrong(tmp_path):
    """average_gradients over ranks that hold different shards would average different rows,
    silently where the shards have one shape; a rank without tasks would skip the backward
    whose reduce-scatter the others wait in; a plain learnable tensor beside the shards would
    keep this rank's own gradient; rates placed beside the shards meet whole parameters in
    the inner step (torch's mixed-tensor error, said again with the fix)."""
    for said in _spawn(tmp_path, 2, "split_refusals"):
        assert "would average different shards of '0.weight'" in (said["average shards"] or "")
        assert "nothing to average" in said["average shards"]
        assert "1 of 2 ranks have no task" in (said["no task"] or "")
        assert "plain tensors that require grad (['extra'])" in (said["plain beside shards"] or "")
        placed = said["placed rates on whole parameters"] or ""
        assert "met a DTensor hyperparameter with whole parameters" in placed
        assert "keep the rates as fm.hyper built them" in placed


def test_a_rank_whose_loss_leaves_out_parameters_sends_zeros_for_them(tmp_path):
    """gather_params's one backward node reduces every gathered parameter's gradient on
    every rank, zeros for those a rank's loss did not reach: no rank waits in a
    reduce-scatter the other skipped, and the shards get the task-weighted mean."""
    batch = _split_batch()
    shares = [tuple(x[:3] for x in batch), tuple(x[3:] for x in batch)]
    expected = None
    for rank, (share, count) in enumerate(zip(shares, (3, 2), strict=True)):
        net = _net()
        fmodel = fm.functional_model(net)
        _split_partial_losses(fmodel, fmodel.params, share, rank).backward()
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)) * count / 5
            for p in net.parameters()
        ]
        expected = (
            grads if expected is None else [a + b for a, b in zip(expected, grads, strict=True)]
        )
    for grads in _spawn(tmp_path, 2, "split_partial_use"):
        for ours, theirs in zip(grads, expected, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_average_gradients_over_a_meshs_task_axis_runs_and_over_its_shard_axis_is_refused(
    tmp_path,
):
    """On a 2 x 2 mesh the task axis's group holds ranks with the same shards: averaged, for a
    model sharded with mesh_dim= and for one sharded over the shard axis's sub-mesh; the shard
    axis's group holds different shards: refused, naming the task axis's group."""
    for said in _spawn(tmp_path, 4, "average_groups"):
        assert said["2-D", "tasks"] is None and said["sub-mesh", "tasks"] is None, said
        assert "group=mesh.get_group('tasks')" in (said["2-D", "shards"] or "")
        assert "would average different shards" in (said["sub-mesh", "shards"] or "")
