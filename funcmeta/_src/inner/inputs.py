"""What a batch's inputs mean as a call of the model, its task count, and the checks made
before any step.

A batch is ``(inputs, targets)``. ``inputs`` become the model's arguments:

- a tuple: positional arguments, ``model(*inputs)``;
- a mapping (a dict, a HuggingFace ``BatchEncoding``): keyword arguments, ``model(**inputs)``;
- :class:`Args`: both, ``Args(x, attention_mask=m)`` is ``model(x, attention_mask=m)``;
- anything else: the one positional argument, ``model(inputs)``. A model that takes a
  dict or a tuple as its single argument gets ``Args(that)``.

Under task batching every tensor among the inputs, keyword ones included, carries the
leading task axis.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> class Scaled(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(3, 1)
    ...     def forward(self, x, *, scale):
    ...         return self.lin(x) * scale
    >>> fmodel = fm.functional_model(Scaled())
    >>> x, y = torch.randn(5, 3), torch.randn(5, 1)
    >>> batch = (fm.Args(x, scale=torch.tensor(2.0)), y)
    >>> fm.adapt(fmodel, fmodel.params, F.mse_loss, batch, fm.optim.sgd(lr=0.1), steps=1).losses.shape
    torch.Size([1])
    >>> batch = ({"x": x, "scale": torch.tensor(2.0)}, y)     # keywords only
    >>> fm.adapt(fmodel, fmodel.params, F.mse_loss, batch, fm.optim.sgd(lr=0.1), steps=1).losses.shape
    torch.Size([1])
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_tree
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import autocast_enabled, user_stacklevel
from funcmeta._src.inner.options import AdaptOptions
from funcmeta._src.module.functional import FunctionalModel
from funcmeta._src.optim.base import GradientTransformation

__all__ = [
    "Args",
    "CallInputs",
    "CheckedCall",
    "TaskAxisError",
    "TaskAxisSuspect",
    "TaskAxisWarning",
    "check_adapt_call",
    "check_batch",
    "check_batch_call",
    "check_call",
    "check_model",
    "check_task_options",
    "split_batch",
    "with_task_axis",
    "split_inputs",
    "leftover_task_axis",
    "warn_one_task_as_many",
    "task_count",
]

CallInputs = tuple[tuple[Any, ...], dict[str, Any]]
"""``(args, kwargs)``: the inputs of a batch as the model's call arguments."""


class CheckedCall(NamedTuple):
    """A call checked by :func:`check_batch_call`, ready to compute on."""

    batch: tuple[CallInputs, Any]
    """``((args, kwargs), targets)`` (``targets`` is None for inputs alone)."""
    tasks: int | None
    """The number of tasks of a task-batched call, else None."""
    param_dims: dict[str, int | None] | None
    """Task-batched: 0 for each parameter given per task, None for one shared by all."""
    buffers: dict[str, Tensor]
    """The buffers to start from (default: the module's); task-batched, one copy per task."""


@exposed_in("funcmeta")
class Args:
    """Positional and keyword arguments for the model, as the inputs of a batch.

    Example:
        >>> import funcmeta as fm
        >>> fm.Args(1, 2, mask=3)
        Args(1, 2, mask=3)
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Args({', '.join(parts)})"


@exposed_in("funcmeta.inputs")
def split_inputs(inputs: Any) -> CallInputs:
    """``(args, kwargs)`` for the inputs of a batch (see the module docstring)."""
    if isinstance(inputs, Args):
        return tuple(inputs.args), dict(inputs.kwargs)
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, Mapping):
        keys = [k for k in inputs if not isinstance(k, str)]
        if keys:
            raise TypeError(f"keyword inputs need string keys, got {keys}")
        return (), dict(inputs)
    return (inputs,), {}


def check_model(fmodel: Any) -> None:
    """Raise ``TypeError`` unless ``fmodel`` is a :class:`funcmeta.FunctionalModel`."""
    if not isinstance(fmodel, FunctionalModel):
        hint = (
            "; wrap it first: fmodel = fm.functional_model(module)"
            if isinstance(fmodel, nn.Module)
            else ""
        )
        raise TypeError(
            f"fmodel must be a FunctionalModel from fm.functional_model, got "
            f"{type(fmodel).__name__}{hint}"
        )


@exposed_in("funcmeta.inputs")
def split_batch(batch: Any) -> tuple[CallInputs, Any]:
    """``((args, kwargs), targets)`` for a batch ``(inputs, targets)``
    (see :mod:`funcmeta.inputs`)."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise TypeError(
            "batch must be a pair (inputs, targets); inputs may be a tuple of positional "
            "arguments, a dict of keyword arguments or fm.Args(...)"
        )
    return split_inputs(batch[0]), batch[1]


def task_count(batch: Any) -> int:
    """The size of the leading task axis shared by every tensor of ``batch``.

    Raises ``ValueError`` naming the tensors whose leading axis differs.
    """
    paths, leaves = tree.flatten_with_paths(batch)
    tensors = [(p, x) for p, x in zip(paths, leaves, strict=True) if isinstance(x, Tensor)]
    if not tensors:
        raise ValueError("the batch holds no tensors: nothing gives the task axis")
    scalars = [p or "batch" for p, x in tensors if x.dim() == 0]
    if scalars:
        raise ValueError(
            f"batch tensors {scalars} are scalars; every one needs a leading task axis"
        )
    first = tensors[0][1].shape[0]
    if first == 0:
        raise ValueError(
            f"the batch holds zero tasks (batch tensor {tensors[0][0] or 'batch'!r} has shape "
            f"{tuple(tensors[0][1].shape)}); the task axis comes first"
        )
    odd = {p or "batch": tuple(x.shape) for p, x in tensors if x.shape[0] != first}
    if odd:
        raise ValueError(
            f"every batch tensor needs the same leading task axis (expected {first} tasks, as "
            f"batch tensor {tensors[0][0] or 'batch'!r} has); these differ: {odd}"
        )
    return first


_NO_OPT = object()


def check_call(fmodel: Any, params: Any, opt: Any = _NO_OPT) -> None:
    """Raise a ``TypeError``/``ValueError`` naming the problem when ``fmodel``, ``params`` or
    ``opt`` cannot be what :func:`funcmeta.adapt` and the task functions take (``opt``, when
    passed, is required)."""
    check_model(fmodel)
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a dict of tensors keyed by parameter name (fmodel.params), got "
            f"{type(params).__name__}"
        )
    on_meta = [k for k, v in params.items() if isinstance(v, Tensor) and v.is_meta]
    if on_meta:
        raise ValueError(
            f"parameters {on_meta} are on the meta device and hold no data; materialise the "
            "module first (module.to_empty(device=...) and initialise it, or load a state dict)"
        )
    if opt is None:
        raise TypeError(
            "opt is required: the inner optimizer, a funcmeta GradientTransformation "
            "(fm.optim.sgd(lr=0.1), fm.optim.adam(lr=1e-3), ...)"
        )
    if opt is not _NO_OPT and not isinstance(opt, GradientTransformation):
        if isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"opt is a torch.optim.{type(opt).__name__}, which updates .grad in place and "
                "cannot be differentiated through; use its funcmeta counterpart for the inner "
                "loop (fm.optim.sgd, adam, adamw, rmsprop, adagrad) and keep torch.optim for "
                "the outer loop"
            )
        raise TypeError(
            "opt must be a funcmeta GradientTransformation (fm.optim.sgd(lr=0.1), ...), got "
            f"{type(opt).__name__}"
        )


def check_batch_call(
    fmodel: Any,
    params: Any,
    batch: Any,
    *,
    opt: Any = _NO_OPT,
    buffers: Any = None,
    task_batched: bool = False,
    targets: bool = True,
) -> CheckedCall:
    """The one check of a call on a batch, before any computation: :func:`funcmeta.adapt`,
    :func:`funcmeta.adapt_tasks`, :func:`funcmeta.task_losses`, :func:`funcmeta.apply_tasks`
    (``targets=False``: ``batch`` is the inputs alone) and, through them, the recipes.

    Checks the model, the parameters and buffers (against the module's shapes, and with
    ``task_batched`` against the task axis), ``opt`` when given, the batch (its task axis when
    ``task_batched``, empty tensors, input dtypes) and the dtypes of parameters and buffers.
    """
    check_call(fmodel, params, opt)
    if not task_batched:
        fmodel.check_params(params)
    split = split_batch(batch) if targets else (split_inputs(batch), None)
    count = task_count(split) if task_batched else None
    check_batch(split, params)
    check_dtypes(params, fmodel.buffers if buffers is None else buffers, fmodel)
    if count is None:
        return CheckedCall(split, None, None, fmodel.buffers if buffers is None else dict(buffers))
    return CheckedCall(split, count, *_task_trees(fmodel, params, buffers, count))


def _task_trees(
    fmodel: FunctionalModel,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor] | None,
    tasks: int,
) -> tuple[dict[str, int | None], dict[str, Tensor]]:
    """``(param_dims, per_task_buffers)``: which parameters carry the task axis, and the
    buffers (default: the module's) with one copy per task."""
    buffers = fmodel.buffers if buffers is None else buffers
    dims = check_tree(buffers, fmodel.buffer_shapes, "buffers", tasks=tasks)
    copies = with_task_axis(buffers, dims, tasks, copy=True)
    return check_tree(params, fmodel.param_shapes, "params", tasks=tasks), copies


def with_task_axis(
    values: Mapping[str, Tensor | None],
    dims: Mapping[str, int | None],
    tasks: int,
    *,
    copy: bool = False,
) -> dict[str, Any]:
    """``values`` with a task axis: an entry the tasks share (``dims[k]`` is ``None``)
    expanded to ``(tasks, *shape)``, a view (``copy``: a copy for each task, which the
    forward may update in place, as BatchNorm its running statistics); an entry that has
    the axis (0), or is ``None``, as it is."""
    return {
        k: v if v is None or dims[k] == 0 else _expanded(v, tasks, copy) for k, v in values.items()
    }


def _expanded(value: Tensor, tasks: int, copy: bool) -> Tensor:
    view = value.expand(tasks, *value.shape)
    return view.clone() if copy else view


def check_task_options(options: AdaptOptions) -> None:
    """Raise ``ValueError`` for an option task batching cannot take (``on_nonfinite="skip"``:
    the tasks share the optimizer's step count)."""
    if options.on_nonfinite == "skip":
        raise ValueError(
            "on_nonfinite='skip' is not available with task batching: the tasks share the "
            "optimizer's step count; use 'raise', or adapt the tasks one by one"
        )


def check_adapt_call(
    fmodel: Any,
    params: Any,
    opt: Any,
    batch: Any,
    steps: Any,
    options: AdaptOptions,
    *,
    task_batched: bool = False,
    buffers: Any = None,
) -> CheckedCall:
    """Check a call of :func:`funcmeta.adapt` (``task_batched``: of
    :func:`funcmeta.adapt_tasks`) before any computation: :func:`check_batch_call`, the step
    count, and the options task batching cannot take."""
    options.check_steps(steps)
    if task_batched:
        check_task_options(options)
    checked = check_batch_call(
        fmodel, params, batch, opt=opt, buffers=buffers, task_batched=task_batched
    )
    if checked.tasks is not None:
        warn_one_task_as_many(checked.batch, checked.tasks)
    else:
        _warn_leading_task_axis(fmodel, checked.batch)
    return checked


@exposed_in("funcmeta")
class TaskAxisWarning(UserWarning):
    """A batch whose shapes suggest a task-axis mistake that would otherwise run silently:
    :func:`funcmeta.adapt` given a batch with a leading task axis, or
    :func:`funcmeta.adapt_tasks` given one task's batch. Silence it, where the shapes are
    meant, with ``warnings.filterwarnings("ignore", category=fm.TaskAxisWarning)``."""


#: Layers that act on the last axis of their input alone, so that extra leading axes (a
#: leftover task axis) pass through them silently as more examples.
_LAST_AXIS = (
    nn.Linear,
    nn.Bilinear,
    nn.Identity,
    nn.LayerNorm,
    nn.Dropout,
    nn.AlphaDropout,
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
)


#: Activations that act on each element alone (any input shape).
_ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.Hardshrink,
    nn.Softshrink,
    nn.Tanhshrink,
    nn.Softplus,
    nn.Softsign,
    nn.LogSigmoid,
    nn.Threshold,
    nn.RReLU,
)


def _acts_on_the_last_axis(m: nn.Module) -> bool:
    """Whether the layer ``m`` itself reads no leading axis: an elementwise activation, one
    PReLU weight, a softmax or GLU over ``dim=-1``, or a layer of :data:`_LAST_AXIS`. Not
    attention (it mixes a sequence), not a softmax over another axis, not a per-channel PReLU
    (it reads axis 1)."""
    if isinstance(m, _LAST_AXIS + _ELEMENTWISE):
        return True
    if isinstance(m, nn.PReLU):
        return m.num_parameters == 1
    if isinstance(m, nn.Softmax | nn.LogSoftmax | nn.Softmin | nn.GLU):
        return m.dim == -1
    return False


def _last_axis_only(module: nn.Module) -> bool:
    """Whether every layer of ``module`` acts on the last axis alone (an MLP): no layer
    reads a sequence, an image or a set along the leading axes (the root's own forward is
    judged by its layers)."""
    return all(
        _acts_on_the_last_axis(m)
        for m in module.modules()
        if m is not module or isinstance(m, _LAST_AXIS)
    ) and any(isinstance(m, nn.Linear) for m in module.modules())


def _first_floating(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    return next(
        (v for v in (*args, *kwargs.values()) if isinstance(v, Tensor) and v.is_floating_point()),
        None,
    )


def _warn_leading_task_axis(fmodel: FunctionalModel, split: tuple[CallInputs, Any]) -> None:
    """Warn when :func:`funcmeta.adapt` gets floating inputs and targets that share two
    leading axes, for a model whose layers act on the last axis alone: most likely a batch
    of tasks ``(T, N, ...)``, which such a model runs as one task of ``T * N`` examples."""
    (args, kwargs), targets = split
    x = _first_floating(args, kwargs)
    if (
        x is None
        or x.dim() < 3
        or not isinstance(targets, Tensor)
        or not targets.is_floating_point()
        or targets.dim() < 3
        or targets.shape[:2] != x.shape[:2]
        or not _last_axis_only(fmodel.module)
    ):
        return
    tasks, examples = x.shape[:2]
    warnings.warn(
        f"fm.adapt takes one task's batch: these inputs {tuple(x.shape)} and targets "
        f"{tuple(targets.shape)} share their two leading axes, and the model's layers act on "
        f"the last axis alone, so this runs as ONE task of {tasks} x {examples} examples. If "
        "the first axis is a task axis, use fm.adapt_tasks (all tasks at once) or pass one "
        "task, (x[t], y[t]). If this is one task's data, silence this with "
        "warnings.filterwarnings('ignore', category=fm.TaskAxisWarning)",
        TaskAxisWarning,
        stacklevel=user_stacklevel(),
    )


def warn_one_task_as_many(split: tuple[CallInputs, Any], tasks: int) -> None:
    """Warn when every target holds one value per task (a scalar target after the task
    axis): most likely one task's batch without a task axis, read as ``tasks`` tasks of one
    example each."""
    targets = [x for x in tree.leaves(split[1]) if isinstance(x, Tensor)]
    if tasks < 2 or not targets:
        return
    (args, kwargs), _ = split
    x = _first_floating(args, kwargs)
    if all(t.dim() == 1 for t in targets):
        said = f"targets of shape {tuple(targets[0].shape)} make {tasks} tasks of one example each"
    elif x is not None and x.dim() <= 2 and all(t.dim() <= 2 for t in targets):
        said = (
            f"inputs of shape {tuple(x.shape)} make {tasks} tasks of one unbatched example "
            f"each (inputs {tuple(x.shape[1:])} per task)"
        )
    else:
        return
    warnings.warn(
        f"adapt_tasks reads the leading axis of every batch tensor as the task axis: these "
        f"{said}. If this is one task's batch, call fm.adapt, or give it a task axis "
        "(x.unsqueeze(0), y.unsqueeze(0))",
        TaskAxisWarning,
        stacklevel=user_stacklevel(),
    )


def check_dtypes(
    params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], fmodel: FunctionalModel
) -> None:
    """Raise ``TypeError`` when the parameters were cast without the module's buffers: the
    given floating-point parameters have one dtype that differs from the module's own, and
    buffers that had the parameters' dtype in the module kept it (BatchNorm statistics in
    float32 beside float64 parameters, as after ``{k: v.double() for k, v in
    fmodel.params.items()}``). A buffer the module keeps in a dtype of its own on purpose
    (a bf16 decoder's float32 rotary frequencies) is never named."""
    if not isinstance(params, Mapping) or not isinstance(buffers, Mapping):
        return  # named by the checks of the dicts themselves
    pdt = {v.dtype for v in params.values() if isinstance(v, Tensor) and v.is_floating_point()}
    own = {v.dtype for v in fmodel.params.values() if v.is_floating_point()}
    if len(pdt) != 1 or len(own) != 1 or pdt == own:
        return  # not one dtype, or the module's own: the module's buffers are as it keeps them
    (p,), (o,) = pdt, own
    own_buffers = fmodel.buffers
    names = [
        k
        for k, v in buffers.items()
        if isinstance(v, Tensor)
        and v.is_floating_point()
        and v.dtype != p
        and k in own_buffers
        and own_buffers[k].dtype == o  # kept in the parameters' dtype by the module
    ]
    if names:
        b = buffers[names[0]].dtype
        raise TypeError(
            f"the parameters are {p} but the buffers {names[:4]}{' ...' if len(names) > 4 else ''} "
            f"are {b}, as the module keeps them beside its {o} parameters: cast the module "
            f"itself (module.to({p})) before fm.functional_model, or pass buffers= of the same "
            f"dtype ({{k: v.to({p}) for k, v in fmodel.buffers.items()}})"
        )


def check_batch(batch: tuple[CallInputs, Any], params: Mapping[str, Tensor]) -> None:
    """Raise ``ValueError``/``TypeError`` naming the tensor for an empty batch tensor, or a
    floating-point input whose dtype differs from the parameters' (outside autocast)."""
    (args, kwargs), targets = batch
    leaves = [x for x in tree.leaves((args, kwargs, targets)) if isinstance(x, Tensor)]
    dtypes = {v.dtype for v in params.values() if isinstance(v, Tensor) and v.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 and not autocast_enabled() else None
    if all(
        x.numel() and (dtype is None or not x.is_floating_point() or x.dtype == dtype)
        for x in leaves
    ):
        return  # nothing to report: skip naming the tensors
    named = [
        *(x for i, a in enumerate(args) for x in _tensors(a, f"inputs[{i}]")),
        *(x for k, v in kwargs.items() for x in _tensors(v, f"inputs[{k!r}]")),
        *_tensors(targets, "targets"),
    ]
    empty = {name: tuple(x.shape) for name, x in named if x.dim() > 0 and x.numel() == 0}
    if empty:
        raise ValueError(f"batch tensors {empty} are empty: there is nothing to compute a loss on")
    if dtype is None:
        return
    odd = {
        name: str(x.dtype)
        for name, x in named
        if name.startswith("inputs") and x.is_floating_point() and x.dtype != dtype
    }
    if odd:
        listed = ", ".join(f"{name} is {d}" for name, d in odd.items())
        raise TypeError(
            f"batch inputs do not have the parameters' dtype {dtype}: {listed}; cast the data "
            f"(x.to({dtype})) or the model (module.to({next(iter(odd.values()))}))"
        )


def _tensors(value: Any, prefix: str) -> list[tuple[str, Tensor]]:
    paths, leaves = tree.flatten_with_paths(value)
    out = []
    for where, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, Tensor):
            out.append((f"{prefix}.{where}" if where else prefix, leaf))
    return out


@exposed_in("funcmeta.inputs")
class TaskAxisError(ValueError):
    """A single task's batch that still has its task axis, as the model's output shows."""


@exposed_in("funcmeta.inputs")
class TaskAxisSuspect(NamedTuple):
    """A single task's batch whose floating inputs ``(A, B, ...)`` and class-index targets
    ``(A, B)`` share their two leading axes: perhaps ``A`` tasks of ``B`` examples, given to
    :func:`funcmeta.adapt` with the task axis left in."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]

    def hint(self) -> str:
        tasks, examples = self.targets
        return (
            f"fm.adapt takes one task's batch; these inputs {self.inputs} and class-index "
            f"targets {self.targets} share their leading axes, as a batch of {tasks} tasks of "
            f"{examples} examples would. If the first axis is the task axis, use "
            "fm.adapt_tasks (all tasks at once) or pass one task, (x[t], y[t])"
        )

    def check_output(self, out: Any, targets: Any, loss_fn: Any) -> None:
        """Raise where cross-entropy would silently read the examples as classes: the
        output ``(A, B, B)`` (as many columns as examples per task) with targets ``(A, B)``."""
        if loss_fn not in (F.cross_entropy, F.nll_loss) or not isinstance(out, Tensor):
            return
        shape = tuple(out.shape)
        if len(shape) == 3 and shape[:2] == self.targets and shape[1] == shape[2]:
            raise TaskAxisError(
                f"{self.hint()}. The model's output {shape} has as many columns as examples "
                f"per task, so {loss_fn.__name__} would read axis 1 (the examples) as the "
                "classes and run. (Per-token targets of a sequence model: flatten both, "
                "out.flatten(0, 1) and y.flatten(), which cross-entropy needs anyway.)"
            )


def leftover_task_axis(
    args: tuple[Any, ...], kwargs: dict[str, Any], targets: Any
) -> TaskAxisSuspect | None:
    """A :class:`TaskAxisSuspect` when the first floating input tensor and integer targets of
    two axes share those axes, else ``None`` (nothing to suspect)."""
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.dim() != 2:
        return None
    first = next(
        (v for v in (*args, *kwargs.values()) if isinstance(v, Tensor) and v.is_floating_point()),
        None,
    )
    if first is None or first.dim() < 3 or tuple(first.shape[:2]) != tuple(targets.shape):
        return None
    return TaskAxisSuspect(tuple(first.shape), tuple(targets.shape))
