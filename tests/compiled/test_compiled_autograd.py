"""``fm.compile_meta_step``'s autograd graph: the eager step's own computation
(``torch.autograd.grad`` for every gradient) traced into one graph, where the installed torch
traces it. Which graph a step compiles is chosen by name, with its reason; models built with
``checkpoint_layers=`` compile on it (their layers torch activation checkpoint regions) and
give ``fm.adapt_tasks``' float64 meta-gradients to 1e-10: a residual MLP, conv4 with
BatchNorm, a transformers Llama decoder. The compiles here use torch's ``aot_eager`` backend
(dynamo and AOTAutograd, the graph run as traced: seconds, where inductor's C++ build takes
minutes on a small CPU); ``benchmarks/memory/compiled_checkpoint.py`` compiles with inductor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama
from torch import nn

import funcmeta as fm
from funcmeta._src.compiled.eager_reasons import AUTOGRAD_GRAPH_TORCH, autograd_untraceable

DTYPE = torch.float64

needs_autograd_graph = pytest.mark.skipif(
    autograd_untraceable() is not None, reason=f"{autograd_untraceable()}"
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


def residual_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 16), *(Block(16) for _ in range(3)), nn.Linear(16, 1)).to(
        DTYPE
    )


def sinusoid(tasks: int = 4):
    b = fm.data.Sinusoid().sample(tasks, 5, 6, generator=torch.Generator().manual_seed(0))
    return tuple(tuple(t.to(DTYPE) for t in part) for part in (b.support, b.query))


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile with the aot_eager backend (the graph as dynamo and AOTAutograd trace
    it, activation checkpointing's recomputation included, without inductor's build)."""
    compile_ = torch.compile

    def compile_aot_eager(fn, **kwargs):  # type: ignore[no-untyped-def]
        return compile_(fn, fullgraph=True, dynamic=False, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_aot_eager)


def meta_grads(net: nn.Module, run) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    for p in net.parameters():
        p.grad = None
    run()
    return [p.grad.clone() for p in net.parameters()]


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
    return worst / max(y.abs().max().item() for y in b)


def plain(fmodel, loss_fn, opt, support, query, steps: int, **options) -> None:  # type: ignore[no-untyped-def]
    result = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, opt, steps=steps, **options)
    losses = fm.task_losses(
        fmodel, result.params, loss_fn, query, buffers=result.buffers, task_chunk=result.chunk
    ).losses
    losses.mean().backward()


def compiled_equals_plain(net, fmodel, loss_fn, support, query, steps=2, **options) -> float:  # type: ignore[no-untyped-def]
    opt = fm.optim.sgd(lr=0.1)
    theirs = meta_grads(net, lambda: plain(fmodel, loss_fn, opt, support, query, steps, **options))
    step = fm.compile_meta_step(
        fmodel, loss_fn, opt, steps=steps, task_chunk=None, graph="autograd", **options
    )
    assert step.graph == "autograd" and step.graph_reason is None
    ours = meta_grads(net, lambda: step(support, query))
    assert step.eager_reason is None, step.eager_reason  # compiled, not eager
    assert len(step.compile_seconds) == 1
    return relative(ours, theirs)


def test_the_graph_is_chosen_by_name_with_its_reason(monkeypatch: pytest.MonkeyPatch):
    fmodel = fm.functional_model(residual_mlp())
    opt = fm.optim.sgd(lr=0.1)
    chosen = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, compile=False)
    asked = fm.compile_meta_step(
        fmodel, F.mse_loss, opt, steps=1, compile=False, graph="torch.func"
    )
    assert asked.graph == "torch.func" and asked.graph_reason == "graph='torch.func' was asked for"
    if autograd_untraceable() is None:
        assert chosen.graph == "autograd" and chosen.graph_reason is None
    # a torch older than the one the autograd graph is tested on: the torch.func graph
    old = ".".join(map(str, (AUTOGRAD_GRAPH_TORCH[0], AUTOGRAD_GRAPH_TORCH[1] - 2))) + ".0"
    monkeypatch.setattr(torch, "__version__", old)
    fallback = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, compile=False)
    assert fallback.graph == "torch.func"
    assert fallback.graph_reason is not None and f"torch {old}" in fallback.graph_reason
    with pytest.raises(ValueError, match=r"graph='autograd'\) needs torch " + old):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, graph="autograd")
    with pytest.raises(ValueError, match="graph must be"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, graph="jax")


@needs_autograd_graph
@pytest.mark.parametrize("order", ["second", "first"])
def test_checkpointed_residual_blocks_compile_with_the_plain_paths_meta_gradients(aot_eager, order):
    net = residual_mlp()
    fmodel = fm.functional_model(net, checkpoint_layers=["1", "2", "3"])
    support, query = sinusoid()
    error = compiled_equals_plain(
        net, fmodel, F.mse_loss, support, query, first_order=order == "first"
    )
    assert error < 1e-10


@needs_autograd_graph
@pytest.mark.slow
def test_checkpointed_conv4_blocks_with_batchnorm_compile_with_the_plain_paths_meta_gradients(
    aot_eager,
):
    torch.manual_seed(0)
    net = fm.models.conv4(3, hidden=4).to(DTYPE)
    blocks = [n for n, m in net.named_modules() if n.startswith("features.") and n.count(".") == 1]
    assert len(blocks) == 4
    fmodel = fm.functional_model(net, checkpoint_layers=blocks)
    g = torch.Generator().manual_seed(1)
    ys = torch.arange(3).repeat(2, 2)
    support = (torch.randn(2, 6, 1, 28, 28, generator=g, dtype=DTYPE), ys)
    query = (torch.randn(2, 6, 1, 28, 28, generator=g, dtype=DTYPE), ys)
    assert compiled_equals_plain(net, fmodel, F.cross_entropy, support, query) < 1e-10


@needs_autograd_graph
@pytest.mark.slow
def test_checkpointed_llama_decoder_layers_compile_with_the_plain_paths_meta_gradients(
    aot_eager, monkeypatch: pytest.MonkeyPatch
):
    """transformers' LlamaRMSNorm computes in float32 whatever the model's dtype: the compiled
    graph and the eager step round it differently (2.7e-8 apart here). The check computes the
    norm in the model's float64, so that what remains is the graph's own difference."""
    net = tiny_llama(2)

    def rms_norm(self, hidden):  # type: ignore[no-untyped-def]
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden * torch.rsqrt(variance + self.variance_epsilon)

    monkeypatch.setattr(type(net.model.norm), "forward", rms_norm)
    layers = ["model.layers.0", "model.layers.1"]
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32, (4, 2, 1, 8), generator=g)  # 2 tasks of 1 sequence of 8

    def model_loss(out, labels):  # type: ignore[no-untyped-def]
        return F.cross_entropy(out.logits.flatten(0, -2), labels.flatten())

    support, query = (ids[0], ids[1]), (ids[2], ids[3])
    assert compiled_equals_plain(net, fmodel, model_loss, support, query) < 1e-10


class SelfCheckpointing(nn.Module):
    """A model that calls torch.utils.checkpoint in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)
        return self.head(torch.tanh(h)).mean(1)


class Encoder(nn.Module):
    """A transformer encoder layer (multi-head attention), a head on the last position."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)[:, -1])


@needs_autograd_graph
@pytest.mark.slow
@pytest.mark.parametrize("build", [SelfCheckpointing, Encoder], ids=["own checkpoints", "encoder"])
def test_models_the_torch_func_graph_cannot_hold_compile_on_the_autograd_graph(aot_eager, build):
    """A model that checkpoints itself, and multi-head attention in second order (on the
    kernels with a second derivative), stop the torch.func graph
    (tests/compiled/test_eager_reasons.py); on the autograd graph they compile, exactly."""
    torch.manual_seed(0)
    net = build().to(DTYPE)
    fmodel = fm.functional_model(net)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 4, 5, 8, generator=g, dtype=DTYPE), torch.randint(0, 3, (2, 4)))
    assert compiled_equals_plain(net, fmodel, F.cross_entropy, batch, batch) < 1e-10


@needs_autograd_graph
def test_a_checkpointed_model_runs_eagerly_by_default_saying_how_to_compile_it():
    """Compiled, a checkpointed model holds more memory than the eager checkpointed step (the
    inner gradients keep their activations): by default it runs eagerly, exactly, and says
    so; graph='autograd' compiles it (the tests above)."""
    net = residual_mlp()
    fmodel = fm.functional_model(net, checkpoint_layers=["1", "2", "3"])
    support, query = sinusoid()
    opt = fm.optim.sgd(lr=0.1)
    theirs = meta_grads(net, lambda: plain(fmodel, F.mse_loss, opt, support, query, 2))
    with pytest.warns(UserWarning, match=r"runs eagerly: checkpoint_layers=\['1', '2', '3'\]"):
        step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, task_chunk=None)
    assert step.graph == "autograd"
    assert "pass graph='autograd' to compile it anyway" in (step.eager_reason or "")
    ours = meta_grads(net, lambda: step(support, query))
    assert relative(ours, theirs) == 0.0
