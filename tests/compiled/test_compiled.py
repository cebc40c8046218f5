"""``fm.compile_meta_step``: the meta-iteration as one graph gives the meta-gradients of the
plain path (``fm.adapt_tasks``, the query losses, ``backward``) and of the recipes, float64
to 1e-10: the graph's computation run eagerly in every configuration (cheap), and compiled
by ``torch.compile`` in a few (each compile takes seconds on a small CPU)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from helpers import GRAPH_TORCH
from torch import nn

import funcmeta as fm
from funcmeta._src.compiled.eager_reasons import autograd_untraceable
from funcmeta._src.core.capabilities import torch_release
from funcmeta._src.inner.inputs import split_batch

DTYPE = torch.float64


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1)
    ).to(DTYPE)


def conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).to(DTYPE)


def sinusoid(tasks: int = 4, seed: int = 0):
    b = fm.data.Sinusoid().sample(tasks, 5, 6, generator=torch.Generator().manual_seed(seed))
    cast = lambda pair: tuple(t.to(DTYPE) for t in pair)  # noqa: E731
    return cast(b.support), cast(b.query)


def images(tasks: int = 3):
    g = torch.Generator().manual_seed(1)
    ys = torch.arange(3).repeat(tasks, 2)
    support = (torch.randn(tasks, 6, 1, 8, 8, generator=g, dtype=DTYPE), ys)
    query = (torch.randn(tasks, 6, 1, 8, 8, generator=g, dtype=DTYPE), ys)
    return support, query


def setup(name: str):
    """``(net, fmodel, opt, hyper, options, loss_fn, (support, query))`` for a configuration."""
    net = conv() if name == "batchnorm" else mlp()
    fmodel = fm.functional_model(net)
    hyper: list[nn.Module] = []
    options: dict = {}
    loss_fn = F.cross_entropy if name == "batchnorm" else F.mse_loss
    data = images() if name == "batchnorm" else sinusoid()
    opt = fm.optim.sgd(lr=0.1)
    if name == "first-order":
        options["first_order"] = True
    elif name == "adam-per-layer-rates":
        rates = fm.hyper.per_layer(fmodel.params, 0.05, parameterization="softplus").to(DTYPE)
        opt, hyper = fm.optim.adam(lr=rates), [rates]
    elif name == "per-step-rates":
        rates = fm.hyper.per_tensor(fmodel.params, 0.1, steps=3).to(DTYPE)
        opt, hyper = fm.optim.sgd(lr=rates), [rates]
    elif name == "anil":
        options["trainable"] = ["4"]
    elif name == "clip":
        opt = fm.optim.chain(fm.optim.clip_by_global_norm(0.05), fm.optim.sgd(lr=0.1))
    elif name == "clip_grad_norm":  # the inner-loop option: each task's gradient clipped
        options["clip_grad_norm"] = 0.05
    elif name == "truncate":  # the first step without a graph, the second order after it
        options["truncate"] = 1
    elif name == "truncate-first-order-anil":
        options.update(truncate=2, first_order=True, trainable=["4"], allow_unused=True)
    return net, fmodel, opt, hyper, options, loss_fn, data


def meta_grads(net, hyper, run):
    for t in [*net.parameters(), *(p for h in hyper for p in h.parameters())]:
        t.grad = None
    loss = run()
    return loss, [
        t.grad.clone() for t in [*net.parameters(), *(p for h in hyper for p in h.parameters())]
    ]


def relative(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)) / max(
        y.abs().max().item() for y in b
    )


def falls_back_exactly(
    net, fmodel, loss_fn, support, query, steps: int, graph: str = "torch.func"
) -> None:
    """The step on a model it cannot compile (on the ``torch.func`` graph unless ``graph``
    says otherwise): it says once that it runs eagerly, keeps why, and gives the plain path's
    meta-gradients exactly."""
    opt = fm.optim.sgd(lr=0.1)
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=steps, compile=False)
    _, plain = meta_grads(net, [], lambda: reference(support, query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=steps, graph=graph)
    with pytest.warns(UserWarning, match="compile_meta_step runs eagerly"):
        _, ours = meta_grads(net, [], lambda: step(support, query))
    assert step.eager_reason is not None
    assert relative(ours, plain) == 0.0


def traced(step, support, query):
    """The graph's computation (grad_and_value of the meta-loss), run without compiling over
    the step's chunks of tasks, its gradients added to .grad as the compiled step does."""
    params = step.fmodel.params
    hyper = [dict(m.named_parameters()) for m in step.hyper]
    s, q = split_batch(support), split_batch(query)
    (gp, gh), loss = step.run_graph(step._uncompiled, params, hyper, s, q, support[0].shape[0])
    for tensors, grads in [(params, gp), *zip(hyper, gh, strict=True)]:
        for k, t in tensors.items():
            if t.requires_grad:
                t.grad = grads[k] if t.grad is None else t.grad + grads[k]
    return loss


GRAPHS = ["autograd", "torch.func"] if autograd_untraceable() is None else ["torch.func"]

CONFIGS = [
    "sgd",
    "first-order",
    "adam-per-layer-rates",
    "per-step-rates",
    "anil",
    "clip",
    "clip_grad_norm",
    "truncate",
    "truncate-first-order-anil",
    "batchnorm",
]


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("chunk", [None, 1, 3])
@pytest.mark.parametrize("name", CONFIGS)
def test_the_graphs_computation_gives_the_plain_paths_meta_gradients(name, chunk, graph):
    """Every configuration, all tasks in one graph or ``task_chunk`` at a time (with 4
    tasks and chunks of 3: chunks of two sizes), for both graphs: the eager step's own
    (``torch.autograd.grad``) and the ``torch.func`` one."""
    net, fmodel, opt, hyper, options, loss_fn, (support, query) = setup(name)
    steps = 3
    step = fm.compile_meta_step(
        fmodel,
        loss_fn,
        opt,
        steps=steps,
        hyper=hyper,
        compile=False,
        task_chunk=chunk,
        graph=graph,
        **options,
    )
    assert step.graph == graph
    tasks = support[0].shape[0]
    assert len(step.chunks(tasks)) == -(-tasks // (chunk or tasks))
    plain_loss, plain = meta_grads(net, hyper, lambda: step(support, query))
    ours_loss, ours = meta_grads(net, hyper, lambda: traced(step, support, query))
    assert relative(ours, plain) < 1e-10, name
    assert torch.allclose(ours_loss, plain_loss, rtol=1e-12, atol=0)
    if name == "anil":  # the body is held fixed in the inner loop and still learns
        assert net[0].weight.grad.abs().sum() > 0


def test_the_plain_path_is_the_per_task_loop():
    """The reference itself: fm.adapt per task, the mean of the query losses."""
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("adam-per-layer-rates")
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, hyper=hyper, compile=False)
    _, plain = meta_grads(net, hyper, lambda: step(support, query))

    def loop():
        losses = []
        for t in range(support[0].shape[0]):
            r = fm.adapt(
                fmodel, fmodel.params, loss_fn, (support[0][t], support[1][t]), opt, steps=2
            )
            losses.append(loss_fn(fmodel(r.params, query[0][t]), query[1][t]))
        loss = torch.stack(losses).mean()
        loss.backward()
        return loss

    _, looped = meta_grads(net, hyper, loop)
    assert relative(plain, looped) < 1e-10


@pytest.mark.parametrize("recipe", ["maml", "metasgd", "anil"])
def test_the_graphs_computation_gives_the_recipes_meta_gradients(recipe):
    net, fmodel, _, _, _, loss_fn, (support, query) = setup("sgd")
    hyper: list[nn.Module] = []
    options: dict = {}
    if recipe == "metasgd":
        rates = fm.hyper.per_element(fmodel.params, 0.05).to(DTYPE)
        hyper, opt = [rates], fm.optim.sgd(lr=rates)
        run = lambda: fm.recipes.metasgd(  # noqa: E731
            fmodel, fmodel.params, loss_fn, support, query, steps=2, lr=rates
        ).loss.backward()
    elif recipe == "anil":
        options["trainable"] = ["4"]
        opt = fm.optim.sgd(lr=0.1)
        run = lambda: fm.recipes.anil(  # noqa: E731
            fmodel, fmodel.params, loss_fn, support, query, steps=2, lr=0.1, trainable=["4"]
        ).loss.backward()
    else:
        opt = fm.optim.sgd(lr=0.1)
        run = lambda: fm.recipes.maml(  # noqa: E731
            fmodel, fmodel.params, loss_fn, support, query, steps=2, lr=0.1
        ).loss.backward()
    _, theirs = meta_grads(net, hyper, run)
    step = fm.compile_meta_step(
        fmodel, loss_fn, opt, steps=2, hyper=hyper, compile=False, **options
    )
    _, ours = meta_grads(net, hyper, lambda: traced(step, support, query))
    assert relative(ours, theirs) < 1e-10


@pytest.mark.slow
def test_compiled_once_per_kind_of_input_with_the_plain_paths_meta_gradients():
    """torch.compile for real (a small model: compiling takes seconds): Adam with learnable
    per-layer rates, float64, to 1e-10; the first call's time reported; the same shapes reuse
    the graph; new shapes compile again and say so."""
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("adam-per-layer-rates")
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, hyper=hyper, compile=False)
    _, plain = meta_grads(net, hyper, lambda: reference(support, query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, hyper=hyper)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _, ours = meta_grads(net, hyper, lambda: step(support, query))
        _, again = meta_grads(net, hyper, lambda: step(support, query))
    assert not [w for w in said if "compile_meta_step" in str(w.message)]  # no fallback, once
    assert step.eager_reason is None
    assert relative(ours, plain) < 1e-10
    assert relative(again, ours) < 1e-14
    assert len(step.compile_seconds) == 1 and next(iter(step.compile_seconds.values())) > 0
    more_support, more_query = sinusoid(tasks=5, seed=2)
    with pytest.warns(UserWarning, match="compiles again for a new kind of input"):
        step(more_support, more_query)
    assert len(step.compile_seconds) == 2


@pytest.mark.slow
def test_each_step_has_its_own_recompile_limit():
    """torch.compile stops compiling a function after its recompile limit (8 graphs); the
    steps of a process must not share one function, or the ninth model compiled in a process
    (a sweep over widths, a notebook) would run eagerly. With the limit at 2, three steps on
    three models all compile."""
    import torch._dynamo

    support, query = sinusoid()
    steps = []
    config = torch._dynamo.config  # torch 2.5 names the limit cache_size_limit
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{limit: 2}):
        for width in (2, 3, 4):
            torch.manual_seed(width)
            net = nn.Sequential(nn.Linear(1, width), nn.Tanh(), nn.Linear(width, 1)).to(DTYPE)
            step = fm.compile_meta_step(
                fm.functional_model(net), F.mse_loss, fm.optim.sgd(lr=0.1), steps=1
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step(support, query)
            steps.append(step)
    assert [s.eager_reason for s in steps] == [None, None, None]


@pytest.mark.slow
def test_compiled_in_chunks_of_tasks_gives_the_same_meta_gradients():
    """task_chunk=3 on 4 tasks, compiled for real: two kinds of chunk, both compiled by the
    first call without a warning, reused by the second; the meta-gradients of all tasks."""
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("sgd")
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, compile=False)
    plain_loss, plain = meta_grads(net, hyper, lambda: reference(support, query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, task_chunk=3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loss, ours = meta_grads(net, hyper, lambda: step(support, query))
        _, again = meta_grads(net, hyper, lambda: step(support, query))
    assert not [w for w in said if "compile_meta_step" in str(w.message)]
    assert step.eager_reason is None
    assert len(step.compile_seconds) == 2
    assert relative(ours, plain) < 1e-10
    assert relative(again, ours) < 1e-14
    assert torch.allclose(loss, plain_loss, rtol=1e-12, atol=0)


@pytest.mark.slow
def test_compiled_batchnorm_in_float32_is_as_close_to_float64_as_the_plain_path():
    """A conv net with BatchNorm (batch statistics), compiled for real in float32 ("auto":
    one task at a time on a CPU): its meta-gradient is no further from the float64 one than
    the plain path's float32 meta-gradient is. The two float32 results differ from each other
    by about as much as each differs from float64 (rounding in another order), so comparing
    them with each other would say nothing about which is right."""
    net64 = conv()
    support, query = images(tasks=4)
    net32 = conv().float()
    down = lambda pair: tuple(t.float() if t.is_floating_point() else t for t in pair)  # noqa: E731
    opt = fm.optim.sgd(lr=0.1)

    def plain(net, s, q):
        step = fm.compile_meta_step(
            fm.functional_model(net), F.cross_entropy, opt, steps=3, compile=False
        )
        return [g.double() for g in meta_grads(net, [], lambda: step(s, q))[1]]

    truth = plain(net64, support, query)
    eager = plain(net32, down(support), down(query))
    step = fm.compile_meta_step(fm.functional_model(net32), F.cross_entropy, opt, steps=3)
    ours = [g.double() for g in meta_grads(net32, [], lambda: step(down(support), down(query)))[1]]
    assert step.eager_reason is None and step.task_chunk == 1
    assert relative(eager, truth) > 1e-9  # float32 rounding is there to be measured
    assert relative(ours, truth) <= 2 * relative(eager, truth)


def test_options_this_torch_lacks_fall_back_to_the_defaults(monkeypatch):
    """An inductor option or mode that torch.compile refuses (an older torch) leaves the step
    compiled with torch.compile's defaults, and says which and why."""
    real = torch.compile
    given = []

    def picky(fn, **kwargs):
        given.append(kwargs)
        if "options" in kwargs or kwargs.get("mode"):
            raise RuntimeError("Unexpected optimization option layout_optimization")
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", picky)
    _, fmodel, opt, *_ = setup("sgd")
    step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1)
    assert step._compiled is not None and step.eager_reason is None
    assert "Unexpected optimization option" in step.options_note
    assert given[-1] == {"fullgraph": True, "dynamic": False}


def test_a_torch_without_the_max_pooling_choice_compiles_without_it_and_says_so(monkeypatch):
    """Where this torch lacks the names that make max pooling's backward aten's kernel, the
    step runs its graph as inductor lowers it, with the same meta-gradients, and says so."""
    import contextlib

    import funcmeta._src.compiled.plan as compiled_module

    @contextlib.contextmanager
    def lacking():
        yield False

    monkeypatch.setattr(compiled_module, "inductor_aten_max_pool_backward", lacking)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the graph's computation
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("sgd")
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, compile=False)
    _, plain = meta_grads(net, hyper, lambda: reference(support, query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2)
    _, ours = meta_grads(net, hyper, lambda: step(support, query))
    assert step.eager_reason is None
    assert "max pooling's backward compiles as inductor's own lowering" in step.options_note
    assert relative(ours, plain) < 1e-10


def test_auto_chunks_one_task_at_a_time_for_conv_nets_on_a_cpu():
    """``task_chunk="auto"`` (the default): one task per graph call for a model with
    convolutions on a CPU, all tasks at once otherwise; a number or None is kept."""
    _, conv_model, opt, *_ = setup("batchnorm")
    _, mlp_model, *_ = setup("sgd")
    auto = lambda fmodel, **kw: fm.compile_meta_step(  # noqa: E731
        fmodel, F.mse_loss, opt, steps=1, compile=False, **kw
    )
    assert auto(conv_model).task_chunk == 1
    assert auto(mlp_model).task_chunk is None
    assert auto(conv_model, task_chunk=None).task_chunk is None
    assert auto(mlp_model, task_chunk=2).task_chunk == 2


class Branching(nn.Module):
    """A forward that branches on a tensor's value: vmap refuses it, so the step cannot be
    one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, x):
        y = self.lin(x)
        return y if y.sum() > 0 else -y


def test_what_cannot_be_compiled_runs_eagerly_with_the_same_numbers_and_says_why():
    torch.manual_seed(0)
    net = Branching().to(DTYPE)
    fmodel = fm.functional_model(net)
    support, query = sinusoid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # task batching's own note that the model runs per task
        falls_back_exactly(net, fmodel, F.mse_loss, support, query, steps=1)


class SelfCheckpointing(nn.Module):
    """A model that checkpoints part of its forward itself (torch.utils.checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(1, 8), nn.Linear(8, 1)

    def forward(self, x):
        inner = lambda t: torch.tanh(self.a(t))  # noqa: E731
        return self.b(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False))


def test_a_self_checkpointing_model_runs_eagerly_and_leaves_checkpoint_working():
    """torch.func's gradients refuse the checkpoint's saved-tensor hooks, so the graph
    cannot be compiled (every torch tested but 2.11, whose graph holds it and must give the
    plain path's meta-gradients); the failed compile must not leave the hooks off (torch
    does): the eager path, and any later checkpoint of the process, still work, with the plain
    path's numbers."""
    torch.manual_seed(0)
    net = SelfCheckpointing().to(DTYPE)
    fmodel = fm.functional_model(net)
    support, query = sinusoid()
    if torch_release()[:2] == (2, 11):
        # torch 2.11's dynamo compiles the checkpoint inside torch.func.grad: the graph's
        # meta-gradients must then be the plain path's
        opt = fm.optim.sgd(lr=0.1)
        reference = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, compile=False)
        _, plain = meta_grads(net, [], lambda: reference(support, query))
        step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, graph="torch.func")
        _, ours = meta_grads(net, [], lambda: step(support, query))
        assert step.eager_reason is None and relative(ours, plain) < 1e-12
    else:
        falls_back_exactly(net, fmodel, F.mse_loss, support, query, steps=2)
    x = torch.randn(3, 1, dtype=DTYPE, requires_grad=True)
    torch.utils.checkpoint.checkpoint(torch.tanh, x, use_reentrant=False).sum().backward()
    assert torch.allclose(x.grad, 1 - torch.tanh(x.detach()) ** 2)


class SequenceClassifier(nn.Module):
    """An LSTM or a transformer encoder layer, then a linear head on the last step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "lstm":
            self.body: nn.Module = nn.LSTM(8, 8, batch_first=True)
        else:
            self.body = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x)
        return self.head((h[0] if self.kind == "lstm" else h)[:, -1])


@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_real_sequence_models_fall_back_with_the_plain_paths_numbers(kind):
    """An LSTM (no vmap rule inside a compiled graph) and a transformer encoder layer (its
    attention kernel has no double backward on a CPU) cannot be one graph: the step says
    why and gives the plain path's meta-gradients exactly."""
    torch.manual_seed(0)
    net = SequenceClassifier(kind).to(DTYPE)
    fmodel = fm.functional_model(net)
    g = torch.Generator().manual_seed(0)
    support = (torch.randn(2, 4, 5, 8, generator=g, dtype=DTYPE), torch.randint(0, 3, (2, 4)))
    query = (torch.randn(2, 4, 5, 8, generator=g, dtype=DTYPE), torch.randint(0, 3, (2, 4)))
    falls_back_exactly(net, fmodel, F.cross_entropy, support, query, steps=2)


@GRAPH_TORCH
def test_the_inner_loop_options_compile_with_the_plain_paths_meta_gradients():
    """torch.compile for real on the options the graph holds beside first_order and
    trainable: clip_grad_norm, truncate and allow_unused, float64, to 1e-10."""
    net, fmodel, opt, _, _, loss_fn, (support, query) = setup("sgd")
    options = {"clip_grad_norm": 0.05, "truncate": 1, "allow_unused": True}
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, compile=False, **options)
    _, plain = meta_grads(net, [], lambda: reference(support, query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, **options)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _, ours = meta_grads(net, [], lambda: step(support, query))
    assert not [w for w in said if "compile_meta_step" in str(w.message)]  # no fallback
    assert step.eager_reason is None
    assert relative(ours, plain) < 1e-10


UNTRACED_OPTIONS = [
    {"checkpoint_steps": True},
    {"offload_activations": True},
    {"on_nonfinite": "raise"},
    {"loss_scale": 8.0},
    {"loss_scale": torch.amp.GradScaler("cpu", init_scale=8.0)},
]


@pytest.mark.parametrize("option", UNTRACED_OPTIONS, ids=lambda o: next(iter(o)))
def test_an_option_the_graph_cannot_hold_runs_eagerly_naming_it(option):
    """compile_meta_step accepts every option of fm.adapt_tasks: one a graph cannot hold
    makes the step run fm.adapt_tasks with it, and the warning and eager_reason name it;
    the meta-gradients are those of fm.adapt_tasks with the option."""
    name = next(iter(option))
    net, fmodel, opt, _, _, loss_fn, (support, query) = setup("sgd")

    def plain():
        result = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, opt, steps=2, **option)
        loss = fm.task_losses(fmodel, result.params, loss_fn, query, buffers=result.buffers)
        loss.losses.mean().backward()
        return loss.losses.mean()

    _, theirs = meta_grads(net, [], plain)
    # checkpoint_steps compiles on the autograd graph (tests/compiled/test_compiled_autograd.py)
    graph = "torch.func" if name == "checkpoint_steps" else "auto"
    with pytest.warns(UserWarning, match=f"compile_meta_step runs eagerly: {name}="):
        step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, graph=graph, **option)
    assert step.eager_reason is not None and step.eager_reason.startswith(f"{name}=")
    assert f"leave {name} out to compile" in step.eager_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, when the step was made
        _, ours = meta_grads(net, [], lambda: step(support, query))
    assert relative(ours, theirs) == 0.0


@pytest.mark.parametrize("order", ["second", "first"])
def test_the_torch_func_graph_runs_a_checkpointed_model_eagerly_naming_its_layers(order):
    """compile_meta_step(graph="torch.func") on a model built with checkpoint_layers= runs
    fm.adapt_tasks on the checkpointed layers (that graph would run the module without them):
    the warning and eager_reason name the layers and what is missing; the meta-gradients are
    those of fm.adapt_tasks on the same checkpointed model, exactly, in float64."""
    torch.manual_seed(0)
    net = mlp().double()
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    opt = fm.optim.sgd(lr=0.1)
    support, query = (tuple(t.double() for t in part) for part in sinusoid(tasks=4))
    first = order == "first"

    def plain():
        result = fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, support, opt, steps=2, first_order=first
        )
        loss = fm.task_losses(fmodel, result.params, F.mse_loss, query, buffers=result.buffers)
        loss.losses.mean().backward()
        return loss.losses.mean()

    _, theirs = meta_grads(net, [], plain)
    with pytest.warns(UserWarning, match=r"runs eagerly: checkpoint_layers=\['0', '2', '4'\]"):
        step = fm.compile_meta_step(
            fmodel, F.mse_loss, opt, steps=2, first_order=first, graph="torch.func"
        )
    assert "torch.func.functional_call, without funcmeta's checkpointed layers" in (
        step.eager_reason or ""
    )
    assert "build the model without checkpoint_layers to compile" in step.eager_reason
    _, ours = meta_grads(net, [], lambda: step(support, query))
    assert relative(ours, theirs) == 0.0


def test_every_option_of_adapt_tasks_is_compiled_or_named():
    """The options compile_meta_step compiles and those it names cover AdaptOptions."""
    from dataclasses import fields

    from funcmeta._src.compiled.eager_reasons import UNTRACED

    traced = {"first_order", "trainable", "clip_grad_norm", "truncate", "allow_unused"}
    assert traced | set(UNTRACED) == {f.name for f in fields(fm.AdaptOptions)}
    covered = {k for name in CONFIGS for k in setup(name)[4]}
    assert traced <= covered  # each is checked against the plain path above


def test_bad_calls_are_named():
    net, fmodel, opt, *_ = setup("sgd")
    with pytest.raises(TypeError, match="unknown option 'checkpoint_step'"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, checkpoint_step=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="truncate must be"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, truncate=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_nonfinite='skip' is not available with task"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, on_nonfinite="skip")
    with pytest.raises(ValueError, match=r"truncate must be an int in \[0, steps=1\]"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, truncate=2)
    with pytest.raises(ValueError, match="steps"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=0)
    with pytest.raises(
        ValueError, match="task_chunk must be a positive int, 'auto' or None, got 0"
    ):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, task_chunk=0)
    with pytest.raises(TypeError, match=r"hyper\[0\] is a float"):
        fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, hyper=[0.1])
    with pytest.raises(TypeError, match="expects a FunctionalModel"):
        fm.compile_meta_step(net, F.mse_loss, opt, steps=1)
    step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=1, compile=False)
    support, _ = sinusoid(tasks=4)
    _, query = sinusoid(tasks=3)
    with pytest.raises(ValueError, match="support holds 4 tasks and query 3"):
        step(support, query)


def identity_compile(monkeypatch):
    """torch.compile as the identity: the step runs the graph's computation uncompiled."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


def test_the_first_call_raises_the_plain_paths_errors_the_graph_cannot_see(monkeypatch):
    """In the graph, torch.func.grad gives a zero gradient where autograd finds that the inner
    loss does not depend on an adapted parameter; the step runs the plain path's check once,
    before its first graph call, and raises what fm.adapt_tasks raises."""
    identity_compile(monkeypatch)
    _, fmodel, opt, _, _, _, (support, query) = setup("sgd")

    def constant(out, y):  # no gradient history to the parameters
        return (y**2).mean()

    with pytest.raises(ValueError, match="does not depend on the adapted parameters"):
        fm.adapt_tasks(fmodel, fmodel.params, constant, support, opt, steps=1)
    step = fm.compile_meta_step(fmodel, constant, opt, steps=1)
    with pytest.raises(ValueError, match="does not depend on the adapted parameters"):
        step(support, query)

    torch.manual_seed(0)
    spare = nn.Sequential(mlp(), nn.Linear(1, 1).to(DTYPE))  # the last layer is never run
    spare.forward = spare[0].forward  # type: ignore[method-assign]
    unused = fm.functional_model(spare)
    step = fm.compile_meta_step(unused, F.mse_loss, opt, steps=1)
    with pytest.raises(ValueError, match=r"does not depend on the adapted parameters \['1.bias'"):
        step(support, query)
    step = fm.compile_meta_step(unused, F.mse_loss, opt, steps=1, allow_unused=True)
    step(support, query)
    assert step.eager_reason is None


INPUT_FORMS = {
    "tensor": lambda x: x,
    "tuple": lambda x: (x,),
    "dict": lambda x: {"input": x},
    "Args": lambda x: fm.Args(x),
}


@pytest.mark.parametrize("form", sorted(INPUT_FORMS))
@pytest.mark.parametrize(("chunk", "checked"), [(1, 1), (3, 3), (None, 4)])
def test_the_check_runs_on_the_tasks_of_the_first_graph_call(monkeypatch, chunk, checked, form):
    """The plain path's check runs the inner loop on the tasks the first graph call takes
    (one where the step runs one a call), once, whatever form the inputs take; the unused
    parameter is still found on them."""
    import funcmeta._src.compiled.step as step_module
    from funcmeta._src.inner.inputs import split_batch, task_count

    identity_compile(monkeypatch)
    _, fmodel, opt, _, _, loss_fn, ((xs, ys), (xq, yq)) = setup("sgd")
    wrap = INPUT_FORMS[form]
    support, query = (wrap(xs), ys), (wrap(xq), yq)
    seen: list[int] = []
    adapt_tasks = step_module.adapt_tasks

    def counted(fmodel, params, loss_fn, support, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(task_count(split_batch(support)))
        return adapt_tasks(fmodel, params, loss_fn, support, *args, **kwargs)

    monkeypatch.setattr(step_module, "adapt_tasks", counted)
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1, task_chunk=chunk)
    step(support, query)
    step(support, query)
    assert seen == [checked]
    assert step.eager_reason is None

    torch.manual_seed(0)
    spare = nn.Sequential(mlp(), nn.Linear(1, 1).to(DTYPE))  # the last layer is never run
    spare.forward = spare[0].forward  # type: ignore[method-assign]
    step = fm.compile_meta_step(
        fm.functional_model(spare), F.mse_loss, opt, steps=1, task_chunk=chunk
    )
    with pytest.raises(ValueError, match=r"does not depend on the adapted parameters \['1.bias'"):
        step(support, query)


def test_the_first_compiled_call_on_a_cpu_starts_inductors_vector_probe(monkeypatch):
    """Once, before the first graph call of a compiled step on a CPU (its C++ builds beside
    the check and dynamo's trace); a step that runs eagerly starts none."""
    import funcmeta._src.compiled.step as step_module

    identity_compile(monkeypatch)
    _, fmodel, opt, _, _, loss_fn, (support, query) = setup("sgd")
    started: list[int] = []
    monkeypatch.setattr(step_module, "probe_cpu_vector_isa", lambda: started.append(1))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1)
    step(support, query)
    step(support, query)
    assert started == [1]
    eager = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1, compile=False)
    eager(support, query)
    assert started == [1]


def test_inductors_vector_probe_runs_once_a_process_and_gives_inductors_choice():
    """The probe's thread is started once; joined, it has filled inductor's own cache of the
    instruction sets, from which inductor's choice is then read."""
    from funcmeta._src.core.fence import probe_cpu_vector_isa

    cpu_vec_isa = pytest.importorskip("torch._inductor.cpu_vec_isa")
    thread = probe_cpu_vector_isa()
    assert thread is not None and probe_cpu_vector_isa() is thread
    thread.join(timeout=300)
    assert not thread.is_alive()
    cached = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    if cached is not None:  # a torch that caches it as torch 2.13 does
        assert cached().currsize == 1
    assert isinstance(cpu_vec_isa.pick_vec_isa(), cpu_vec_isa.VecISA)


@GRAPH_TORCH
def test_inductors_vector_probe_imports_nothing_in_its_thread(tmp_path):
    """Everything the probe's thread imports is imported before it starts (no module is
    imported by two threads at once), on a new cache directory, where it builds."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from funcmeta._src.core.fence import probe_cpu_vector_isa\n"
        "before = set(sys.modules)\n"
        "thread = probe_cpu_vector_isa()\n"
        "started = set(sys.modules)\n"
        "thread.join(timeout=300)\n"
        "print(sorted(set(sys.modules) - started), len(started - before) > 0)\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[] True"


def test_the_check_leaves_the_random_draws_to_the_graph(monkeypatch):
    """The check runs once and restores the generators (its dropout draws included): the
    graph draws what it would have."""
    identity_compile(monkeypatch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 12), nn.Dropout(0.5), nn.Tanh(), nn.Linear(12, 1)).to(DTYPE)
    fmodel = fm.functional_model(net.train())
    support, query = sinusoid()
    step = fm.compile_meta_step(fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=2)
    seen: list[torch.Tensor] = []
    graph = step._compiled_step

    def watched(*args):
        seen.append(torch.get_rng_state())
        return graph(*args)

    monkeypatch.setattr(step, "_compiled_step", watched)
    before = torch.get_rng_state()
    step(support, query)
    assert step._checked and torch.equal(seen[0], before)
    step(support, query)  # checked once
    assert len(seen) == 2


def test_under_no_grad_the_step_computes_the_query_loss_only(monkeypatch):
    """As fm.adapt_tasks and fm.task_losses under torch.no_grad(): a loss, no meta-gradient."""
    identity_compile(monkeypatch)
    net, fmodel, opt, _, _, loss_fn, (support, query) = setup("sgd")
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2)
    for p in net.parameters():
        p.grad = None
    with torch.no_grad():
        loss = step(support, query)
    assert all(p.grad is None for p in net.parameters())
    with torch.no_grad():
        result = fm.adapt_tasks(fmodel, fmodel.params, loss_fn, support, opt, steps=2)
        plain = fm.task_losses(fmodel, result.params, loss_fn, query, buffers=result.buffers)
    assert torch.equal(loss, plain.losses.mean())


def test_auto_on_a_cpu_is_the_rule_of_functional_models_auto():
    """A model without convolutions on a CPU: ``task_chunk="auto"`` chunks the graph calls as
    fm.functional_model's ``"auto"`` chunks the forward (all tasks for a small model, one at
    a time here: a million parameters times 2,000 inputs per task), with the plain path's
    meta-gradients."""
    from funcmeta._src.batching.chunks import rule_chunk

    torch.manual_seed(0)
    small = fm.compile_meta_step(
        fm.functional_model(mlp()), F.mse_loss, fm.optim.sgd(lr=0.1), steps=1
    )
    assert small.plan.task_chunk == "rule" and small.chunks(4, inputs_per_task=5) == [(0, 4)]
    net = nn.Linear(1000, 1000).to(DTYPE)
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=1e-3)
    g = torch.Generator().manual_seed(0)
    support = (
        torch.randn(4, 2, 1000, generator=g, dtype=DTYPE),
        torch.randn(4, 2, 1000, generator=g, dtype=DTYPE),
    )
    query = (
        torch.randn(4, 2, 1000, generator=g, dtype=DTYPE),
        torch.randn(4, 2, 1000, generator=g, dtype=DTYPE),
    )
    step = fm.compile_meta_step(fmodel, F.mse_loss, opt, steps=2, compile=False)
    assert rule_chunk(4, inputs_per_task=2000, parameters=1_001_000, device="cpu") == 1
    plain_loss, plain = meta_grads(net, [], lambda: step(support, query))
    ours_loss, ours = meta_grads(net, [], lambda: traced(step, support, query))
    assert step.task_chunk == 1  # four graph calls of one task
    assert relative(ours, plain) < 1e-10
    assert torch.allclose(ours_loss, plain_loss, rtol=1e-12, atol=0)


@GRAPH_TORCH
def test_torch_compile_still_traces_no_checkpoint_inside_torch_func_grad():
    """Why a checkpointed model's step runs eagerly (eager_reasons.checkpointed_layers): under
    torch.compile, torch.utils.checkpoint inside torch.func.grad raises (saved-tensor hooks
    are refused there). When a torch traces it, this test fails: the compiled step can then
    take checkpointed layers, and the reason must change."""
    from funcmeta._src.core.fence import saved_tensor_hooks_state, set_saved_tensor_hooks_state

    def loss(x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False).sum()

    graph = torch.compile(torch.func.grad(loss), fullgraph=True, backend="eager")
    hooks = saved_tensor_hooks_state()
    try:
        with pytest.raises(Exception, match="saved tensor hooks"):
            graph(torch.ones(3))
    finally:
        set_saved_tensor_hooks_state(hooks)  # a failed trace inside torch.func leaves them off
    assert "torch.compile traces no checkpoint inside torch.func.grad" in (
        fm.compile_meta_step(
            fm.functional_model(nn.Sequential(nn.Linear(1, 1)), checkpoint_layers="sequential"),
            F.mse_loss,
            fm.optim.sgd(lr=0.1),
            steps=1,
            graph="torch.func",
        ).eager_reason
        or ""
    )
