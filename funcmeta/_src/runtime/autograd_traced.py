"""The autograd-traced runtime: the eager runtime's own step, ``torch.autograd.grad`` for
every inner gradient, as ``fm.compile_meta_step`` traces it where the installed torch
traces ``torch.autograd.grad`` into one graph (dynamo's ``trace_autograd_ops``; see
``docs/decisions/compiled-autograd-step.md``).

The model runs through ``torch.func.functional_call`` on fresh copies of the buffers, all
tasks of a call under one ``torch.func.vmap``, as in :data:`funcmeta._src.runtime.TRACED`.
What differs: the inner gradient is ``torch.autograd.grad`` of the summed task losses, with
``create_graph`` in second order (the eager step's), and the model runs as a shadow whose
checkpointed layers (``checkpoint_layers=``) call ``torch.utils.checkpoint`` (non-reentrant)
while dynamo traces them. In the graph, a checkpointed layer is torch's activation
checkpoint region: the compiled step's outer gradient (the backward region of the graph)
recomputes the layer's forward instead of keeping its activations. Each inner step is a
region of the graph (:func:`funcmeta._src.core.fence.inner_step_region`), from which the
compiled step's rematerialization recomputes the checkpointed layers' inner gradients too,
or under ``checkpoint_steps`` the whole step (:attr:`recomputes_steps`; the pass:
``funcmeta._src.core.fence.remat``). Run without tracing (the
step's uncompiled computation, the reference of the tests) a checkpointed layer runs as it
is: ``torch.utils.checkpoint`` under ``vmap`` recomputes outside the vmap level in eager mode,
which torch refuses, and checkpointing changes no value.

Example:
    >>> import torch, funcmeta as fm
    >>> from funcmeta._src.runtime.autograd_traced import AutogradTracedRuntime, traced_runner
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> fmodel = fm.functional_model(net, checkpoint_layers=["0"])
    >>> runtime = AutogradTracedRuntime(traced_runner(fmodel))
    >>> out, _ = runtime.run(fmodel, fmodel.params, fmodel.buffers, (torch.ones(3, 2),), {})
    >>> torch.equal(out, net(torch.ones(3, 2)))
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from funcmeta._src.core.fence import inner_step_region
from funcmeta._src.module.functional import FunctionalModel, shares_tensors
from funcmeta._src.module.shadow import Standin, shadow
from funcmeta._src.runtime.base import Objective
from funcmeta._src.runtime.traced import TracedRuntime

__all__ = ["AutogradTracedRuntime", "traced_runner"]


class _TracedCheckpoint(Standin):
    """A checkpointed layer of the traced step: ``torch.utils.checkpoint`` of the layer
    while dynamo traces it (torch's activation checkpoint region), the layer itself
    otherwise."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layer = self.original
        if not torch.compiler.is_compiling():
            return layer(*args, **kwargs)
        return checkpoint(layer, *args, use_reentrant=False, **kwargs)


def traced_runner(fmodel: FunctionalModel) -> nn.Module:
    """The module the autograd-traced step runs: ``fmodel``'s module, with its checkpointed
    layers (``fmodel.checkpointed``) as torch activation checkpoint regions (a shadow that
    shares every tensor; the module is not changed)."""
    replace: dict[str, Callable[[nn.Module], nn.Module]] = {
        name: _TracedCheckpoint for name in fmodel.checkpointed
    }
    root, _ = shadow(fmodel.module, replace)
    return root


class AutogradTracedRuntime(TracedRuntime):
    """The autograd-traced runtime (see the module docstring), one per compiled step:
    ``runner`` is what the model runs as (:func:`traced_runner`)."""

    recomputes_steps = True

    def __init__(self, runner: nn.Module) -> None:
        self.runner = runner
        self._tied = shares_tensors(runner)

    def module_of(self, fmodel: FunctionalModel) -> nn.Module:
        return self.runner

    def tied(self, fmodel: FunctionalModel) -> bool:
        return self._tied

    def step_scope(
        self, k: int, steps: int, first_order: bool
    ) -> contextlib.AbstractContextManager[Any]:
        # the step's operations, annotated in the graph while dynamo traces them
        if not torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return inner_step_region(k)

    def gradient(
        self,
        objective: Objective,
        leaves: list[Tensor],
        buffers: dict[str, Tensor],
        *,
        second_order: bool,
        keep_graph: bool,
    ) -> tuple[Tensor, list[Tensor | None], dict[str, Tensor]]:
        # the eager step's gradient: second order differentiates the leaves themselves (the
        # outer gradient goes through it), first order detached copies of them
        with torch.enable_grad():
            wrt = [p if second_order and p.requires_grad else _graph_leaf(p) for p in leaves]
            total, loss, new_buffers = objective(wrt, buffers)
            found = torch.autograd.grad(total, wrt, create_graph=second_order, allow_unused=True)
        if not second_order:
            found = tuple(g if g is None else g.detach() for g in found)
        return loss, list(found), new_buffers


def _graph_leaf(p: Tensor) -> Tensor:
    """A detached copy of ``p`` that requires grad: the inner gradient's leaf where the
    outer gradient does not go through it."""
    return p.detach().requires_grad_()
