"""funcmeta's engine, private: nothing here is public API, and names may change between
releases. The public names are re-exported by ``funcmeta/__init__.py`` and the public
modules beside this package.

Packages, lowest first; a module imports from its own package or from lower rows only
(``scripts/check_layers.py``, ``docs/design.md``)::

    core                tree, checks, types, the torch fence, vmap levels, kernels, replay
    optim               the optimizers as pure (init, update) pairs
    module              FunctionalModel (swap + run), the shadow base, the executor protocol
    checkpoint | batching   per-layer checkpointing | the task executor (never each other)
    inner               the batch and its task axis, forward, the loop, adapt and adapt_tasks
"""
