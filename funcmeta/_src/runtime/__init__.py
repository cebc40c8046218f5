"""How a step runs, chosen once at the entry point and handed down: the runtime.

A :class:`~funcmeta._src.runtime.base.Runtime` owns how the model runs, how the tasks of a
call are batched, how the inner gradient is taken and what wraps each inner step. Three exist:
:data:`EAGER` (``fm.adapt``, ``fm.adapt_tasks``, the recipes: the model's own tensor swap and
task executor, ``vmap`` in chunks, ``torch.autograd.grad``, the error reports and the kernel
choice), :data:`PER_TASK` (the eager one with the tasks in a loop, without ``vmap``: a
sharded model's task-batched calls; :func:`runtime_for` chooses between the two) and
:data:`TRACED` (what ``fm.compile_meta_step`` traces: ``torch.func.functional_call``, one
``torch.func.vmap``, ``torch.func.grad``). The inner loop (``funcmeta._src.inner``) asks
its runtime and branches on nothing. ``place`` says which batch the model runs on now.
"""

from funcmeta._src.runtime.base import Runtime
from funcmeta._src.runtime.eager import EAGER, EagerRuntime
from funcmeta._src.runtime.per_task import PER_TASK, PerTaskRuntime, runtime_for
from funcmeta._src.runtime.traced import TRACED, TracedRuntime

__all__ = [
    "EAGER",
    "PER_TASK",
    "TRACED",
    "EagerRuntime",
    "PerTaskRuntime",
    "Runtime",
    "TracedRuntime",
    "runtime_for",
]
