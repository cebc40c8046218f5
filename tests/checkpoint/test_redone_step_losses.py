"""What a redone step's loss keeps under ``checkpoint_steps=True`` (``docs/memory.md``, "Will
it fit?").

torch's non-reentrant checkpoint recomputes, in the outer backward, every tensor the step
saved whose graph node is still alive, and frees each when the backward reads it. The loss a
second-order step returns (``AdaptResult.losses``) keeps its own node alive, and the outer
backward does not go through it, so what the loss saved (a cross-entropy's
log-probabilities) stays until the backward ends, one per step: the formula of the LLM
benchmark counts it, and the docs tell how to drop it. A loss that records each tensor it
saves shows which stay, and that dropping the inner losses changes no meta-gradient.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

STEPS = 3


class RecordedLoss(torch.autograd.Function):
    """The mean squared error, saving beside its inputs a tensor of its own whose life is
    recorded (a weak reference per forward, recomputations included). Twice differentiable:
    its backward computes from the saved inputs."""

    made: ClassVar[list[weakref.ref[torch.Tensor]]] = []

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        own = out.detach().clone()
        RecordedLoss.made.append(weakref.ref(own))
        ctx.save_for_backward(out, y, own)
        return ((out - y) ** 2).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, y, _ = ctx.saved_tensors
        return grad * 2 * (out - y) / out.numel(), None


def meta_step(drop_losses: bool, checkpoint_steps: bool) -> tuple[int, list[torch.Tensor]]:
    """One second-order meta-step: how many of the loss's own tensors are alive after the
    outer backward, and the meta-gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    fmodel = fm.functional_model(net)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    RecordedLoss.made.clear()
    result = fm.adapt(
        fmodel,
        fmodel.params,
        RecordedLoss.apply,
        (x, y),
        fm.optim.sgd(lr=0.1),
        steps=STEPS,
        checkpoint_steps=checkpoint_steps,
    )
    query = F.mse_loss(fmodel(result.params, x), y)
    logged = result.losses.detach()
    if drop_losses:
        del result
    query.backward()
    assert logged.shape == (STEPS,) and not logged.requires_grad
    alive = sum(ref() is not None for ref in RecordedLoss.made)
    return alive, [p.grad for p in net.parameters()]


def test_each_redone_steps_loss_keeps_what_it_saved_while_the_losses_are_alive():
    alive, _ = meta_step(drop_losses=False, checkpoint_steps=True)
    assert alive == STEPS  # the recomputation's, one per step


def test_dropping_the_inner_losses_keeps_nothing_and_changes_no_meta_gradient():
    alive, dropped = meta_step(drop_losses=True, checkpoint_steps=True)
    assert alive == 0
    _, kept = meta_step(drop_losses=False, checkpoint_steps=True)
    _, unchecked = meta_step(drop_losses=False, checkpoint_steps=False)
    for a, b, c in zip(dropped, kept, unchecked, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("drop_losses", [False, True])
def test_without_step_checkpoints_the_losses_keep_their_forwards_tensors(drop_losses):
    """Unchecked, the steps' graphs are the outer graph: a loss's saved tensors live as its
    node does, and dropping the losses frees them."""
    alive, _ = meta_step(drop_losses=drop_losses, checkpoint_steps=False)
    assert alive == (0 if drop_losses else STEPS)
