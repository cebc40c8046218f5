"""torch.compile's internals (dynamo and inductor): a custom post-grad graph pass, max
pooling's backward lowered to aten's kernel, a code object of a step's own (dynamo counts
recompiles per code object), whether a trace is running, why inductor skipped a CUDA
graph, and inductor's probe of the CPU's vector instructions started early."""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from funcmeta._src.core.fence.registry import ACCESSES

__all__ = [
    "UNNAMED_CUDAGRAPH_SKIP",
    "autograd_tracing",
    "backward_region",
    "can_mark_backward",
    "compiling",
    "cudagraph_skips",
    "inductor_aten_max_pool_backward",
    "inductor_graph_pass",
    "inductor_has_option",
    "inductor_mode_options",
    "probe_cpu_vector_isa",
    "with_own_code_object",
]

# the thread of probe_cpu_vector_isa, once per process
_PROBE: list[threading.Thread] = []
_PROBE_LOCK = threading.Lock()


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


def inductor_mode_options(mode: str | None) -> dict[str, Any] | None:
    """The inductor options ``torch.compile(mode=mode, dynamic=False)`` applies, as a dict
    (``{}`` for ``None`` and ``"default"``), so that options can be added to a mode
    (``torch.compile`` takes a mode or options, not both); ``None`` where this torch cannot
    say (the mode is unknown to it, or it lacks ``list_mode_options``). An optional access:
    it is not in :data:`ACCESSES`."""
    if mode is None or mode == "default":
        return {}
    try:  # torch.compile applies exactly this table for a mode (``apply_mode``)
        from torch._inductor import list_mode_options

        return dict(list_mode_options(mode, False))
    except Exception:  # an unknown mode raises; an older torch may lack the name
        return None


@functools.cache
def inductor_has_option(name: str) -> bool:
    """Whether this torch's inductor has the config option ``name`` (dotted for a nested one,
    ``"cpp.threads"``): ``torch.compile`` refuses an options dict with an unknown key. An
    optional access: it is not in :data:`ACCESSES`."""
    try:  # inductor is imported only when a compiled step is built
        from torch._inductor import config
    except ImportError:
        return False
    found: Any = config
    for part in name.split("."):
        if not hasattr(found, part):
            return False
        found = getattr(found, part)
    return True


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


def autograd_tracing() -> contextlib.AbstractContextManager[Any] | None:
    """A block in which dynamo traces ``torch.autograd.grad`` into the graph (its
    ``trace_autograd_ops``, off by default), or ``None`` where this torch's dynamo lacks the
    switch. An optional access: it is not in :data:`ACCESSES`."""
    import torch._dynamo.config as dynamo_config  # imported only when a compiled step is built

    if not hasattr(dynamo_config, "trace_autograd_ops"):
        return None
    return dynamo_config.patch(trace_autograd_ops=True)


def backward_region() -> contextlib.AbstractContextManager[Any]:
    """A block whose operations a traced graph marks as its backward region
    (``torch.fx.traceback.annotate({"phase": "backward"})``): where torch's activation
    checkpointing recomputes checkpointed regions of a forward-loss-backward graph. A plain
    block where this torch lacks the annotation (see :func:`can_mark_backward`)."""
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if annotate is None:
        return contextlib.nullcontext()
    return annotate({"phase": "backward"})


def can_mark_backward() -> bool:
    """Whether this torch has ``torch.fx.traceback.annotate`` (:func:`backward_region`)."""
    return callable(getattr(torch.fx.traceback, "annotate", None))


def compiling() -> bool:
    """Whether torch.compile is tracing this call (Python-side caches keyed by optree specs
    step aside then: the compiler cannot hash them)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


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


def probe_cpu_vector_isa() -> threading.Thread | None:
    """Start inductor's probe of the CPU's vector instruction sets in a thread of its own,
    once per process, and return it (``None`` where this torch has no such probe).

    Inductor picks the instruction set for its CPU kernels the first time it generates one:
    it builds a small library for each set it knows and loads each in a child process. On a
    new cache directory (``TORCHINDUCTOR_CACHE_DIR``) that takes a C++ build per set; with
    the libraries kept, a child process per set. Started before
    a compile, the builds run in child processes beside dynamo's trace and AOTAutograd
    instead of after them. The result is inductor's own, kept where it keeps it
    (``functools.cache``; the builds behind per-set file locks): a compile that asks before
    the thread is done waits on the same lock and builds nothing twice. An optional access:
    it is not in :data:`ACCESSES`.

    Example:
        >>> from funcmeta._src.core.fence.inductor import probe_cpu_vector_isa
        >>> probe = probe_cpu_vector_isa()
        >>> probe is probe_cpu_vector_isa()  # once per process
        True
    """
    with _PROBE_LOCK:
        if _PROBE:
            return _PROBE[0]
        # what the probe imports (its builder imports torch's C++ extension tools and
        # setuptools), imported here, not in the thread, where dynamo imports beside it
        try:
            import torch.utils.cpp_extension  # noqa: F401
            from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401
        except ImportError:  # pragma: no cover - a torch without inductor's CPU backend
            return None
        pick = getattr(cpu_vec_isa, "pick_vec_isa", None)
        if pick is None:  # pragma: no cover - a torch that names it otherwise
            return None

        def run() -> None:
            with contextlib.suppress(Exception):  # the compile asks again, reports its error
                pick()

        thread = threading.Thread(target=run, name="inductor-cpu-isa-probe", daemon=True)
        _PROBE.append(thread)
        thread.start()
        return thread
