"""Why :func:`funcmeta.compile_meta_step` runs a meta-iteration eagerly, and what to change:
:func:`explain` turns the error torch.compile raised into one line that names the cause in
the model's terms and the fix (:attr:`funcmeta.MetaStep.eager_reason`).

torch's own errors here say where tracing stopped inside torch (``TorchRuntimeError:
RuntimeError when making fake tensor call``), not what in the model did it; each rule reads
the whole chain of errors for the words of one known cause.

Example:
    >>> from funcmeta._src.compiled.eager_reasons import explain
    >>> explain(RuntimeError("Attempted to wrap RNN, GRU, or LSTM"))[:44]
    'the model has an nn.RNN, nn.LSTM or nn.GRU: '
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from funcmeta._src.core.capabilities import torch_release
from funcmeta._src.core.fence import (
    autograd_tracing,
    can_mark_backward,
    can_recompute_inner_gradients,
)
from funcmeta._src.inner.options import AdaptOptions

__all__ = [
    "COMPILE_FALSE",
    "RULES",
    "UNTRACED",
    "Rule",
    "checkpointed_layers",
    "explain",
    "first_line",
    "untraced",
]

COMPILE_FALSE = "compile=False was given: pass compile=True (the default) to compile the step"

#: The inner-loop options a compiled graph cannot hold, and why: each needs a decision
#: on the host per step, or autograd machinery that torch.compile does not trace.
UNTRACED: dict[str, str] = {
    "loss_scale": "checks every step for an overflow on the host and stops the loop there",
    "on_nonfinite": "checks every step's numbers on the host",
    "checkpoint_steps": "recomputes each step in the backward (torch.utils.checkpoint), "
    "which torch.compile does not trace inside torch.func (the autograd graph, on torch "
    "2.13 and newer, recomputes the steps itself)",
    "offload_activations": "moves what autograd saves through saved-tensor hooks, which "
    "torch.compile does not trace inside torch.func",
}

#: The plain path every reason offers, with the same meta-gradients.
_PLAIN = "fm.adapt_tasks (the same meta-gradients; the step runs it now)"


class Rule(NamedTuple):
    """A known cause: any of ``words`` in the errors' text (lower case) names it; ``says``
    is the cause and the change, in the model's terms; the model's layers of the classes
    ``layers`` are the ones that stop the graph, named in the reason. Any of ``with_layers``
    names it too where the model has such a layer: a graph break that torch delays to a
    later operation, whose text names no layer."""

    name: str
    words: tuple[str, ...]
    says: str
    layers: tuple[type[nn.Module], ...] = ()
    with_layers: tuple[str, ...] = ()


RULES: list[Rule] = [
    Rule(
        "random numbers recomputed",
        ("rng ops in recompute regions",),
        "a checkpointed layer or step draws random numbers (dropout in training mode): torch "
        "cannot recompute random operations in a compiled graph; keep dropout out of the "
        "checkpointed layers (or in eval mode), leave checkpoint_steps out, or use "
        f"{_PLAIN}",
        (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout),
    ),
    Rule(
        "recurrent",
        ("wrap rnn, gru, or lstm",),
        "the model has an nn.RNN, nn.LSTM or nn.GRU: torch.compile does not trace those "
        f"layers inside torch.func transforms; use {_PLAIN}, which batches them itself",
        (nn.RNNBase,),
        # torch 2.15 delays the refusal of an RNN to the next use of the layer (dynamo's
        # DelayGraphBreakVariable), whose error names no RNN
        ("delaygraphbreakvariable",),
    ),
    Rule(
        "own checkpoints",
        ("saved tensor hooks", "tag_activation_checkpoint"),
        "the model calls torch.utils.checkpoint in its forward (its own activation "
        "checkpointing), which torch.func cannot compile; turn it off for the compiled step "
        "(e.g. model.gradient_checkpointing_disable()), or use "
        f"{_PLAIN}, which runs those checkpoints",
    ),
    Rule(
        "value read in Python",
        ("call_method item", ".item()", "data-dependent", "data dependent", "generic_jump"),
        "the model's forward reads a tensor's value in Python (.item(), bool(t), `if t:`), "
        "which one graph cannot hold; compute it with tensor ops (torch.where) or use "
        f"{_PLAIN}",
    ),
    Rule(
        "no double backward",
        ("_autograd_grad", "derivative for", "double backward", "twice differentiable"),
        "an operator of the model (a fused attention or RNN kernel, most often) has no second "
        "derivative inside the compiled graph; pass first_order=True, or use "
        f"{_PLAIN}, which runs second order on kernels that have one",
        (nn.MultiheadAttention, nn.RNNBase),
    ),
    Rule(
        "no vmap rule",
        ("vmap", "batching rule"),
        "an operator of the model has no vmap rule inside a compiled graph; use "
        f"{_PLAIN}, which runs such layers once per task",
    ),
    Rule(
        "too many kinds of input",
        ("recompile_limit", "cache_size_limit", "recompile limit"),
        "this step met more kinds of input (shapes, dtypes) than torch.compile keeps graphs "
        "for; keep the tasks, shots and queries the same from call to call",
    ),
]


AUTOGRAD_GRAPH_TORCH = (2, 13)
"""The first torch release on which the compiled step traces ``torch.autograd.grad`` (the
autograd graph): the one its tests ran on (``docs/decisions/compiled-autograd-step.md``)."""


def autograd_untraceable() -> str | None:
    """``None`` where :func:`funcmeta.compile_meta_step` compiles the eager step's own
    computation (``torch.autograd.grad`` in the graph), else why it compiles the
    ``torch.func`` graph instead."""
    if torch_release() < AUTOGRAD_GRAPH_TORCH:
        return (
            f"torch {torch.__version__}: the graph of torch.autograd.grad (dynamo's "
            "trace_autograd_ops) is tested from torch "
            f"{'.'.join(map(str, AUTOGRAD_GRAPH_TORCH))} on"
        )
    if autograd_tracing() is None:
        return f"torch {torch.__version__}'s dynamo has no trace_autograd_ops"
    if not can_mark_backward():
        return f"torch {torch.__version__} has no torch.fx.traceback.annotate"
    return None


def checkpointed_layers(names: list[str], graph_reason: str | None = None) -> str:
    """Why a model built with ``checkpoint_layers=`` keeps :func:`funcmeta.compile_meta_step`
    eager where the step compiles the ``torch.func`` graph (``graph_reason`` says why it
    does): that graph runs the module itself through ``torch.func.functional_call``
    (``funcmeta._src.runtime.traced.TracedRuntime.run``), not the checkpointed runner, whose
    layers are the checkpoint engine's autograd Functions."""
    why = "" if graph_reason is None else f" (the torch.func graph: {graph_reason})"
    return (
        f"checkpoint_layers={names} is not compiled{why}: the traced step runs the module itself "
        "through torch.func.functional_call, without funcmeta's checkpointed layers (autograd "
        "Functions that keep each layer's inputs and recompute it), so a graph would hold "
        "every activation, and torch.compile traces no checkpoint inside torch.func.grad "
        "(torch.utils.checkpoint there raises that torch.func does not support saved tensor "
        "hooks; an autograd.Function with setup_context is a graph break); the step runs "
        "fm.adapt_tasks on the checkpointed layers instead (their memory, the same "
        "meta-gradients); build the model without checkpoint_layers to compile"
    )


def checkpointed_layers_keep_memory(names: list[str]) -> str:
    """Why a model built with ``checkpoint_layers=`` runs eagerly unless the autograd graph is
    asked for by name, where this torch lacks the rematerialization pass that funcmeta
    extends to the inner gradients (:func:`funcmeta._src.core.fence.recompute_inner_gradients`):
    compiled, it would hold more memory than the eager checkpointed step
    (``docs/decisions/compiled-autograd-step.md``)."""
    return (
        f"checkpoint_layers={names} run eagerly (fm.adapt_tasks on the checkpointed layers: "
        "their memory, the same meta-gradients): this torch lacks the rematerialization pass "
        "(torch._functorch._activation_checkpointing) through which the compiled step "
        "recomputes the layers' inner gradients, so compiled, the inner gradients would keep "
        "the activations they read, more memory than the eager checkpointed step; pass "
        "graph='autograd' to compile it anyway (the same meta-gradients)"
    )


def untraced(options: AdaptOptions, graph: str = "torch.func") -> str | None:
    """Why the inner-loop ``options`` given to :func:`funcmeta.compile_meta_step` keep its
    meta-iteration eager on ``graph`` (``"torch.func"`` or ``"autograd"``), naming the first
    of them that does (:data:`UNTRACED`), else ``None``; an option at its default value
    compiles, and ``checkpoint_steps`` compiles on the autograd graph, which recomputes the
    steps itself, where this torch has the pass it takes."""
    for name, why in UNTRACED.items():
        value = getattr(options, name)
        if name == "checkpoint_steps" and graph == "autograd" and can_recompute_inner_gradients():
            continue
        if value not in (None, False):
            return (
                f"{name}={value!r} is not compiled: it {why}; use {_PLAIN}, or leave "
                f"{name} out to compile"
            )
    return None


def _text(error: BaseException) -> str:
    """The messages of ``error`` and of every error it came from, in lower case."""
    parts, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return "\n".join(parts).lower()


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, at most 200 characters."""
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else ""


def explain(error: BaseException, module: nn.Module | None = None) -> str:
    """One line: the cause of a failed compile in the model's terms and what to change, with
    the layers of ``module`` that stop the graph where the cause is a kind of layer; an
    unknown cause keeps torch's first line and says how to see where tracing stopped."""
    text = _text(error)
    for rule in RULES:
        named = any(word in text for word in rule.words) or (
            any(word in text for word in rule.with_layers) and bool(_layers(module, rule.layers))
        )
        if named:
            return f"{rule.says}{_layers(module, rule.layers)} ({type(error).__name__})"
    return (
        f"{type(error).__name__}: {first_line(error)}. torch.compile could not compile this "
        f"meta-iteration; use {_PLAIN}, or compile=False to say so without trying "
        "(TORCH_LOGS=graph_breaks shows where tracing stopped)"
    )


def _layers(module: nn.Module | None, kinds: tuple[type[nn.Module], ...]) -> str:
    """``"; the layers that stop it: 'rnn' (LSTM), ..."`` for the layers of ``module`` of
    the classes ``kinds`` (the outermost of nested ones), or nothing."""
    if module is None or not kinds:
        return ""
    found: list[tuple[str, nn.Module]] = []
    for name, layer in module.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(layer, kinds) and not inside:
            found.append((name, layer))
    if not found:
        return ""
    named = ", ".join(f"{name or 'the model'!r} ({type(m).__name__})" for name, m in found[:8])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    return f"; the layers that stop it: {named}{more}"
