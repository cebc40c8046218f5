"""The inner loop and its entry points, on one path: where a module becomes a functional
model with its checkpointed layers and task executor (``model``), the options (``options``),
the batch and its task axis (``inputs``), a forward and its loss (``forward``), the loop of
optimizer steps (``loop``), :func:`funcmeta.adapt` (``adapt``), :func:`funcmeta.adapt_tasks`,
:func:`funcmeta.apply_tasks` and :func:`funcmeta.task_losses` (``tasks``) and measuring the
task chunk (``tune``). It imports every package below it.
"""
