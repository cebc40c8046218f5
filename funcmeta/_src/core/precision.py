"""Exact float32 on GPUs: :func:`exact_float32`, TF32 off for a block.

On NVIDIA GPUs since Ampere, torch may run float32 convolutions and recurrent layers on cuDNN
(and, if asked, float32 matrix products) in TF32, which keeps 10 bits of mantissa. cuDNN's
convolutions and RNNs do so by default. One forward and backward barely notice; a
second-order meta-gradient differentiates through every inner step's gradient and amplifies
the rounding: second-order MAML through conv4 with BatchNorm on an H200 differed by 3.0%
(relative) between two runs of the same loop with TF32, and by 7.8e-5 without
(docs/memory.md, "TF32 and second order"). Inside :func:`exact_float32` every float32
matrix product, convolution and recurrent layer runs in full float32; the settings before it
come back after it (also on error). On a CPU it changes nothing.

On torch >= 2.9 it sets the per-operator flags (``torch.backends.cudnn.conv.fp32_precision``
and its kin, to ``"ieee"``); read those inside it, since torch refuses to read the legacy
``allow_tf32`` flags once the new ones are set. Older releases get ``allow_tf32 = False``.

Example:
    >>> import torch, funcmeta as fm
    >>> with fm.exact_float32():
    ...     y = torch.ones(2, 2) @ torch.ones(2, 2)   # in full float32 on a GPU too
    >>> y.tolist()
    [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch

__all__ = ["exact_float32"]

# torch >= 2.9 sets the precision per backend and operator; older releases have only the
# allow_tf32 flags (reading one form while the other is set may warn, so each torch uses one)
_NEW = (
    [
        (torch.backends.cuda.matmul, "fp32_precision"),
        # cudnn.conv lives on the module object torch swaps in, which its annotations omit
        (cast(Any, torch.backends.cudnn).conv, "fp32_precision"),
        (torch.backends.cudnn.rnn, "fp32_precision"),
    ]
    if hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")
    else []
)
_LEGACY = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off for the block: float32 matrix products, cuDNN convolutions and cuDNN
    recurrent layers in full float32, for float32 meta-gradients that a second-order
    derivative does not amplify TF32's rounding into. Usable as a decorator too."""
    settings: list[tuple[Any, str, Any]] = (
        [(owner, name, "ieee") for owner, name in _NEW]
        if _NEW
        else [(owner, name, False) for owner, name in _LEGACY]
    )
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in settings]
    try:
        for owner, name, value in settings:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
