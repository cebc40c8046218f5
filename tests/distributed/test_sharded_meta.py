"""fm.distributed.shard_model(init=...): a model built on the meta device, each rank
materializing only its shards, one whole tensor at a time. A transformers Llama with peft LoRA
adapters built that way on 2 and 3 gloo ranks (uneven shards on 3) gives the meta-gradients of
the same model built whole in one process with the same values, second order, to 1e-12
(float64); no whole tensor outlives its placement; bad input is refused by name."""

from __future__ import annotations

import weakref
import zlib

import pytest
import torch
import torch.nn.functional as F
from helpers import NEEDS_SHARDED, spawn_gloo
from torch import nn

import funcmeta as fm

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
)
peft = pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[dev]'")

pytestmark = [NEEDS_SHARDED, pytest.mark.xdist_group("sharded")]

CONFIG = {
    "vocab_size": 30,  # 30 rows: 10 per rank on 3, and 15 on 2
    "hidden_size": 12,
    "intermediate_size": 20,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 16,
    "tie_word_embeddings": False,
    "use_cache": False,
}


def _decoder() -> nn.Module:
    """The Llama with LoRA adapters on its attention projections, where it is built (the
    caller's default device: the meta device, or the CPU)."""
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    return peft.get_peft_model(model, lora).to(torch.float64).train()


def _values(name: str, like: torch.Tensor) -> torch.Tensor:
    """A seeded draw per name (the same on every rank and in the reference); the rotary
    frequencies computed as the model computes them."""
    if name.endswith("inv_freq"):
        config = transformers.LlamaConfig(**CONFIG)
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=config)
        return getattr(rotary, name.rsplit(".", 1)[1]).to(like.dtype)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return 0.3 * torch.randn(like.shape, generator=g, dtype=like.dtype)


def _whole_model() -> nn.Module:
    """The reference: built on the CPU, every tensor set to :func:`_values`."""
    model = _decoder()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            t.copy_(_values(name, t))
    return model


def _loss(out, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[..., :-1, :].flatten(0, -2), ids[..., 1:].flatten())


def _meta_gradients(model: nn.Module, mesh=None) -> list:
    """Second-order MAML (2 tasks, 2 steps, per-layer softplus rates on the adapters, the
    decoder layers checkpointed): the meta-gradients of the adapters and the rates, whole."""
    layers = [n for n, _ in model.named_modules() if n.rsplit(".", 2)[-2:-1] == ["layers"]]
    fmodel = fm.functional_model(model, checkpoint_layers=layers)
    adapters = {k: v for k, v in fmodel.params.items() if v.requires_grad}
    rates = fm.hyper.per_layer(adapters, 0.1, parameterization="softplus").double()
    if mesh is not None:
        fm.distributed.shard_hyper(rates, model)
    g = torch.Generator().manual_seed(1)
    xs, xq = (torch.randint(0, 30, (2, 1, 8), generator=g) for _ in range(2))
    out = fm.recipes.maml(
        fmodel, fmodel.params, _loss, ({"input_ids": xs}, xs), ({"input_ids": xq}, xq),
        steps=2, lr=rates, task_chunk=1,
    )  # fmt: skip
    out.loss.backward()
    grads = [*adapters.values(), *rates.parameters()]
    return [g.grad.full_tensor() if mesh is not None else g.grad for g in grads]


def _case_meta_built(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = _decoder()
    whole_alive: list = []

    def init(name: str, like: torch.Tensor) -> torch.Tensor:
        assert like.is_meta
        # every tensor asked for before this one is gone: one whole tensor at a time
        whole_alive.append(sum(r() is not None for r in seen))
        value = _values(name, like)
        seen.append(weakref.ref(value))
        return value

    seen: list = []
    fm.distributed.shard_model(model, mesh, init=init)
    local = {n: p.to_local().shape[0] for n, p in model.named_parameters() if p.dim() > 0}
    return {
        "grads": _meta_gradients(model, mesh),
        "alive": max(whole_alive),
        "asked": len(seen),
        "embed rows": local["base_model.model.model.embed_tokens.weight"],
        "meta": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "buffer": model.base_model.model.model.rotary_emb.inv_freq,
    }


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_model_built_on_the_meta_device_shards_without_any_rank_holding_it_whole(world):
    results = spawn_gloo(world, _case_meta_built)
    reference = _meta_gradients(_whole_model())
    count = sum(1 for _ in _whole_model().named_parameters()) + 2  # and the two buffers
    for r in results:
        assert r["meta"] == []
        assert r["asked"] == count
        assert r["alive"] == 0
        assert r["embed rows"] == 30 // world
        torch.testing.assert_close(r["buffer"], _values("rotary_emb.inv_freq", r["buffer"]))
        assert len(r["grads"]) == len(reference)
        for a, b in zip(r["grads"], reference, strict=True):
            assert b.abs().max() > 0
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def _case_refusals(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    said = {}

    def said_by(key: str, make, **kwargs) -> None:
        try:
            fm.distributed.shard_model(make(), mesh, **kwargs)
        except (fm.distributed.ShardingError, TypeError) as error:
            said[key] = f"{type(error).__name__}: {error}"

    def on_meta() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))

    said_by("no init", on_meta)
    said_by("not callable", on_meta, init=3)
    said_by("not meta", lambda: nn.Linear(4, 6), init=lambda n, t: torch.zeros(t.shape))
    said_by("shape", on_meta, init=lambda n, t: torch.zeros(3))
    said_by("dtype", on_meta, init=lambda n, t: torch.zeros(t.shape, dtype=torch.float64))
    said_by("not a tensor", on_meta, init=lambda n, t: [0.0])
    said_by("meta back", on_meta, init=lambda n, t: t)
    return said


def test_a_meta_device_build_refuses_bad_input_by_name():
    (said,) = spawn_gloo(1, _case_refusals)
    assert (
        "ShardingError: '0.weight' (and 3 more) is on the meta device: pass init="
        in (said["no init"])
    )
    assert said["not callable"].startswith("TypeError: init must be a function")
    assert "has no tensor there" in said["not meta"]
    assert "init('0.weight', ...) returned a tensor (3,), torch.float32" in said["shape"]
    assert "'0.weight' needs shape (6, 4) and torch.float32" in said["shape"]
    assert "returned a tensor (6, 4), torch.float64" in said["dtype"]
    assert "init('0.weight', ...) returned list" in said["not a tensor"]
    assert "returned a tensor on the meta device" in said["meta back"]


def _case_different_values(world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()

    def build(seeded: bool) -> str:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))

        def init(name: str, like: torch.Tensor) -> torch.Tensor:
            # the same seed on every rank, or a seed of each rank's own
            seed = zlib.crc32(name.encode()) + (0 if seeded else rank)
            return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed))

        try:
            fm.distributed.shard_model(model, mesh, init=init)
        except fm.distributed.ShardingError as error:
            return f"ShardingError: {error}"
        return "placed"

    return {"seeded": build(True), "unseeded": build(False)}


def test_init_that_gives_the_ranks_different_values_is_refused_on_every_rank():
    """Each rank keeps its slice of its own init values, with no communication: values that
    differ between the ranks would make a model that is none of them, silently. The ranks
    compare a checksum of all the values once they are placed, and each raises."""
    for said in spawn_gloo(2, _case_different_values):
        assert said["seeded"] == "placed"
        assert said["unseeded"].startswith(
            "ShardingError: init= gave different values on different ranks"
        )
