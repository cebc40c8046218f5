"""Task batching: the task executor that makes T tasks one computation, with the
meta-gradients of a loop over them.

What it owns:

- ``executor``: :class:`TaskExecutor`, which :func:`funcmeta.functional_model` gives every
  model: it runs task-batched calls, falls back to one run per task where a model cannot run
  under ``vmap`` (found by a probe, reported once per layer), and owns the chunk choice;
- ``chunks``: choosing the task chunk by measuring the first calls;
- ``layers``: the stand-ins that compute a layer for all tasks at once (linear, convolution,
  BatchNorm, pooling, embeddings with a padding index), with ``attention``, ``layer_norm``,
  ``recurrent``, ``cells`` and ``packed`` (packed sequences) for their families;
- ``intercept``: the torch-function mode that keeps a task axis where vmap would not;
- ``fallback``: which layer refused ``vmap`` and why.

It imports the core and the module package, never checkpointing: the task runner with
its checkpointed layers is built by ``funcmeta._src.inner.model``.

Example:
    >>> import torch
    >>> from funcmeta._src.batching.layers import task_standins
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LSTM(3, 3))
    >>> sorted((name, cls.__name__) for name, cls in task_standins(net).items())
    [('0', 'TaskLinear'), ('1', 'TaskRecurrent')]
"""

__all__: list[
    str
] = []  # the public entry points are funcmeta's (fm.adapt_tasks, fm.tune_task_chunk)
