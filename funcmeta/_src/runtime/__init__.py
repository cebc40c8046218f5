"""How a step runs, chosen once where the model is made and handed down: the runtime.

A :class:`~funcmeta._src.runtime.base.Runtime` owns how the model runs, how the tasks of a
call are batched, how the inner gradient is taken, what wraps each inner step, and what an
entry point checks around a call. :func:`funcmeta.functional_model` gives each model its
runtime (``FunctionalModel.runtime``); the entry points ask it (``runtime.for_params``) and
pass it down, a required argument below them. Here: :data:`EAGER` (``fm.adapt``,
``fm.adapt_tasks``, the recipes: the model's own tensor swap and task executor, ``vmap`` in
chunks, ``torch.autograd.grad``, the error reports and the kernel choice) and :data:`TRACED`
(what ``fm.compile_meta_step`` traces: ``torch.func.functional_call``, one
``torch.func.vmap``, ``torch.func.grad``), and, per compiled step on torch 2.13 and newer,
``autograd_traced.AutogradTracedRuntime`` (``TRACED``'s forward with ``torch.autograd.grad``,
and checkpointed layers as torch checkpoint regions). A model sharded by ``fm.distributed.shard_model``
gets that call's runtime (``funcmeta._src.distributed.runtime``). The inner loop
(``funcmeta._src.inner``) asks its runtime and branches on nothing. ``place`` says which
batch the model runs on now.
"""

from funcmeta._src.runtime.base import Runtime
from funcmeta._src.runtime.eager import EAGER, EagerRuntime
from funcmeta._src.runtime.traced import TRACED, TracedRuntime

__all__ = [
    "EAGER",
    "TRACED",
    "EagerRuntime",
    "Runtime",
    "TracedRuntime",
]
