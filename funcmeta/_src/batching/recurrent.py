"""Recurrent layers for all tasks at once: ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` with per-task
weights as one computation over the tasks.

``aten::lstm``, ``aten::gru`` and ``aten::rnn_*`` have no ``vmap`` batching rule, so under task
batching a recurrent layer would run once per task. :class:`TaskRecurrent` computes the layer
for every task in one pass instead, on the unwrapped tensors with the task axis first: each
layer and direction projects its whole input with one batched matrix product, then walks the
time steps with one batched matrix product per step, the cell equations exactly as
``torch.nn`` documents them (``h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh)`` for ``nn.RNN``;
the i, f, g, o gates and the projection of ``nn.LSTM``; the r, z, n gates of ``nn.GRU``).
Every operation is an ordinary differentiable one, so first and second order need no special
kernel (and never cuDNN's, which has no double backward).

When it runs: in second-order steps (:func:`funcmeta.checkpoint.kernels.twice_differentiable`),
where torch's own kernels run op by op too, and wherever torch has no fused kernel for the
layer (``nn.GRU`` and ``nn.RNN`` on CPU, float64). Where torch has one (cuDNN on CUDA, oneDNN's
LSTM on CPU in float32), first-order steps and query passes run it once per task instead,
which measured faster than one op-by-op pass (``benchmarks/speed/sequence_tasks.py``). A call that builds no graph (evaluation) with
weights all tasks share runs the layer once, as torch computes it, on the tasks joined to
its batch (``benchmarks/speed/recurrent_evaluation.py``).

Covered: any ``num_layers``, ``bidirectional``, ``batch_first`` either way, ``bias=False``,
``proj_size``, inputs with or without a batch dimension, ``hx`` given or not, per task or
shared, weights per task or shared. It steps aside to the per-task loop (:class:`PerTask`,
which runs the layer once per task outside the vmap level, and runs subclasses of
``nn.RNNBase``, which may compute something else),
saying once why, for what it cannot compute exactly: a ``PackedSequence`` built by hand (one
made by ``pack_padded_sequence`` in the model runs in the one pass, each sequence's later
steps masked: ``funcmeta._src.batching.packed``), dropout between layers in training mode (a
loop draws each task's masks separately), forward hooks
on the layer, tensors batched at different ``vmap`` levels.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> class Tagger(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.rnn = torch.nn.GRU(3, 4, batch_first=True)
    ...         self.out = torch.nn.Linear(4, 2)
    ...     def forward(self, x):
    ...         return self.out(self.rnn(x)[0][:, -1])
    >>> fmodel = fm.functional_model(Tagger())
    >>> x, y = torch.randn(5, 6, 7, 3), torch.randint(0, 2, (5, 6))   # 5 tasks
    >>> r = fm.adapt_tasks(fmodel, fmodel.params, F.cross_entropy, (x, y), fm.optim.sgd(lr=0.1), steps=2)
    >>> r.losses.shape, fmodel.per_task
    (torch.Size([2, 5]), False)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from funcmeta._src.batching.packed import TaskPacked, packed_of, sequence
from funcmeta._src.core.fence import (
    add_batch_dim,
    cudnn_disabled,
    fused_rnn,
    has_hooks,
    pack_padded_op,
    pad_packed_op,
)
from funcmeta._src.core.kernels import in_twice_differentiable
from funcmeta._src.core.vmap import (
    any_batched,
    call_outside_vmap,
    innermost_level,
    is_batched,
    maybe_get_level,
    physical,
)
from funcmeta._src.module.shadow import LayerTensors, Standin, within

__all__ = [
    "PerTask",
    "TaskRecurrent",
    "bind_fallback_report",
    "per_task",
    "recurrent_layers",
    "recurrent_standins",
]

_PACK = pack_padded_op
_PAD = pad_packed_op
_BLOCK = 4  # time steps per projection of the input (see _direction)


def _rnn_kernels() -> contextlib.AbstractContextManager:
    """cuDNN off inside a twice-differentiable block: its RNN kernels have no double
    backward. Other blocks keep the user's setting."""
    return cudnn_disabled() if in_twice_differentiable() else contextlib.nullcontext()


def per_task(original: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) called once per task: under
    task batching it runs once per task outside the vmap level, with that task's parameters,
    buffers and inputs, and its outputs are stacked; an unbatched call runs the layer as it
    is. Inside :func:`funcmeta.checkpoint.kernels.twice_differentiable` it runs without cuDNN,
    whose RNN kernels have no double backward."""
    if args and packed_of(args[0]) is not None:
        return _per_task_packed(original, args[0], args[1:], kwargs)
    layer, params, buffers = LayerTensors.of(original)
    tensors = params + buffers
    with _rnn_kernels():
        if not any_batched(tensors, args, kwargs):
            return original(*args, **kwargs)

        def one_task(ts: list[Tensor], a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
            return layer.call(original, ts[: len(params)], ts[len(params) :], a, kw)

        return call_outside_vmap(
            lambda f, flat: f(*flat), one_task, (tensors, args, kwargs), per_task=True
        )


class PerTask(Standin):
    """Stands in for a recurrent layer, which has no vmap batching rule, by calling it once
    per task (:func:`per_task`)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return per_task(self.original, args, kwargs)


def _per_task_packed(
    original: nn.Module, seq: PackedSequence, rest: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The layer once per task on a task-batched packed sequence
    (``funcmeta._src.batching.packed``): each task's own packed sequence, built from its
    padded steps and lengths; the output packed sequence stands for all tasks again."""
    packed = packed_of(seq)
    assert packed is not None
    layer, params, buffers = LayerTensors.of(original)
    tensors, n = params + buffers, len(params)
    level, steps = packed.level, packed.shape[1]
    order, unorder = seq.sorted_indices, seq.unsorted_indices

    def one_task(ts: list[Tensor], x: Tensor, lengths: Tensor, a: Any, kw: Any) -> Any:
        data, sizes = _PACK(x, lengths, False)  # in the pack's order already
        given = PackedSequence(data, sizes, *a[:2])
        out, state = layer.call(original, ts[:n], ts[n:], (given, *a[2:]), kw)
        if not isinstance(out, PackedSequence):
            raise RuntimeError(
                f"vmap: {type(original).__name__} did not return a packed sequence for one"
            )
        return _PAD(out.data, out.batch_sizes, False, 0.0, steps)[0], state

    x, lengths = add_batch_dim(packed.padded, 0, level), add_batch_dim(packed.lengths, 0, level)
    with _rnn_kernels():
        out, state = call_outside_vmap(
            lambda f, flat: f(*flat),
            one_task,
            (tensors, x, lengths, (order, unorder, *rest), kwargs),
            per_task=True,
        )
    return sequence(TaskPacked(physical(out, level), packed.lengths, level), order, unorder), state


def recurrent_layers(module: nn.Module) -> dict[str, type[Standin]]:
    """The recurrent layers of ``module`` (outermost), each to be run by :class:`PerTask`."""
    out: dict[str, type[Standin]] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.RNNBase) and not any(within(name, n) for n in out):
            out[name] = PerTask
    return out


def _tasks(values: Sequence[Tensor | None], level: int) -> int:
    for v in values:
        if v is not None and is_batched(v):
            return physical(v, level).shape[0]
    raise AssertionError("no batched tensor")  # pragma: no cover - checked by the caller


def _per_task(value: Tensor | None, level: int, tasks: int) -> Tensor | None:
    """``value`` with the task axis first: its tasks' values, or a shared value expanded."""
    if value is None:
        return None
    if is_batched(value):
        return physical(value, level)
    return value.expand(tasks, *value.shape)


class _Weight:
    """A weight or bias as the pass uses it: ``(T, ...)`` when given per task, the layer's
    shape when shared by all tasks."""

    def __init__(self, value: Tensor, level: int) -> None:
        self.per_task = is_batched(value)
        self.tensor = physical(value, level) if self.per_task else value
        self._t: Tensor | None = None
        self._bias: Tensor | None = None

    @classmethod
    def sum(cls, a: _Weight, b: _Weight) -> _Weight:
        """``a + b`` (biases), per task where either is."""
        out = cls.__new__(cls)
        out.per_task, out.tensor = a.per_task or b.per_task, a.tensor + b.tensor
        out._t = out._bias = None
        return out

    def t(self) -> Tensor:
        """The transpose (of each task's matrix), made once for every use in the call: one
        view per time step was one autograd node per step, and in second order each held a
        weight-sized gradient (4 MiB for an LSTM's at T = 16) until that step's other use
        was reached in the backward; with one view they accumulate in one buffer."""
        if self._t is None:
            self._t = self.tensor.transpose(1, 2) if self.per_task else self.tensor.t()
        return self._t

    def bias(self) -> Tensor:
        """As a bias for ``(T, M, G)``: ``(T, 1, G)`` per task, ``(G,)`` shared (made once,
        as :meth:`t`)."""
        if self._bias is None:
            self._bias = self.tensor.unsqueeze(1) if self.per_task else self.tensor
        return self._bias


def _project(x: Tensor, w: _Weight, b: _Weight | None) -> Tensor:
    """``x @ w^T + b`` for every task; ``x`` is ``(T, M, K)``."""
    if not w.per_task:
        if b is None or not b.per_task:
            return F.linear(x, w.tensor, None if b is None else b.tensor)
        return torch.baddbmm(b.bias(), x, w.t().expand(x.shape[0], -1, -1))
    if b is None:
        return torch.bmm(x, w.t())
    return torch.baddbmm(b.bias().expand(x.shape[0], 1, -1), x, w.t())


class TaskRecurrent(Standin):
    """Stands in for ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` under task batching: the layer for
    all tasks in one pass (see the module docstring), or once per task where that cannot be
    exact, said once per layer."""

    def forward(self, input: Any, hx: Any = None) -> Any:
        m = cast(nn.RNNBase, self.original)
        hxs = list(hx) if isinstance(hx, tuple | list) else [hx]
        weights = {name: getattr(m, name) for name in _weight_names(m)}
        packed = packed_of(input)
        if packed is not None:
            return self._packed(input, packed, hx, hxs, weights)
        values = [input if isinstance(input, Tensor) else None, *hxs, *weights.values()]
        if not any(v is not None and is_batched(v) for v in values):
            return per_task(m, (input, hx), {})
        why = _why_not(m, input, hxs, values)
        if why is not None:
            self._step_aside_once(why)
            return per_task(m, (input, hx), {})
        level = innermost_level(values)
        assert level is not None
        merge = (
            _no_graph(values)
            and not any(is_batched(w) for w in weights.values())
            and not any(
                isinstance(v, Tensor) and is_batched(v) and is_batched(physical(v, level))
                for v in values
            )
        )  # tensors batched at an outer level too would reach torch's kernel, which has no rule
        if not in_twice_differentiable() and not merge and fused_rnn(m.mode, input):
            return per_task(m, (input, hx), {})  # the fused kernel, per task, is faster
        _check_call(m, input, hx)
        tasks = _tasks(values, level)
        if merge:
            return _merged(m, input, hxs, level, tasks)
        layer = {k: _Weight(v, level) for k, v in weights.items()}
        out, final = _one_pass(m, input, hxs, layer, level, tasks)
        wrapped = [add_batch_dim(t, 0, level) for t in final]
        state = (wrapped[0], wrapped[1]) if m.mode == "LSTM" else wrapped[0]
        return add_batch_dim(out, 0, level), state

    def _packed(
        self,
        seq: PackedSequence,
        packed: TaskPacked,
        hx: Any,
        hxs: list[Any],
        weights: dict[str, Tensor],
    ) -> Any:
        """The layer on a task-batched packed sequence: one pass with each sequence's later
        steps masked, or once per task (each task's own packed sequence) on cuDNN's kernel,
        or where one pass cannot be exact. On CPU torch runs packed sequences op by op, so one
        pass measured faster than once per task there (``benchmarks/speed/sequence_tasks.py``)."""
        m = cast(nn.RNNBase, self.original)
        level = packed.level
        why = _why_not(m, seq, hxs, [*hxs, *weights.values()], packed)
        if why is not None:
            self._step_aside_once(why)
            return per_task(m, (seq, hx), {})
        one = packed.empty(packed.shape[1:])  # one task's steps, for the checks
        if not in_twice_differentiable() and fused_rnn(m.mode, one, packed=True):
            return per_task(m, (seq, hx), {})  # cuDNN, per task
        _check_call(m, one.transpose(0, 1) if m.batch_first else one, hx)
        tasks = packed.shape[0]
        order, unorder = seq.sorted_indices, seq.unsorted_indices
        starts = [_permuted(_per_task(h, level, tasks), order, level) for h in hxs]
        starts += [None] * ((2 if m.mode == "LSTM" else 1) - len(starts))
        layer = {k: _Weight(v, level) for k, v in weights.items()}
        out, final = _layers(m, packed.padded, starts, layer, packed.valid())
        wrapped = [add_batch_dim(_permuted(t, unorder, level), 0, level) for t in final]
        state = (wrapped[0], wrapped[1]) if m.mode == "LSTM" else wrapped[0]
        assert isinstance(out, _Steps)
        outputs = TaskPacked(out.stacked, packed.lengths, level, out.shape, final[0])
        return sequence(outputs, order, unorder), state

    _fm_name: str
    _fm_report: dict[str, str]

    def __init__(self, original: nn.Module, name: str = "", report: dict | None = None) -> None:
        super().__init__(original)
        self._fm_name = name  # plain attributes: neither is a parameter, buffer or module
        self._fm_report = {} if report is None else report

    def _step_aside_once(self, why: str) -> None:
        """Record in the report, and warn, that this layer runs once per task, the first
        time it does."""
        name, report = self._fm_name, self._fm_report
        if name not in report:
            report[name] = f"{type(self.original).__name__}: {why}"
            warnings.warn(
                f"task batching runs {type(self.original).__name__} layer {name!r} once per "
                f"task: {why}. The results are exact; the batched speed-up is lost for this "
                "layer (fmodel.per_task_layers)",
                stacklevel=4,
            )


def _why_not(
    m: nn.RNNBase, x: Any, hxs: list[Any], values: list[Any], packed: TaskPacked | None = None
) -> str | None:
    """Why the layer cannot run as one pass for all tasks, or None; ``x`` is ``packed``'s
    sequence where the input is a task-batched packed sequence."""
    if has_hooks(m):
        return "it has hooks, which run once per call of the layer"
    if packed is None and isinstance(x, PackedSequence):
        return "its input is a PackedSequence built by hand (pack it with pack_padded_sequence)"
    if m.training and m.dropout > 0 and m.num_layers > 1:
        return "dropout between its layers draws each task's masks on its own in training mode"
    if packed is None and (not isinstance(x, Tensor) or x.dim() not in (2, 3)):
        return "its input is not a 2-D or 3-D tensor"
    if not all(h is None or isinstance(h, Tensor) for h in hxs):
        return "its hx is not a tensor or a tuple of tensors"
    levels = {maybe_get_level(v) for v in values if isinstance(v, Tensor) and is_batched(v)}
    if len(levels | ({packed.level} if packed is not None else set())) > 1:
        return "its tensors are batched at different vmap levels"
    return None


def _permuted(h: Tensor | None, order: Tensor | None, level: int) -> Tensor | None:
    """``h`` ``(T, D, N, H)`` with its sequences in ``order`` (batched ``(N,)`` per task, or
    shared), as torch's recurrent layers permute ``hx`` for a packed sequence."""
    if h is None or order is None:
        return h
    tasks, dirs, batch, size = h.shape
    index = physical(order, level) if is_batched(order) else order.expand(tasks, batch)
    return h.gather(2, index.view(tasks, 1, batch, 1).expand(tasks, dirs, batch, size))


def _no_graph(values: list[Any]) -> bool:
    """Whether the call builds no graph (evaluation, ``torch.no_grad()``). A tensor batched
    under vmap reads ``requires_grad`` False: the tensors under it are asked."""

    def needs_grad(v: Tensor) -> bool:
        while is_batched(v):
            v = physical(v, maybe_get_level(v))
        return v.requires_grad

    if not torch.is_grad_enabled():
        return True
    return not any(isinstance(v, Tensor) and needs_grad(v) for v in values)


def _merged(m: nn.RNNBase, given: Tensor, hxs: list[Any], level: int, tasks: int) -> Any:
    """The layer with weights shared by all tasks, as torch computes it (on its fused kernel
    where it has one), in one call with the tasks joined to the batch axis: ``(L, T * N, I)``
    (``(T * N, L, I)`` batch first), the states ``(layers * dirs, T * N, H)``; one sequence
    per task becomes a batch of T. Only for calls that build no graph: with gradients, an
    LSTM's ANIL meta-iteration measured slower this way than once per task on the fused
    kernel (``benchmarks/speed/recurrent_evaluation.py``)."""
    x = _per_task(given, level, tasks)
    assert x is not None
    unbatched = given.dim() == 2
    if unbatched:  # (T, L, I): the tasks are the batch
        x = x if m.batch_first else x.transpose(0, 1)
    elif m.batch_first:  # (T, N, L, I)
        x = x.reshape(tasks * x.shape[1], *x.shape[2:])
    else:  # (T, L, N, I)
        x = x.transpose(0, 1).reshape(x.shape[1], tasks * x.shape[2], x.shape[3])
    states = []
    for h in hxs:
        hp = _per_task(h, level, tasks)
        if hp is not None:  # (T, D, N, H) -> (D, T * N, H); (T, D, H) -> (D, T, H)
            hp = hp.transpose(0, 1)
            hp = hp if unbatched else hp.reshape(hp.shape[0], -1, hp.shape[-1])
        states.append(hp)
    hx = None if states[0] is None else tuple(states) if m.mode == "LSTM" else states[0]
    layer, params, buffers = LayerTensors.of(m)
    with _rnn_kernels():
        out, final = layer.call(m, params, buffers, (x, hx), {})

    def tasks_out(t: Tensor, dim: int) -> Tensor:  # the task axis back out of dim
        if not unbatched:
            t = t.unflatten(dim, (tasks, -1))
        return add_batch_dim(t, dim, level)

    out = tasks_out(out, 0 if m.batch_first else 1)
    if m.mode == "LSTM":
        return out, (tasks_out(final[0], 1), tasks_out(final[1], 1))
    return out, tasks_out(final, 1)


def _check_call(m: nn.RNNBase, x: Tensor, hx: Any) -> None:
    """The layer's own checks of its input and ``hx`` (sizes, dtypes), on one task's shapes:
    the one pass would otherwise broadcast a wrong ``hx`` silently."""
    if x.dim() == 2:  # one sequence: checked as a batch of one, as the layer does
        x = x.unsqueeze(0 if m.batch_first else 1)  # as the layer does
        if isinstance(hx, tuple | list):
            hx = tuple(h.unsqueeze(1) if h.dim() == 2 else h for h in hx)
        elif hx is not None:
            hx = hx.unsqueeze(1) if hx.dim() == 2 else hx
    if hx is None:
        m.check_input(x, None)
    else:
        m.check_forward_args(x, hx, None)


def _weight_names(m: nn.RNNBase) -> list[str]:
    """The layer's parameter names in ``torch.nn``'s documented scheme, layer by layer and
    direction by direction."""
    names = []
    for layer in range(m.num_layers):
        for suffix in ("", "_reverse")[: 2 if m.bidirectional else 1]:
            names += [f"weight_ih_l{layer}{suffix}", f"weight_hh_l{layer}{suffix}"]
            if m.bias:
                names += [f"bias_ih_l{layer}{suffix}", f"bias_hh_l{layer}{suffix}"]
            if getattr(m, "proj_size", 0) > 0:
                names.append(f"weight_hr_l{layer}{suffix}")
    return names


def _one_pass(
    m: nn.RNNBase,
    given: Tensor,
    hxs: list[Tensor | None],
    weights: dict[str, _Weight],
    level: int,
    tasks: int,
) -> tuple[Tensor, list[Tensor]]:
    """The layer for every task: ``(output, [h_n] or [h_n, c_n])``, task axis first."""
    unbatched = given.dim() == 2  # one sequence per task, without a batch dimension
    x = _per_task(given, level, tasks)
    assert x is not None
    if unbatched:
        x = x.unsqueeze(2)  # (T, L, 1, I)
    elif m.batch_first:
        x = x.transpose(1, 2)  # (T, L, N, I)
    starts = []
    for i in range(2 if m.mode == "LSTM" else 1):
        start = _per_task(hxs[i] if i < len(hxs) else None, level, tasks)
        starts.append(start.unsqueeze(2) if start is not None and unbatched else start)
    out, final = _layers(m, x, starts, weights)
    assert isinstance(out, Tensor)
    x = out
    if unbatched:
        return x.squeeze(2), [h.squeeze(2) for h in final]
    return (x.transpose(1, 2) if m.batch_first else x), final


def _layers(
    m: nn.RNNBase,
    x: Tensor,
    starts: list[Tensor | None],
    weights: dict[str, _Weight],
    valid: Tensor | None = None,
) -> tuple[Tensor | _Steps, list[Tensor]]:
    """The layer's stack over ``x`` ``(T, L, N, I)`` from ``starts`` (``(T, layers * dirs,
    N, H)`` each, None for zeros): the outputs ``(T, L, N, H)`` and the final states. With
    ``valid`` ``(T, L, N)`` (:meth:`TaskPacked.valid`), each sequence ends at its length, as
    in a packed sequence: its later steps leave the state as it is, their outputs are
    undefined, and the outputs come as :class:`_Steps`."""
    tasks, _, batch, _ = x.shape
    dirs = 2 if m.bidirectional else 1
    h_size = m.proj_size if getattr(m, "proj_size", 0) > 0 else m.hidden_size
    sizes = [h_size, m.hidden_size] if m.mode == "LSTM" else [h_size]
    states = [
        x.new_zeros(tasks, m.num_layers * dirs, batch, size) if start is None else start
        for start, size in zip(starts, sizes, strict=True)
    ]
    ends = None
    if valid is not None:
        ends = _SequenceEnds(valid)
        # What the padding holds reaches the weights' gradients times 0: zeros in place of
        # it where it is not finite (0 * NaN), and only then (a copy of the input)
        if not bool(torch.isfinite(x).all()):
            x = x.masked_fill(~ends.valid.unsqueeze(-1), 0)
    finals: list[list[Tensor]] = [[] for _ in sizes]
    result: Tensor | _Steps = x
    for layer in range(m.num_layers):
        outs = []
        for d in range(dirs):
            names = {
                kind: f"{kind}_l{layer}{'_reverse' if d else ''}"
                for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")
            }
            start = [s[:, layer * dirs + d] for s in states]
            out, last = _direction(
                m.mode, x, start, {k: weights.get(n) for k, n in names.items()}, d == 1, ends
            )
            outs.append(out)
            for f, t in zip(finals, last, strict=True):
                f.append(t)
        steps = _Steps(outs, batch)
        if ends is None or layer < m.num_layers - 1:
            result = x = steps.stacked()
        else:  # the last layer on packed sequences: its steps, stacked only when read
            result = steps
    return result, [torch.stack(f, dim=1) for f in finals]  # (T, layers * dirs, N, H)


class _Steps:
    """A layer's outputs as each direction's steps (``(T, rows, H)`` each, ``rows`` a prefix
    of the ``batch``), stacked into ``(T, L, N, H * dirs)`` by :meth:`stacked` only when
    read: a classifier on packed sequences often reads the final state alone."""

    def __init__(self, directions: list[list[Tensor]], batch: int) -> None:
        self.directions, self.batch = directions, batch
        first = directions[0][0]
        width = sum(d[0].shape[-1] for d in directions)
        self.shape = (first.shape[0], len(directions[0]), batch, width)

    def stacked(self) -> Tensor:
        def full(t: Tensor) -> Tensor:
            missing = self.batch - t.shape[1]
            return t if not missing else F.pad(t, (0, 0, 0, missing))

        parts = [torch.stack([full(t) for t in d], dim=1) for d in self.directions]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class _SequenceEnds:
    """Where packed sequences end, from ``valid`` ``(T, L, N)`` (whether each step is within
    its sequence; each task's sequences sorted longest first): ``rows[s]``, how many rows
    some task still runs at step ``s`` (a prefix); ``keep[s]``, which of those rows run,
    ``(T, rows[s], 1)``, or None where all do."""

    def __init__(self, valid: Tensor) -> None:
        self.valid = valid
        running = valid.any(0)  # (L, N): the rows some task runs at each step
        ragged = (running & ~valid).any(0).any(-1)  # (L,)
        self.rows: list[int] = running.sum(1).tolist()
        self.keep: list[Tensor | None] = [
            valid[:, s, :n].unsqueeze(-1) if r else None
            for s, (n, r) in enumerate(zip(self.rows, ragged.tolist(), strict=True))
        ]


def _direction(
    mode: str,
    x: Tensor,
    state: list[Tensor],
    w: dict[str, _Weight | None],
    reverse: bool,
    ends: _SequenceEnds | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """One layer in one direction over ``x`` ``(T, L, N, I)`` from ``state`` (``[h]``, or
    ``[h, c]`` for an LSTM, each ``(T, N, H)``): the outputs, each step's ``(T, rows, H)``
    in time order (all ``N`` rows but for packed sequences), and the final state. With
    ``ends`` (packed sequences), a step runs only the rows some task still runs (the forward
    direction's shrink over time; the reverse direction's grow, each row starting from its
    initial state at its sequence's last step), and keeps the state of the rows whose
    sequence has ended; its outputs past a length are undefined."""
    tasks, steps, batch, size = x.shape
    w_ih, w_hh, b_hh = w["weight_ih"], w["weight_hh"], w["bias_hh"]
    assert w_ih is not None and w_hh is not None
    # The input's projection, made a block of time steps at a time just before the cell
    # needs it; the hidden bias joins its bias where the cell adds the two projections anyway
    # (not the GRU's n), so that it takes no pass of its own. Blocks, not all steps at once:
    # the whole projection, for every task, would stay alive until the last step (19.7 MiB
    # for a GRU at T = 16, which a loop holds for one task at a time), and so would its
    # gradients in the backward of unbind.
    # split and unbind, not indexing: one backward per block and for all blocks, instead of
    # a full-size zero per step.
    in_bias = w["bias_ih"]
    if b_hh is not None and mode != "GRU":  # both biases join the input's projection
        in_bias = b_hh if in_bias is None else _Weight.sum(in_bias, b_hh)
    cell_bias = b_hh if mode == "GRU" else None
    parts = x.split(_BLOCK, dim=1)
    initial = list(state)
    running = batch if ends is None or not reverse else 0  # the rows that run (a prefix)
    done: list[list[Tensor]] = []  # forward: the states of rows that ended, later rows first
    state = initial if running == batch else [v[:, :running] for v in initial]
    outs: list[Tensor] = [state[0]] * steps
    for k in reversed(range(len(parts))) if reverse else range(len(parts)):
        span = parts[k].shape[1]
        gi = _project(parts[k].reshape(tasks, span * batch, size), w_ih, in_bias)
        block = gi.view(tasks, span, batch, -1).unbind(1)
        del gi
        for j in reversed(range(span)) if reverse else range(span):
            step = k * _BLOCK + j
            keep = None
            if ends is not None:
                rows, keep = ends.rows[step], ends.keep[step]
                if rows < running:  # forward: these rows' sequences have all ended
                    done.append([v[:, rows:running] for v in state])
                    state = [v[:, :rows] for v in state]
                elif rows > running:  # reverse: these rows' sequences start here
                    state = [
                        torch.cat([v, i[:, running:rows]], 1)
                        for v, i in zip(state, initial, strict=True)
                    ]
                running = rows
            h, c = state[0], state[1] if mode == "LSTM" else None
            gate_in = block[j] if running == batch else block[j][:, :running]
            h_new, c_new = _cell(mode, gate_in, h, c, w, cell_bias)
            if keep is None:
                state = [h_new] if c_new is None else [h_new, c_new]
            else:
                state = [torch.where(keep, h_new, h)]
                if c_new is not None:
                    state.append(torch.where(keep, c_new, c))  # type: ignore[arg-type]
            outs[step] = state[0]
        del block  # before the next block's projection: one block's alive at a time
    if done:
        state = [torch.cat([v, *(d[i] for d in reversed(done))], 1) for i, v in enumerate(state)]
    return outs, state


def _cell(
    mode: str,
    gi: Tensor,
    h: Tensor,
    c: Tensor | None,
    w: dict[str, _Weight | None],
    b_hh: _Weight | None,
) -> tuple[Tensor, Tensor | None]:
    """One time step of the cell, for every task: ``(h, c)`` (``c`` None but for an LSTM)
    from the input's projection ``gi`` ``(T, N, G)``."""
    w_hh = w["weight_hh"]
    assert w_hh is not None
    if mode == "LSTM":
        assert c is not None  # an LSTM's state is [h, c]
        i, f, g, o = _add_recurrent_product(gi, h, w_hh).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        hr = w["weight_hr"]
        return (h if hr is None else _project(h, hr, None)), c
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, dim=-1)
        # r and z in place of the hidden projection's first two thirds, as torch's own GRU
        # cell does: that projection stays alive anyway (r * hn saves its last third), so the
        # gates take no memory of their own. unsafe_chunk: the thirds keep separate version
        # counters, so changing one does not invalidate what the others saved.
        hr_, hz, hn = _project(h, w_hh, b_hh).unsafe_chunk(3, dim=-1)
        r = hr_.add_(ir).sigmoid_()
        z = hz.add_(iz).sigmoid_()
        n = torch.tanh(in_ + r * hn)
        return (h - n) * z + n, None
    if mode == "RNN_TANH":
        return torch.tanh(_add_recurrent_product(gi, h, w_hh)), None
    return torch.relu(_add_recurrent_product(gi, h, w_hh)), None


def _add_recurrent_product(acc: Tensor, h: Tensor, w: _Weight) -> Tensor:
    """``acc + h @ w^T`` for every task, in one call: ``acc`` ``(T, N, G)``, ``h``
    ``(T, N, H)``."""
    if w.per_task:
        return torch.baddbmm(acc, h, w.t())
    tasks, batch, width = h.shape
    flat = torch.addmm(acc.reshape(tasks * batch, -1), h.reshape(tasks * batch, width), w.t())
    return flat.view(tasks, batch, -1)


def recurrent_standins(module: nn.Module) -> dict[str, type[Standin]]:
    """The recurrent layers of ``module`` (outermost): :class:`TaskRecurrent` for exact
    ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``, :class:`PerTask` (once per task) for other
    ``nn.RNNBase`` subclasses, which may compute something else."""
    out: dict[str, type[Standin]] = {}
    for name, cls in recurrent_layers(module).items():
        kind = type(module.get_submodule(name))
        out[name] = TaskRecurrent if kind in (nn.RNN, nn.LSTM, nn.GRU) else cls
    return out


def bind_fallback_report(standins: dict[str, Any], report: dict[str, str]) -> dict[str, Any]:
    """``standins`` (name -> stand-in class) with each :class:`TaskRecurrent` told its name
    and the ``report`` dict to record in when it steps aside."""
    return {
        name: functools.partial(cls, name=name, report=report)
        if isinstance(cls, type) and issubclass(cls, TaskRecurrent)
        else cls
        for name, cls in standins.items()
    }
