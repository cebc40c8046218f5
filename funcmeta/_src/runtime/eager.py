"""The eager runtime: :data:`EAGER`, how ``fm.adapt``, ``fm.adapt_tasks`` and the recipes run.

The model runs through its own tensor swap (``FunctionalModel.run_plain``), task-batched
inputs handed to its task executor (stand-ins, checkpointed layers, the once-per-task
fallback); the tasks of a call are mapped by ``vmap`` in chunks
(``funcmeta._src.core.vmap.vmap_flat``); the inner gradient is ``torch.autograd.grad`` on the
forward's graph (checkpointed layers may take theirs on it: ``kept_for_the_gradient``); each
step says which batch a model error happened on, an allocator failure names the options that
bound the memory, and the steps whose graph is differentiated again run on kernels that
allow it. A shape or dtype error inside the model is said again with the batch, the layer
and the shapes.

Example:
    >>> import torch, funcmeta as fm
    >>> from funcmeta._src.runtime import EAGER
    >>> fmodel = fm.functional_model(torch.nn.Linear(2, 1))
    >>> out, _ = EAGER.run(fmodel, fmodel.params, fmodel.buffers, (torch.ones(3, 2),), {})
    >>> out.shape
    torch.Size([3, 1])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from funcmeta._src.checkpoint.engine import graph_input, kept_for_the_gradient
from funcmeta._src.core import kernels
from funcmeta._src.core.checks import error_like
from funcmeta._src.core.fence import traceback_modules
from funcmeta._src.core.sharding import rewrite_mixed
from funcmeta._src.core.vmap import any_batched, vmap_flat
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.module.shadow import Standin
from funcmeta._src.module.task_protocol import ChunkSpec, TaskCall, TaskChunk
from funcmeta._src.runtime.base import Objective, Runtime
from funcmeta._src.runtime.place import at, current

__all__ = ["EAGER", "EagerRuntime", "out_of_memory"]


class EagerRuntime(Runtime):
    """The eager runtime (see the module docstring); :data:`EAGER` is the one instance."""

    def run(
        self,
        fmodel: FunctionalModel,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, dict[str, Tensor]]:
        """``fmodel.run_checked``, with task-batched inputs handed straight to the model's task
        executor (the call goes down the packages, never back up through the model); a dtype
        mismatch inside the model (torch's "must have the same dtype") is said again with the
        dtypes of the inputs and parameters and the fix."""
        batched = False
        try:
            fmodel.check_buffers(buffers)
            executor = fmodel.executor
            batched = any_batched(params, buffers, args, kwargs)
            if executor is not None and batched:
                return executor.run(fmodel, params, buffers, args, kwargs)
            return fmodel.run_plain(params, buffers, args, kwargs)
        except (RuntimeError, IndexError) as error:
            sharded = rewrite_mixed(error)
            if sharded is not None:
                raise sharded from error
            text = str(error)
            if isinstance(error, RuntimeError) and ("dtype" in text or "scalar type" in text):
                raise error_like(error, f"{text}\n{_dtypes_hint(params, args, kwargs)}") from error
            if _WHERE in text or not _about_shapes(error):
                raise
            where = _where_it_failed(fmodel, error, args, kwargs, batched)
            raise error_like(error, f"{text}\n{where}") from error

    def over_tasks(
        self,
        one_task: Callable[..., Any],
        trees: tuple[Any, ...],
        in_dims: tuple[Any, ...],
        chunk: int | None,
    ) -> Any:
        return vmap_flat(one_task, trees, in_dims, chunk)

    def chunk_for(
        self, fmodel: FunctionalModel, task_chunk: ChunkSpec, describe: Callable[[], TaskCall]
    ) -> TaskChunk:
        """The chunk the model's task executor gives the call for its ``task_chunk``."""
        if fmodel.executor is None:
            return TaskChunk(None)
        return fmodel.executor.chunk_for(describe(), task_chunk)

    def following(
        self,
        fmodel: FunctionalModel,
        task_chunk: ChunkSpec,
        describe: Callable[[], TaskCall],
        run: Callable[[int | None], tuple[Any, dict[str, Tensor]]],
    ) -> tuple[Any, dict[str, Tensor]]:
        """On the chunk the model's executor gives the pass for its ``task_chunk``: that of
        the inner loop whose :class:`~funcmeta.TaskChunk` it was given (its time counted with
        that loop's when measured), or the rule on its own shapes under ``"auto"``."""
        if fmodel.executor is None:
            return run(None)
        return fmodel.executor.run_following(run, task_chunk, describe)

    def gradient(
        self,
        objective: Objective,
        leaves: list[Tensor],
        buffers: dict[str, Tensor],
        *,
        second_order: bool,
        keep_graph: bool,
    ) -> tuple[Tensor, list[Tensor | None], dict[str, Tensor]]:
        with torch.enable_grad():
            if second_order:
                wrt = [p if p.requires_grad else graph_input(p) for p in leaves]
            else:
                wrt = [graph_input(p) for p in leaves]
            with kept_for_the_gradient() if keep_graph else contextlib.nullcontext():
                total, loss, new_buffers = objective(wrt, buffers)
                if not total.requires_grad:
                    raise ValueError(
                        "the inner loss does not depend on the adapted parameters (it has no "
                        "gradient history): loss_fn must compute the loss from the model's "
                        "output (a loss of the targets alone, or one computed under "
                        "torch.no_grad() or from .detach()ed outputs, cannot be adapted on)"
                    )
                found = torch.autograd.grad(
                    total, wrt, create_graph=second_order, allow_unused=True
                )
        return loss, list(found), new_buffers

    def second_order_kernels(self, steps: contextlib.ExitStack) -> None:
        # kernels that allow a second derivative (a recomputation restores its forward's)
        steps.enter_context(kernels.twice_differentiable())

    @contextlib.contextmanager
    def step_scope(self, k: int, steps: int, first_order: bool) -> Iterator[None]:
        try:
            with at(f"the support batch at inner step {k}"):
                yield
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not out_of_memory(error):
                raise
            raise _memory_error(error, k, steps, first_order) from error


#: The eager runtime.
EAGER = EagerRuntime()


def out_of_memory(error: RuntimeError) -> bool:
    """Whether ``error`` is an allocator failure (CUDA's ``OutOfMemoryError``, or the CPU
    allocator's "can't allocate memory")."""
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(error, oom):
        return True
    message = str(error)
    return "out of memory" in message.lower() or "can't allocate memory" in message


def _memory_error(error: RuntimeError, k: int, steps: int, first_order: bool) -> Exception:
    """``error`` again, its message naming the step and the options that bound the memory."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    held = "" if first_order else " (each second-order step keeps its graph)"
    message = (
        f"out of memory at inner step {k} of {steps}{held}: {first}\n"
        "The inner loop's memory grows with the number of steps. To bound it: "
        "checkpoint_steps=True keeps only each step's parameters and recomputes the steps in "
        "the outer backward (same meta-gradients), and first_order=True or truncate= keeps no "
        "graph of the steps; per-layer checkpointing (functional_model(..., "
        "checkpoint_layers=...)) lowers what each step keeps. Fewer steps or tasks per call "
        "(task_chunk=) also help."
    )
    return error_like(error, message)


_WHERE = "funcmeta: the model's forward failed on"
_SHAPE_WORDS = ("shape", "size", "dimension", "dim ", "mat1", "mat2", "expected input", "index")


def _about_shapes(error: BaseException) -> bool:
    """Whether ``error`` reads as a shape (or index) mismatch inside the model."""
    text = str(error).lower()
    return any(word in text for word in _SHAPE_WORDS)


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    given = [(f"argument {i}", v) for i, v in enumerate(args)] + list(kwargs.items())
    parts = [
        f"{name} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
        for name, v in given
        if isinstance(v, Tensor)
    ]
    return ", ".join(parts) if parts else "no tensor arguments"


def _where_it_failed(
    fmodel: FunctionalModel,
    error: BaseException,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batched: bool,
) -> str:
    """Which batch the model failed on (as the caller said: ``funcmeta._src.runtime.place``),
    its inputs' shapes, and the innermost of the model's layers on the error's traceback."""
    names = {id(m): name for name, m in fmodel.module.named_modules()}
    # a task-batched run goes through stand-ins for some layers: each names its original
    seen = [m.original if isinstance(m, Standin) else m for m in traceback_modules(error)]
    layers = [m for m in seen if id(m) in names]
    if layers:
        name = names[id(layers[-1])]
        layer = (
            f"in layer '{name}' ({type(layers[-1]).__name__})"
            if name
            else f"in the model's own forward ({type(layers[-1]).__name__})"
        )
    else:
        layer = "outside the model's layers"
    tasks = " (shapes per task: every task of the batch runs this layer alike)" if batched else ""
    return (
        f"{_WHERE} {current() or 'a batch'}{tasks}, {layer}; its inputs: {_shapes(args, kwargs)}. "
        "Check the batch's shapes against the model's (a batch of shape (N, features) for "
        "nn.Linear(features, ...)); a leftover or missing task axis shows here too"
    )


def _dtypes_hint(
    params: Mapping[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    kinds: dict[torch.dtype, list[str]] = {}
    for name, p in params.items():
        kinds.setdefault(p.dtype, []).append(name)
    common = max(kinds, key=lambda d: len(kinds[d]))
    odd = {n: str(d).replace("torch.", "") for d, ns in kinds.items() if d != common for n in ns}
    given = [(f"argument {i}", v) for i, v in enumerate(args)] + list(kwargs.items())
    inputs = {w: str(v.dtype).replace("torch.", "") for w, v in given if isinstance(v, Tensor)}
    want = str(common).replace("torch.", "")
    parts = [f"The parameters are {want}" + (f", except {odd}" if odd else "")]
    parts.append(f"the inputs are {inputs}")
    fix = (
        f"cast the odd parameters with the module (module.to(torch.{want}))"
        if odd
        else f"give the model {want} inputs (x.to(torch.{want})); integer inputs are for embeddings"
    )
    return "; ".join(parts) + f": {fix}."
