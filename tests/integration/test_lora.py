"""LoRA adapters (peft) as the inner loop's parameters: a decoder's base frozen, the adapters
adapted with learnable per-layer softplus rates. float64 against a hand-written unroll, and
task batching against the loop (Llama's float32 RMS norm reorders its sums there)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import next_token_loss
from torch.func import functional_call

import funcmeta as fm

peft = pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[dev]'")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
)

T, N, L, V = 3, 4, 6, 32


def lora_decoder(dtype=torch.float64):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation="eager",
    )
    base = transformers.LlamaForCausalLM(config).to(dtype)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,
    )  # B != 0: real gradients
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(base, lora)


def data():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, V, (T, N, L), generator=g) for _ in range(2))


def relative(a, b):
    fa, fb = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((fa - fb).norm() / fb.norm())


@pytest.mark.parametrize("first_order", [False, True], ids=["second", "first"])
def test_adapting_only_the_adapters_equals_a_hand_unroll(first_order):
    model = lora_decoder()
    fmodel = fm.functional_model(model)
    adapters = {k: v for k, v in fmodel.params.items() if "lora_" in k}
    assert set(adapters) == {k for k, v in fmodel.params.items() if v.requires_grad}
    assert len(fmodel.frozen) == len(fmodel.params) - len(adapters)  # the base is frozen
    rates = fm.hyper.per_layer(adapters, 0.1, parameterization="softplus").double()
    support, query = data()
    wrt = [*adapters.values(), *rates.parameters()]

    loss = 0
    for t in range(T):
        r = fm.adapt(
            fmodel,
            fmodel.params,
            next_token_loss,
            ({"input_ids": support[t]}, support[t]),
            fm.optim.sgd(lr=rates),
            steps=2,
            first_order=first_order,
        )
        loss = loss + next_token_loss(fmodel(r.params, input_ids=query[t]), query[t]) / T
    ours = torch.autograd.grad(loss, wrt)

    every, lrs, reference = dict(fmodel.params), rates(), 0
    for t in range(T):
        p = dict(adapters)
        for _ in range(2):
            out = functional_call(
                model, {**every, **p}, (), {"input_ids": support[t]}, tie_weights=False
            )
            grads = torch.autograd.grad(
                next_token_loss(out, support[t]), list(p.values()), create_graph=not first_order
            )
            p = {k: v - lrs[k] * g for (k, v), g in zip(p.items(), grads, strict=True)}
        out = functional_call(model, {**every, **p}, (), {"input_ids": query[t]}, tie_weights=False)
        reference = reference + next_token_loss(out, query[t]) / T
    assert relative(ours, torch.autograd.grad(reference, wrt)) < 1e-10

    r = fm.adapt_tasks(
        fmodel,
        fmodel.params,
        next_token_loss,
        ({"input_ids": support}, support),
        fm.optim.sgd(lr=rates),
        steps=2,
        first_order=first_order,
        task_chunk=None,
    )
    batched = fm.task_losses(
        fmodel, r.params, next_token_loss, ({"input_ids": query}, query), task_chunk=None
    )[0]
    assert relative(torch.autograd.grad(batched.mean(), wrt), ours) < 1e-7
    assert fmodel.per_task is False  # peft's layers ran batched, no per-task fallback


def test_bf16_lora_decoder_runs_task_batched_with_finite_meta_gradients():
    model = lora_decoder(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # adapters in float32 beside the bf16 base, as usual
    fmodel = fm.functional_model(model)
    support, query = data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fm.recipes.maml(
            fmodel,
            fmodel.params,
            next_token_loss,
            ({"input_ids": support}, support),
            ({"input_ids": query}, query),
            steps=2,
            lr=0.1,
        )
    grads = torch.autograd.grad(out.loss, [p for p in model.parameters() if p.requires_grad])
    assert all(bool(torch.isfinite(g).all()) for g in grads)
