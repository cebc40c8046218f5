"""Closed-form heads (:mod:`funcmeta.heads`): ``ridge`` solves ridge regression for many
tasks at once, exactly or implicitly through :func:`funcmeta.implicit.root`, and holds the
R2D2 classifier head with its learnable regulariser, scale and bias; ``linear_cross_entropy``
is a language model's loss from its hidden states and linear head, vocabulary-parallel on a
head's shards."""
