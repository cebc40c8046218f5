"""The differentiable optimizers as pure ``(init, update)`` pairs in the optax shape: the
transformation contract and ``chain`` (``base``), hyperparameters per leaf and per step and the
learnable trees (``hyper``), the building blocks (``primitives``), clipping (``clip``), ``sgd``, ``adam``,
``rmsprop``, ``adagrad``, and the conversion of a configured ``torch.optim`` optimizer
(``from_torch``). Public as :mod:`funcmeta.optim`. It imports only the core.
"""
