"""Sinusoid regression tasks (Finn et al., 2017): ``y = A sin(x - phase)``.

Amplitude ``A ~ U[0.1, 5]``, phase ``~ U[0, pi]``, inputs ``x ~ U[-5, 5]``, by default.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from funcmeta._src.core.checks import check_int, check_real
from funcmeta._src.core.exposed import exposed_in

__all__ = ["Sinusoid", "SinusoidBatch"]


@exposed_in("funcmeta.data")
class SinusoidBatch(NamedTuple):
    """A batch of tasks; every tensor has a leading task axis ``T``.

    ``x_*``/``y_*`` have shape ``(T, n, 1)``; ``amplitude`` and ``phase`` have shape ``(T,)``.
    """

    x_support: Tensor
    y_support: Tensor
    x_query: Tensor
    y_query: Tensor
    amplitude: Tensor
    phase: Tensor

    @property
    def support(self) -> tuple[Tensor, Tensor]:
        """``(x_support, y_support)``: the support batch, as the recipes and
        :func:`funcmeta.adapt_tasks` take it."""
        return (self.x_support, self.y_support)

    @property
    def query(self) -> tuple[Tensor, Tensor]:
        """``(x_query, y_query)``: the query batch."""
        return (self.x_query, self.y_query)


def _check_range(name: str, lo_hi: tuple[float, float]) -> tuple[float, float]:
    low, high = lo_hi
    lo, hi = check_real(low, f"{name}[0] (low)"), check_real(high, f"{name}[1] (high)")
    if not lo <= hi:
        raise ValueError(f"{name} must be (low, high) with low <= high, got {lo_hi!r}")
    return lo, hi


@exposed_in("funcmeta.data")
class Sinusoid:
    """The sinusoid task distribution; :meth:`sample` draws tasks with support and query sets.

    Example:
        >>> import torch, funcmeta as fm
        >>> b = fm.data.Sinusoid().sample(2, 5, 5, generator=torch.Generator().manual_seed(1))
        >>> torch.allclose(b.y_support, b.amplitude[:, None, None] * torch.sin(b.x_support - b.phase[:, None, None]))
        True
    """

    def __init__(
        self,
        amplitude: tuple[float, float] = (0.1, 5.0),
        phase: tuple[float, float] = (0.0, math.pi),
        x_range: tuple[float, float] = (-5.0, 5.0),
    ) -> None:
        self.amplitude = _check_range("amplitude", amplitude)
        self.phase = _check_range("phase", phase)
        self.x_range = _check_range("x_range", x_range)

    def sample(
        self,
        num_tasks: int,
        support: int,
        query: int,
        *,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> SinusoidBatch:
        """Draw ``num_tasks`` tasks with ``support`` and ``query`` points each.

        Draws happen on the CPU from ``generator`` (seed it for reproducible tasks), then
        move to ``device``.
        """
        for name, n, low in (
            ("num_tasks", num_tasks, 1),
            ("support", support, 0),
            ("query", query, 0),
        ):
            check_int(n, name, low=low)
        dtype = dtype or torch.get_default_dtype()

        def uniform(shape: tuple[int, ...], lo_hi: tuple[float, float]) -> Tensor:
            lo, hi = lo_hi
            return torch.rand(shape, generator=generator, dtype=dtype) * (hi - lo) + lo

        amp = uniform((num_tasks,), self.amplitude)
        phase = uniform((num_tasks,), self.phase)
        x = uniform((num_tasks, support + query, 1), self.x_range)
        y = amp[:, None, None] * torch.sin(x - phase[:, None, None])
        parts = (x[:, :support], y[:, :support], x[:, support:], y[:, support:], amp, phase)
        return SinusoidBatch(*(t.to(device) for t in parts))
