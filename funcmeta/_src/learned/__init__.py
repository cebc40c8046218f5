"""Learned update rules (:mod:`funcmeta.learned`): ``curvature`` is Meta-Curvature's learned
preconditioner of the inner gradient, ``mlp`` a per-coordinate MLP optimizer; both are
gradient transformations whose own parameters are meta-learned."""
