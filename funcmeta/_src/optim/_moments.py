"""Exponential moving averages of gradients, shared by Adam and RMSprop."""

from __future__ import annotations

import torch
from torch import Tensor

from funcmeta._src.core.checks import is_number

__all__ = ["ema", "ema_sq"]


def ema(avg: Tensor, x: Tensor, beta: float | Tensor) -> Tensor:
    """``beta * avg + (1 - beta) * x`` computed as torch.optim does (``lerp``)."""
    return avg.lerp(x, 1 - beta) if is_number(beta) else avg + (1 - beta) * (x - avg)


def ema_sq(avg: Tensor, x: Tensor, beta: float | Tensor) -> Tensor:
    """``beta * avg + (1 - beta) * x * x``."""
    if is_number(beta):
        return torch.addcmul(avg.mul(beta), x, x, value=1 - beta)
    return avg * beta + (1 - beta) * (x * x)
