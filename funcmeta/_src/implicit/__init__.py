"""Implicit differentiation (:mod:`funcmeta.implicit`): ``solvers`` holds the linear solvers
(conjugate gradient, normal-equation CG, Neumann series) and their results; ``ift`` is
:func:`funcmeta.implicit.root`, a solution differentiated through its optimality condition
by the implicit function theorem."""
