"""bf16 HuggingFace decoders built the standard way (``from_config(..., dtype=torch.bfloat16)``,
as ``from_pretrained`` does) keep their rotary frequencies in float32 on purpose: funcmeta
runs them in every mode, with finite meta-gradients, and refuses only parameters cast without
the buffers the module keeps in their dtype."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import next_token_loss
from torch import nn

import funcmeta as fm

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
)
T, N, L, V = 2, 3, 6, 32


def decoder(kind: str) -> nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": V, "use_cache": False}
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=32, **common)
    else:
        cls = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig,
        }[kind]
        config = cls(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            **common,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)


MODES = {
    "adapt": {},
    "first-order": {"first_order": True},
    "adapt_tasks": {},
    "checkpoint_layers": {},
    "step-checkpoint": {"checkpoint_steps": True},
    "maml": {},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2"])
def test_standard_bf16_decoders_run_in_every_mode(kind, mode):
    model = decoder(kind)
    mixed = {k: v.dtype for k, v in model.named_buffers() if v.dtype != torch.bfloat16}
    if kind != "gpt2":
        assert mixed and set(mixed.values()) == {torch.float32}  # the rotary frequencies
    layers = "sequential" if mode == "checkpoint_layers" else None
    fmodel = fm.functional_model(model, checkpoint_layers=layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (T, N, L), generator=g)
    opt = fm.optim.sgd(lr=0.1)
    params = fmodel.params
    if mode == "maml":
        loss = fm.recipes.maml(
            fmodel,
            params,
            next_token_loss,
            ({"input_ids": ids}, ids),
            ({"input_ids": ids}, ids),
            steps=2,
            lr=0.1,
            task_chunk=None,
        ).loss
    elif mode == "adapt_tasks" or mode == "checkpoint_layers":
        batch = ({"input_ids": ids}, ids)
        r = fm.adapt_tasks(fmodel, params, next_token_loss, batch, opt, steps=2, task_chunk=None)
        loss = fm.task_losses(fmodel, r.params, next_token_loss, batch, task_chunk=None)[0]
        loss = loss.mean()
    else:
        r = fm.adapt(
            fmodel,
            params,
            next_token_loss,
            ({"input_ids": ids[0]}, ids[0]),
            opt,
            steps=2,
            **MODES[mode],
        )
        loss = next_token_loss(fmodel(r.params, input_ids=ids[0]), ids[0])
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    present = [gr for gr in grads if gr is not None]
    assert present and all(bool(torch.isfinite(gr).all()) for gr in present)


def test_parameters_cast_without_the_buffers_the_module_keeps_with_them_are_refused():
    """The confusion the dtype check is for: float64 parameters passed to a float32 module
    whose BatchNorm statistics stay float32. Llama's float32 rotary frequencies beside bf16
    parameters are the module's own choice and pass."""
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fmodel = fm.functional_model(net)
    double = {k: v.double() for k, v in fmodel.params.items()}
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"buffers \['1\.running_mean'.*as the module keeps them"):
        fm.adapt(fmodel, double, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1)
    llama = fm.functional_model(decoder("llama"))
    as_float = {k: v.float() for k, v in llama.params.items()}  # bf16 -> float32 parameters
    ids = torch.randint(0, V, (N, L))
    fm.adapt(
        llama, as_float, next_token_loss, ({"input_ids": ids}, ids), fm.optim.sgd(lr=0.1), steps=1
    )


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_float64_copies_give_the_hand_unrolled_meta_gradients(kind):
    """The standard-loaded decoder cast to float64: fm.adapt equals a hand-written unroll of
    functional_call and autograd.grad (second order) to 1e-10, and task batching the loop to
    the float32 round-off of the RMS norms (1e-7)."""
    from torch.func import functional_call
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = decoder(kind).double()
    fmodel = fm.functional_model(model)
    params = fmodel.params
    g = torch.Generator().manual_seed(2)
    ids, query = (torch.randint(0, V, (T, N, L), generator=g) for _ in range(2))
    opt = fm.optim.sgd(lr=0.1)
    loss = 0
    for t in range(T):
        r = fm.adapt(fmodel, params, next_token_loss, ({"input_ids": ids[t]}, ids[t]), opt, steps=2)
        loss = loss + next_token_loss(fmodel(r.params, input_ids=query[t]), query[t]) / T
    ours = torch.autograd.grad(loss, list(params.values()))
    reference = 0
    with sdpa_kernel(SDPBackend.MATH):  # the kernel with a double backward
        for t in range(T):
            p = dict(params)
            for _ in range(2):
                out = functional_call(model, p, (), {"input_ids": ids[t]}, tie_weights=False)
                grads = torch.autograd.grad(
                    next_token_loss(out, ids[t]), list(p.values()), create_graph=True
                )
                p = {k: v - 0.1 * gr for (k, v), gr in zip(p.items(), grads, strict=True)}
            out = functional_call(model, p, (), {"input_ids": query[t]}, tie_weights=False)
            reference = reference + next_token_loss(out, query[t]) / T
        want = torch.autograd.grad(reference, list(params.values()))
    flat = [torch.cat([x.flatten() for x in gs]) for gs in (ours, want)]
    assert float((flat[0] - flat[1]).norm() / flat[1].norm()) < 1e-10
    r = fm.adapt_tasks(
        fmodel, params, next_token_loss, ({"input_ids": ids}, ids), opt, steps=2, task_chunk=None
    )
    batched = fm.task_losses(
        fmodel, r.params, next_token_loss, ({"input_ids": query}, query), task_chunk=None
    )[0]
    b = torch.cat([x.flatten() for x in torch.autograd.grad(batched.mean(), list(params.values()))])
    assert float((b - flat[0]).norm() / flat[0].norm()) < 1e-7
