"""The core, below everything: the pytree helpers (``tree``), every validator (``checks``),
the result types (``types``), the fence around torch's and Python's private internals
(``fence``: the only module that touches them), vmap levels and "inside a transform"
(``vmap``), the kernels a twice-differentiated step runs on (``kernels``), whether a run is a
recomputation (``replay``), float32 without TF32 (``precision``), temporary file names
(``tempfiles``, for snapshots and downloads), each public name's public home (``exposed``)
and the errors of renamed names (``renames``). It imports nothing of funcmeta's above.
"""
