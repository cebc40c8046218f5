"""A transformers Llama decoder (4 blocks, grouped-query attention, from a config) sharded
across 2 and 4 gloo processes with fm.distributed.shard_model: the meta-gradients of its
parameters and of learnable per-layer rates equal the single-process unsharded run's to
1e-12 (float64) in every mode: plain, per-layer checkpointing, the takeover (the model's
own gradient checkpointing), step checkpointing, task batching (MAML, ANIL, MAML++), LoRA
adapters (peft) on the frozen sharded base, and per-layer softplus rates; in bfloat16 the
sharded run is as far from the float64 meta-gradients as the unsharded one. On 4 ranks a 2 x 2 mesh splits the tasks
along one axis and the parameters along the other.

The task-batched references run their tasks one at a time (``task_chunk=1``), as a sharded
model does: Llama's RMS norm computes in float32 inside a float64 model, and a vmapped run
of it rounds differently (docs/decisions/huggingface-models.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import NEEDS_SHARDED, spawn_gloo, tiny_llama

import funcmeta as fm

pytestmark = NEEDS_SHARDED

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
)
peft = pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[dev]'")

BLOCKS = [f"model.layers.{i}" for i in range(4)]
MODES = [
    "plain",
    "checkpoint_layers",
    "takeover",
    "checkpoint_steps",
    "maml",
    "anil",
    "mamlpp",
    "lora",
    "rates",
    "bf16",
]


def _decoder(mode: str) -> torch.nn.Module:
    model = tiny_llama(4, torch.bfloat16 if mode == "bf16" else torch.float64)
    if mode == "takeover":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "lora":
        lora = peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        model = peft.get_peft_model(model, lora)
    return model.train()


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, -2), labels.flatten())


def _tokens(tasks: int | None):
    g = torch.Generator().manual_seed(1)
    shape = (4, 6) if tasks is None else (tasks, 4, 6)
    return tuple(torch.randint(0, 32, shape, generator=g) for _ in range(4))


#: The modes also run with the embedding and the head computed on their shards.
ON_SHARDS = ["plain", "checkpoint_layers", "checkpoint_steps", "lora", "rates", "mamlpp", "bf16"]


def _meta(
    mode: str, mesh=None, mesh_dim=None, task_group=None, own_tasks=False, on_shards=False
) -> list:
    """One meta-iteration in ``mode``: the meta-gradients of the parameters (full tensors),
    then of the learnable rates; ``None`` for a frozen parameter. ``own_tasks``: each rank
    its share of the tasks on the whole parameters (fm.distributed.gather_params).
    ``on_shards``: the embedding and the head computed on their shards, never gathered."""
    model = _decoder(mode)
    if mesh is not None:
        names = [n for n, _ in model.named_modules() if n.endswith(("embed_tokens", "lm_head"))]
        assert len(names) == 2, names
        fm.distributed.shard_model(
            model, mesh, mesh_dim=mesh_dim, compute_on_shards=names if on_shards else ()
        )
    fmodel = fm.functional_model(
        model, checkpoint_layers=BLOCKS if mode == "checkpoint_layers" else None
    )
    rates = None
    if mode in ("rates", "mamlpp"):
        steps = 2 if mode == "mamlpp" else None
        rates = fm.hyper.per_layer(fmodel.params, 0.1, steps=steps, parameterization="softplus")
        rates = rates.double()
        if mesh is not None:
            fm.distributed.shard_hyper(rates, model)
    if mode in ("maml", "anil", "mamlpp"):
        xs, ys, xq, yq = _tokens(4)
        count = xs.shape[0]
        if task_group is not None or own_tasks:
            (xs, ys, xq, yq), count = fm.distributed.shard((xs, ys, xq, yq), group=task_group)
        support, query = (xs, ys), (xq, yq)
        params = fm.distributed.gather_params(fmodel.params, count) if own_tasks else fmodel.params
        if mode == "maml":
            out = fm.recipes.maml(
                fmodel, params, _loss, support, query, steps=2, lr=0.1, task_chunk=1
            )
        elif mode == "anil":
            out = fm.recipes.anil(
                fmodel,
                fmodel.params,
                _loss,
                support,
                query,
                steps=2,
                lr=0.1,
                trainable="lm_head",
                task_chunk=1,
            )
        else:
            weights = fm.recipes.mamlpp_step_weights(2, epoch=1, msl_epochs=4)
            out = fm.recipes.mamlpp(
                fmodel,
                fmodel.params,
                _loss,
                support,
                query,
                steps=2,
                lr=rates,
                step_weights=weights,
                task_chunk=1,
            )
        out.loss.backward()
        if task_group is not None:
            fm.distributed.average_gradients(
                dict(model.named_parameters()), count, group=task_group
            )
    else:
        xs, ys, xq, yq = _tokens(None)
        opt = fm.optim.sgd(lr=rates if rates is not None else 0.1)
        options = {"checkpoint_steps": True} if mode == "checkpoint_steps" else {}
        result = fm.adapt(fmodel, fmodel.params, _loss, (xs, ys), opt, steps=2, **options)
        _loss(fmodel(result.params, xq), yq).backward()
    learnable = [*model.parameters(), *(rates.parameters() if rates is not None else [])]
    return [
        None if p.grad is None else (p.grad.full_tensor() if mesh is not None else p.grad)
        for p in learnable
    ]


def _every_mode(world: int) -> dict:
    """One rank's meta-gradients in every mode (and on a 2 x 2 mesh on 4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    result = {mode: _meta(mode, mesh) for mode in MODES}
    for mode in ON_SHARDS:
        result[f"{mode}, on shards"] = _meta(mode, mesh, on_shards=True)
    result["maml, own tasks"] = _meta("maml", mesh, own_tasks=True)
    result["maml, own tasks, on shards"] = _meta("maml", mesh, own_tasks=True, on_shards=True)
    if world == 4:  # tasks along one axis, the parameters along the other
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tasks", "shards"))
        tasks = grid.get_group("tasks")
        result["maml, 2 x 2 mesh"] = _meta("maml", grid, "shards", tasks)
        result["maml, 2 x 2 mesh, on shards"] = _meta("maml", grid, "shards", tasks, on_shards=True)
    return result


@pytest.mark.slow  # about 55 s on 2 ranks and 150 s on 4 (2 cores): make test-slow, in CI
@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_llama_decoder_gives_the_unsharded_meta_gradients(world):
    results = spawn_gloo(world, _every_mode)
    references = {mode: _meta(mode) for mode in MODES}
    runs = [(mode, mode) for mode in MODES] + [(f"{m}, on shards", m) for m in ON_SHARDS]
    for ours in results:
        for run, mode in runs:
            theirs = references[mode]
            assert len(ours[run]) == len(theirs), run
            assert sum(a is not None for a in theirs) > 0, run
            for a, b in zip(ours[run], theirs, strict=True):
                assert (a is None) == (b is None), run  # LoRA: the base gets none
                if a is None:
                    continue
                if mode == "bf16":
                    continue  # against float64 below
                else:
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=run)
        # bfloat16: as far from the float64 meta-gradients as the unsharded bfloat16 run (the
        # sharded run sums some per-step gradients in another order: a few bf16 roundings)
        exact = references["plain"]
        for run in ("bf16", "bf16, on shards"):
            for a, b, c in zip(ours[run], references["bf16"], exact, strict=True):
                scale = c.abs().max()
                ours_off = (a.double() - c).abs().max() / scale
                theirs_off = (b.double() - c).abs().max() / scale
                assert ours_off <= 1.25 * theirs_off + 2**-8, (run, ours_off, theirs_off)
        for run in ("maml, own tasks", "maml, own tasks, on shards") + (
            ("maml, 2 x 2 mesh", "maml, 2 x 2 mesh, on shards") if world == 4 else ()
        ):
            for a, b in zip(ours[run], references["maml"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=run)
