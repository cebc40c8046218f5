"""The meta-learning methods (:mod:`funcmeta.recipes`), one module each (``maml``, ``anil``,
``metasgd``, ``reptile``, ``mamlpp``, ``imaml``, ``protonet``, ``r2d2``); ``results``
holds what they return, ``common`` what they share: the call check, the default inner
optimizer and the query loss."""
