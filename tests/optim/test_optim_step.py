"""The inner loop's optimizer step (``funcmeta._src.optim.base.step``): a transformation's
direct parameter step (its ``descend`` field) against ``update`` + ``apply_updates`` (the plain
path): the same numbers bit for bit, the same first- and second-order gradients; and the
learning-rate resolver's memory, which must never serve stale rates."""

from __future__ import annotations

import pytest
import torch

import funcmeta as fm
from funcmeta._src.optim.base import step
from funcmeta._src.optim.hyper import LeafResolver

DTYPE = torch.float64


def tree(seed, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, 4, generator=g, dtype=dtype),
        "b": {"c": torch.randn(5, generator=g, dtype=dtype)},
    }


def rates_of(kind, dtype=DTYPE):
    if kind == "number":
        return 0.1
    if kind == "scalar tensor":
        return torch.tensor(0.1, dtype=dtype, requires_grad=True)
    if kind == "per tensor":
        return {
            "a": torch.tensor(0.1, dtype=dtype, requires_grad=True),
            "b": {"c": torch.tensor(0.2, dtype=dtype, requires_grad=True)},
        }
    if kind == "per element":
        return fm.tree.tree_map(lambda x: (x.abs() * 0.1).requires_grad_(), tree(7, dtype))
    if kind == "schedule":
        return lambda step: 0.1 / (1 + step)
    raise AssertionError(kind)


OPTIMIZERS = {
    "sgd": lambda lr: fm.optim.sgd(lr=lr),
    "sgd momentum": lambda lr: fm.optim.sgd(lr=lr, momentum=0.9, weight_decay=0.01),
    "adam": lambda lr: fm.optim.adam(lr=lr),
    "clipped rmsprop": lambda lr: fm.optim.chain(
        fm.optim.clip_by_global_norm(0.5), fm.optim.rmsprop(lr=lr)
    ),
}
RATES = ["number", "scalar tensor", "per tensor", "per element", "schedule"]


@pytest.mark.parametrize("dtype", [torch.float32, DTYPE])
@pytest.mark.parametrize("rates", RATES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_equals_update_then_apply_bit_for_bit(name, rates, dtype):
    lr = rates_of(rates, dtype)
    opt = OPTIMIZERS[name](lr)
    params = fm.tree.tree_map(lambda x: x.requires_grad_(), tree(0, dtype))
    state_a = state_b = opt.init(params)
    pa = pb = params
    for k in range(3):
        grads = fm.tree.tree_map(lambda p, k=k: torch.sin(p * (k + 1)), pa)
        grads_b = fm.tree.tree_map(lambda p, k=k: torch.sin(p * (k + 1)), pb)
        pa, state_a = step(opt, grads, state_a, pa)
        updates, state_b = opt.update(grads_b, state_b, pb)
        pb = fm.apply_updates(pb, updates)
        for x, y in zip(fm.tree.leaves(pa), fm.tree.leaves(pb), strict=True):
            assert x.dtype == y.dtype
            assert torch.equal(x, y)
    # first and second order: the same derivatives to the initial parameters and the rates
    fixed = not callable(lr) or isinstance(lr, torch.Tensor)
    rate_leaves = fm.tree.leaves(lr) if fixed else []
    leaves = fm.tree.leaves(params) + [x for x in rate_leaves if isinstance(x, torch.Tensor)]
    la = sum((x**3).sum() for x in fm.tree.leaves(pa))
    lb = sum((x**3).sum() for x in fm.tree.leaves(pb))
    ga = torch.autograd.grad(la, leaves, create_graph=True)
    gb = torch.autograd.grad(lb, leaves, create_graph=True)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    hvp_a = torch.autograd.grad(sum(g.sum() for g in ga), leaves, allow_unused=True)
    hvp_b = torch.autograd.grad(sum(g.sum() for g in gb), leaves, allow_unused=True)
    for x, y in zip(hvp_a, hvp_b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_hand_made_transformation_takes_the_plain_path():
    def init(params):
        return ()

    def update(updates, state, params=None):
        return fm.tree.tree_map(lambda g: -0.5 * g, updates), state

    opt = fm.optim.GradientTransformation(init, update)
    params = {"w": torch.ones(2)}
    new, _ = step(opt, {"w": torch.ones(2)}, opt.init(params), params)
    assert new["w"].tolist() == [0.5, 0.5]


def test_the_resolver_never_serves_stale_rates():
    params = tree(0)
    leaves, spec = fm.tree.flatten(params)
    rates = {"a": torch.tensor(0.1), "b": {"c": torch.tensor(0.2)}}
    resolve = LeafResolver(rates, "lr")
    first = resolve(params, spec, leaves, 0)
    assert [float(x) for x in first] == pytest.approx([0.1, 0.2])
    assert resolve(params, spec, leaves, 1) == first
    rates["a"] = torch.tensor(0.3)  # a new tensor in the dict: resolved again
    assert [float(x) for x in resolve(params, spec, leaves, 2)] == pytest.approx([0.3, 0.2])
    rates["a"] = torch.ones(2)  # a bad shape is reported, not hidden by the memory
    with pytest.raises(ValueError, match="lr for parameter 'a' has shape"):
        resolve(params, spec, leaves, 3)
    # the same rates against differently shaped parameters are checked again
    per_element = {"a": torch.ones(3, 4), "b": {"c": torch.ones(5)}}
    resolve = LeafResolver(per_element, "lr")
    resolve(params, spec, leaves, 0)
    other = {"a": torch.ones(2, 4), "b": {"c": torch.ones(5)}}
    other_leaves, other_spec = fm.tree.flatten(other)
    with pytest.raises(ValueError, match="does not broadcast"):
        resolve(other, other_spec, other_leaves, 0)


def test_learning_rate_errors_still_come_at_init():
    opt = fm.optim.sgd(lr={"a": torch.ones(7), "b": {"c": torch.ones(5)}})
    with pytest.raises(ValueError, match="lr for parameter 'a'"):
        opt.init(tree(0))


def test_clipping_is_pure_and_says_how_it_clips_per_task():
    """The optimizers are pure functions of their arguments: ``update`` clips by the norm of the
    whole tree wherever it is called; ``update_tasks`` (what the inner loop of
    ``fm.adapt_tasks`` calls for updates with a task axis) clips each task by its own, and
    ``chain`` passes it on; a transformation that works leaf by leaf has none."""
    g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64)}  # norms 5 and 0.5
    clip = fm.optim.clip_by_global_norm(1.0)
    whole, _ = clip.update(g, clip.init(g))
    per_task, _ = clip.update_tasks(g, clip.init(g))
    norm = torch.linalg.vector_norm(g["w"])
    assert torch.allclose(whole["w"], g["w"] / (norm + 1e-6))
    assert torch.allclose(per_task["w"][0], g["w"][0] / (5.0 + 1e-6))
    assert torch.equal(per_task["w"][1], g["w"][1])  # within its own bound: untouched
    assert fm.optim.sgd(lr=0.1).update_tasks is None
    opt = fm.optim.chain(clip, fm.optim.sgd(lr=0.1))
    params = {"w": torch.zeros(2, 2, dtype=torch.float64)}
    stepped, _ = step(opt, g, opt.init(params), params, tasks=True)
    assert torch.allclose(stepped["w"], -0.1 * per_task["w"])
    plain, _ = step(opt, g, opt.init(params), params)
    assert torch.allclose(plain["w"], -0.1 * whole["w"])


def test_the_direct_step_is_a_field_of_the_transformation():
    """Extending an optimizer takes explicit fields: nothing is set on its functions."""
    sgd = fm.optim.sgd(lr=0.1)
    assert sgd.descend is not None and not hasattr(sgd.update, "descend")
    assert fm.optim.chain(fm.optim.clip_by_global_norm(1.0), sgd).descend is not None
    assert fm.optim.chain(sgd, fm.optim.clip_by_global_norm(1.0)).descend is None
    assert fm.optim.adam(lr=0.1).descend is not None  # its last link scales by the rate
    assert fm.optim.sgd(lr=0.1, momentum=0.9).descend is not None


def test_fm_optim_exports_no_internals():
    """Constructors, chain, apply_updates, global_norm, from_torch and the types: the step
    the inner loop takes and the numeric helpers stay inside."""
    for name in ("step", "with_descend", "safe_sqrt", "clip_grads_by_global_norm"):
        assert name not in fm.optim.__all__ and not hasattr(fm.optim, name)
