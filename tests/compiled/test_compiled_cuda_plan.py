"""``fm.compile_meta_step`` on CUDA, asked on a CPU: which mode, inductor options and task
chunks a CUDA device gets (``compile_plan``, a pure function), and the step's handling of
CUDA graphs with a stand-in for one: a graph that writes every replay into the same output
tensors, as a CUDA graph does, must leave ``.grad`` holding the plain path's sum over steps
and chunks; a new batch shape compiles again; a CUDA graph inductor skips is named once.
The tests marked ``cuda`` run the same on a GPU (``make gpu-check``)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import GRAPH_TORCH
from test_compiled import conv, images, meta_grads, relative, setup, sinusoid

import funcmeta as fm
import funcmeta._src.compiled.step as compiled_module
from funcmeta._src.compiled.plan import compile_plan
from funcmeta._src.core import fence, tree

# ---------------------------------------------------------------- the plan per device

CPU_OPTIONS = {"cpp_wrapper": True, "layout_optimization": False}
CUDA_CONV_OPTIONS = {"triton.cudagraphs": True, "layout_optimization": False}


@pytest.mark.parametrize(
    ("device", "convolutional", "mode", "chunk", "expected"),
    [
        # device, conv net, mode, task_chunk -> (mode, CUDA graphs, task_chunk)
        ("cpu", False, None, "auto", (None, False, "rule")),  # functional_model's rule
        ("cpu", True, None, "auto", (None, False, 1)),
        ("cuda", False, None, "auto", ("reduce-overhead", True, None)),
        ("cuda", True, None, "auto", ("reduce-overhead", True, 1)),
        ("cuda", True, None, None, ("reduce-overhead", True, None)),
        ("cuda", False, None, 4, ("reduce-overhead", True, 4)),
        ("cuda", False, "default", "auto", ("default", False, None)),
        ("cuda", True, "max-autotune", "auto", ("max-autotune", True, 1)),
        (
            "cuda",
            False,
            "max-autotune-no-cudagraphs",
            "auto",
            ("max-autotune-no-cudagraphs", False, None),
        ),
        ("cpu", False, "reduce-overhead", "auto", ("reduce-overhead", False, "rule")),
        ("mps", True, None, "auto", (None, False, None)),
    ],
)
def test_each_device_gets_its_plan(device, convolutional, mode, chunk, expected):
    plan = compile_plan(device, convolutional, mode, chunk)
    assert (plan.mode, plan.cuda_graphs, plan.task_chunk) == expected
    assert plan.device == device


def test_the_plans_options_and_lowering():
    """On a CPU: the C++ wrapper, the model's layout, the graph passes, aten's max-pooling
    backward. On CUDA: the mode alone for an MLP; for a conv net the options that spell
    reduce-overhead out (torch.compile takes a mode or options) plus the model's layout, and
    inductor's own lowerings; a mode given is passed as it is."""
    cpu = compile_plan("cpu", True)
    assert cpu.options == CPU_OPTIONS and cpu.graph_passes
    given = cpu.compile_kwargs()["options"]
    assert CPU_OPTIONS.items() <= given.items()
    assert set(given) - set(CPU_OPTIONS) <= {
        "post_grad_custom_post_pass",
        "cpp_wrapper_build_separate",
    }
    assert cpu.separate_build and not compile_plan("cuda", True).separate_build
    assert cpu.lowering is fence.inductor_aten_max_pool_backward
    assert cpu == compile_plan("cpu", True)  # pure: the same question, the same plan
    mlp = compile_plan("cuda", False)
    assert mlp.options is None and mlp.compile_kwargs() == {"mode": "reduce-overhead"}
    assert mlp.lowering is contextlib.nullcontext and mlp.note is None
    convnet = compile_plan("cuda", True)
    assert convnet.compile_kwargs() == {"options": CUDA_CONV_OPTIONS}
    assert convnet.lowering is contextlib.nullcontext
    assert compile_plan("cuda", True, "default").compile_kwargs() == {"mode": "default"}
    assert "CUDA tensors only" in compile_plan("cpu", False, "reduce-overhead").note


def test_the_cpu_plan_builds_the_wrapper_apart_where_inductor_can(monkeypatch):
    """The C++ wrapper is built apart from the kernels where this torch's inductor has the
    option, and the options leave it out where it has not (torch.compile refuses an unknown
    option, and the step would then compile without any of the plan's options)."""
    import funcmeta._src.compiled.plan as plan_module

    cpu = compile_plan("cpu", False)
    known = fence.inductor_has_option("cpp_wrapper_build_separate")
    assert cpu.compile_kwargs()["options"].get("cpp_wrapper_build_separate") is (known or None)
    monkeypatch.setattr(plan_module, "inductor_has_option", lambda name: False)
    assert "cpp_wrapper_build_separate" not in cpu.compile_kwargs()["options"]
    assert fence.inductor_has_option("cpp.threads") and not fence.inductor_has_option("cpp.nope")
    assert not fence.inductor_has_option("no_such_option")


def test_a_recomputing_graph_is_compiled_without_the_locality_reorder(monkeypatch):
    """A plan whose graph recomputes checkpointed layers or steps (``remat``) asks inductor
    not to move producers next to their consumers, on every device; a mode is written out
    as the options torch.compile applies for it; a torch without the option gets none."""
    import dataclasses

    import funcmeta._src.compiled.plan as plan_module

    def remat(plan):
        return dataclasses.replace(plan, remat=True).compile_kwargs()

    assert fence.inductor_has_option("reorder_for_locality")  # the torch this suite runs
    cpu = compile_plan("cpu", False)
    assert not cpu.remat and "reorder_for_locality" not in cpu.compile_kwargs()["options"]
    assert remat(cpu)["options"]["reorder_for_locality"] is False
    assert remat(compile_plan("cuda", False)) == {
        "options": {"triton.cudagraphs": True, "reorder_for_locality": False}
    }
    assert remat(compile_plan("cuda", True)) == {
        "options": {**CUDA_CONV_OPTIONS, "reorder_for_locality": False}
    }
    assert remat(compile_plan("cuda", True, "default")) == {
        "options": {"reorder_for_locality": False}
    }
    from torch._inductor import list_mode_options

    autotune = remat(compile_plan("cuda", False, "max-autotune"))["options"]
    assert autotune == {**list_mode_options("max-autotune", False), "reorder_for_locality": False}
    assert fence.inductor_mode_options("no-such-mode") is None
    assert remat(compile_plan("cuda", False, "no-such-mode")) == {"mode": "no-such-mode"}
    monkeypatch.setattr(plan_module, "inductor_has_option", lambda name: False)
    assert "reorder_for_locality" not in remat(cpu)["options"]
    assert remat(compile_plan("cuda", False)) == {"mode": "reduce-overhead"}


def _spied_compile(monkeypatch):
    given = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: given.append(kwargs) or fn)
    return given


@pytest.mark.parametrize(
    ("layers", "steps_checkpointed", "recomputes"),
    [("sequential", False, True), (None, True, True), (None, False, False)],
)
@GRAPH_TORCH
def test_a_recomputing_step_compiles_without_the_locality_reorder(
    monkeypatch, layers, steps_checkpointed, recomputes
):
    """The step of a model with ``checkpoint_layers``, or with ``checkpoint_steps``, marks its
    plan ``remat`` and torch.compile gets ``reorder_for_locality=False``; a plain step's
    options are its plan's."""
    given = _spied_compile(monkeypatch)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    step = fm.compile_meta_step(
        fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=2, checkpoint_steps=steps_checkpointed
    )
    assert step.eager_reason is None and step.plan.remat is recomputes
    (kwargs,) = given
    assert kwargs["options"].get("reorder_for_locality", True) is (not recomputes)
    plain = compile_plan("cpu", False)
    assert set(kwargs["options"]) - set(plain.compile_kwargs()["options"]) == (
        {"reorder_for_locality"} if recomputes else set()
    )


@GRAPH_TORCH
def test_a_recomputing_step_on_cuda_writes_its_mode_out(monkeypatch):
    """On CUDA the plan's reduce-overhead becomes its options, with the order kept, and the
    step still replays CUDA graphs."""
    given = _spied_compile(monkeypatch)
    on_cuda(monkeypatch)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    fmodel = fm.functional_model(net, checkpoint_layers="sequential")
    step = fm.compile_meta_step(fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=1)
    assert step.plan.remat and step.plan.cuda_graphs and step.plan.mode == "reduce-overhead"
    assert given == [
        {
            "fullgraph": True,
            "dynamic": False,
            "options": {"triton.cudagraphs": True, "reorder_for_locality": False},
        }
    ]


@pytest.mark.slow
def test_inductor_runs_the_locality_reorder_only_where_the_option_lets_it(monkeypatch):
    """The option the plan sets is the gate of the pass it means: inductor runs
    ``reorder_for_locality`` on a graph it compiles for inference unless the option is off
    (a torch that renamed or moved the pass would make the option a no-op)."""
    from torch._inductor.fx_passes import post_grad

    calls = []
    original = post_grad.reorder_for_locality
    monkeypatch.setattr(
        post_grad, "reorder_for_locality", lambda graph: calls.append(1) or original(graph)
    )
    from torch._inductor import config

    torch._dynamo.reset()
    for keep_order in (False, True):
        calls.clear()
        fn = torch.compile(
            lambda x: (x.sin() + 1).cos() * x,
            fullgraph=True,
            dynamic=False,
            options={"reorder_for_locality": not keep_order},
        )
        with config.patch(force_disable_caches=True):
            fn(torch.randn(8))
        assert bool(calls) is (not keep_order)
        torch._dynamo.reset()


def test_reduce_overhead_is_the_cudagraphs_option():
    """The CUDA conv plan writes reduce-overhead as inductor's option: it must be all the
    mode sets on this torch."""
    from torch._inductor import list_mode_options

    assert list_mode_options("reduce-overhead") == {"triton.cudagraphs": True}
    assert list_mode_options("max-autotune")["triton.cudagraphs"] is True


def on_cuda(monkeypatch) -> None:
    """The step plans as for a model on CUDA (the tensors stay on the CPU)."""
    monkeypatch.setattr(compiled_module, "_device", lambda fmodel: "cuda", raising=False)


def test_a_step_on_cuda_compiles_as_its_plan_says(monkeypatch):
    """What torch.compile gets for a conv net on CUDA, and the chunk "auto" picks."""
    given = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: given.append(kwargs) or fn)
    on_cuda(monkeypatch)
    _, fmodel, opt, *_ = setup("batchnorm")
    step = fm.compile_meta_step(fmodel, F.cross_entropy, opt, steps=1)
    assert step.plan == compile_plan("cuda", True)
    assert step.task_chunk == 1
    assert given == [{"fullgraph": True, "dynamic": False, "options": CUDA_CONV_OPTIONS}]


# ---------------------------------------------------------------- a CUDA graph's outputs


class Replaying:
    """A stand-in for a compiled function under CUDA graphs: each kind of input has output
    tensors of its own that every call writes its results into and returns (the same
    objects), and every call first overwrites the outputs of all earlier calls (one memory
    pool), as a replay does. ``marks`` counts ``cudagraph_mark_step_begin``."""

    def __init__(self, fn):
        self.fn = fn
        self.outputs: dict = {}
        self.calls = 0
        self.marks = 0

    def __call__(self, *args):
        self.calls += 1
        result = self.fn(*args)
        for outputs in self.outputs.values():
            for t in outputs:
                t.fill_(float("nan"))
        flat, spec = tree.flatten_registered(result)
        key = tuple(tuple(x.shape) for x in tree.leaves_registered(args) if torch.is_tensor(x))
        if key not in self.outputs:
            self.outputs[key] = [x.clone() for x in flat]
        for mine, new in zip(self.outputs[key], flat, strict=True):
            mine.copy_(new)
        return tree.unflatten_registered(self.outputs[key], spec)

    def mark(self):
        self.marks += 1


def replaying(monkeypatch) -> list[Replaying]:
    """torch.compile gives a :class:`Replaying` of the graph's computation; the list holds
    each one made."""
    made: list[Replaying] = []

    def compile(fn, **kwargs):
        made.append(Replaying(fn))
        return made[-1]

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", lambda: made[-1].mark(), raising=False
    )
    on_cuda(monkeypatch)
    return made


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_cuda_graphs_reused_outputs_leave_grad_the_plain_paths_sum(monkeypatch, chunk):
    """Two steps on two batches, ``.grad`` not zeroed between them (gradient accumulation):
    it holds the sum of the plain path's meta-gradients, and each step's returned loss stays
    its own, where every graph call writes into the tensors the last one returned. With 4
    tasks in chunks of 3: two graphs, each call after the other's. Each graph call is a new
    step for CUDA graph trees."""
    made = replaying(monkeypatch)
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("sgd")
    support2, query2 = sinusoid(seed=3)
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, compile=False)

    def two(step):
        first = step(support, query)
        second = step(support2, query2)
        return torch.stack([first, second])

    plain_losses, plain = meta_grads(net, hyper, lambda: two(reference))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, task_chunk=chunk)
    losses, ours = meta_grads(net, hyper, lambda: two(step))
    assert relative(ours, plain) < 1e-10
    assert torch.allclose(losses, plain_losses, rtol=1e-12, atol=0)
    assert step.eager_reason is None and step.plan.cuda_graphs
    (graph,) = made
    assert graph.calls == 2 * len(step.chunks(4)) == graph.marks
    sizes = {stop - start for start, stop in step.chunks(4)}
    assert step.graph_note is None and len(step.compile_seconds) == len(sizes)


def test_a_new_batch_shape_on_cuda_graphs_compiles_its_own_graph(monkeypatch):
    """A batch of another shape: the step says it compiles again, records the new kind's
    seconds, and gives that batch's meta-gradients, with the first shape's outputs
    overwritten meanwhile."""
    made = replaying(monkeypatch)
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("sgd")
    more_support, more_query = sinusoid(tasks=5, seed=2)
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1, compile=False)
    _, plain = meta_grads(net, hyper, lambda: reference(more_support, more_query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1)
    step(support, query)
    with pytest.warns(UserWarning, match="compiles again for a new kind of input"):
        _, ours = meta_grads(net, hyper, lambda: step(more_support, more_query))
    assert relative(ours, plain) < 1e-10
    assert len(step.compile_seconds) == 2 and len(made[0].outputs) == 2


@pytest.mark.slow
def test_compiled_for_real_with_the_cuda_plan_on_a_cpu(monkeypatch):
    """torch.compile for real, as the step compiles on CUDA (``mode="reduce-overhead"``), on
    CPU tensors: inductor runs the graph without CUDA graphs (they capture CUDA work only)
    and counts the skip without a log line; the step names it once, and gives the plain
    path's meta-gradients over two calls and, for a new batch shape, a second compile with
    its own seconds."""
    on_cuda(monkeypatch)
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("sgd")
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1, compile=False)

    def twice(step):
        step(support, query)
        return step(support, query)

    _, plain = meta_grads(net, hyper, lambda: twice(reference))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1)
    assert step.plan.mode == "reduce-overhead"
    with pytest.warns(UserWarning, match="runs its graph without CUDA graphs") as said:
        _, ours = meta_grads(net, hyper, lambda: twice(step))
    assert len([w for w in said if "CUDA graphs" in str(w.message)]) == 1
    assert step.eager_reason is None
    assert step.graph_note == fence.UNNAMED_CUDAGRAPH_SKIP
    assert relative(ours, plain) < 1e-10
    more_support, more_query = sinusoid(tasks=5, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(more_support, more_query)
    assert len(step.compile_seconds) == 2 and min(step.compile_seconds.values()) > 0


# ---------------------------------------------------------------- a skipped CUDA graph


def test_a_skipped_cuda_graph_is_named_once_with_what_to_change(monkeypatch):
    """Where inductor runs the graph without a CUDA graph, the step keeps inductor's reason
    (its first line) in ``graph_note`` and warns once, naming what to change; the numbers
    are the plain path's."""
    replaying(monkeypatch)
    reason = (
        "skipping cudagraphs due to cpu device (arg3_1). Found from : \n"
        '   File "model.py", line 3, in forward'
    )
    watched = []

    @contextlib.contextmanager
    def skips():
        found: list[str] = []
        watched.append(found)
        yield found
        found.append(reason)

    monkeypatch.setattr(compiled_module, "cudagraph_skips", skips)
    net, fmodel, opt, hyper, _, loss_fn, (support, query) = setup("sgd")
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1, compile=False)
    _, plain = meta_grads(net, hyper, lambda: reference(support, query))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1)
    with pytest.warns(UserWarning, match="without CUDA graphs") as said:
        _, ours = meta_grads(net, hyper, lambda: step(support, query))
    (warning,) = [w for w in said if "CUDA graphs" in str(w.message)]
    assert "cpu device (arg3_1)" in str(warning.message)
    assert "keep every tensor the meta-iteration reads on the GPU" in str(warning.message)
    assert warning.filename == __file__
    assert step.graph_note == "skipping cudagraphs due to cpu device (arg3_1)"
    assert relative(ours, plain) < 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(support, query)  # said once
    assert len(watched) == 2
    monkeypatch.setattr(compiled_module, "_device", lambda fmodel: "cpu")
    on_cpu = fm.compile_meta_step(fmodel, loss_fn, opt, steps=1)
    on_cpu(support, query)
    assert len(watched) == 2 and on_cpu.graph_note is None  # no CUDA graphs: nothing watched


@pytest.mark.parametrize(
    ("reason", "hint"),
    [
        ("skipping cudagraphs due to mutated inputs (2 instances)", "in place"),
        ("disabling cudagraphs due to incompatible op aten.nonzero.default", ".item()"),
        ("skipping cudagraphs due to multiple devices: device(type='cuda', index=0)", "one GPU"),
        ("skipping cudagraph due to function 0 exceeding max re-recording limit", "fixed"),
        ("skipping cudagraphs due to something new", "mode='default'"),
    ],
)
def test_each_skip_names_what_to_change(reason, hint):
    assert hint in compiled_module._skip_hint(reason)


def test_the_skip_probe_reads_inductors_log_and_counter():
    """On this torch: a skip inductor logs is collected with its words; one it counts
    without a log line (a CPU graph, or inductor's warnings silenced) is collected as
    unnamed; none, nothing."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    message = "skipping cudagraphs due to a test of funcmeta's probe"
    with fence.cudagraph_skips() as found:
        log_cudagraph_skip_and_bump_counter(message)
    assert found == [message]
    with fence.cudagraph_skips() as found:
        counters["inductor"]["cudagraph_skips"] += 1
    assert found == [fence.UNNAMED_CUDAGRAPH_SKIP]
    with fence.cudagraph_skips() as found:
        pass
    assert found == []


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_cuda_graphs_on_a_gpu_give_the_plain_paths_meta_gradients():
    """On a GPU (``make gpu-check``): the sinusoid MLP in float64 with the CUDA plan, three
    calls (compile and warm-up, capture, replay) accumulated in ``.grad``, then a new batch
    shape: the plain path's sums, no skipped graph, a compile time per kind."""
    net, _, opt, hyper, _, loss_fn, (support, query) = setup("sgd")
    fmodel = fm.functional_model(net.cuda())
    s, q = (tuple(t.cuda() for t in pair) for pair in (support, query))
    reference = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2, compile=False)

    def thrice(step):
        return torch.stack([step(s, q) for _ in range(3)])

    plain_losses, plain = meta_grads(net, hyper, lambda: thrice(reference))
    step = fm.compile_meta_step(fmodel, loss_fn, opt, steps=2)
    assert step.plan == compile_plan("cuda", False)
    losses, ours = meta_grads(net, hyper, lambda: thrice(step))
    assert step.eager_reason is None and step.graph_note is None, step.graph_note
    assert relative(ours, plain) < 1e-10
    assert torch.allclose(losses, plain_losses, rtol=1e-12, atol=0)
    s5, q5 = (tuple(t.cuda() for t in pair) for pair in sinusoid(tasks=5, seed=2))
    _, plain5 = meta_grads(net, hyper, lambda: reference(s5, q5))
    with pytest.warns(UserWarning, match="compiles again"):
        _, ours5 = meta_grads(net, hyper, lambda: step(s5, q5))
    assert relative(ours5, plain5) < 1e-10
    assert len(step.compile_seconds) == 2 and step.graph_note is None


@pytest.mark.cuda
def test_a_conv_net_on_a_gpu_runs_one_task_per_graph_replay():
    """On a GPU: a BatchNorm conv net in float64 with the CUDA conv plan (one task per
    graph call, the model's layout, CUDA graphs), three calls: the plain path's sum."""
    net = conv().cuda()
    fmodel = fm.functional_model(net)
    support, query = images(tasks=3)
    s, q = (tuple(t.cuda() for t in pair) for pair in (support, query))
    opt = fm.optim.sgd(lr=0.1)
    reference = fm.compile_meta_step(fmodel, F.cross_entropy, opt, steps=1, compile=False)
    _, plain = meta_grads(net, [], lambda: [reference(s, q) for _ in range(3)][-1])
    step = fm.compile_meta_step(fmodel, F.cross_entropy, opt, steps=1)
    assert step.plan == compile_plan("cuda", True) and step.task_chunk == 1
    _, ours = meta_grads(net, [], lambda: [step(s, q) for _ in range(3)][-1])
    assert step.eager_reason is None and step.graph_note is None, step.graph_note
    assert relative(ours, plain) < 1e-10
    assert next(iter(step.compile_seconds.values())) > 0
