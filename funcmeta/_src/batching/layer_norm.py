"""``nn.LayerNorm`` with per-task weights under task batching, keeping what a per-task loop
keeps.

vmap's rule for ``F.layer_norm`` with a batched weight normalises without the affine
parameters, then multiplies by the weight and adds the bias as two more operations. Autograd
then keeps the normalised activation for the weight's gradient, beside the input, mean and
inverse standard deviation the normalisation keeps: one more activation-sized tensor per
layer for all tasks, which the loop's fused ``layer_norm`` does not keep (BERT's first-order
peak held five of them).

:class:`TaskLayerNorm` computes the layer for all tasks with one autograd node,
:class:`PerTaskLayerNorm`: the same normalisation and the same products (in float32 and
float64 the numbers of vmap's rule, bit for bit), saving the input, the statistics and the
weight. Its backward
works the normalised activation out again from them. The backward is written in
differentiable operations (``native_layer_norm_backward`` has a derivative of its own), so
the node can be differentiated twice. Inside a second-order inner step
(:func:`funcmeta.checkpoint.kernels.in_twice_differentiable`) the stand-in steps aside all the
same: there the graph of the step keeps the activations either way (BERT and GPT-2 peaks
measured equal with and without it), and torch's own double backward is used.

It steps aside, running the layer as it is, for a layer with hooks, without a per-task
weight, with an input or bias batched differently from the weight, under autocast (whose
rule for ``layer_norm`` this node would bypass), and inside a second-order inner step.

Dtypes. vmap's rule promotes: a bfloat16 input with float32 parameters came out float32
(``layer_norm`` gives bfloat16), and a float64 input with float32 parameters ran in float64
(``layer_norm`` refuses it). The node gives the input's dtype in the first case, computing in
float32 as ``layer_norm`` does, and raises ``layer_norm``'s own error in the second. In
bfloat16 and float16 it computes in float32 and rounds once, as ``layer_norm``'s kernels do:
vmap's three steps rounded three times, and a third of bfloat16 outputs differed from the
layer's by an ulp.

Example:
    >>> import torch
    >>> from funcmeta._src.batching.layer_norm import per_task_layer_norm
    >>> x = torch.randn(3, 5, 4, dtype=torch.float64)          # 3 tasks, 5 rows, 4 features
    >>> w, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    >>> loop = torch.stack([torch.nn.functional.layer_norm(x[t], (4,), w[t], b[t]) for t in range(3)])
    >>> torch.allclose(per_task_layer_norm(x, w, b, 1, 1e-5), loop)
    True
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.core.fence import add_batch_dim, autocast_enabled, has_hooks
from funcmeta._src.core.kernels import in_twice_differentiable
from funcmeta._src.core.vmap import is_batched, maybe_get_level, physical
from funcmeta._src.module.shadow import Standin

__all__ = ["PerTaskLayerNorm", "TaskLayerNorm", "per_task_layer_norm"]


def _task_view(value: Tensor, like: Tensor) -> Tensor:
    """A per-task ``(T, *normalized_shape)`` tensor viewed to broadcast against ``like``,
    ``(T, *batch, *normalized_shape)``."""
    batch = like.dim() - value.dim()
    return value.view(value.shape[0], *([1] * batch), *value.shape[1:])


class PerTaskLayerNorm(torch.autograd.Function):
    """Layer normalisation over the last ``dims`` axes of ``x``, ``(T, *batch, *shape)``,
    with a weight per task, ``(T, *shape)``, and a bias per task, shared (``shape``) or
    None. Outputs ``(y, mean, rstd)``; the statistics are not differentiable. Saves the
    input, the statistics and the weight, not the normalised activation.

    With a bfloat16 or float16 input (and parameters of its dtype, or float32: the mixed
    precision ``layer_norm`` accepts) it computes in float32 and rounds ``y`` to the input's
    dtype once, as ``layer_norm`` does; the gradients come back in their inputs' dtypes."""

    # called on the tensors under vmap's wrappers, inside the vmap: torch asks for a rule,
    # and with no input batched at that level the generated one runs the node as it is
    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor, bias: Tensor | None, dims: int, eps: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        shape = x.shape[x.dim() - dims :]
        compute = _compute_dtype(x)
        y, mean, rstd = torch.native_layer_norm(x.to(compute), shape, None, None, eps)
        y.mul_(_task_view(weight.to(compute), x))
        if bias is not None:
            y.add_((bias if bias.dim() == dims else _task_view(bias, x)).to(compute))
        return y.to(x.dtype), mean, rstd

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        x, weight, bias, dims, eps = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.dims, ctx.eps = dims, eps
        ctx.shared_bias = bias is not None and bias.dim() == dims
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(mean, rstd)

    @staticmethod
    def backward(
        ctx: Any, grad: Tensor, _grad_mean: Any, _grad_rstd: Any
    ) -> tuple[Tensor | None, ...]:
        x_saved, weight_saved, mean, rstd = ctx.saved_tensors
        compute = _compute_dtype(x_saved)  # float32 for bfloat16 and float16, as the forward
        x, weight, grad = (v.to(compute) for v in (x_saved, weight_saved, grad))
        dims = ctx.dims
        shape = list(x.shape[x.dim() - dims :])
        batch = tuple(range(1, x.dim() - dims))  # the axes between the tasks and the features
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad * _task_view(weight, x), x, shape, mean, rstd, None, None,
                [True, False, False],
            )[0].to(x_saved.dtype)  # fmt: skip
        if need_w:
            if torch.is_grad_enabled():  # a graph of the backward: x_hat as a function of x
                x_hat = torch.native_layer_norm(x, shape, None, None, ctx.eps)[0]
            else:
                x_hat = (x - mean).mul_(rstd)
            grad_w = grad * x_hat
            if batch:
                grad_w = grad_w.sum(batch)
            grad_w = grad_w.to(weight_saved.dtype)
        if need_b:
            axes = (0, *batch) if ctx.shared_bias else batch
            grad_b = (grad.sum(axes) if axes else grad).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


_REDUCED = (torch.bfloat16, torch.float16)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for a bfloat16 or float16 input, whose result is rounded once at the end as
    ``layer_norm``'s kernels do (normalising, scaling and shifting in the input's dtype
    rounds three times: a third of bfloat16 results then differ from the layer's by an
    ulp); the input's dtype otherwise."""
    return torch.float32 if x.dtype in _REDUCED else x.dtype


def per_task_layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor | None, dims: int, eps: float
) -> Tensor:
    """``F.layer_norm`` for each task ``t`` of ``x[t]`` with ``weight[t]`` and ``bias[t]``
    (or a shared ``bias``), over the last ``dims`` axes, as one :class:`PerTaskLayerNorm`."""
    return PerTaskLayerNorm.apply(x, weight, bias, dims, eps)[0]


def _dtypes_taken(x: torch.dtype, weight: torch.dtype, bias: torch.dtype | None) -> bool:
    """Whether ``layer_norm`` takes these dtypes together: all one dtype, or a bfloat16 or
    float16 input with float32 parameters."""
    params = {weight} if bias is None else {weight, bias}
    return params == {x} or (x in _REDUCED and params == {torch.float32})


class TaskLayerNorm(Standin):
    """Stands in for ``nn.LayerNorm`` under task batching: with a per-task weight, one
    :class:`PerTaskLayerNorm` for all tasks; otherwise, and in the cases the module docstring
    lists, the layer as it is."""

    def forward(self, x: Tensor) -> Tensor:
        m = cast(nn.LayerNorm, self.original)
        w, b = m.weight, m.bias
        if (
            has_hooks(m)
            or w is None
            or not (is_batched(x) and is_batched(w))
            or in_twice_differentiable()
            or autocast_enabled()
        ):
            return m(x)
        level = maybe_get_level(w)
        dims = len(m.normalized_shape)
        if (
            maybe_get_level(x) != level
            or x.dim() < dims
            or tuple(x.shape[x.dim() - dims :]) != tuple(m.normalized_shape)
        ):
            return m(x)  # another level's tensor, or the layer's own error for a wrong shape
        if b is not None and is_batched(b) and maybe_get_level(b) != level:
            return m(x)
        xp, wp = physical(x, level), physical(w, level)
        bp = physical(b, level) if b is not None and is_batched(b) else b
        if any(is_batched(v) for v in (xp, wp, bp)):
            return m(x)  # batched at an outer level too: vmap's rule
        if not _dtypes_taken(x.dtype, w.dtype, None if b is None else b.dtype):
            # dtypes layer_norm refuses together: its own error, from one task's call (vmap's
            # rule would promote them and run); were it to take them, vmap's rule
            one_bias = None if bp is None else (bp[0] if bp.dim() > dims else bp)
            F.layer_norm(xp[0], m.normalized_shape, wp[0], one_bias, m.eps)
            return m(x)
        return add_batch_dim(per_task_layer_norm(xp, wp, bp, dims, m.eps), 0, level)
