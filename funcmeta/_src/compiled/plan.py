"""How :func:`funcmeta.compile_meta_step` compiles its graph for a kind of device and model:
``compile_plan``, a pure function of the device type, whether the model has
convolutions, and the caller's ``mode`` and ``task_chunk`` (``CompilePlan``), so that
a test on a CPU can ask what a CUDA device gets.

Example:
    >>> import funcmeta as fm
    >>> plan = fm.MetaStep.plan_for("cpu", convolutional=True)
    >>> plan.task_chunk, plan.cuda_graphs
    (1, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from funcmeta._src.compiled.passes import cpu_passes
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import (
    inductor_aten_max_pool_backward,
    inductor_has_option,
    inductor_mode_options,
)

__all__ = ["CompilePlan", "compile_plan"]

# the torch.compile modes whose inductor options include "triton.cudagraphs"
_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})
# inductor's option to build a C++ wrapper apart from its kernels (torch 2.8 and newer)
_SEPARATE_BUILD = "cpp_wrapper_build_separate"
# inductor's post-grad pass that moves each producer next to its first consumer: torch runs it
# only on a graph it compiles for inference, which a meta-step's traced backward is to it
_LOCALITY = "reorder_for_locality"


@exposed_in("funcmeta")
@dataclasses.dataclass(frozen=True)
class CompilePlan:
    """How :func:`funcmeta.compile_meta_step` compiles its graph for one kind of device and model:
    what ``MetaStep.plan_for`` chooses (``MetaStep.plan``).

    Attributes:
        device: the device type the model's parameters are on (``"cpu"``, ``"cuda"``, ...).
        mode: ``torch.compile``'s mode this amounts to (``None``: its default). Where
            ``options`` is set, torch.compile gets the options alone (it takes a mode or
            options, not both), and they spell the mode out: ``"reduce-overhead"`` is
            ``{"triton.cudagraphs": True}``.
        options: inductor options, or ``None``.
        graph_passes: whether the options get the step's CPU graph passes
            (the tall batched products turned), added by
            :meth:`compile_kwargs`: making them imports inductor, which a plan does not.
        task_chunk: how many tasks one graph call takes (``None``: all of them; ``"rule"``:
            the rule of ``task_chunk="auto"`` on each call's shapes).
        cuda_graphs: whether the graph is replayed as a CUDA graph. Each replay writes into
            the same output tensors, so the step copies a graph call's results before it
            keeps them, and marks each call a new step
            (``torch.compiler.cudagraph_mark_step_begin``).
        lowering: the context a compile of the graph runs inside (inductor's lowering
            choices for this device).
        note: why the plan is not what the device would get otherwise, else ``None``.
        separate_build: whether :meth:`compile_kwargs` asks inductor to build the C++
            wrapper apart from the kernels (``cpp_wrapper_build_separate``: the wrapper, one
            line per operation of the graph, at ``-O1``, the kernels at ``-O3``), where this
            torch has the option: the cold compile of a large meta-step is cut by a quarter.
        remat: whether the graph recomputes checkpointed layers or steps for its outer
            gradient (set by the step for a model with ``checkpoint_layers``, or
            ``checkpoint_steps``). :meth:`compile_kwargs` then turns inductor's
            ``reorder_for_locality`` off where this torch has it: torch runs that pass only
            on a graph it compiles for inference, which a meta-step that traces its own
            gradients is to it, and moving each producer next to its first consumer keeps
            the producer's inputs alive longer, which undoes part of the recomputation's
            saving (``docs/decisions/compiled-autograd-step.md``). A ``mode`` is then
            written out as its options (torch.compile applies the same table), so that
            the option can be added.
    """

    device: str
    mode: str | None
    options: Mapping[str, Any] | None
    task_chunk: int | Literal["rule"] | None
    cuda_graphs: bool
    lowering: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    note: str | None = None
    graph_passes: bool = False
    separate_build: bool = False
    remat: bool = False

    def compile_kwargs(self) -> dict[str, Any]:
        """What ``torch.compile`` gets besides ``fullgraph`` and ``dynamic``.

        Example:
            >>> import dataclasses
            >>> import funcmeta as fm
            >>> plan = fm.MetaStep.plan_for("cuda", convolutional=False)
            >>> dataclasses.replace(plan, remat=True).compile_kwargs()
            {'options': {'triton.cudagraphs': True, 'reorder_for_locality': False}}
        """
        locality = self.remat and inductor_has_option(_LOCALITY)
        if self.options is None:
            spelled = inductor_mode_options(self.mode) if locality else None
            if spelled is None:
                return {"mode": self.mode}
            return {"options": {**spelled, _LOCALITY: False}}
        options = {**self.options, **(cpu_passes() if self.graph_passes else {})}
        if self.separate_build and inductor_has_option(_SEPARATE_BUILD):
            options[_SEPARATE_BUILD] = True
        if locality:
            options[_LOCALITY] = False
        return {"options": options}


def compile_plan(
    device: str,
    convolutional: bool,
    mode: str | None = None,
    task_chunk: int | Literal["auto"] | None = "auto",
) -> CompilePlan:
    """How :func:`funcmeta.compile_meta_step` compiles for a model on ``device`` (a device type),
    with convolutions or without, given the caller's ``mode`` and ``task_chunk``: a pure
    function, so that a test on a CPU can ask what a CUDA device gets.

    - ``mode=None`` on a CPU: inductor's C++ wrapper (a few hundred small kernels launched
      without a Python call each), built apart from the kernels and less optimised than
      them (a quarter of a large step's cold compile), the double backward's batched products in the
      orientation torch's CPU kernel runs fast, convolutions in the model's layout
      (``layout_optimization`` off), and max pooling's backward as aten's kernel
      (``docs/decisions/inductor-on-cpu.md``).
    - ``mode=None`` on CUDA: ``"reduce-overhead"``, CUDA graphs: the whole meta-iteration
      is one graph launch (the sinusoid at T = 32 ran 0.79 ms against 3.74-7.0 ms without,
      on an H200). For a model with convolutions, also ``layout_optimization`` off: the
      model's layout, as on the CPU and as the eager path runs it, and no layout
      conversions to compile.
    - a ``mode`` given is torch.compile's, as it is; CUDA graphs where it asks for them on
      CUDA (``"reduce-overhead"``, ``"max-autotune"``).
    - ``task_chunk="auto"``: 1 for a model with convolutions on a CPU or CUDA: all tasks of
      conv4 in one graph compiled for 6 to over 20 minutes on a CPU and did not finish in
      140 s on an H200; the graph of one task compiled in 3-5 minutes on the CPU. Otherwise
      the rule of :func:`funcmeta.functional_model`'s ``task_chunk="auto"``: on a CPU
      ``"rule"``, applied to each call's shapes (all tasks for a small model), elsewhere all
      tasks in one graph. A number or ``None`` is kept.

    Example:
        >>> from funcmeta._src.compiled.plan import compile_plan
        >>> plan = compile_plan("cuda", convolutional=True)
        >>> plan.mode, plan.cuda_graphs, plan.task_chunk, dict(plan.options)
        ('reduce-overhead', True, 1, {'triton.cudagraphs': True, 'layout_optimization': False})
        >>> compile_plan("cuda", convolutional=False).compile_kwargs()
        {'mode': 'reduce-overhead'}
    """
    chunk: int | Literal["rule"] | None = task_chunk  # type: ignore[assignment]
    if task_chunk == "auto":
        if convolutional and device in ("cpu", "cuda"):
            chunk = 1  # the graph of one task: its compile time is bounded
        else:  # the rule of fm.functional_model's task_chunk="auto": all tasks but on a CPU
            chunk = "rule" if device == "cpu" else None
    if mode is not None:
        graphs = mode in _GRAPH_MODES
        note = (
            f"mode={mode!r} asks for CUDA graphs, which capture CUDA tensors only: on "
            f"{device} the graph runs without them"
            if graphs and device != "cuda"
            else None
        )
        return CompilePlan(device, mode, None, chunk, graphs and device == "cuda", note=note)
    if device == "cpu":
        options = {"cpp_wrapper": True, "layout_optimization": False}
        lowering = inductor_aten_max_pool_backward
        return CompilePlan(
            "cpu", None, options, chunk, False, lowering, graph_passes=True, separate_build=True
        )
    if device == "cuda":
        conv_options = {"triton.cudagraphs": True, "layout_optimization": False}
        return CompilePlan(
            "cuda", "reduce-overhead", conv_options if convolutional else None, chunk, True
        )
    return CompilePlan(device, None, None, chunk, False)
