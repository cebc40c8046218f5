"""Task batching: everything that makes T tasks one computation, with the meta-gradients of a
loop over them.

What it owns:

- :mod:`~funcmeta.batching.vmap`: the vmap glue: a lean ``vmap``, leaving a vmap level for a
  checkpointed layer or a per-task run, joining per-chunk outputs;
- :mod:`~funcmeta.batching.layers`: the stand-ins that compute a layer for all tasks at once
  (linear, convolution, BatchNorm, pooling, embeddings with a padding index);
- :mod:`~funcmeta.batching.attention`: ``nn.MultiheadAttention`` for all tasks, on the fused
  attention kernel with the tasks in its batch;
- :mod:`~funcmeta.batching.recurrent`: recurrent layers for all tasks in one pass, or once
  per task (:class:`~funcmeta.batching.recurrent.TaskLoop`) where that cannot be exact;
- :mod:`~funcmeta.batching.fallback`: which layer refused ``vmap`` and why, when a model runs
  once per task;
- :mod:`~funcmeta.batching.tune`: measuring the task-chunk size (:func:`tune_task_chunk`).

The task axis that optimizers see (``fm.optim.task_axis``, per-task gradient clipping) lives
in :mod:`funcmeta.optim.base`, below this package; the public entry points
(:func:`funcmeta.adapt_tasks`, :func:`funcmeta.apply_tasks`, :func:`funcmeta.task_losses`)
are in :mod:`funcmeta.tasks`, above it.

What it may import: :mod:`funcmeta._torch_private`, :mod:`funcmeta.remat.kernels`,
:mod:`funcmeta.remat.shadow` (stand-ins share the module-tree machinery of checkpointing);
:mod:`~funcmeta.batching.tune` alone sits above the core and imports :mod:`funcmeta.tasks`.
``docs/design.md`` has the whole layering.

Example:
    >>> import torch, funcmeta as fm
    >>> from funcmeta.batching.layers import task_standins
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LSTM(3, 3))
    >>> sorted((name, cls.__name__) for name, cls in task_standins(net).items())
    [('0', 'TaskLinear'), ('1', 'TaskRecurrent')]
"""

__all__: list[
    str
] = []  # the public entry points are funcmeta's (fm.adapt_tasks, fm.tune_task_chunk)
