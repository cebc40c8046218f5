"""torch's rematerialization of a traced forward-loss-backward graph
(``torch._functorch._activation_checkpointing``), extended to a meta-step's inner gradients.

In a graph that traces ``torch.autograd.grad`` (dynamo's ``trace_autograd_ops``), torch
recomputes the operations of activation checkpoint regions (``torch.utils.checkpoint``) for the
one region marked as the backward (``torch.fx.traceback.annotate({"phase": "backward"})``):
the meta-step's outer gradient. An inner step's gradient is, to that pass, a forward
operation: what it reads stays in memory until the outer gradient, so a checkpointed model
compiled keeps nearly all the memory its checkpoints were to save. While
:func:`recompute_inner_gradients` is active, the pass first tags each inner step's operations
(those traced inside :func:`inner_step_region`) for recomputation too:

- ``"layers"``: the inner gradient's operations that read a checkpointed operation's result,
  or another so tagged (the gradients of the checkpointed layers, recomputed in the outer
  gradient from the layers' recomputed forwards);
- ``"steps"``: every operation of the step (its forward and its gradient), each step its own
  region: only the parameters between the steps are kept (``checkpoint_steps``).

Recomputation changes no value: the same operations run on the same inputs.

Example:
    >>> from funcmeta._src.core.fence.remat import inner_step_region, recompute_inner_gradients
    >>> with recompute_inner_gradients("layers"), inner_step_region(0):
    ...     pass
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "INNER_STEP_KEY",
    "RematMode",
    "can_recompute_inner_gradients",
    "inner_step_region",
    "recompute_inner_gradients",
    "remat_cache_tag",
    "tag_inner_steps",
]

#: The key of the annotation (``node.meta["custom"]``) that marks an inner step's operations.
INNER_STEP_KEY = "funcmeta_inner_step"

RematMode = Literal["layers", "steps"]

_PASS_MODULE = (
    "torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass"
)
_PASS_NAME = "remat_using_tags_for_fwd_loss_bwd_graph"
_lock = threading.Lock()
# this file's tagging, as a part of torch's compile cache keys (a change to it is a new key)
_SOURCE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
# the steps' region numbers (``ac_graph_id``), above any of torch's checkpoint regions
_STEP_REGIONS = 1 << 20


def _pass_module() -> Any | None:
    try:
        module = importlib.import_module(_PASS_MODULE)
    except ImportError:
        return None
    return module if callable(getattr(module, _PASS_NAME, None)) else None


def can_recompute_inner_gradients() -> bool:
    """Whether this torch has the rematerialization pass :func:`recompute_inner_gradients`
    extends, and the annotations it reads."""
    return _pass_module() is not None and callable(getattr(torch.fx.traceback, "annotate", None))


def inner_step_region(step: int) -> contextlib.AbstractContextManager[Any]:
    """A block whose traced operations are inner step ``step``'s (an annotation of the graph's
    nodes). A plain block where this torch lacks ``torch.fx.traceback.annotate``."""
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if annotate is None:
        return contextlib.nullcontext()
    return annotate({INNER_STEP_KEY: step})


def _policies() -> tuple[Any, Callable[[Any], bool]]:
    from torch._functorch.partitioners import must_recompute
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE, must_recompute


def tag_inner_steps(graph: torch.fx.Graph, mode: RematMode) -> int:
    """Tag the inner steps' operations of ``graph`` for recomputation (``mode``: see the
    module docstring), in place; the number tagged. Operations outside every inner step (the
    parameter updates, the outer gradient) are left as they are. Under ``"steps"`` a step is
    one region (``ac_graph_id``): what one step passes to the next outside the parameters
    (a buffer, say) is kept, as between torch's checkpoint regions, and the checkpointed
    layers inside a step are recomputed with it."""
    must, must_recompute = _policies()
    tagged: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        custom = node.meta.get("custom") or {}
        step = custom.get(INNER_STEP_KEY)
        if step is None or custom.get("phase") == "backward":
            continue
        if mode == "steps":
            node.meta["ac_graph_id"] = _STEP_REGIONS + step
        elif must_recompute(node) or not (
            node.meta.get("autograd_backward", False)
            and any(must_recompute(i) or i in tagged for i in node.all_input_nodes)
        ):
            continue
        node.meta["recompute"] = must
        tagged.add(node)
    return len(tagged)


@contextlib.contextmanager
def recompute_inner_gradients(mode: RematMode) -> Iterator[None]:
    """While inside, torch's rematerialization of a traced forward-loss-backward graph first
    tags the inner steps' operations (:func:`tag_inner_steps` with ``mode``). Outside, the pass
    is torch's own. A plain block where this torch lacks the pass."""
    module = _pass_module()
    if module is None:
        yield
        return
    original = getattr(module, _PASS_NAME)

    def remat(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        tag_inner_steps(gm.graph, mode)
        return original(gm)

    with _lock, _keyed(mode):
        setattr(module, _PASS_NAME, remat)
        try:
            yield
        finally:
            setattr(module, _PASS_NAME, original)


def remat_cache_tag(mode: RematMode) -> str:
    """What :func:`recompute_inner_gradients` adds to torch's compile cache key tag: the mode
    and this tagging's version. torch's AOTAutograd cache keys a graph by its code, which the
    step annotations do not change, so without it a step compiled with ``checkpoint_steps``
    loaded the partition of the same model's step compiled without (the same values, the
    other mode's memory), and the other way round."""
    return f"funcmeta-remat:{mode}:{_SOURCE}"


@contextlib.contextmanager
def _keyed(mode: RematMode) -> Iterator[None]:
    """torch's compile cache key tag with :func:`remat_cache_tag` added (after any tag of the
    user's); where this torch has no tag, its AOTAutograd cache off instead (inductor's own
    cache keys the partitioned graphs, which differ). Set and put back as an attribute
    (cheaper than ``config.patch``), under :func:`recompute_inner_gradients`' lock."""
    config = getattr(torch.compiler, "config", None)
    if config is not None and hasattr(config, "cache_key_tag"):
        user = config.cache_key_tag
        config.cache_key_tag = f"{user}|{remat_cache_tag(mode)}" if user else remat_cache_tag(mode)
        try:
            yield
        finally:
            config.cache_key_tag = user
        return
    functorch = importlib.import_module("torch._functorch.config")
    if hasattr(functorch, "enable_autograd_cache"):
        with functorch.patch(enable_autograd_cache=False):
            yield
        return
    yield
