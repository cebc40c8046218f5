"""The fence around torch's private internals: every access funcmeta makes to a name torch
does not promise to keep is here, wrapped once, and nowhere else.

Each access is registered in :data:`ACCESSES` with a probe that says whether this torch
release has it; ``tests/core/test_torch_version.py`` runs every probe on every torch the suite runs
on and fails with the torch version and the missing name. What each is for:

- **functorch's batching primitives** (``torch._C._functorch``): stepping in and out of a
  ``vmap`` level, wrapping and unwrapping batched tensors. Task batching's fast layers and
  checkpointed layers under ``vmap`` need them (:mod:`funcmeta.batching`).
- **torch's pytree registry** (``torch.utils._cxx_pytree`` or ``torch.utils._pytree``):
  flattening outputs of registered types (HuggingFace ``ModelOutput``).
- **attention kernel flags** (``torch._C._get/_set_*_sdp_*``) and the multi-head attention
  fast-path flag (``torch.backends.mha._is_fastpath_enabled``): choosing twice-differentiable
  kernels and putting the user's choice back (:mod:`funcmeta._src.core.kernels`).
- **``nn.Module`` internals**: its ``_parameters``, ``_buffers`` and ``_modules`` dicts
  (shadow module trees share them; :class:`funcmeta.FunctionalModel` swaps tensors in
  them), its hook dictionaries (does a call run hooks?), and a convolution's
  ``_conv_forward`` and ``_reversed_padding_repeated_twice``.
- **``torch.utils.checkpoint.checkpoint``'s code**: while funcmeta runs a model or
  recomputes a layer, calls of ``torch.utils.checkpoint.checkpoint`` (however the caller
  imported it: HuggingFace binds it in a ``functools.partial``) reach funcmeta's dispatcher
  instead (:mod:`funcmeta._src.checkpoint.takeover`); the function's code is swapped for a trampoline
  and put back when the last such block ends. Calls from other threads, or outside those
  blocks, run torch's own code.
- **vmap's refusals**: which ``RuntimeError`` texts mean "vmap cannot batch this" (torch has
  no exception type for it), checked against a real refusal by the test suite.

Example:
    >>> from funcmeta._src.core.fence import missing_accesses
    >>> missing_accesses()
    []
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

__all__ = [
    "ACCESSES",
    "FUNCTORCH",
    "add_batch_dim",
    "checkpoint_redirected",
    "original_checkpoint",
    "set_checkpoint_dispatch",
    "pack_padded_op",
    "pad_packed_op",
    "qkv_same_embed_dim",
    "reparametrized",
    "buffer_dict",
    "caller_frame",
    "compiling",
    "saved_tensor_hooks_state",
    "set_saved_tensor_hooks_state",
    "inductor_graph_pass",
    "inductor_aten_max_pool_backward",
    "with_own_code_object",
    "conv_forward",
    "frame_local",
    "frame_executes",
    "user_stacklevel",
    "traceback_modules",
    "conv_padding",
    "cudagraph_skips",
    "cudnn_disabled",
    "dispatch_checkpoint",
    "fused_rnn",
    "get_fast_path",
    "has_hooks",
    "is_batchedtensor",
    "is_vmap_refusal",
    "maybe_get_level",
    "missing_accesses",
    "missing_functorch",
    "module_dict",
    "parameter_dict",
    "peek_interpreter_stack",
    "inside_transform",
    "autocast_enabled",
    "AutocastState",
    "pop_dynamic_layer_stack",
    "prepare_vmap",
    "push_dynamic_layer_stack",
    "remove_batch_dim",
    "sdp_backends",
    "sdp_getters",
    "sdp_priority",
    "sdp_setters",
    "set_fast_path",
    "set_module_dict",
    "set_sdp_priority",
    "share_dicts",
    "take_attributes",
    "torch_pytree",
    "unwrap_batched",
    "vmap_decrement_nesting",
    "write_back_attributes",
    "vmap_increment_nesting",
]

# ------------------------------------------------------------------ functorch primitives

FUNCTORCH = (
    "_add_batch_dim",
    "_remove_batch_dim",
    "_unwrap_batched",
    "_vmap_decrement_nesting",
    "_vmap_increment_nesting",
    "is_batchedtensor",
    "maybe_get_level",
    "peek_interpreter_stack",
    "pop_dynamic_layer_stack",
    "push_dynamic_layer_stack",
)
"""The names taken from ``torch._C._functorch`` (present from torch 2.0 to at least 2.15)."""

_functorch_c: types.ModuleType | None
try:
    import torch._C._functorch as _functorch_c
except ImportError:  # pragma: no cover - depends on the torch release
    _functorch_c = None


def _functorch(name: str) -> Any:
    return getattr(_functorch_c, name, None)


add_batch_dim = _functorch("_add_batch_dim")
remove_batch_dim = _functorch("_remove_batch_dim")
unwrap_batched = _functorch("_unwrap_batched")
vmap_increment_nesting = _functorch("_vmap_increment_nesting")
vmap_decrement_nesting = _functorch("_vmap_decrement_nesting")
is_batchedtensor = _functorch("is_batchedtensor")
maybe_get_level = _functorch("maybe_get_level")
peek_interpreter_stack = _functorch("peek_interpreter_stack")
pop_dynamic_layer_stack = _functorch("pop_dynamic_layer_stack")
push_dynamic_layer_stack = _functorch("push_dynamic_layer_stack")

# The operators under ``pack_padded_sequence`` and ``pad_packed_sequence``, as the function
# modes see them (``torch._VF`` forwards to them).
pack_padded_op: Any = getattr(torch._C._VariableFunctions, "_pack_padded_sequence", None)
pad_packed_op: Any = getattr(torch._C._VariableFunctions, "_pad_packed_sequence", None)

_PREPARED = [False]


def inside_transform() -> bool | None:
    """Whether a ``torch.func`` transform (vmap, grad, ...) is running now; ``None`` where
    this torch cannot tell (no ``peek_interpreter_stack``)."""
    if peek_interpreter_stack is None:
        return None
    return peek_interpreter_stack() is not None


def autocast_enabled() -> bool:
    """Whether autocast is on now, for CPU or CUDA."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


class AutocastState:
    """The autocast state in force now (CPU, and CUDA if ``cuda``), to be put back later."""

    __slots__ = ("cache", "states")

    def __init__(self, cuda: bool) -> None:
        types = ("cpu", "cuda") if cuda else ("cpu",)
        self.states = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types
        ]
        self.cache = torch.is_autocast_cache_enabled()

    def enter(self, stack: contextlib.ExitStack) -> None:
        for device_type, enabled, dtype in self.states:
            if enabled or torch.is_autocast_enabled(device_type):
                stack.enter_context(
                    torch.autocast(
                        device_type, enabled=enabled, dtype=dtype, cache_enabled=self.cache
                    )
                )

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            self.enter(stack)
            yield


def prepare_vmap() -> None:
    """Let ``torch.func.vmap`` register its batching decompositions (``nll_loss`` and others
    would otherwise take the slow per-example fallback): it does so on its first call, which
    the primitives above bypass. Once per process."""
    if not _PREPARED[0]:
        torch.func.vmap(torch.neg)(torch.zeros(1))
        _PREPARED[0] = True


# ------------------------------------------------------------------ pytree registry

try:  # torch's registry on optree: registered types (HuggingFace ModelOutput), fast
    import torch.utils._cxx_pytree as torch_pytree
except ImportError:  # pragma: no cover - depends on the torch and optree releases
    import torch.utils._pytree as torch_pytree  # type: ignore[no-redef]

# ------------------------------------------------------------------ attention kernel flags

sdp_backends: tuple[str, ...] = tuple(
    name
    for name in ("flash", "mem_efficient", "math", "cudnn", "overrideable")
    if hasattr(torch._C, f"_get_{name}_sdp_enabled") and hasattr(torch._C, f"_set_sdp_use_{name}")
)
"""The attention backends whose enabled flags torch keeps as global state (torch >= 2.5 has
at least the first four), read and written as ``torch.nn.attention.sdpa_kernel`` does."""
sdp_getters: tuple[Callable[[], bool], ...] = tuple(
    getattr(torch._C, f"_get_{name}_sdp_enabled") for name in sdp_backends
)
sdp_setters: tuple[Callable[[bool], None], ...] = tuple(
    getattr(torch._C, f"_set_sdp_use_{name}") for name in sdp_backends
)
sdp_priority: Callable[[], Any] | None = getattr(torch._C, "_get_sdp_priority_order", None)
set_sdp_priority: Callable[[Any], None] | None = getattr(torch._C, "_set_sdp_priority_order", None)

_mha = torch.backends.mha
# the flag itself (torch.backends.mha.get_fastpath_enabled also asks TorchScript each time)
get_fast_path: Callable[[], bool] = (
    (lambda: _mha._is_fastpath_enabled)
    if hasattr(_mha, "_is_fastpath_enabled")
    else _mha.get_fastpath_enabled
)
set_fast_path: Callable[[bool], None] = _mha.set_fastpath_enabled


@contextlib.contextmanager
def cudnn_disabled() -> Iterator[None]:
    """cuDNN off for the block (a process-wide flag), put back afterwards."""
    if not torch.backends.cudnn.enabled:
        yield
        return
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = True


def fused_rnn(mode: str, x: Tensor, packed: bool = False) -> bool:
    """Whether torch runs a recurrent layer of ``mode`` (``nn.RNNBase.mode``) on ``x`` (the
    steps of a packed sequence with ``packed``) on a fused kernel in first order: cuDNN on
    CUDA (when enabled), oneDNN's LSTM on CPU in float32 or bfloat16 (when enabled; not for
    packed sequences, which torch runs op by op on CPU). Elsewhere it runs op by op, one time
    step at a time."""
    if x.device.type == "cuda":
        return bool(torch.backends.cudnn.enabled) and torch.backends.cudnn.is_available()
    return (
        not packed
        and x.device.type == "cpu"
        and mode == "LSTM"
        and x.dtype in (torch.float32, torch.bfloat16)
        and bool(torch.backends.mkldnn.enabled)
        and torch.backends.mkldnn.is_available()
    )


# ------------------------------------------------------------------ nn.Module internals


def parameter_dict(module: nn.Module) -> dict[str, Any]:
    """The module's own ``_parameters`` dict (the object, not a copy)."""
    return module._parameters


def buffer_dict(module: nn.Module) -> dict[str, Any]:
    """The module's own ``_buffers`` dict (the object, not a copy)."""
    return module._buffers


def module_dict(module: nn.Module) -> dict[str, Any]:
    """The module's own ``_modules`` dict (the object, not a copy)."""
    return module._modules


def share_dicts(standin: nn.Module, original: nn.Module) -> None:
    """Give ``standin`` the very parameter, buffer and child dicts of ``original``, so that a
    name reaches the same tensors in both (a stand-in in a shadow tree)."""
    standin.__dict__["_parameters"] = original._parameters
    standin.__dict__["_buffers"] = original._buffers
    standin.__dict__["_modules"] = original._modules


def set_module_dict(module: nn.Module, children: dict[str, Any]) -> None:
    """Give ``module`` (a shallow copy) a child dict of its own."""
    module.__dict__["_modules"] = children


def take_attributes(twin: nn.Module, original: nn.Module) -> None:
    """Give the shallow copy ``twin`` every attribute of ``original`` but its child dict."""
    children = twin._modules
    twin.__dict__.update(original.__dict__)
    twin.__dict__["_modules"] = children


def write_back_attributes(twin: nn.Module, original: nn.Module) -> None:
    """Set on ``original`` the attributes the shallow copy ``twin`` holds that ``original``
    lacks or holds another object for (its child dict aside), tensors excepted: a tensor a
    task-batched run keeps on a module is batched, and must not reach the user's module."""
    mine = original.__dict__
    mine.update(
        {
            k: v
            for k, v in twin.__dict__.items()
            if k != "_modules" and (k not in mine or mine[k] is not v) and not isinstance(v, Tensor)
        }
    )


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _HOOKS)


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs forward or backward hooks, its own or global ones.
    Written out, not looped: it runs for every stand-in layer on every call."""
    hooks = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


@functools.cache
def _graph_pass_base() -> type | None:
    try:  # inductor is imported only when a compiled step is built
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # a torch without custom graph passes
        return None
    return CustomGraphPass


def inductor_graph_pass(fn: Callable[[Any], object], key: str) -> Any | None:
    """``fn`` (a rewrite of a post-grad FX graph, in place) as an inductor
    ``post_grad_custom_post_pass``, with ``key`` for inductor's compile cache (the hash of
    the pass's code); ``None`` where this torch has no custom graph passes (the graph is
    then compiled without it). An optional access: it is not in :data:`ACCESSES`."""
    base = _graph_pass_base()
    if base is None:
        return None

    class _Pass(base):  # type: ignore[misc, valid-type]
        def __call__(self, graph: Any) -> None:
            fn(graph)

        def uuid(self) -> str:
            return key

    return _Pass()


@functools.cache
def _max_pool_backward_lowering() -> tuple[Any, list[dict[Any, Any]], Any, Any] | None:
    """``(op, decomposition tables, inductor's lowerings, aten's fallback)`` for 2-d max
    pooling's backward, resolved once; ``None`` where this torch lacks one of them."""
    try:  # inductor is imported only when a compiled step is built
        from torch._inductor import decomposition, lowering

        op = torch.ops.aten.max_pool2d_with_indices_backward.default
        # the table inductor decomposes with (select_decomp_table: a cached dict) and its source
        tables = [decomposition.decompositions, decomposition.select_decomp_table()]
        fallback = lowering.fallback_max_pool2d_with_indices_backward
    except (ImportError, AttributeError):
        return None
    if op not in lowering.lowerings:
        return None
    unique = list({id(t): t for t in tables}.values())
    return op, unique, lowering.lowerings, fallback


@contextlib.contextmanager
def inductor_aten_max_pool_backward() -> Iterator[bool]:
    """While inside, inductor compiles 2-d max pooling's backward
    (``aten.max_pool2d_with_indices_backward``) as a call of aten's kernel, which scatters
    each gradient to the index the forward kept, instead of decomposing it into a generated
    scatter that recomputes every window's maximum (``docs/decisions/inductor-on-cpu.md``).
    Yields whether it could: ``False`` where this torch lacks one of the names (the graph then
    compiles as inductor would). Process-wide while inside: a compile in another thread
    meanwhile sees it too. An optional access: it is not in :data:`ACCESSES`."""
    names = _max_pool_backward_lowering()
    if names is None:
        yield False
        return
    op, tables, lowerings, fallback = names
    removed = [(t, t.pop(op)) for t in tables if op in t]
    lowered = lowerings[op]
    lowerings[op] = fallback
    try:
        yield True
    finally:
        lowerings[op] = lowered
        for table, decomposed in removed:
            table[op] = decomposed


def with_own_code_object(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called from a function whose code object is new. torch.compile keeps its
    compiled graphs, and counts them against its recompile limit (8), per code object; every
    compiled step's ``torch.func.grad_and_value`` is the same ``functorch`` function, so
    without this the ninth model compiled in a process would stop compiling
    (``docs/decisions/compiled-meta-step.md``)."""

    def graph(*args: Any) -> Any:
        return fn(*args)

    code = graph.__code__.replace()  # equal, but a new object: a cache of its own
    return types.FunctionType(code, graph.__globals__, "graph", None, graph.__closure__)


def saved_tensor_hooks_state() -> str | None:
    """Whether saved-tensor hooks are allowed now: ``None`` when they are, else the message
    torch raises for them. ``torch.func``'s gradient transforms turn them off while they
    run; a compile that fails inside one (inductor tracing ``torch.func.grad``) can leave
    them off for the rest of the process, so that every later ``torch.utils.checkpoint``
    call fails (``docs/decisions/compiled-meta-step.md``)."""
    autograd: Any = torch._C._autograd
    if autograd._saved_tensors_hooks_is_enabled():
        return None
    return str(autograd._saved_tensors_hooks_get_disabled_error_message())


def set_saved_tensor_hooks_state(state: str | None) -> None:
    """Put back what :func:`saved_tensor_hooks_state` returned."""
    autograd: Any = torch._C._autograd
    if state is None:
        autograd._saved_tensors_hooks_enable()
    else:
        autograd._saved_tensors_hooks_disable(state)


def compiling() -> bool:
    """Whether torch.compile is tracing this call (Python-side caches keyed by optree specs
    step aside then: the compiler cannot hash them)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def reparametrized(module: nn.Module, values: dict[str, Tensor]) -> Any:
    """A context in which ``module``'s parameters of those names are ``values``: what
    ``torch.func.functional_call`` does, as a context around other code (torch.compile
    traces it)."""
    from torch.nn.utils import stateless

    return stateless._reparametrize_module(module, values)


def qkv_same_embed_dim(module: nn.MultiheadAttention) -> bool:
    """Whether ``nn.MultiheadAttention`` keeps one packed input projection (query, key and
    value of one size): its private flag."""
    return bool(module._qkv_same_embed_dim)


# ------------------------------------------------------------------ Python frames


def caller_frame(depth: int = 1) -> types.FrameType | None:
    """The frame ``depth`` calls above the caller of this function."""
    return sys._getframe(depth + 1)


def frame_local(frame: types.FrameType | None, name: str, default: Any = None) -> Any:
    """The local variable ``name`` of ``frame`` (``default`` if it has none)."""
    return default if frame is None else frame.f_locals.get(name, default)


def frame_executes(frame: types.FrameType | None, function: Callable[..., Any]) -> bool:
    """Whether ``frame`` runs ``function``'s code."""
    code = getattr(function, "__code__", None)
    return frame is not None and code is not None and frame.f_code is code


def conv_forward(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A convolution's forward with the given weight and bias (its padding mode included)."""
    forward = cast(Callable[[Tensor, Tensor, Tensor | None], Tensor], module._conv_forward)
    return forward(x, weight, bias)


def conv_padding(module: nn.Module) -> Any:
    """The ``F.pad`` padding of a convolution with a non-zero padding mode."""
    return module._reversed_padding_repeated_twice


# ------------------------------------------------------------------ torch.utils.checkpoint

# The function whose code runs for torch.utils.checkpoint.checkpoint (under the decorators
# torch puts on it), and that code.
_CHECKPOINT: Any = inspect.unwrap(torch.utils.checkpoint.checkpoint)
_CHECKPOINT_CODE: types.CodeType = _CHECKPOINT.__code__


def _copy_function(fn: Any) -> Any:
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = dict(fn.__kwdefaults__ or {})
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return copy


original_checkpoint: Callable[..., Any] = _copy_function(_CHECKPOINT)
"""torch's ``checkpoint``, never redirected (a copy of the function with its own code)."""

_DISPATCH: list[Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None] = [
    None
]
_REDIRECT_LOCK = threading.Lock()
_REDIRECT_DEPTH = [0]


def set_checkpoint_dispatch(
    dispatch: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
) -> None:
    """Where redirected ``checkpoint(function, *args, **kwargs)`` calls go:
    ``dispatch(function, args, kwargs)``."""
    _DISPATCH[0] = dispatch


def dispatch_checkpoint(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A redirected call: to the dispatcher, or torch's own code if none is set."""
    dispatch = _DISPATCH[0]
    if dispatch is None:
        return original_checkpoint(function, *args, **kwargs)
    return dispatch(function, args, kwargs)


def _trampoline(function: Any, *args: Any, **kwargs: Any) -> Any:
    # runs as torch.utils.checkpoint.checkpoint's code, with that module's globals
    from funcmeta._src.core.fence import dispatch_checkpoint

    return dispatch_checkpoint(function, args, kwargs)


@contextlib.contextmanager
def checkpoint_redirected() -> Iterator[None]:
    """Send every call of ``torch.utils.checkpoint.checkpoint`` to the dispatcher for the
    block (nested and concurrent blocks share one redirection; torch's code is back when
    the last ends, also on error)."""
    with _REDIRECT_LOCK:
        if _REDIRECT_DEPTH[0] == 0:
            _CHECKPOINT.__code__ = _trampoline.__code__
        _REDIRECT_DEPTH[0] += 1
    try:
        yield
    finally:
        with _REDIRECT_LOCK:
            _REDIRECT_DEPTH[0] -= 1
            if _REDIRECT_DEPTH[0] == 0:
                _CHECKPOINT.__code__ = _CHECKPOINT_CODE


def _redirects_checkpoint() -> bool:
    """Whether a redirection reaches every way of calling ``checkpoint``: the public name,
    the function bound elsewhere before (``from torch.utils.checkpoint import checkpoint``),
    and ``checkpoint_sequential``."""
    if _CHECKPOINT.__closure__ or "function" not in inspect.signature(_CHECKPOINT).parameters:
        return False
    seen: list[Any] = []
    saved = _DISPATCH[0]

    def record(f: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        seen.append(f)
        return f(*a)

    set_checkpoint_dispatch(record)
    bound = torch.utils.checkpoint.checkpoint
    try:
        with checkpoint_redirected():
            x = torch.ones(2)
            bound(torch.neg, x, use_reentrant=False)
            torch.utils.checkpoint.checkpoint_sequential(
                [nn.Identity(), nn.Identity()], 2, x, use_reentrant=False
            )
    finally:
        _DISPATCH[0] = saved
    return len(seen) == 2 and _CHECKPOINT.__code__ is _CHECKPOINT_CODE


# ------------------------------------------------------------------ vmap's refusals

_VMAP_REFUSALS = ("vmap:", "vmap support", "batching rule", "data-dependent control flow")


def is_vmap_refusal(error: BaseException) -> bool:
    """Whether ``error`` is ``vmap`` saying it cannot batch something (data-dependent control
    flow, an operator without a batching rule). torch has no exception type for it; the
    texts are checked against real refusals on every torch the suite runs on."""
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in message for t in _VMAP_REFUSALS)


# ------------------------------------------------------------------ the registry


def _has_module_internals() -> bool:
    m = nn.Conv1d(1, 1, 1, padding=1, padding_mode="reflect")
    dicts = (m._parameters, m._buffers, m._modules)
    return (
        all(isinstance(d, dict) for d in dicts)
        and all(hasattr(m, name) for name in _HOOKS)
        and all(hasattr(nn.modules.module, name) for name in _GLOBAL_HOOKS)
        and callable(getattr(m, "_conv_forward", None))
        and hasattr(m, "_reversed_padding_repeated_twice")
    )


def _functorch_probe(name: str) -> Callable[[], bool]:
    """Whether ``torch._C._functorch`` has ``name``, as a probe for :data:`ACCESSES`."""
    return lambda: _functorch(name) is not None


ACCESSES: dict[str, Callable[[], bool]] = {
    **{f"torch._C._functorch.{n}": _functorch_probe(n) for n in FUNCTORCH},
    "torch.utils._cxx_pytree or torch.utils._pytree": lambda: hasattr(torch_pytree, "tree_flatten"),
    "torch._C._get/_set_{flash,mem_efficient,math,cudnn}_sdp_*": lambda: (
        {
            "flash",
            "mem_efficient",
            "math",
            "cudnn",
        }
        <= set(sdp_backends)
    ),
    "torch.backends.mha fast-path flag": lambda: (
        callable(get_fast_path) and isinstance(get_fast_path(), bool)
    ),
    "torch._C._VariableFunctions._pack_padded_sequence / _pad_packed_sequence": lambda: (
        callable(pack_padded_op) and callable(pad_packed_op)
    ),
    "torch.utils.checkpoint.checkpoint's code (redirected while funcmeta runs a model)": (
        _redirects_checkpoint
    ),
    "torch._C._autograd._saved_tensors_hooks_{is_enabled,enable,disable,...}": lambda: all(
        hasattr(torch._C._autograd, f"_saved_tensors_hooks_{n}")
        for n in ("is_enabled", "enable", "disable", "get_disabled_error_message")
    ),
    "nn.Module _parameters/_buffers/_modules, hook dicts, Conv _conv_forward": (
        _has_module_internals
    ),
}
"""Every private access, by name, with a probe: ``True`` when this torch has it."""


def missing_functorch() -> list[str]:
    """The names of :data:`FUNCTORCH` that this torch's ``torch._C._functorch`` lacks."""
    return [name for name in FUNCTORCH if _functorch(name) is None]


def missing_accesses() -> list[str]:
    """The names of :data:`ACCESSES` that this torch release lacks."""
    return [name for name, probe in ACCESSES.items() if not probe()]


# ------------------------------------------------------------------ CUDA graphs' skips

# inductor's loggers for "skipping cudagraphs due to ..." (the cudagraphs artifact from torch
# 2.6 or so, perf_hints before), and the counter it bumps with each skip
_CUDAGRAPH_LOGS = (
    "torch._inductor.cudagraph_utils.__cudagraphs",
    "torch._inductor.cudagraph_utils.__perf_hints",
)
UNNAMED_CUDAGRAPH_SKIP = (
    "skipping cudagraphs (inductor counted a skip but logged no reason here; "
    "TORCH_LOGS=cudagraphs prints it)"
)


@functools.cache
def _inductor_counters() -> Any | None:
    """``torch._dynamo.utils.counters`` (a dict of ``Counter`` by subsystem), or ``None``."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo's counters
        return None
    return counters


@functools.cache
def _skip_log() -> Any:
    """A logging handler on inductor's skip loggers that keeps the last messages about
    skipped CUDA graphs, and how many it has seen; attached once, on first use, and left
    attached (one handler for the process: adding and removing one per call would cost
    more than the check)."""
    import logging

    class SkipLog(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.seen = 0
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "cudagraph" in text and ("skipping" in text or "disabling" in text):
                self.seen += 1
                self.messages = [*self.messages[-63:], text]

    handler = SkipLog()
    for name in _CUDAGRAPH_LOGS:
        logging.getLogger(name).addHandler(handler)
    return handler


@contextlib.contextmanager
def cudagraph_skips() -> Iterator[list[str]]:
    """While inside, collects why inductor declined to capture or replay a CUDA graph (it
    logs "skipping cudagraphs due to ..." as a warning and runs the graph's kernels without
    one; ``counters["inductor"]["cudagraph_skips"]`` counts them): yields a list, filled
    when the block ends with each logged reason, and :data:`UNNAMED_CUDAGRAPH_SKIP` where
    the counter grew without a reason reaching the log (a user who silenced inductor's
    warnings). Empty where nothing was skipped, or where this torch has neither name.
    Process-wide: a skip in another thread meanwhile is collected too."""
    found: list[str] = []
    counters = _inductor_counters()
    log = _skip_log()
    before = counters["inductor"]["cudagraph_skips"] if counters is not None else 0
    seen = log.seen
    try:
        yield found
    finally:
        logged = min(log.seen - seen, len(log.messages))
        if logged:
            found.extend(log.messages[-logged:])
        counted = counters["inductor"]["cudagraph_skips"] - before if counters is not None else 0
        if counted > logged:
            found.append(UNNAMED_CUDAGRAPH_SKIP)


def _watches_cudagraph_skips() -> bool:
    """Whether this torch has what :func:`cudagraph_skips` reads: dynamo's counters and
    inductor's skip logger (``log_cudagraph_skip_and_bump_counter`` and its logger)."""
    import logging

    if _inductor_counters() is None:
        return False
    try:
        from torch._inductor import cudagraph_utils
    except ImportError:
        return False
    logs = [getattr(cudagraph_utils, n, None) for n in ("cudagraphs_log", "perf_hint_log")]
    return callable(getattr(cudagraph_utils, "log_cudagraph_skip_and_bump_counter", None)) and any(
        isinstance(log, logging.Logger) and log.name in _CUDAGRAPH_LOGS for log in logs
    )


ACCESSES["torch._dynamo.utils.counters['inductor']['cudagraph_skips'], inductor's skip log"] = (
    _watches_cudagraph_skips
)


def traceback_modules(error: BaseException) -> list[nn.Module]:
    """The modules whose methods are on ``error``'s traceback (each frame's ``self``),
    outermost first: where in a model a forward failed."""
    found: list[nn.Module] = []
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and (not found or found[-1] is not owner):
            found.append(owner)
        tb = tb.tb_next
    return found


_PACKAGE = str(Path(__file__).resolve().parents[2]) + "/"


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn``, called right where this is called, that
    points at the first frame outside funcmeta: the user's call, however deep the warning
    is raised."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
