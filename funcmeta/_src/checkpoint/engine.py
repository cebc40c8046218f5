"""Checkpointing that composes with double backward: the engine of per-layer checkpointing.

``torch.utils.checkpoint`` (non-reentrant) supports ``autograd.grad(create_graph=True)``, but
only by recording the recomputed layer and its backward into the graph being built: in a
second-order inner loop every checkpointed layer is recomputed, and its activations stay alive
until the outer backward. Per-layer checkpointing then saves nothing in second order.

:func:`checkpoint` keeps only the function's inputs in second order too, with two autograd
Functions:

- ``_Checkpoint`` runs the function and keeps only its input tensors. Its backward recomputes the
  function and takes the vector-Jacobian product (VJP).
- When that backward is itself recorded (``create_graph=True``, the inner loop of
  second-order MAML), it returns the VJP through ``_CheckpointVJP`` instead: computed the same
  way, but recorded as one node that keeps the function's inputs and the incoming gradients,
  nothing of the function's insides. A backward through that node (the outer backward)
  recomputes the function, its VJP with a graph, and differentiates that, one layer at a
  time.

A second-order inner step takes its gradient right after its forward: within
:func:`kept_for_the_gradient` (which the inner loop enters for such a step) the first run keeps
its graph, the inner gradient takes the VJP on it, and drops it, instead of recomputing. So per
second-order step of an inner loop the function runs three times: its forward, and twice in
the outer backward, which reaches the recorded VJP and the forward's node a whole sweep apart
(the recorded VJPs in the order of the forward, then the forward's nodes in reverse). That is
the least a schedule can run that keeps one function's activations at a time between the
inner loop and the outer backward; sharing one recomputation between those two nodes would
keep the activations of every function of the step between them (``docs/memory.md``, The
recomputation schedule; ``tests/checkpoint/test_schedule.py`` counts the runs).

Every run of the function after the first one (each recomputation) reproduces the first: the
random number generator states (dropout masks), autocast and the kernel choice
(:mod:`funcmeta.checkpoint.kernels`) of the first run are put back for it. A recorded VJP is recomputed
under the autocast state in force when it was first computed.

Example:
    >>> import torch
    >>> from funcmeta._src.checkpoint.engine import checkpoint
    >>> x = torch.randn(5, requires_grad=True)
    >>> y = checkpoint(lambda t: torch.tanh(t) * t, x)
    >>> (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)   # recomputed, recorded
    >>> torch.allclose(g, torch.tanh(x) + x * (1 - torch.tanh(x) ** 2))
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor

from funcmeta._src.core import kernels, tree
from funcmeta._src.core.fence import AutocastState, saved_hooks_in_force
from funcmeta._src.core.replay import recomputation
from funcmeta._src.core.saved import keep, kept
from funcmeta._src.core.sharding import saving_split
from funcmeta._src.module import scope

__all__ = [
    "OpenFunctionError",
    "graph_input",
    "checkpoint",
    "checkpoint_closed",
    "kept_for_the_gradient",
    "recomputing_for_a_vjp",
]

_TENSOR = object()  # where a tensor leaf goes in a structure kept without its tensors


class _Replay:
    """What a recomputation must reproduce of the first run: the random number generator
    states of the CPU and of the CUDA devices of the inputs, autocast and the kernel choice."""

    __slots__ = ("autocast", "cpu_rng", "device_rng", "devices", "kernel_state")

    def __init__(self, tensors: list[Tensor]) -> None:
        self.devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.autocast = AutocastState(bool(self.devices))
        self.kernel_state = kernels.capture()

    def __call__(self) -> _Replaying:
        return _Replaying(self)


class _Replaying:
    """One recomputation under a :class:`_Replay`: the first run's generator states, autocast
    and kernel choice for the block, the states before it back afterwards (as
    ``torch.random.fork_rng`` does, without its generator machinery: a recomputation of a
    small layer spent a third of its Python time there)."""

    __slots__ = ("cpu", "device", "replay", "stack")

    def __init__(self, replay: _Replay) -> None:
        self.replay = replay

    def __enter__(self) -> None:
        replay = self.replay
        self.cpu = torch.get_rng_state()
        self.device = [torch.cuda.get_rng_state(d) for d in replay.devices]
        self.stack = contextlib.ExitStack()
        try:
            torch.set_rng_state(replay.cpu_rng)
            for device, state in zip(replay.devices, replay.device_rng, strict=True):
                torch.cuda.set_rng_state(state, device)
            replay.autocast.enter(self.stack)
            self.stack.enter_context(kernels.restore(replay.kernel_state))
        except BaseException:
            self._put_back()
            raise

    def __exit__(self, *exc: object) -> None:
        self._put_back()

    def _put_back(self) -> None:
        try:
            self.stack.close()
        finally:
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.replay.devices, self.device, strict=True):
                torch.cuda.set_rng_state(state, device)


def recomputing_for_a_vjp() -> bool:
    """Whether a checkpointed function is being recomputed for a VJP taken right away (the
    saved-tensor hooks in force are that recomputation's own): what it saves lives only
    until that VJP is taken."""
    hooks = saved_hooks_in_force()
    return hooks is not None and hooks[0] is keep


def _unpack_nothing(_: None) -> Tensor:  # pragma: no cover - never called
    raise RuntimeError("funcmeta: a tensor of a checkpointed forward was used in backward")


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def graph_input(t: Tensor) -> Tensor:
    """A new graph input with the data of ``t`` that requires grad (call it in grad mode). It
    is a view, not a leaf: autocast caches its cast of a leaf that requires grad until the
    autocast region ends, which would keep a low-precision copy of every such input alive
    (one per layer call, or per inner step). Writing into it in place raises, as it should
    where the input is kept for a recomputation."""
    return t.detach().requires_grad_().view_as(t)


def _alias(t: Tensor) -> Tensor:
    """A new graph input with the data of ``t``, requiring grad as ``t`` does."""
    return graph_input(t) if t.requires_grad else t.detach()


class _Call:
    """One call of :func:`checkpoint`: the function, the structure of its arguments and outputs,
    and the state its recomputations replay. Lives as long as the graph that holds it."""

    __slots__ = (
        "args_spec",
        "closed",
        "constant",
        "fn",
        "kept",
        "leaves",
        "out_leaves",
        "out_spec",
        "replay",
        "slots",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        closed: Callable[[], str] | None = None,
    ):
        self.fn = fn
        self.closed = closed
        leaves, self.args_spec = tree.flatten_registered((args, kwargs))
        # non-tensor leaves stay here; tensor leaves travel as the Function's inputs
        self.slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        self.leaves = [_TENSOR if isinstance(x, Tensor) else x for x in leaves]
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.constant: list[bool] = []
        self.replay: _Replay | None = None
        self.kept: tuple[list[Tensor], list[Tensor]] | None = None

    def tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        leaves = tree.leaves_registered((args, kwargs))
        return [leaves[i] for i in self.slots]

    def call(self, tensors: tuple[Tensor, ...] | list[Tensor]) -> Any:
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors, strict=True):
            leaves[i] = t
        args, kwargs = tree.unflatten_registered(leaves, self.args_spec)
        with scope.checkpoint_body():
            return self.fn(*args, **kwargs)

    def first(self, tensors: tuple[Tensor, ...]) -> list[Tensor]:
        """The first run, as the model would run it (grad mode on, inputs requiring grad as
        given), keeping nothing for backward. Returns its tensor outputs, detached."""
        self.replay = _Replay(list(tensors))
        inputs = _leaves(tensors)
        keeping: list[_Call] | None = getattr(_KEEPING, "calls", None)
        saving = (
            torch.autograd.graph.saved_tensors_hooks(lambda _: None, _unpack_nothing)
            if keeping is None
            else torch.autograd.graph.saved_tensors_hooks(keep, kept)
        )
        with torch.enable_grad(), saving:
            mark = _next_sequence_nr() if self.closed is not None else 0
            out = self.call(inputs)
        leaves, self.out_spec = tree.flatten_registered(out)
        if self.closed is not None:
            _check_closed(leaves, inputs, mark, self.closed)
        self.out_leaves = [_TENSOR if isinstance(x, Tensor) else x for x in leaves]
        outs = [x for x in leaves if isinstance(x, Tensor)]
        # an output with no gradient history (a constant such as T5's zero position bias)
        # stays a constant: no gradient flows into it, and none is asked of it
        self.constant = [not x.requires_grad for x in outs]
        if keeping is not None:
            self.kept = (inputs, outs)
            keeping.append(self)
        return [x.detach() for x in outs]

    def output(self, tensors: tuple[Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        it = iter(tensors)
        leaves = [next(it) if x is _TENSOR else x for x in leaves]
        return tree.unflatten_registered(leaves, self.out_spec)

    def again(self, tensors: tuple[Tensor, ...] | list[Tensor]) -> list[Tensor]:
        """A recomputation's tensor outputs, under the state of the first run."""
        assert self.replay is not None
        with self.replay(), recomputation():
            out = self.call(tensors)
        return [x for x in tree.leaves_registered(out) if isinstance(x, Tensor)]

    def first_vjp(
        self, wanted: list[int], picked: list[int], saved: Any, grads: list[Tensor]
    ) -> tuple[Tensor | None, ...]:
        """The VJP of the first run's outputs ``picked`` against ``grads`` (no graph), with
        respect to the inputs ``wanted``: on the first run's graph if it was kept for it
        (:func:`kept_for_the_gradient`), which it then drops, else recomputed on ``saved``."""
        kept, self.kept = self.kept, None
        if kept is None:
            return self.vjp(wanted, picked, _leaves(saved), grads, create_graph=False)
        inputs, outs = kept
        return torch.autograd.grad(
            [outs[i] for i in picked], [inputs[i] for i in wanted], grads, allow_unused=True
        )

    def vjp(
        self,
        wanted: list[int],
        picked: list[int],
        tensors: list[Tensor],
        grads: list[Tensor],
        create_graph: bool,
    ) -> tuple[Tensor | None, ...]:
        """Recompute on ``tensors`` (fresh graph inputs: leaves, or views of the saved
        tensors, so that no path runs through another input's history, as through a weight
        tied to an earlier layer) and take the VJP of the outputs ``picked`` against
        ``grads``, with respect to the inputs ``wanted``."""
        # The activations of this recomputation are used right away and dropped: they must
        # not reach the saved-tensor hooks of an enclosing step checkpoint or offload.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, kept):
            outs = self.again(tensors)
            return torch.autograd.grad(
                [outs[i] for i in picked],
                [tensors[i] for i in wanted],
                grads,
                create_graph=create_graph,
                allow_unused=True,
            )


_KEEPING = threading.local()  # .calls: the calls keeping their first run's graph, or None


@contextlib.contextmanager
def kept_for_the_gradient() -> Iterator[None]:
    """Within the block, a checkpointed function's first run keeps its graph until the first
    backward through it takes its VJP there (instead of recomputing); at the end of the
    block every graph still kept is dropped. For a forward whose gradient is taken right
    after it, inside the block: an inner step of second-order MAML.

    Example:
        >>> import torch
        >>> from funcmeta._src.checkpoint.engine import checkpoint, kept_for_the_gradient
        >>> x = torch.randn(3, requires_grad=True)
        >>> with kept_for_the_gradient():
        ...     y = checkpoint(torch.tanh, x)
        ...     (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # on the kept graph
        >>> torch.allclose(g, 1 - torch.tanh(x) ** 2)
        True
        >>> (h,) = torch.autograd.grad(g.sum(), x)  # the outer backward recomputes
        >>> torch.allclose(h, -2 * torch.tanh(x) * (1 - torch.tanh(x) ** 2))
        True
    """
    saved = getattr(_KEEPING, "calls", None)
    calls: list[_Call] = []
    _KEEPING.calls = calls
    try:
        yield
    finally:
        _KEEPING.calls = saved
        for run in calls:
            run.kept = None


class OpenFunctionError(RuntimeError):
    """A checkpointed function's outputs depend, through autograd, on a tensor that is not
    among its arguments: recomputed apart from that tensor, it would give that dependency
    no gradient."""


def _next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will have at least."""
    node = torch.empty(0, requires_grad=True).view(0).grad_fn
    assert node is not None
    return node._sequence_nr() + 1


def _check_closed(
    outputs: list[Any], inputs: list[Tensor], mark: int, what: Callable[[], str]
) -> None:
    """Raise :class:`OpenFunctionError` if the graph of ``outputs`` (a function's first run)
    reaches a tensor that requires grad other than ``inputs``: a leaf, or a node made before
    the run began (sequence number below ``mark``)."""
    stops = {x.grad_fn for x in inputs if x.grad_fn is not None}
    todo: list[torch.autograd.graph.Node | None] = [
        o.grad_fn for o in outputs if isinstance(o, Tensor) and o.grad_fn is not None
    ]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None or node._sequence_nr() < mark:
            shape = tuple(leaf.shape) if isinstance(leaf, Tensor) else None
            found = (
                f"a leaf tensor of shape {shape}"
                if shape is not None
                else f"a tensor computed before the call (by {node.name()})"
            )
            raise OpenFunctionError(
                f"{what()} depends on {found} that requires grad and is not among its "
                "arguments or the parameters and buffers of the modules it was given (a "
                "tensor held in a closure or a global): a recomputation would give it no "
                "gradient. Pass that tensor to checkpoint as an argument "
                "(checkpoint(fn, x, t, ...)), or register it as a parameter or buffer of the "
                "checkpointed module"
            )
        todo.extend(n for n, _ in node.next_functions)


def _leaves(tensors: Any) -> list[Tensor]:
    """Graph inputs with the data of ``tensors``, cut from their history, requiring grad as
    they do."""
    with torch.enable_grad():
        return [_alias(t) for t in tensors]


def _views(tensors: Any) -> list[Tensor]:
    """Graph inputs connected to ``tensors``' history (views), in grad mode."""
    return [t.view_as(t) if t.requires_grad else t for t in tensors]


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _Call, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.run = run
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        outs = run.first(tensors)
        fixed = [o for o, c in zip(outs, run.constant, strict=True) if c or not _differentiable(o)]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        run: _Call = ctx.run
        tensors = ctx.saved_tensors
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        picked = [i for i, g in enumerate(grads) if g is not None and not run.constant[i]]
        result: list[Tensor | None] = [None] * (1 + len(tensors))
        if not wanted or not picked:
            return tuple(result)
        given = cast(list[Tensor], [grads[i] for i in picked])  # picked: not None
        if torch.is_grad_enabled():
            # This backward is recorded (create_graph): one node that keeps the inputs and
            # the gradients, not the function's activations.
            with saving_split(tensors):
                vjps = _CheckpointVJP.apply(run, wanted, picked, len(tensors), *tensors, *given)
        else:
            vjps = run.first_vjp(wanted, picked, tensors, given)
        for i, g in zip(wanted, vjps, strict=True):
            result[1 + i] = g
        return tuple(result)


class _CheckpointVJP(torch.autograd.Function):
    """The VJP of a :class:`_Checkpoint` function, recorded as one node (see the module
    docstring). Inputs: the function's input tensors, then the gradients of its outputs."""

    @staticmethod
    def forward(
        ctx: Any, run: _Call, wanted: list[int], picked: list[int], n: int, *saved: Tensor
    ) -> tuple[Tensor | None, ...]:
        ctx.meta = (run, wanted, picked, n)
        ctx.autocast = AutocastState(bool(run.replay.devices) if run.replay else False)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*saved)
        grads = [g.detach() for g in saved[n:]]
        return tuple(run.first_vjp(wanted, picked, saved[:n], grads))

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Tensor | None, ...]:
        run, wanted, picked, n = ctx.meta
        saved = ctx.saved_tensors
        result: list[Tensor | None] = [None] * (4 + len(saved))
        need = [i for i, flag in enumerate(ctx.needs_input_grad[4:]) if flag]
        if not need or all(c is None for c in cotangents):
            return tuple(result)
        record = torch.is_grad_enabled()  # a third order: keep this graph too
        with torch.enable_grad():
            xs = _views(saved) if record else _leaves(saved)
            with ctx.autocast():
                vjps = run.vjp(wanted, picked, xs[:n], xs[n:], create_graph=True)
            pairs = [
                (v, c)
                for v, c in zip(vjps, cotangents, strict=True)
                if v is not None and c is not None and v.requires_grad
            ]
            if not pairs:
                return tuple(result)
            # the VJPs' own values are not needed to differentiate them: only their graph
            # (its edges) is kept, their memory freed before this backward
            edges = [torch.autograd.graph.get_gradient_edge(v) for v, _ in pairs]
            given = [c for _, c in pairs]
            del vjps, pairs
            grads = torch.autograd.grad(
                edges, [xs[i] for i in need], given, create_graph=record, allow_unused=True
            )
        for i, g in zip(need, grads, strict=True):
            result[4 + i] = g
        return tuple(result)


def _checkpointed(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    closed: Callable[[], str] | None,
) -> Any:
    """:func:`checkpoint` and :func:`checkpoint_closed`: the first run checked when ``closed``."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    run = _Call(fn, args, kwargs, closed=closed)
    tensors = run.tensors(args, kwargs)
    if not any(t.requires_grad for t in tensors):
        if closed is None:
            return fn(*args, **kwargs)
        # nothing given requires grad: an output that does depends on something outside
        mark = _next_sequence_nr()
        out = fn(*args, **kwargs)
        _check_closed(tree.leaves_registered(out), [], mark, closed)
        return out
    # a sharded model's runtime keeps each rank's slice of what the node saves
    with saving_split(tensors):
        outs = _Checkpoint.apply(run, *tensors)
    return run.output(outs)


def checkpoint_closed(
    what: Callable[[], str], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """:func:`checkpoint` for a function that is not known to be pure in its arguments (one a
    model checkpoints itself): its first run is checked to depend, through autograd, on
    nothing that requires grad but its arguments; else :class:`OpenFunctionError`, whose
    message begins with ``what()``."""
    return _checkpointed(fn, args, kwargs, what)


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping only the tensors among the arguments for backward.

    Tensors may sit anywhere in the arguments (nested in lists, dicts, registered pytrees);
    outputs may be any pytree with tensor and non-tensor leaves. ``fn`` must be a pure
    function of its tensor arguments apart from its randomness, which is replayed; it runs
    once now and once more in each backward that goes through it (twice in a backward that
    goes through the graph of a recorded one). Without grad mode, or without an input that
    requires grad, it is just ``fn(*args, **kwargs)``.
    """
    return _checkpointed(fn, args, kwargs, None)
