"""A whole meta-iteration as one ``torch.compile`` graph (:func:`funcmeta.compile_meta_step`):
the step and its calls (``step``), how it compiles per device (``plan``), the rewrites of
its graph before inductor lowers it (``passes``) and why a step runs eagerly (``eager_reasons``).
The graph traces the inner loop of ``funcmeta._src.inner``, the one :func:`funcmeta.adapt_tasks`
runs; nothing here writes a loop of its own.
"""
