"""A whole meta-iteration as one compiled graph: :func:`funcmeta.compile_meta_step`.

One meta-iteration of MAML and its relatives is the inner loop of ``steps`` optimizer steps
for every task, the query loss, and the outer gradient with respect to the initial
parameters and every learnable hyperparameter. :func:`funcmeta.compile_meta_step` hands one
of two graphs of it to ``torch.compile`` (``MetaStep.graph`` says which, ``graph_reason``
why not the first):

- ``"autograd"``, where the installed torch traces ``torch.autograd.grad`` (dynamo's
  ``trace_autograd_ops``, from torch 2.13): the eager step's own computation, every inner
  gradient ``torch.autograd.grad(create_graph=True)`` of the summed task losses and the outer
  gradient ``torch.autograd.grad`` of the mean query loss, marked as the graph's backward
  region (``funcmeta._src.runtime.autograd_traced``). A model built with
  ``checkpoint_layers=`` compiles on it with ``graph="autograd"``: each checkpointed layer
  is a torch activation checkpoint region, whose forward the outer gradient recomputes; the
  inner gradients still keep what they read, so such a step holds more than the eager
  checkpointed one, which is the default for it
  (``docs/decisions/compiled-autograd-step.md``).
- ``"torch.func"``, the graph of older torches (and ``graph="torch.func"``), written as one
  pure function of ``torch.func`` transforms:

- the tasks run together under ``torch.func.vmap`` (the forward only);
- each inner gradient is ``torch.func.grad`` of the *sum* of the per-task losses, taken
  outside the ``vmap``, as :func:`funcmeta.adapt_tasks` takes it (``vmap`` of a gradient
  through BatchNorm's batch statistics gives wrong second-order meta-gradients; a gradient
  of the summed losses does not: ``docs/decisions/task-batching-vmap.md``);
- the update is the funcmeta optimizer's own (pure) ``update``, per-task clipping included;
- the outer gradient is ``torch.func.grad`` of the mean query loss, with respect to the
  model's parameters and the parameters of the ``hyper`` modules (learnable rates).

Calling the step writes the meta-gradients into ``.grad`` (added, as ``backward`` adds) and
returns the mean query loss, so a training loop stays ordinary PyTorch: ``outer.step()``.

Compiled once per kind of input (shapes, dtypes, devices); the first call of each kind is
timed (``MetaStep.compile_seconds``) and a new kind says so once. Where the step cannot
be compiled (a graph break, an operator ``torch.compile`` or ``vmap`` refuses, a torch
without ``torch.compile`` support for ``torch.func``), it runs :func:`funcmeta.adapt_tasks`
and :func:`funcmeta.task_losses` eagerly instead, with the same meta-gradients, and says
once why (``MetaStep.eager_reason``).

How it compiles depends on the device (``compile_plan``, a pure function of the device
type, whether the model has convolutions, and the caller's ``mode`` and ``task_chunk``;
``MetaStep.plan`` keeps what it chose):

- on a CPU, inductor's C++ wrapper and the step's CPU choices, and conv nets one task per
  graph call;
- on CUDA, CUDA graphs (``mode="reduce-overhead"``): each call replays the captured graph
  of the whole meta-iteration. torch copies the inputs into the graph's static buffers on
  each replay, and each replay writes into the same output tensors, so the step copies the
  results before it adds them to ``.grad`` or runs the next chunk of tasks, and marks each
  call a new step for torch's CUDA graph trees. A new batch shape compiles and captures a
  graph of its own. Where inductor runs the graph without a CUDA graph (it logs "skipping
  cudagraphs due to ..."), the step keeps the reason (``MetaStep.graph_note``) and says
  once what to change. Conv nets run one task per graph call with convolutions in the
  model's layout, a graph that compiles in bounded time.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fmodel = fm.functional_model(net)
    >>> step = fm.compile_meta_step(fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=2, compile=False)
    >>> b = fm.data.Sinusoid().sample(4, 5, 5, generator=torch.Generator().manual_seed(0))
    >>> loss = step(b.support, b.query)          # fills net's .grad
    >>> net[0].weight.grad.shape
    torch.Size([8, 1])
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from funcmeta._src.batching.chunks import rule_chunk
from funcmeta._src.compiled.eager_reasons import (
    COMPILE_FALSE,
    autograd_untraceable,
    checkpointed_layers,
    checkpointed_layers_keep_memory,
    explain,
    first_line,
    untraced,
)
from funcmeta._src.compiled.plan import CompilePlan, compile_plan
from funcmeta._src.core import kernels, tree
from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import (
    RematMode,
    autograd_tracing,
    backward_region,
    can_recompute_inner_gradients,
    cudagraph_skips,
    probe_cpu_vector_isa,
    recompute_inner_gradients,
    reparametrized,
    saved_tensor_hooks_state,
    set_saved_tensor_hooks_state,
    with_own_code_object,
)
from funcmeta._src.core.precision import CONVOLUTIONS, warn_tf32_second_order
from funcmeta._src.core.types import LossFn
from funcmeta._src.inner.forward import vmapped_losses
from funcmeta._src.inner.inputs import (
    Args,
    check_task_options,
    split_batch,
    task_count,
    warn_one_task_as_many,
    with_task_axis,
)
from funcmeta._src.inner.options import AdaptKeywords, AdaptOptions
from funcmeta._src.inner.tasks import adapt_tasks, task_inner_loop, task_losses
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.module.guard import guard_of
from funcmeta._src.optim.base import GradientTransformation
from funcmeta._src.runtime import TRACED, Runtime
from funcmeta._src.runtime.autograd_traced import AutogradTracedRuntime, traced_runner
from funcmeta._src.runtime.place import at

__all__ = ["MetaStep", "compile_meta_step"]


@exposed_in("funcmeta")
class MetaStep:
    """A compiled meta-iteration (see the module docstring); build it with
    :func:`funcmeta.compile_meta_step`.

    Attributes:
        compile_seconds: per kind of input, the seconds its first call took (compiling and
            running once; on CUDA until the GPU is done). With CUDA graphs, the graph is
            captured on the second call of a kind, which this does not count.
        eager_reason: why the step runs eagerly (``None`` while it runs compiled).
        graph: which graph it compiles: ``"autograd"`` (the eager step's own computation,
            ``torch.autograd.grad`` traced) or ``"torch.func"`` (see the module docstring).
        graph_reason: why ``graph`` is ``"torch.func"`` (``None`` on the autograd graph).
        task_chunk: how many tasks one graph call takes (``None``: all of them), as given or
            as ``"auto"`` chose (under the rule: for the latest call).
        plan: how the graph is compiled (``CompilePlan``: mode, inductor options, task
            chunk, CUDA graphs), chosen by ``compile_plan`` for the model's device.
        options_note: why the graph is compiled with torch.compile's defaults instead of
            the plan's options or ``mode`` (a torch without one of them), or without
            one of the step's CPU choices, or why a ``mode`` asking for CUDA graphs gets
            none on this device, else ``None``.
        graph_note: why the graph runs without CUDA graphs where the plan asked for them
            (inductor's own words, "skipping cudagraphs due to ..."), else ``None``; the
            step warns once, naming what to change.
    """

    def __init__(
        self,
        fmodel: FunctionalModel,
        loss_fn: LossFn,
        opt: GradientTransformation,
        *,
        steps: int,
        hyper: Sequence[nn.Module],
        options: AdaptOptions,
        compile: bool,
        plan: CompilePlan,
        graph: str = "auto",
    ) -> None:
        self.fmodel, self.loss_fn, self.opt, self.steps = fmodel, loss_fn, opt, steps
        self.plan = plan
        self.task_chunk = None if plan.task_chunk == "rule" else plan.task_chunk
        self._parameter_count = sum(p.numel() for p in fmodel.module.parameters())
        self._calls = 0
        self.hyper = list(hyper)
        self.options = options
        self.compile_seconds: dict[tuple[Any, ...], float] = {}
        self._checked = False  # the plain path's check before the first graph call
        self.eager_reason: str | None = None if compile else COMPILE_FALSE
        # which graph: the eager step's own (torch.autograd.grad), where this torch traces it
        untraceable = autograd_untraceable()
        if graph == "autograd" and untraceable is not None:
            raise ValueError(f"compile_meta_step(graph='autograd') needs {untraceable}")
        self.graph_reason = (
            "graph='torch.func' was asked for" if graph == "torch.func" else untraceable
        )
        self.graph = "torch.func" if self.graph_reason is not None else "autograd"
        self._runtime: Runtime = (
            TRACED if self.graph == "torch.func" else AutogradTracedRuntime(traced_runner(fmodel))
        )
        reason = untraced(options, self.graph) if compile else None
        if reason is None and compile and fmodel.checkpointed and self.graph == "torch.func":
            reason = checkpointed_layers(fmodel.checkpointed, self.graph_reason)
        elif (
            reason is None
            and compile
            and fmodel.checkpointed
            and graph == "auto"
            and not can_recompute_inner_gradients()
        ):
            reason = checkpointed_layers_keep_memory(fmodel.checkpointed)
        # what the autograd graph's rematerialization recomputes besides the checkpointed
        # layers' forwards: their inner gradients, or under checkpoint_steps every step
        self._remat: RematMode | None = None
        if self.graph == "autograd" and can_recompute_inner_gradients():
            if options.checkpoint_steps:
                self._remat = "steps"
            elif fmodel.checkpointed:
                self._remat = "layers"
        if self.graph == "autograd" and (fmodel.checkpointed or options.checkpoint_steps):
            # torch recomputes in this graph: inductor keeps its order (CompilePlan.remat)
            plan = self.plan = dataclasses.replace(plan, remat=True)
        if reason is not None:
            self.eager_reason = reason
            compile = False
            warnings.warn(f"compile_meta_step runs eagerly: {self.eager_reason}", stacklevel=3)
        self._buffer_names = list(fmodel.buffers)
        grad_fn: Callable[..., Any] = (
            torch.func.grad_and_value(self._meta_loss, argnums=(0, 1))
            if self.graph == "torch.func"
            else self._autograd_meta_loss
        )
        self._uncompiled = grad_fn  # the graph's computation, run eagerly (tests compare it)
        self._compiled: Callable[..., Any] | None = None
        self.options_note: str | None = plan.note if compile else None
        self.graph_note: str | None = None
        if compile:
            own = with_own_code_object(grad_fn)
            how = plan.compile_kwargs()
            try:
                self._compiled = torch.compile(own, fullgraph=True, dynamic=False, **how)
            except Exception as error:  # an inductor option or mode this torch lacks
                self.options_note = f"{how}: {type(error).__name__}: {first_line(error)}"
                self._compiled = torch.compile(own, fullgraph=True, dynamic=False)
                self.plan = dataclasses.replace(
                    plan,
                    mode=None,
                    options=None,
                    cuda_graphs=False,
                    graph_passes=False,
                    remat=False,
                )

    @staticmethod
    def plan_for(
        device: str,
        convolutional: bool,
        mode: str | None = None,
        task_chunk: int | Literal["auto"] | None = "auto",
    ) -> CompilePlan:
        """What :func:`funcmeta.compile_meta_step` would choose for a model on ``device`` (a device
        type: ``"cpu"``, ``"cuda"``), with convolutions or without, given ``mode`` and
        ``task_chunk`` (``compile_plan``); asking needs no such device.

        Example:
            >>> import funcmeta as fm
            >>> plan = fm.MetaStep.plan_for("cuda", convolutional=False)
            >>> plan.mode, plan.cuda_graphs, plan.task_chunk
            ('reduce-overhead', True, None)
        """
        return compile_plan(device, convolutional, mode, task_chunk)

    # ---------------------------------------------------------------- the pure function

    def _meta_loss(
        self,
        params: dict[str, Tensor],
        hyper: list[dict[str, Tensor]],
        buffers: dict[str, Tensor],
        support: Any,
        query: Any,
        tasks: int,
    ) -> Tensor:
        return self._with_hyper(0, hyper, params, buffers, support, query, tasks)

    def _autograd_meta_loss(
        self,
        params: dict[str, Tensor],
        hyper: list[dict[str, Tensor]],
        buffers: dict[str, Tensor],
        support: Any,
        query: Any,
        tasks: int,
    ) -> tuple[tuple[dict[str, Tensor], list[dict[str, Tensor]]], Tensor]:
        """The meta-loss and its gradients as the eager step takes them: the inner loop
        with ``torch.autograd.grad(create_graph=True)``, then ``torch.autograd.grad`` of the
        query loss with respect to ``params`` and ``hyper`` (leaves that require grad), as
        ``torch.func.grad_and_value(argnums=(0, 1))`` returns them (zeros where unused).
        The outer gradient is marked as the graph's backward region, where torch's
        activation checkpointing recomputes the checkpointed layers."""
        with torch.enable_grad():
            loss = self._with_hyper(0, hyper, params, buffers, support, query, tasks)
            wrt = [*params.values(), *(v for h in hyper for v in h.values())]
            with backward_region():
                found = torch.autograd.grad(loss, wrt, allow_unused=True)
        grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, found, strict=True)]
        it = iter(grads)
        g_params = {k: next(it) for k in params}
        g_hyper = [{k: next(it) for k in h} for h in hyper]
        return (g_params, g_hyper), loss.detach()

    def _with_hyper(self, i: int, hyper: list[dict[str, Tensor]], *args: Any) -> Tensor:
        """The meta-loss with the ``hyper`` modules' parameters from ``i`` on put in place."""
        if i == len(self.hyper):
            return self._inner_and_query(*args)
        with reparametrized(self.hyper[i], hyper[i]):
            return self._with_hyper(i + 1, hyper, *args)

    def _inner_and_query(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        support: Any,
        query: Any,
        tasks: int,
    ) -> Tensor:
        """The mean query loss after the inner loop: :func:`funcmeta.adapt_tasks`'s loop
        (its ``task_inner_loop``) and :func:`funcmeta.task_losses`'s forward, as
        ``torch.compile`` traces them."""
        # the model's parameters and buffers are shared by the tasks; each task updates
        # its own copy of the buffers (BatchNorm's running statistics)
        task_buffers = with_task_axis(buffers, dict.fromkeys(buffers), tasks, copy=True)
        result, dims = task_inner_loop(
            self.fmodel,
            self.loss_fn,
            support,
            params,
            dict.fromkeys(params),
            task_buffers,
            self.opt,
            self.steps,
            self.options,
            tasks=tasks,
            runtime=self._runtime,
        )
        losses, _ = vmapped_losses(
            self.fmodel,
            self.loss_fn,
            query,
            dims,
            result.params,
            result.buffers,
            chunk=None,
            runtime=self._runtime,
        )
        return losses.mean()

    # ---------------------------------------------------------------- calling it

    def __call__(self, support: tuple[Any, Any], query: tuple[Any, Any]) -> Tensor:
        """One meta-iteration on a batch of tasks: the meta-gradients are added to ``.grad``
        of the model's parameters that require grad and of the ``hyper`` modules'
        parameters; returns the mean query loss (without a graph). Under ``torch.no_grad()``
        it runs the plain path, which computes the query loss and no meta-gradient, as
        :func:`funcmeta.adapt_tasks` and :func:`funcmeta.task_losses` do there."""
        s, q = split_batch(support), split_batch(query)
        tasks = task_count(s)
        warn_one_task_as_many(s, tasks)
        if task_count(q) != tasks:
            raise ValueError(
                f"support holds {tasks} tasks and query {task_count(q)}: one task axis for both"
            )
        params = self.fmodel.params
        warn_tf32_second_order(self.fmodel.module, params.values(), self.options.first_order)
        hyper: list[dict[str, Tensor]] = [dict(m.named_parameters()) for m in self.hyper]
        self._calls += 1
        if self._compiled is not None and self.eager_reason is None and torch.is_grad_enabled():
            if not self._checked:
                if self.plan.device == "cpu":  # its C++ builds beside the check and the trace
                    probe_cpu_vector_isa()
                _, stop = self.graph_calls(s, tasks)[0]
                self._check_on_the_plain_path(_first_tasks(support, s, stop, tasks), params)
                self._checked = True
            # the traced run swaps tensors into the module (functional_call): one thread
            with guard_of(self.fmodel.module):
                done = self._compiled_step(params, hyper, s, q, tasks)
            if done is not None:
                return done
        return self._eager_step(support, query, params, hyper)

    def _check_on_the_plain_path(self, support: tuple[Any, Any], params: dict[str, Tensor]) -> None:
        """The plain path's inner loop on the tasks of the first graph call (``support``), once,
        first order and without a graph, for its errors: ``torch.func.grad`` in the graph
        gives a zero gradient where ``autograd.grad`` finds that the inner loss does not
        depend on an adapted parameter, which the plain path refuses (unless
        ``allow_unused=True``). Every graph call runs the same program on tasks of the same
        shapes, so the tasks of one call show what all would (one task where the step runs
        one a call: the check costs a task's inner loop, not the batch's). The random number
        generators are restored after it, so the compiled run draws what it would have."""
        devices = sorted({p.device.index or 0 for p in params.values() if p.is_cuda})
        with torch.random.fork_rng(devices=devices), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the call itself says what it has to say
            adapt_tasks(
                self.fmodel,
                {k: v.detach() for k, v in params.items()},
                self.loss_fn,
                support,
                self.opt,
                steps=self.steps,
                **vars(self.options),
            )

    def chunks(self, tasks: int, inputs_per_task: int = 0) -> list[tuple[int, int]]:
        """The ``(start, stop)`` task ranges one call runs, one graph call each: all tasks
        at once, or ``task_chunk`` at a time (the last range holds what is left). Under the
        rule (``plan.task_chunk == "rule"``) the chunk is that of ``task_chunk="auto"`` for
        ``tasks`` tasks of ``inputs_per_task`` input elements each, kept in ``task_chunk``."""
        if self.plan.task_chunk == "rule":
            self.task_chunk = rule_chunk(
                tasks,
                inputs_per_task=inputs_per_task,
                parameters=self._parameter_count,
                device="cpu",
            )
        c = tasks if self.task_chunk is None else min(self.task_chunk, tasks)
        return [(i, min(i + c, tasks)) for i in range(0, tasks, c)]

    def graph_calls(self, support: Any, tasks: int) -> list[tuple[int, int]]:
        """The task ranges of :meth:`chunks` for a support batch (split by ``split_batch``) of
        ``tasks`` tasks: the rule, where the plan chose it, reads the size of its inputs."""
        inputs = 0
        if self.plan.task_chunk == "rule":  # the rule reads the inputs' size
            inputs = sum(x.numel() for x in tree.leaves(support[0]) if isinstance(x, Tensor))
        return self.chunks(tasks, inputs // max(tasks, 1))

    def run_graph(
        self,
        graph: Callable[..., Any],
        params: dict[str, Tensor],
        hyper: list[dict[str, Tensor]],
        support: Any,
        query: Any,
        tasks: int,
    ) -> tuple[tuple[dict[str, Tensor], list[dict[str, Tensor]]], Tensor]:
        """``graph`` (the compiled meta-iteration, or its computation uncompiled) over the
        tasks in :meth:`chunks`: the meta-gradients and the mean query loss of all tasks,
        each chunk's weighted by its share of the tasks. The tasks are independent, so this
        is the gradient of the mean over all of them."""
        # leaves of the graph's own: the autograd graph differentiates them with
        # torch.autograd.grad (they require grad), the torch.func graph with torch.func.grad
        leaf = (
            (lambda v: v.detach().requires_grad_())
            if self.graph == "autograd"
            else (lambda v: v.detach())
        )
        detached = {k: leaf(v) for k, v in params.items()}
        raw = [{k: leaf(v) for k, v in h.items()} for h in hyper]
        buffers = {k: v.detach() for k, v in self.fmodel.buffers.items()}
        ranges = self.graph_calls(support, tasks)
        # a CUDA graph writes every replay into the same output tensors: its results are
        # copied (or weighted into new tensors) before the next replay, and never kept
        replayed = self.plan.cuda_graphs and graph is self._compiled
        total: Any = None
        for start, stop in ranges:
            part = (
                [support, query]
                if len(ranges) == 1
                else [_task_slice(b, start, stop) for b in (support, query)]
            )
            started = time.perf_counter()
            key = self._note_kind(graph, part, detached, raw)
            if replayed:
                out = self._replay(graph, detached, raw, buffers, *part, stop - start)
            else:
                out = graph(detached, raw, buffers, *part, stop - start)
            if key is not None:
                if self.plan.device == "cuda" and torch.cuda.is_available():
                    torch.cuda.synchronize()  # the first run's kernels are part of it
                self.compile_seconds[key] = time.perf_counter() - started
            if len(ranges) == 1:
                return tree.tree_map(torch.clone, out) if replayed else out
            share = (stop - start) / tasks
            weighted = tree.tree_map(lambda x, w=share: x * w, out)
            total = weighted if total is None else tree.tree_map(torch.add, total, weighted)
        return total

    def _replay(self, graph: Callable[..., Any], *args: Any) -> Any:
        """One call of the graph compiled for CUDA graphs: a new step for torch's CUDA graph
        trees (the outputs of the last replay are no longer read), and a note of why
        inductor ran it without a CUDA graph, where it did."""
        _mark_step_begin()
        with cudagraph_skips() as skipped:
            out = graph(*args)
        if skipped:
            self._note_skip(skipped)
        return out

    def _note_skip(self, skipped: list[str]) -> None:
        """Keep inductor's reasons for running without CUDA graphs; warn the first time."""
        # inductor's first line, without the pointer to the stack trace it goes on with
        reasons = [s.strip().split("\n")[0].split(" Found from")[0].rstrip(". :") for s in skipped]
        first = self.graph_note is None
        known = [] if self.graph_note is None else self.graph_note.split("; ")
        self.graph_note = "; ".join(dict.fromkeys([*known, *reasons]))
        if first:
            warnings.warn(
                f"compile_meta_step runs its graph without CUDA graphs ({reasons[0]}): "
                f"{_skip_hint(skipped[0])} (the same numbers, without the speed of one "
                "graph launch; step.graph_note keeps the reasons)",
                stacklevel=6,
            )

    def _note_kind(self, graph: Callable[..., Any], *values: Any) -> tuple[Any, ...] | None:
        """The kind of input ``values`` are when ``graph`` is the compiled one and meets it
        for the first time (its call compiles: time it), else ``None``; a new kind after the
        first call says so."""
        if graph is not self._compiled:
            return None
        key = _kind(*values)
        if key in self.compile_seconds:
            return None
        if self._calls > 1:
            warnings.warn(
                f"compile_meta_step compiles again for a new kind of input ({_describe(key)}); "
                "keep shapes fixed (the same tasks, shots and queries) to compile once",
                stacklevel=5,
            )
        return key

    def _compiled_step(
        self,
        params: dict[str, Tensor],
        hyper: list[dict[str, Tensor]],
        support: Any,
        query: Any,
        tasks: int,
    ) -> Tensor | None:
        assert self._compiled is not None
        hooks = saved_tensor_hooks_state()
        try:
            tracing = contextlib.ExitStack()
            if self.graph == "autograd":  # autograd.grad traced; kernels with a second derivative
                tracing.enter_context(autograd_tracing() or contextlib.nullcontext())
                if not self.options.first_order:
                    tracing.enter_context(kernels.twice_differentiable())
                if self._remat is not None:
                    tracing.enter_context(recompute_inner_gradients(self._remat))
            with self.plan.lowering() as lowered, tracing:
                (g_params, g_hyper), loss = self.run_graph(
                    self._compiled, params, hyper, support, query, tasks
                )
            if lowered is False and self.options_note is None:
                self.options_note = (
                    "max pooling's backward compiles as inductor's own lowering: this torch lacks "
                    "the names that make it aten's kernel (the same values, slower)"
                )
        except Exception as error:  # a graph break, an unsupported operator: run eagerly
            # a compile that failed inside torch.func.grad can leave saved-tensor hooks
            # off, which breaks every later checkpoint (the eager path's included)
            set_saved_tensor_hooks_state(hooks)
            self.eager_reason = explain(error, self.fmodel.module)
            warnings.warn(
                "compile_meta_step runs eagerly (fm.adapt_tasks, the same meta-gradients): "
                f"torch.compile could not compile the meta-iteration: {self.eager_reason}",
                stacklevel=3,
            )
            return None
        _accumulate(params, g_params)
        for h, g in zip(hyper, g_hyper, strict=True):
            _accumulate(h, g)
        return loss.detach()

    def _eager_step(
        self,
        support: tuple[Any, Any],
        query: tuple[Any, Any],
        params: dict[str, Tensor],
        hyper: list[dict[str, Tensor]],
    ) -> Tensor:
        """The plain path: :func:`funcmeta.adapt_tasks` on the step's chunk (the rule of
        ``"auto"`` where the plan chose the rule), the query losses, ``backward``."""
        result = adapt_tasks(
            self.fmodel,
            params,
            self.loss_fn,
            support,
            self.opt,
            steps=self.steps,
            task_chunk="auto" if self.plan.task_chunk == "rule" else self.plan.task_chunk,
            **vars(self.options),
        )
        with at("the query batch"):
            losses, _, _ = task_losses(
                self.fmodel,
                result.params,
                self.loss_fn,
                query,
                buffers=result.buffers,
                task_chunk=result.chunk,
            )
        loss = losses.mean()
        groups = [{k: t for k, t in g.items() if t.requires_grad} for g in (params, *hyper)]
        wrt = [t for g in groups for t in g.values()]
        if loss.requires_grad and wrt:  # one backward for all of them
            grads = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
            for g in groups:
                # zip takes this group's names first: it stops before the next group's grads
                found = {k: d for k, d in zip(g, grads, strict=False) if d is not None}
                _accumulate({k: g[k] for k in found}, found)
        return loss.detach()


def _device(fmodel: FunctionalModel) -> str:
    """The device type of the model's parameters (``"cpu"`` for a model without any;
    ``"mixed"`` where they are on several kinds of device)."""
    kinds = {p.device.type for p in fmodel.params.values()}
    return kinds.pop() if len(kinds) == 1 else ("cpu" if not kinds else "mixed")


def _convolutional(fmodel: FunctionalModel) -> bool:
    return any(isinstance(m, CONVOLUTIONS) for m in fmodel.module.modules())


def _mark_step_begin() -> None:
    """A new step for torch's CUDA graph trees (``torch.compiler.cudagraph_mark_step_begin``,
    where this torch has it): the tensors the last replay returned are no longer read."""
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    if mark is not None:
        mark()


# what to change, by words in inductor's reason for skipping CUDA graphs
_SKIP_HINTS = (
    (
        "cpu device",
        "keep every tensor the meta-iteration reads on the GPU: the batch, the model's "
        "buffers, the hyper modules, and tensors the loss or the model create (a "
        "torch.tensor(...) without device=)",
    ),
    ("multiple devices", "put the model, the batch and the hyper modules on one GPU"),
    (
        "mutated inputs",
        "the model or the loss writes into a tensor it is given, in place; write it out of place",
    ),
    (
        "incompatible op",
        "an operator of the model or the loss cannot be captured (one that reads a value "
        "back to the CPU, as .item(), nonzero or boolean indexing); write it without one",
    ),
    ("re-recording limit", "keep the shapes of the batch fixed from call to call"),
    ("symbolic shapes", "keep the shapes of the batch fixed from call to call"),
    ("uncached", "leave the CUDA caching allocator on (PYTORCH_NO_CUDA_MEMORY_CACHING unset)"),
)


def _skip_hint(reason: str) -> str:
    """What to change for inductor's ``reason`` to capture CUDA graphs."""
    for words, hint in _SKIP_HINTS:
        if words in reason:
            return hint
    return (
        "change what the reason names, or pass mode='default' to compile without asking for "
        "CUDA graphs"
    )


def _task_slice(batch: Any, start: int, stop: int) -> Any:
    """Tasks ``start:stop`` of a batch split by ``split_batch`` (every tensor leaf carries
    the task axis first)."""
    flat, spec = tree.flatten_registered(batch)
    return tree.unflatten_registered(
        [x[start:stop] if isinstance(x, Tensor) else x for x in flat], spec
    )


def _first_tasks(support: Any, split: Any, stop: int, tasks: int) -> Any:
    """The first ``stop`` of ``tasks`` tasks of the support batch ``support`` (``split``: it
    split by ``split_batch``), as a batch the plain path takes: ``support`` itself for all
    tasks, else the split batch's slice with its inputs as ``fm.Args``, as the graph calls
    slice it."""
    if stop == tasks:
        return support
    (args, kwargs), targets = _task_slice(split, 0, stop)
    return Args(*args, **kwargs), targets


def _accumulate(tensors: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> None:
    for k, t in tensors.items():
        if t.requires_grad:
            g = grads[k]
            t.grad = g if t.grad is None else t.grad + g


def _kind(*values: Any) -> tuple[Any, ...]:
    """What a compiled graph is specialised on: each tensor's shape, dtype and device."""
    return tuple(
        (tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, Tensor) else repr(x)
        for x in tree.leaves_registered(values)
    )


def _describe(key: tuple[Any, ...]) -> str:
    shapes = [str(k[0]) for k in key if isinstance(k, tuple)]
    return "shapes " + ", ".join(shapes[:6]) + (", ..." if len(shapes) > 6 else "")


@exposed_in("funcmeta")
def compile_meta_step(
    fmodel: FunctionalModel,
    loss_fn: LossFn,
    opt: GradientTransformation,
    *,
    steps: int,
    hyper: Sequence[nn.Module] = (),
    compile: bool = True,
    mode: str | None = None,
    task_chunk: int | Literal["auto"] | None = "auto",
    graph: Literal["auto", "autograd", "torch.func"] = "auto",
    **options: Unpack[AdaptKeywords],
) -> MetaStep:
    """A meta-iteration of :func:`funcmeta.adapt_tasks` compiled into one graph (see
    :class:`funcmeta.MetaStep` and ``docs/tasks.md``).

    ``fmodel``, ``loss_fn``, ``opt`` and ``steps`` are those of :func:`funcmeta.adapt_tasks`;
    ``hyper`` lists the modules whose parameters the optimizer reads (``fm.hyper`` trees of
    learnable rates, a learned optimizer), which get meta-gradients too. ``**options`` are
    :func:`funcmeta.adapt_tasks`'s, and the graph runs its inner loop (the same functions,
    traced). ``first_order``, ``trainable``, ``clip_grad_norm``, ``truncate`` and
    ``allow_unused`` compile; ``loss_scale``, ``on_nonfinite``, ``checkpoint_steps`` and
    ``offload_activations`` decide on the host at every step or use autograd machinery that
    torch.compile does not trace: given, the step runs :func:`funcmeta.adapt_tasks` with them
    and says so once, naming the option (``MetaStep.eager_reason``); so does a model built
    with ``checkpoint_layers=`` where the step compiles the ``torch.func`` graph, whose
    checkpointed layers that graph cannot run; on the autograd graph they compile when asked
    for by name (``graph="autograd"``: the same meta-gradients, but torch's recomputation
    leaves the inner gradients' activations in memory, so the eager checkpointed step holds
    less; ``docs/decisions/compiled-autograd-step.md``), and run eagerly by default. Before
    its first
    graph call the step runs the plain path's inner loop once, first order and without a
    graph, and raises its errors, which ``torch.func.grad`` in the graph would not (an inner
    loss that does not depend on an adapted parameter). ``compile=False`` runs
    the plain path eagerly (the reference the compiled graph is tested against).

    ``mode`` is ``torch.compile``'s. ``None``, the default, picks per device
    (``compile_plan``; ``MetaStep.plan`` says what it picked): on a CPU, inductor's
    C++ wrapper and the step's CPU options; on CUDA, ``"reduce-overhead"``: CUDA graphs,
    with ``layout_optimization`` off for a model with convolutions; elsewhere torch's
    default. Where inductor runs the graph without a CUDA graph after all,
    ``MetaStep.graph_note`` says why and the step warns once.

    ``task_chunk=c`` runs the graph on ``c`` tasks at a time, one chunk after another, and
    adds their meta-gradients (the same numbers, to rounding): on a CPU a conv net's
    batched activations outgrow the caches, and one task at a time runs faster
    (``docs/tasks.md``). ``None``: all tasks in one graph. ``"auto"``, the default: 1 for a
    model with convolutions on a CPU or on CUDA (the graph of all tasks of conv4 took many
    minutes to compile on either); otherwise the rule of :func:`funcmeta.functional_model`'s
    ``task_chunk="auto"`` on each call's shapes, which is all tasks at once for a small model
    and on CUDA (``MetaStep.task_chunk`` says which).

    ``graph`` picks the graph: ``"auto"`` (the default: ``"autograd"`` where this torch
    traces ``torch.autograd.grad``, else ``"torch.func"``), ``"autograd"`` (an error on a
    torch that cannot) or ``"torch.func"``. The two give the same meta-gradients.

    Returns a :class:`funcmeta.MetaStep`: ``step(support, query)`` adds the meta-gradients of the mean
    query loss to ``.grad`` and returns that loss. The support and query batches carry the
    task axis, as for :func:`funcmeta.adapt_tasks`.
    """
    check_int(steps, "steps", low=1, what="a positive int")
    if graph not in ("auto", "autograd", "torch.func"):
        raise ValueError(f"graph must be 'auto', 'autograd' or 'torch.func', got {graph!r}")
    if task_chunk is not None and task_chunk != "auto":
        check_int(task_chunk, "task_chunk", low=1, what="a positive int, 'auto' or None")
    # an unknown option or a bad value raises here, naming it, as fm.adapt_tasks would
    checked = AdaptOptions.of(options)
    checked.check_steps(steps)
    check_task_options(checked)
    if not isinstance(fmodel, FunctionalModel):
        raise TypeError(
            f"compile_meta_step expects a FunctionalModel (fm.functional_model(net)), got "
            f"{type(fmodel).__name__}"
        )
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"opt must be a funcmeta optimizer (fm.optim.*), got {type(opt).__name__}")
    modules = list(hyper)
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"hyper[{i}] is a {type(m).__name__}; hyper takes nn.Modules")
    fmodel.runtime.refuse(
        "fm.compile_meta_step",
        "its graph runs the tasks under torch.func.vmap and torch.func.grad, which a DTensor "
        "does not run under; use fm.adapt_tasks or the recipes, which run a sharded model's "
        "tasks one at a time",
    )
    plan = compile_plan(_device(fmodel), _convolutional(fmodel), mode, task_chunk)
    return MetaStep(
        fmodel,
        loss_fn,
        opt,
        steps=steps,
        hyper=modules,
        options=checked,
        compile=compile,
        plan=plan,
        graph=graph,
    )
