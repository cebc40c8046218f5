"""``nn.LSTMCell`` under task batching: one step of the cell for all tasks.

``aten::lstm_cell`` has no batching rule, so under ``vmap`` a model with an ``nn.LSTMCell``
fell back to running once per task. :class:`TaskLSTMCell` computes the cell for all tasks
with batched matrix products (per-task weights) or one matrix product (shared weights), in
the operations of torch's own CPU cell: the hidden projection plus the input projection,
the gates' sigmoid and tanh, ``c' = f * c + i * g`` and ``h' = o * tanh(c')``. It is exact
to rounding against the layer per task, and differentiable twice. (``nn.GRUCell`` and
``nn.RNNCell`` have batching rules already.)

Tensors batched at an outer vmap level too (two task axes) go through it as well: the
outer vmap batches its operations. It steps aside, running the layer as it is, for a layer
with hooks, tensors batched at different vmap levels, under autocast (whose rules for the matrix
products would change their precision, not the layer's), and shapes the layer would refuse
(it then gives its own error, from the per-task run).

Example:
    >>> import torch, funcmeta as fm
    >>> cell = torch.nn.LSTMCell(3, 4)
    >>> fmodel = fm.functional_model(cell)
    >>> h, c = fm.apply_tasks(fmodel, fmodel.params, torch.randn(5, 2, 3))[0]  # 5 tasks
    >>> h.shape, fmodel.per_task
    (torch.Size([5, 2, 4]), False)
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from funcmeta._src.batching.recurrent import _per_task, _project, _tasks, _Weight
from funcmeta._src.core.fence import add_batch_dim, autocast_enabled, has_hooks
from funcmeta._src.core.vmap import any_batched, is_batched, maybe_get_level
from funcmeta._src.module.shadow import Standin

__all__ = ["TaskLSTMCell"]


class TaskLSTMCell(Standin):
    """Stands in for ``nn.LSTMCell`` under task batching (see the module docstring)."""

    def forward(
        self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        m = cast(nn.LSTMCell, self.original)
        weights = (m.weight_ih, m.weight_hh, m.bias_ih, m.bias_hh)
        states = () if hx is None else tuple(hx)
        if has_hooks(m) or not any_batched(input, *states, *weights) or autocast_enabled():
            return m(input, hx)
        values = [v for v in (input, *states, *weights) if v is not None]
        levels = {maybe_get_level(v) for v in values if is_batched(v)}
        if len(levels) != 1 or not _fits(m, input, states):
            return m(input, hx)  # another level's tensors, or the layer's own error
        (level,) = levels
        return self._cell(input, states, level, _tasks(values, level))

    def _cell(
        self, input: Tensor, states: tuple[Tensor, ...], level: int, tasks: int
    ) -> tuple[Tensor, Tensor]:
        m = cast(nn.LSTMCell, self.original)
        one = input.dim() == 1  # one sample per task, without a batch axis
        x = _per_task(input, level, tasks)
        assert x is not None
        if one:
            x = x.unsqueeze(1)
        if states:
            h, c = (_per_task(s, level, tasks) for s in states)
            assert h is not None and c is not None
            if one:
                h, c = h.unsqueeze(1), c.unsqueeze(1)
        else:
            h = c = x.new_zeros(tasks, x.shape[1], m.hidden_size)

        def weight(value: Tensor | None) -> _Weight | None:
            return None if value is None else _Weight(value, level)

        # torch's CPU cell: the hidden projection, then the input projection added to it
        gates = _project(h, _Weight(m.weight_hh, level), weight(m.bias_hh)) + _project(
            x, _Weight(m.weight_ih, level), weight(m.bias_ih)
        )
        i, f, g, o = gates.chunk(4, dim=-1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h_new = torch.sigmoid(o) * torch.tanh(c_new)
        if one:
            h_new, c_new = h_new.squeeze(1), c_new.squeeze(1)
        return add_batch_dim(h_new, 0, level), add_batch_dim(c_new, 0, level)


def _fits(m: nn.LSTMCell, input: Tensor, states: tuple[Tensor, ...]) -> bool:
    """Whether the call has the shapes the layer takes (one task's view): the layer's own
    checks give the error otherwise."""
    if input.dim() not in (1, 2) or input.shape[-1] != m.input_size:
        return False
    if not states:
        return True
    if len(states) != 2:
        return False
    want = (m.hidden_size,) if input.dim() == 1 else (input.shape[0], m.hidden_size)
    return all(tuple(s.shape) == want for s in states) and all(
        s.dtype == input.dtype for s in states
    )
