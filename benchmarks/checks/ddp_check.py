"""What DistributedDataParallel does with meta-learning, measured on two gloo processes.

1. A MAML outer loss through ``fm.functional_model(ddp.module)``, then ``.backward()``: DDP's
   reducer never runs (its forward was not called). Each rank keeps its own local
   gradient. The script reports how far that is from the correct task-averaged gradient
   (``fm.distributed.average_gradients``).
2. An inner ``torch.autograd.grad(..., create_graph=True)`` of a loss computed through
   ``ddp(x)``: whether it raises, and whether the gradient it returns is averaged across
   ranks.
3. The same inner gradient through an FSDP-sharded model (``fully_shard``), then a double
   backward through it.

    python benchmarks/checks/ddp_check.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import funcmeta as fm


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1)).double()


def worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    b = fm.data.Sinusoid().sample(
        8, 5, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    (xs, ys, xq, yq), count = fm.distributed.shard((b.x_support, b.y_support, b.x_query, b.y_query))
    results = {}

    # the correct meta-gradient: plain collectives
    net = model()
    fmodel = fm.functional_model(net)
    fm.recipes.maml(
        fmodel, fmodel.params, F.mse_loss, (xs, ys), (xq, yq), steps=1, lr=0.1
    ).loss.backward()
    fm.distributed.average_gradients(net.parameters(), count)
    correct = [p.grad.clone() for p in net.parameters()]

    # 1. functional_call on ddp.module
    ddp = DistributedDataParallel(model())
    fmodel = fm.functional_model(ddp.module)
    fm.recipes.maml(
        fmodel, fmodel.params, F.mse_loss, (xs, ys), (xq, yq), steps=1, lr=0.1
    ).loss.backward()
    through_module = [p.grad for p in ddp.module.parameters()]
    results["module_max_diff"] = max(
        float((a - c).abs().max()) for a, c in zip(through_module, correct, strict=True)
    )

    # 2. DDP forward + inner autograd.grad(create_graph=True)
    ddp2 = DistributedDataParallel(model())
    params = list(ddp2.parameters())
    try:
        loss = F.mse_loss(ddp2(xs[0]), ys[0])
        grads = torch.autograd.grad(loss, params, create_graph=True)
        local = torch.autograd.grad(F.mse_loss(model()(xs[0]), ys[0]), list(model().parameters()))
        results["inner"] = "returned"
        results["inner_equals_local"] = all(
            torch.allclose(g, lo) for g, lo in zip(grads, local, strict=True)
        )
    except RuntimeError as e:
        results["inner"] = f"raised: {str(e).splitlines()[0][:150]}"
    # 3. FSDP (fully_shard): inner autograd.grad(create_graph=True), then double backward
    try:
        from torch.distributed.fsdp import fully_shard

        sharded = model()
        fully_shard(sharded)
        loss = F.mse_loss(sharded(xs[0]), ys[0])
        grads = torch.autograd.grad(loss, list(sharded.parameters()), create_graph=True)
        results["fsdp_inner"] = "returned"
        sum((g * g).sum() for g in grads).backward()
        results["fsdp_double"] = "ran"
    except (RuntimeError, ImportError) as e:
        results.setdefault("fsdp_inner", "raised")
        results["fsdp_double"] = f"raised: {str(e).splitlines()[0][:150]}"
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
    print(
        f"torch {torch.__version__}, 2 gloo processes, float64, MAML on 8 sinusoid tasks (4 per rank)"
    )
    for r, res in enumerate(results):
        print(
            f"rank {r}: functional_call on ddp.module: max |grad - averaged grad| = {res['module_max_diff']:.3g}"
        )
        inner = res["inner"]
        if inner == "returned":
            inner += (
                f"; equals the rank's local (un-averaged) gradient: {res['inner_equals_local']}"
            )
        print(f"rank {r}: DDP forward + inner autograd.grad(create_graph=True): {inner}")
        print(
            f"rank {r}: FSDP fully_shard: inner autograd.grad(create_graph=True) "
            f"{res['fsdp_inner']}; double backward {res['fsdp_double']}"
        )


if __name__ == "__main__":
    main()
