"""The core, below everything: the pytree helpers (``tree``), every validator (``checks``),
the result types (``types``), the fence around torch's and Python's private internals
(``fence``: the only module that touches them), vmap levels and "inside a transform"
(``vmap``), the kernels a twice-differentiated step runs on (``kernels``), whether a run is a
recomputation (``replay``), float32 without TF32 (``precision``), and the file helpers of
snapshots (``records``, ``rng_state``, ``tempfiles``). It imports nothing of funcmeta's above.
"""
