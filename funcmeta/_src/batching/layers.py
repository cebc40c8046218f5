"""Stand-ins for layers under task batching: fast paths that compute a layer for all tasks at
once, exactly, and the per-task loop for layers that ``vmap`` cannot batch.

- :class:`TaskLinear`: ``nn.Linear`` with per-task weights as one ``torch.baddbmm`` (under
  ``vmap``'s generic rule a batched-weight linear layer costs about ten times an unbatched
  one, torch 2.13, CPU).
- recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): ``funcmeta._src.batching.recurrent``.
- ``nn.LayerNorm`` with per-task weights, keeping what a loop keeps:
  ``funcmeta._src.batching.layer_norm``.
- ``nn.LSTMCell`` (no batching rule in torch): ``funcmeta._src.batching.cells``.

The conv-net layers. Under ``vmap`` over tasks, a convolution whose weights differ per task and
a BatchNorm with per-task affine parameters go through functorch's generic batching rules:
the convolution input is copied into a task-grouped layout at every layer, and BatchNorm is
split into a normalisation plus element-wise products and sums over the whole activation.
These stand-ins compute each layer with one native call on the unwrapped tensors, in one
layout shared by all of them, ``(N, T * C, ...)``, so that the output of one layer is the
input of the next without a copy:

- :class:`TaskConv`: ``nn.Conv1d/2d/3d`` with per-task weights as one convolution with
  ``T * groups`` groups.
- :class:`TaskBatchNorm`: ``nn.BatchNorm1d/2d/3d`` as one batch normalisation over ``T * C``
  channels, with per-task (or shared) affine parameters and per-task running statistics,
  updated in place as the layer would.
- :class:`TaskGroupNorm`: ``nn.GroupNorm`` with per-task affine parameters as one group
  normalisation with ``T * num_groups`` groups.
- :class:`TaskInstanceNorm`: ``nn.InstanceNorm1d/2d/3d`` with per-task affine parameters
  as one instance normalisation over ``T * C`` channels, each task's running statistics
  (when tracked) its own.
- :class:`TaskPool`: max, average and adaptive average pooling on the same layout.
- :class:`TaskEmbedding`: ``nn.Embedding`` with a ``padding_idx``. vmap's rule for the
  embedding backward sends gradient into the padding row when the weight is batched; the
  stand-in looks the rows up without ``padding_idx`` and passes the padding positions' values
  on as constants, so the padding row gets no gradient, in first and second order, as in a
  per-task loop.
- :class:`TaskAttention` (``funcmeta._src.batching.attention``): ``nn.MultiheadAttention``
  called with ``need_weights=False`` on the fused attention kernel with the tasks in its
  batch, instead of vmap's per-example fallback for it.

Each computes exactly what the layer computes per task (the same kernels on the same numbers
per channel; :class:`TaskAttention` the kernels of the layer's own forward, or where it does
not cover a call, the layer's batched path, equal to rounding). A layer with hooks, and a
call these do not cover (unbatched input, a single-sample input, weights batched at another
vmap level, BatchNorm with ``momentum=None`` and tasks with different counts of batches,
``return_indices=True``), runs the layer as it is.

Example:
    >>> import torch
    >>> from funcmeta._src.batching.layers import task_standins
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    >>> {name: cls.__name__ for name, cls in task_standins(net).items()}
    {'0': 'TaskConv', '1': 'TaskBatchNorm'}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.batching.attention import TaskAttention
from funcmeta._src.batching.cells import TaskLSTMCell
from funcmeta._src.batching.layer_norm import TaskLayerNorm
from funcmeta._src.batching.recurrent import recurrent_standins
from funcmeta._src.core.fence import (
    add_batch_dim,
    conv_forward,
    conv_padding,
    has_hooks,
    unwrap_batched,
)
from funcmeta._src.core.vmap import (
    any_batched,
    is_batched,
    maybe_get_level,
    physical,
    uniform_value,
)
from funcmeta._src.module.shadow import Standin, within

if TYPE_CHECKING:
    _Conv: TypeAlias = nn.Conv1d | nn.Conv2d | nn.Conv3d
    _BatchNorm: TypeAlias = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d
    _InstanceNorm: TypeAlias = nn.InstanceNorm1d | nn.InstanceNorm2d | nn.InstanceNorm3d

__all__ = [
    "TaskAttention",
    "TaskBatchNorm",
    "TaskConv",
    "TaskEmbedding",
    "TaskGroupNorm",
    "TaskInstanceNorm",
    "TaskLinear",
    "TaskPool",
    "task_standins",
]

_CONV = {nn.Conv1d: (1, F.conv1d), nn.Conv2d: (2, F.conv2d), nn.Conv3d: (3, F.conv3d)}
_NORM = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}
_INSTANCE = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}  # with N
_POOL = {
    nn.MaxPool1d: 1,
    nn.MaxPool2d: 2,
    nn.MaxPool3d: 3,
    nn.AvgPool1d: 1,
    nn.AvgPool2d: 2,
    nn.AvgPool3d: 3,
    nn.AdaptiveAvgPool1d: 1,
    nn.AdaptiveAvgPool2d: 2,
    nn.AdaptiveAvgPool3d: 3,
}


class TaskLinear(Standin):
    """Stands in for an ``nn.Linear`` under task batching: one ``baddbmm`` for all tasks when
    the input, weight and bias are batched at the same vmap level, ``F.linear`` otherwise.
    A layer with hooks (its own or global ones) runs as it is, hooks included."""

    def forward(self, x: Tensor) -> Tensor:
        original = cast(nn.Linear, self.original)
        if has_hooks(original):
            return original(x)
        w, b = original.weight, original.bias
        if not (is_batched(x) and is_batched(w)):
            return F.linear(x, w, b)
        level = maybe_get_level(w)
        if maybe_get_level(x) != level or (
            b is not None and not (is_batched(b) and maybe_get_level(b) == level)
        ):
            return F.linear(x, w, b)
        xp, wp = physical(x, level), physical(w, level)
        flat = xp.dim() != 3  # (T, N, in) goes in as it is; other shapes via (T, -1, in)
        x3 = xp.reshape(xp.shape[0], -1, xp.shape[-1]) if flat else xp
        if b is None:
            out = torch.bmm(x3, wp.transpose(1, 2))
        else:
            out = torch.baddbmm(physical(b, level).unsqueeze(1), x3, wp.transpose(1, 2))
        if flat:
            out = out.reshape(*xp.shape[:-1], out.shape[-1])
        return add_batch_dim(out, 0, level)


def _grouped(x: Tensor, level: int) -> Tensor:
    """The physical tensor of ``x`` (batched at ``level``) as ``(N, T * C, ...)``: a view
    when the tasks already sit next to the channels, a copy otherwise."""
    xp = physical(x, level, 1)
    return xp.reshape(xp.shape[0], xp.shape[1] * xp.shape[2], *xp.shape[3:])


def _ungrouped(out: Tensor, tasks: int, level: int) -> Tensor:
    """``(N, T * C, ...)`` back to a tensor batched at ``level`` (a view, batch dim 1)."""
    return add_batch_dim(out.view(out.shape[0], tasks, -1, *out.shape[2:]), 1, level)


def _on_channels(x: Tensor, level: int, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
    """``fn(xg, tasks)`` on ``x`` as ``(N, T * C, ...)`` (:func:`_grouped`), batched at
    ``level`` again: a normalisation of ``T * C`` channels with each task's parameters."""
    xg = _grouped(x, level)
    tasks = xg.shape[1] // x.shape[1]
    return _ungrouped(fn(xg, tasks), tasks, level)


def _per_task(value: Tensor | None, level: int, tasks: int) -> Tensor | None:
    """A per-channel parameter as ``(T * C,)``: its tasks' values side by side, or a shared
    value repeated for every task."""
    if value is None:
        return None
    if is_batched(value):
        return physical(value, level, 0).reshape(-1)
    return value.repeat(tasks)


def _same_level(level: int, *values: Tensor | None) -> bool:
    """Whether every batched tensor among ``values`` is batched at ``level`` (shared and
    absent ones pass)."""
    return all(v is None or not is_batched(v) or maybe_get_level(v) == level for v in values)


def _task_statistics(m: _BatchNorm | _InstanceNorm, level: int) -> tuple[Tensor, Tensor] | None:
    """A normalisation layer's running mean and variance as ``(T * C,)`` views of each
    task's buffers, which an in-place update reaches; None where it cannot (buffers shared
    or batched at another level, or not contiguous): the layer then runs as it is."""
    mean, var = m.running_mean, m.running_var
    if not (is_batched(mean) and is_batched(var) and _same_level(level, mean, var)):
        return None
    assert mean is not None and var is not None  # batched: tensors
    mean_p, var_p = physical(mean, level, 0), physical(var, level, 0)
    if not (mean_p.is_contiguous() and var_p.is_contiguous()):
        return None
    return mean_p.view(-1), var_p.view(-1)


class TaskConv(Standin):
    """Stands in for ``nn.Conv1d/2d/3d`` under task batching: per-task weights as one grouped
    convolution over the tasks; shared weights by vmap's rule (the tasks as more samples)."""

    def forward(self, x: Tensor) -> Tensor:
        m = cast("_Conv", self.original)
        if has_hooks(m):
            return m(x)
        dims, conv = _CONV[type(m)]
        w, b = m.weight, m.bias
        if not (is_batched(x) and is_batched(w) and x.dim() == dims + 2):
            return conv_forward(m, x, w, b)
        level = maybe_get_level(w)
        if maybe_get_level(x) != level or not _same_level(level, b):
            return conv_forward(m, x, w, b)
        xg = _grouped(x, level)
        wp = physical(w, level, 0)
        tasks = wp.shape[0]
        wg = wp.reshape(tasks * wp.shape[1], *wp.shape[2:])
        bg = _per_task(b, level, tasks)
        if m.padding_mode != "zeros":
            xg = F.pad(xg, conv_padding(m), mode=m.padding_mode)
            padding: Any = 0
        else:
            padding = m.padding
        out = conv(xg, wg, bg, m.stride, padding, m.dilation, m.groups * tasks)
        return _ungrouped(out, tasks, level)


def _one_count(count: Tensor, level: int) -> int | None:
    """The batches a BatchNorm has tracked, when every task's count is the same (a shared
    count, or per-task counts that agree); None otherwise."""
    if not is_batched(count):
        return int(count)
    if maybe_get_level(count) != level:
        return None
    value = uniform_value(count)
    return None if value is None else int(value)


class TaskBatchNorm(Standin):
    """Stands in for ``nn.BatchNorm1d/2d/3d`` under task batching: one batch normalisation
    over ``T * C`` channels, with the module's train/eval logic and running-statistics
    updates written into each task's buffers. With ``momentum=None`` (a cumulative average)
    the factor is one over the count of batches, so it runs when every task has the same
    count (as tasks adapted together do), and leaves the layer to vmap otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        m = cast("_BatchNorm", self.original)
        if has_hooks(m) or not is_batched(x):
            return m(x)
        if x.dim() not in _NORM[type(m)]:
            return m(x)  # the layer's own error for a wrong shape, or a single sample
        level = maybe_get_level(x)
        mean, var = m.running_mean, m.running_var
        use_stats = not m.training or m.track_running_stats
        if not _same_level(level, m.weight, m.bias):
            return m(x)
        mean_g = var_g = None
        if use_stats and mean is not None:
            stats = _task_statistics(m, level)
            if stats is None:
                return m(x)
            mean_g, var_g = stats
        # where counting is true, num_batches_tracked is a tensor and count an int (the casts)
        counting = m.training and m.track_running_stats and m.num_batches_tracked is not None
        momentum = m.momentum
        if momentum is None:  # a cumulative average: 1 / each task's count of batches
            count = _one_count(cast(Tensor, m.num_batches_tracked), level) if counting else None
            if counting and count is None:
                return m(x)  # tasks with different counts: one factor cannot serve them
        if counting:
            cast(Tensor, m.num_batches_tracked).add_(1)
        if momentum is None:  # as the layer computes it
            momentum = 1.0 / float(cast(int, count) + 1) if counting else 0.0
        return _on_channels(
            x,
            level,
            lambda xg, tasks: F.batch_norm(
                xg,
                mean_g,
                var_g,
                _per_task(m.weight, level, tasks),
                _per_task(m.bias, level, tasks),
                m.training or (mean is None and var is None),
                momentum,
                m.eps,
            ),
        )


class TaskGroupNorm(Standin):
    """Stands in for ``nn.GroupNorm`` with per-task affine parameters under task batching:
    one group normalisation with ``T * num_groups`` groups over ``T * C`` channels, on the
    ``(N, T * C, ...)`` layout (each group's statistics are one task's, per sample, as in the
    layer). vmap's rule normalises, then multiplies and adds over the whole activation,
    keeping the normalised activation too, and promotes dtypes that ``group_norm`` takes as
    they are (a bfloat16 input with float32 parameters came out float32) or refuses
    (float64 with float32 ran). Shared parameters and ``affine=False`` go by vmap's rule,
    which folds the tasks into the samples: one native call already."""

    def forward(self, x: Tensor) -> Tensor:
        m = cast(nn.GroupNorm, self.original)
        w, b = m.weight, m.bias
        if has_hooks(m) or not is_batched(x) or x.dim() < 2 or not any_batched(w, b):
            return m(x)
        level = maybe_get_level(x)
        if not _same_level(level, w, b) or x.shape[1] != m.num_channels:
            return m(x)  # another level's parameters, or the layer's own error
        return _on_channels(
            x,
            level,
            lambda xg, tasks: F.group_norm(
                xg,
                m.num_groups * tasks,
                _per_task(w, level, tasks),
                _per_task(b, level, tasks),
                m.eps,
            ),
        )


class TaskInstanceNorm(Standin):
    """Stands in for ``nn.InstanceNorm1d/2d/3d`` with per-task affine parameters under task
    batching: one instance normalisation over ``T * C`` channels on the ``(N, T * C, ...)``
    layout (statistics per sample and channel, as in the layer), with each task's running
    statistics, when tracked, used and updated in place. vmap's rule promoted dtypes as it
    does for GroupNorm. Shared parameters and ``affine=False`` go by vmap's rule."""

    def forward(self, x: Tensor) -> Tensor:
        m = cast("_InstanceNorm", self.original)
        w, b = m.weight, m.bias
        if has_hooks(m) or not is_batched(x) or x.dim() != _INSTANCE[type(m)]:
            return m(x)  # also one sample without a batch axis, or the layer's own error
        level = maybe_get_level(x)
        if not any_batched(w, b) or not _same_level(level, w, b) or x.shape[1] != m.num_features:
            return m(x)
        mean_g = var_g = None
        if m.running_mean is not None:
            stats = _task_statistics(m, level)
            if stats is None:
                return m(x)
            mean_g, var_g = stats
        return _on_channels(
            x,
            level,
            lambda xg, tasks: F.instance_norm(
                xg,
                mean_g,
                var_g,
                _per_task(w, level, tasks),
                _per_task(b, level, tasks),
                m.training or not m.track_running_stats,
                m.momentum if m.momentum is not None else 0.0,
                m.eps,
            ),
        )


class TaskPool(Standin):
    """Stands in for max, average and adaptive average pooling under task batching: the
    pooling on the ``(N, T * C, ...)`` layout of the layers around it."""

    def forward(self, x: Tensor) -> Tensor:
        m = self.original
        dims = _POOL[type(m)]
        if has_hooks(m) or not is_batched(x) or x.dim() != dims + 2:
            return m(x)
        if getattr(m, "return_indices", False):
            return m(x)
        level = maybe_get_level(x)
        xg = _grouped(x, level)
        tasks = xg.shape[1] // x.shape[1]
        return _ungrouped(m.forward(xg), tasks, level)


class TaskEmbedding(Standin):
    """Stands in for ``nn.Embedding`` with a ``padding_idx`` under task batching: the lookup
    without ``padding_idx``, the padding positions' values detached, so that no gradient
    reaches the padding row (vmap's embedding backward rule would send it there). This is
    the exact path, not a faster one: with hooks (HuggingFace's ``enable_input_require_grads``
    puts one on the input embeddings), the original is called, its hooks run as they do, and
    its forward is this lookup for the call."""

    def forward(self, x: Tensor) -> Tensor:
        m = cast(nn.Embedding, self.original)
        if m.padding_idx is None or not (is_batched(x) or is_batched(m.weight)):
            return m(x)
        if not has_hooks(m):
            return self._lookup(x)
        m.__dict__["forward"] = self._lookup
        try:
            return m(x)
        finally:
            del m.__dict__["forward"]

    def _lookup(self, x: Tensor) -> Tensor:
        m = cast(nn.Embedding, self.original)
        assert m.padding_idx is not None  # forward calls it only for a layer with one
        out = F.embedding(x, m.weight, None, None, 2.0, m.scale_grad_by_freq, m.sparse)
        return torch.where((x == m.padding_idx).unsqueeze(-1), out.detach(), out)


def task_standins(module: nn.Module) -> dict[str, type[Standin]]:
    """The stand-ins of the task-batched runner, by submodule name: the recurrent layers'
    (``funcmeta._src.batching.recurrent.recurrent_standins``, outermost), and outside them
    the fast paths of ``nn.Linear`` (:class:`TaskLinear`), convolutions, BatchNorm and
    pooling, normalisations, ``nn.LSTMCell``, ``nn.MultiheadAttention``
    (:class:`TaskAttention`), and the exact path of embeddings with a padding index. Exact
    types only: a subclass (a parametrized layer included) may compute something else."""
    if unwrap_batched is None:  # pragma: no cover - depends on the torch release
        return {}
    out = recurrent_standins(module)
    loops = list(out)
    for name, m in module.named_modules():
        if any(within(name, n) for n in loops):
            continue
        kind = type(m)
        if kind is nn.Linear:
            out[name] = TaskLinear
        elif kind in _CONV:
            out[name] = TaskConv
        elif kind in _NORM:
            out[name] = TaskBatchNorm
        elif kind is nn.GroupNorm:
            out[name] = TaskGroupNorm
        elif kind in _INSTANCE:
            out[name] = TaskInstanceNorm
        elif kind in _POOL:
            out[name] = TaskPool
        elif kind is nn.Embedding and m.padding_idx is not None:
            out[name] = TaskEmbedding
        elif kind is nn.MultiheadAttention:
            out[name] = TaskAttention
        elif kind is nn.LayerNorm:
            out[name] = TaskLayerNorm
        elif kind is nn.LSTMCell:
            out[name] = TaskLSTMCell
    return out
