"""funcmeta's crossing from a DTensor shard to a plain tensor (distributed/crossing.py): the
whole tensor and the local one, on 2 gloo ranks with uneven shards, give the plain tensor's
first, second and third derivatives (float64) on every torch; torch's own full_tensor()
drops the second order before torch 2.12, which is why the crossing exists."""

from __future__ import annotations

import torch
from helpers import spawn_gloo

from funcmeta._src.core.capabilities import torch_release
from funcmeta._src.distributed import crossing

ROWS = 5  # 3 and 2 rows on 2 ranks


def _weights() -> torch.Tensor:
    return torch.linspace(-1.0, 1.5, ROWS * 3, dtype=torch.float64).reshape(ROWS, 3)


def _f(w: torch.Tensor) -> torch.Tensor:
    return (torch.sin(w) * w**2).sum()


def _derivatives(w, read):
    """f's gradient, the gradient of its sum (second order) and of that one's (third), each
    with respect to ``w`` (a shard or a plain tensor), read whole; zeros where a gradient
    does not reach ``w`` (its graph was cut)."""
    found, g = [], _f(read(w))
    for _ in range(3):
        if g.requires_grad:
            (g,) = torch.autograd.grad(g, w, create_graph=True, allow_unused=True)
        g = torch.zeros_like(w) if g is None else g
        found.append(read(g))
        g = read(g).sum()
    return [t.detach() for t in found]


def _case_whole(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from funcmeta._src.distributed import crossing

    mesh = init_device_mesh("cpu", (world,))
    shard = distribute_tensor(_weights(), mesh, [Shard(0)]).requires_grad_()
    ours = _derivatives(shard, lambda t: crossing.whole(t, "w") if hasattr(t, "to_local") else t)
    theirs = _derivatives(shard, lambda t: t.full_tensor() if hasattr(t, "to_local") else t)
    return ours, theirs, shard.to_local().shape[0]


def _case_local(world):
    """``local`` on each rank's rows: f of the rank's own rows; the derivatives there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from funcmeta._src.distributed import crossing

    mesh = init_device_mesh("cpu", (world,))
    shard = distribute_tensor(_weights(), mesh, [Shard(0)]).requires_grad_()
    (g1,) = torch.autograd.grad(_f(crossing.local(shard)), shard, create_graph=True)
    (g2,) = torch.autograd.grad(crossing.local(g1).sum(), shard, create_graph=True)
    (g3,) = torch.autograd.grad(crossing.local(g2).sum(), shard)
    return [crossing.local(g).detach() for g in (g1, g2, g3)], shard.to_local().shape[0]


def _plain() -> list[torch.Tensor]:
    w = _weights().requires_grad_()
    return _derivatives(w, lambda t: t)


def test_the_whole_tensor_crossing_gives_every_derivative_of_the_plain_tensor():
    plain = _plain()
    for rank, (ours, theirs, rows) in enumerate(spawn_gloo(2, _case_whole)):
        assert rows == (3, 2)[rank]
        for a, b in zip(ours, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        # torch's own: the first derivative always; the second order from torch 2.12 on only
        torch.testing.assert_close(theirs[0], plain[0], rtol=1e-12, atol=1e-14)
        dropped = not torch.allclose(theirs[1], plain[1], rtol=1e-6, atol=1e-9)
        assert dropped == (torch_release() < crossing._JOINED_REDISTRIBUTE), torch.__version__


def test_the_local_tensor_crossing_gives_every_derivative_of_its_rows():
    plain = _plain()
    for rank, (ours, rows) in enumerate(spawn_gloo(2, _case_local)):
        start = (0, 3)[rank]
        for a, b in zip(ours, plain, strict=True):
            torch.testing.assert_close(a, b[start : start + rows], rtol=1e-12, atol=1e-14)
