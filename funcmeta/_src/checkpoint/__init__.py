"""Checkpointing: per-layer activation checkpointing that composes with double backward.
The autograd Functions that keep a layer's inputs and recompute it, its backward and the
derivative of that (``engine``); choosing layers and running each as a checkpointed pure
function (``layers``); and the takeover of ``torch.utils.checkpoint`` calls a model makes
itself (``takeover``). It imports the core and the module package, never task batching.
"""
