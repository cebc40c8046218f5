"""Where a ``DTensor`` shard becomes a plain tensor and back, differentiable twice on every
torch funcmeta accepts.

A sharded model's forward reads its parameters as plain tensors: a layer's whole parameters
(:func:`whole`, an all-gather) or this rank's own shard (:func:`local`, for the layers that
compute on their shards). A second-order meta-gradient differentiates the backward of that
crossing once more: the inner gradient that reaches a shard must stay joined to the graph
of the loss it came from.

torch's own crossings (``DTensor.full_tensor()``, ``DTensor.to_local()``) are not that on
torch 2.5 to 2.11: their backward wraps the incoming gradient in a new ``DTensor`` with the
``DTensor`` constructor (``_ToTorchTensor.backward``, ``Redistribute.backward``), which cuts
it from its graph. The inner gradient then holds no second-order term, and the meta-gradient
is the first-order one, silently, with any number of ranks, one included (torch 2.12 builds
it with ``DTensor.from_local`` and a nested redistribution instead; see
``docs/decisions/sharded-parameters.md``). The autograd functions here make each crossing
and its backward a pair, each the other's backward, built only from public ``DTensor``
calls under ``torch.no_grad()``: a gradient stays joined to its graph on every torch.

A gradient that reaches a shard's crossing with other placements than the shard's (a
``Partial`` sum, say) is redistributed to the shard's first, with torch's
``redistribute``: joined on torch 2.12 and newer only; on older torch such a gradient in a
recorded backward raises ``UnsupportedTorchError``. The inner loops' updates keep a shard's
placements, so a second-order meta-gradient meets none.

Example (one process):
    >>> import tempfile, torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, distribute_tensor
    >>> from funcmeta._src.distributed import crossing
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    >>> w = distribute_tensor(torch.tensor([1.0, 2.0]), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> w.requires_grad_()
    DTensor(...)
    >>> (g,) = torch.autograd.grad((crossing.whole(w, "w") ** 3).sum(), w, create_graph=True)
    >>> (h,) = torch.autograd.grad(g.sum(), w)  # second derivative of x**3: 6x
    >>> h.full_tensor().tolist()
    [6.0, 12.0]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from funcmeta._src.core.capabilities import UnsupportedTorchError, torch_release
from funcmeta._src.distributed import comm

__all__ = ["local", "whole"]

#: The first torch whose ``DTensor.redistribute`` backward is recorded (a nested
#: redistribution): before it, a gradient redistributed in a recorded backward loses its graph.
_JOINED_REDISTRIBUTE = (2, 12)


def whole(shard: Any, what: str) -> Tensor:
    """``shard``'s whole tensor, gathered from every rank that holds a part of it; its
    gradient reaches ``shard`` as this rank's slice (the whole tensor's gradient is the same on
    every rank: each computes the same replicated activations), differentiable again."""
    return _Whole.apply(shard, what)


def local(shard: Any) -> Tensor:
    """``shard``'s local tensor (this rank's part), with the gradient reaching it put back
    on ``shard``'s placements, differentiable again."""
    return _Local.apply(shard)


def _spec(shard: Any) -> tuple[Any, tuple[Any, ...], torch.Size, tuple[int, ...]]:
    return shard.device_mesh, tuple(shard.placements), shard.shape, shard.stride()


def _placed(grad: Any, spec: tuple[Any, ...], what: str) -> Any:
    """``grad`` (a ``DTensor``) on the placements of ``spec``. Where that takes torch's
    ``redistribute`` in a backward that is itself recorded (``create_graph``), on a torch
    whose ``redistribute`` cuts the graph (before 2.12), :class:`UnsupportedTorchError`
    instead of a gradient without its second order."""
    mesh, placements = spec[0], spec[1]
    if tuple(grad.placements) == placements:
        return grad
    if torch.is_grad_enabled() and torch_release() < _JOINED_REDISTRIBUTE:
        raise UnsupportedTorchError(
            f"the gradient of {what} reached its shard on {tuple(grad.placements)} where the "
            f"shard is on {placements}: torch {torch.__version__}'s redistribution between "
            "them keeps no second order (torch 2.12 and newer do); install torch>=2.12 or "
            "take first-order meta-gradients (first_order=True)",
            "sharded models",
        )
    return comm.redistribute(grad, mesh, placements, f"placing the gradient of {what}")


class _Whole(torch.autograd.Function):
    """A shard to its whole tensor (an all-gather); backward :class:`_Slice`."""

    @staticmethod
    def forward(ctx: Any, shard: Any, what: str) -> Tensor:
        ctx.spec, ctx.what = _spec(shard), what
        full = comm.gather_whole(shard, f"gathering {what} across the mesh")
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, None]:
        return _Slice.apply(grad, ctx.spec, ctx.what), None


class _Slice(torch.autograd.Function):
    """A whole tensor, the same on every rank, to a ``DTensor`` of this rank's slice on a
    shard's placements (no communication); backward :class:`_Whole`."""

    @staticmethod
    def forward(ctx: Any, full: Tensor, spec: tuple[Any, ...], what: str) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        ctx.spec, ctx.what = spec, what
        mesh, placements = spec[0], spec[1]
        full = full.contiguous()
        replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        # from Replicate to the shard's placements: a local slice, no communication
        placed = comm.redistribute(replicated, mesh, placements, f"slicing the gradient of {what}")
        mine = placed.to_local()
        if mine.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            mine = mine.clone()  # a view would keep the whole gradient alive
        return DTensor.from_local(
            mine, mesh, list(placements), run_check=False, shape=spec[2], stride=spec[3]
        )

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Tensor, None, None]:
        what = f"the gradient of {ctx.what}"
        return _Whole.apply(_placed(grad, ctx.spec, what), what), None, None


class _Local(torch.autograd.Function):
    """A shard to its local tensor; backward :class:`_FromLocal`."""

    @staticmethod
    def forward(ctx: Any, shard: Any) -> Tensor:
        ctx.spec = _spec(shard)
        mine = shard.to_local()
        return mine.view_as(mine)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return _FromLocal.apply(grad, ctx.spec)


class _FromLocal(torch.autograd.Function):
    """A local tensor to a ``DTensor`` on a shard's placements; backward :class:`_Local`."""

    @staticmethod
    def forward(ctx: Any, mine: Tensor, spec: tuple[Any, ...]) -> Any:
        from torch.distributed.tensor import DTensor

        ctx.spec = spec
        mesh, placements, shape, stride = spec
        return DTensor.from_local(
            mine.view_as(mine), mesh, list(placements), run_check=False, shape=shape, stride=stride
        )

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Tensor, None]:
        return _Local.apply(_placed(grad, ctx.spec, "a shard")), None
