"""``fm.compile_meta_step``'s autograd graph: the eager step's own computation
(``torch.autograd.grad`` for every gradient) traced into one graph, where the installed torch
traces it. Which graph a step compiles is chosen by name, with its reason; models built with
``checkpoint_layers=`` compile on it (their layers torch activation checkpoint regions) and
give ``fm.adapt_tasks``' float64 meta-gradients to 1e-10: a residual MLP, conv4 with
BatchNorm, a transformers Llama decoder. The compiles here use torch's ``aot_eager`` backend
(dynamo and AOTAutograd, the graph run as traced: seconds, where inductor's C++ build takes
minutes on a small CPU); ``benchmarks/memory/compiled_checkpoint.py`` compiles with inductor."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import GRAPH_TORCH, tiny_llama
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
@pytest.mark.parametrize("steps", [False, True], ids=["layers", "layers and steps"])
def test_checkpointed_conv4_blocks_with_batchnorm_compile_with_the_plain_paths_meta_gradients(
    aot_eager, steps
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
    error = compiled_equals_plain(
        net, fmodel, F.cross_entropy, support, query, checkpoint_steps=steps
    )
    assert error < 1e-10


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


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[torch.fx.GraphModule]:
    """torch.compile through AOTAutograd (its rematerialization included) with the graphs it
    hands the backend recorded and run as they are."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    compile_ = torch.compile
    backend = aot_autograd(fw_compiler=record)

    def compile_recorded(fn, **kwargs):  # type: ignore[no-untyped-def]
        return compile_(fn, fullgraph=True, dynamic=False, backend=backend)

    monkeypatch.setattr(torch, "compile", compile_recorded)
    return graphs


def kept_bytes(gm: torch.fx.GraphModule) -> int:
    """The bytes the graph computes before its backward region (the outer gradient, marked
    ``phase: backward``) and reads in it: what it keeps in memory for the outer gradient."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    start = next(
        i for i, n in enumerate(nodes) if (n.meta.get("custom") or {}).get("phase") == "backward"
    )
    total = 0
    for n in nodes[:start]:
        value = n.meta.get("val")
        if isinstance(value, torch.Tensor) and any(index[u] >= start for u in n.users):
            total += value.numel() * value.element_size()
    return total


@needs_autograd_graph
@pytest.mark.slow
def test_the_compiled_step_recomputes_the_inner_gradients_and_steps_it_checkpoints(
    recorded, monkeypatch: pytest.MonkeyPatch
):
    """What the compiled graph keeps for its outer gradient. torch's rematerialization
    recomputes the checkpointed layers' forwards, but the inner gradients read what those
    forwards computed: without funcmeta's pass the checkpointed graph keeps nearly what the
    unchecked one does. With it, the layers' inner gradients are recomputed too, and
    checkpoint_steps recomputes whole steps: each keeps less, with the same meta-gradients."""
    from funcmeta._src.compiled import step as step_module

    support, query = sinusoid()
    opt = fm.optim.sgd(lr=0.1)

    def kept(layers, **options):  # type: ignore[no-untyped-def]
        net = residual_mlp()
        fmodel = fm.functional_model(net, checkpoint_layers=layers)
        theirs = meta_grads(
            net, lambda: plain(fmodel, F.mse_loss, opt, support, query, 3, **options)
        )
        step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=3, task_chunk=None, **options)
        ours = meta_grads(net, lambda: step(support, query))
        assert step.eager_reason is None, step.eager_reason
        assert relative(ours, theirs) < 1e-10
        return kept_bytes(recorded[-1])

    unchecked = kept(None)
    layers = kept(["1", "2", "3"])
    steps = kept(None, checkpoint_steps=True)
    both = kept(["1", "2", "3"], checkpoint_steps=True)
    monkeypatch.setattr(
        step_module, "recompute_inner_gradients", lambda mode: contextlib.nullcontext()
    )
    torch_alone = kept(["1", "2", "3"])
    assert torch_alone > 0.85 * unchecked  # the inner gradients keep the activations
    assert layers < 0.6 * torch_alone
    assert steps < 0.5 * unchecked
    assert both < layers and both < steps


@needs_autograd_graph
@pytest.mark.parametrize("layers", [None, ["1", "2", "3"]], ids=["plain", "checkpointed"])
def test_checkpoint_steps_compile_on_the_autograd_graph_with_the_plain_paths_meta_gradients(
    aot_eager, layers
):
    net = residual_mlp()
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    support, query = sinusoid()
    error = compiled_equals_plain(net, fmodel, F.mse_loss, support, query, checkpoint_steps=True)
    assert error < 1e-10


@needs_autograd_graph
def test_a_checkpointed_model_compiles_by_default_and_runs_eagerly_where_torch_lacks_the_pass(
    aot_eager, monkeypatch: pytest.MonkeyPatch
):
    """A checkpointed model compiles on the autograd graph by default. Where this torch lacks
    the rematerialization pass funcmeta extends, the compiled step would hold more memory than
    the eager checkpointed one: it runs eagerly, exactly, and says how to compile anyway."""
    from funcmeta._src.compiled import eager_reasons
    from funcmeta._src.compiled import step as step_module

    net = residual_mlp()
    fmodel = fm.functional_model(net, checkpoint_layers=["1", "2", "3"])
    support, query = sinusoid()
    opt = fm.optim.sgd(lr=0.1)
    theirs = meta_grads(net, lambda: plain(fmodel, F.mse_loss, opt, support, query, 2))
    step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, task_chunk=None)
    assert step.graph == "autograd" and step.eager_reason is None
    assert relative(meta_grads(net, lambda: step(support, query)), theirs) < 1e-10
    assert step.eager_reason is None

    monkeypatch.setattr(step_module, "can_recompute_inner_gradients", lambda: False)
    monkeypatch.setattr(eager_reasons, "can_recompute_inner_gradients", lambda: False)
    with pytest.warns(UserWarning, match=r"runs eagerly: checkpoint_layers=\['1', '2', '3'\]"):
        eager = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, task_chunk=None)
    assert "pass graph='autograd' to compile it anyway" in (eager.eager_reason or "")
    assert relative(meta_grads(net, lambda: eager(support, query)), theirs) == 0.0
    with pytest.warns(UserWarning, match="runs eagerly: checkpoint_steps=True"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, checkpoint_steps=True)


@needs_autograd_graph
@pytest.mark.parametrize("steps", [False, True], ids=["layers", "steps"])
def test_dropout_recomputed_in_the_graph_runs_eagerly_naming_the_layer(aot_eager, steps):
    """torch's rematerialization cannot recompute random operations: a checkpointed layer or
    step with dropout in training mode runs fm.adapt_tasks, exactly, saying why in the
    model's terms."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Tanh())
    net = nn.Sequential(nn.Linear(1, 16), body, nn.Linear(16, 1)).to(DTYPE)
    fmodel = fm.functional_model(net, checkpoint_layers=None if steps else ["1"])
    support, query = sinusoid()
    opt = fm.optim.sgd(lr=0.1)
    step = fm.compile_meta_step(
        fmodel, F.mse_loss, opt, steps=2, task_chunk=None, checkpoint_steps=steps
    )
    with pytest.warns(UserWarning, match="draws random numbers"):
        step(support, query)
    assert "'1.1' (Dropout)" in (step.eager_reason or "")


@GRAPH_TORCH
def test_the_recomputation_is_part_of_torchs_compile_cache_key() -> None:
    """torch's AOTAutograd cache keys a graph by its code, which the step annotations leave
    alone: while a step compiles with its recomputation, torch's cache key tag names the mode
    (after any tag of the user's), so a plain step's cached partition is not loaded for a
    checkpoint_steps step of the same model, nor the other way round."""
    from funcmeta._src.core import fence

    config = torch.compiler.config
    before = config.cache_key_tag
    tags = {}
    for mode in ("layers", "steps"):
        with fence.recompute_inner_gradients(mode):
            tags[mode] = config.cache_key_tag
        assert config.cache_key_tag == before
    assert tags["layers"] != tags["steps"] and before not in tags.values()
    assert all(fence.remat_cache_tag(m) in tags[m] for m in tags)
    with config.patch(cache_key_tag="mine"), fence.recompute_inner_gradients("steps"):
        assert config.cache_key_tag.startswith("mine|") and "steps" in config.cache_key_tag


@needs_autograd_graph
@pytest.mark.slow
def test_a_checkpoint_steps_step_does_not_load_a_plain_steps_cached_graph(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """In one process with one inductor cache, the plain step of a model compiles first, then
    the same model's checkpoint_steps step: the second misses torch's AOTAutograd cache and
    compiles its own partition (it loaded the plain one's before the key named the mode), and
    gives the same float64 meta-gradients."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    fmodel = fm.functional_model(net)
    support, query = sinusoid()
    grads, hits = [], []
    for steps_checkpointed in (False, True):
        before = counters["aot_autograd"]["autograd_cache_hit"]
        step = fm.compile_meta_step(
            fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=2, checkpoint_steps=steps_checkpointed
        )
        grads.append(meta_grads(net, lambda step=step: step(support, query)))
        assert step.eager_reason is None
        hits.append(counters["aot_autograd"]["autograd_cache_hit"] - before)
    assert hits == [0, 0]
    assert relative(grads[1], grads[0]) < 1e-12
