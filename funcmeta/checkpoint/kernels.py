"""Kernel choice for graphs that are differentiated twice, and the same kernels on recomputation.

Some of PyTorch's fastest kernels have no derivative of their backward:

- ``F.scaled_dot_product_attention`` (``nn.MultiheadAttention``, ``nn.Transformer*Layer``,
  HuggingFace models) is twice differentiable only on its math kernel. CPU flash attention and
  the CUDA flash, memory-efficient and cuDNN kernels raise in second order.
- cuDNN's RNN kernels (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` on CUDA) have no double backward.
- The inference fast path of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` has
  no derivative at all.

:func:`twice_differentiable` selects kernels that have one: the math attention kernel, RNNs
without cuDNN and no inference fast path. :func:`funcmeta.adapt` enters it for its
second-order inner steps (forward and inner gradient), the only graphs it builds that are
differentiated again. First-order steps, the query pass and evaluation keep the user's kernel
choice and the fast kernels. Use it yourself when you differentiate a model's output twice
outside :func:`funcmeta.adapt` (a Hessian-vector product, a gradient penalty).

The choice is global state that PyTorch reads when a kernel runs, so a checkpoint that
recomputes a layer during the outer ``.backward()`` would otherwise pick whatever is in force
then. funcmeta's checkpoints (per layer and per step) :func:`capture` the state when their
forward runs and :func:`restore` it for the recomputation.

Example:
    >>> import torch, funcmeta as fm
    >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> x = torch.randn(2, 5, 8)
    >>> with fm.checkpoint.kernels.twice_differentiable():
    ...     out = attn(x, x, x, need_weights=False)[0]
    ...     g = torch.autograd.grad(out.pow(2).sum(), attn.in_proj_weight, create_graph=True)[0]
    >>> hvp = torch.autograd.grad(g.sum(), attn.in_proj_weight)[0]   # second order works
    >>> hvp.shape
    torch.Size([24, 8])
"""

from funcmeta._src.core.kernels import (
    KernelRestore,
    KernelState,
    capture,
    entered_again,
    in_twice_differentiable,
    no_fast_path,
    recompute_with,
    restore,
    twice_differentiable,
)

__all__ = [
    "KernelRestore",
    "KernelState",
    "capture",
    "entered_again",
    "in_twice_differentiable",
    "no_fast_path",
    "recompute_with",
    "restore",
    "twice_differentiable",
]
