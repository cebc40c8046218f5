"""The port of learn2learn's MAML-Omniglot example (examples/l2l_maml_omniglot_port.py): the
meta-gradients of learn2learn's semantics (clone() = the parameters as non-leaf copies,
adapt() = p - lr * grad with create_graph, the mean over tasks), float64 on real Omniglot
tasks, written by hand always and by learn2learn itself where it is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import shared_file
from torch.func import functional_call

import funcmeta as fm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def port():
    spec = importlib.util.spec_from_file_location(
        "l2l_port", EXAMPLES / "l2l_maml_omniglot_port.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tasks():
    """Four real 5-way 1-shot Omniglot tasks (float64) and a float64 OmniglotFC."""
    m = port()
    folder = shared_file("omniglot/images_background_small1.zip").parent
    images, labels, _ = fm.data.load_omniglot(folder, "background_small1", size=28)
    episodes = fm.data.Episodes(images.double(), labels, ways=5, shots=1, query=1)
    batch = episodes.sample(4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    return m, m.omniglot_fc(5).double(), m.split(batch)


def by_hand(model, support, query, lr, steps):
    """learn2learn's loop written out."""
    names = [n for n, _ in model.named_parameters()]
    total = 0
    tasks = support[0].shape[0]
    for t in range(tasks):
        params = {n: p.clone() for n, p in model.named_parameters()}  # maml.clone()
        for _ in range(steps):
            loss = F.cross_entropy(functional_call(model, params, (support[0][t],)), support[1][t])
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            params = {n: params[n] - lr * g for n, g in zip(names, grads, strict=True)}
        total = total + F.cross_entropy(functional_call(model, params, (query[0][t],)), query[1][t])
    return torch.autograd.grad(total / tasks, list(model.parameters()))


def relative(a, b):
    fa, fb = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((fa - fb).norm() / fb.norm())


@pytest.mark.parametrize("batched", [False, True], ids=["loop", "batched"])
@pytest.mark.parametrize("steps", [1, 3])
def test_the_port_gives_learn2learns_meta_gradients(tasks, batched, steps):
    m, model, (support, query) = tasks
    reference = by_hand(model, support, query, 0.5, steps)
    fmodel = fm.functional_model(model)
    ours = torch.autograd.grad(
        m.meta_loss(fmodel, support, query, 0.5, steps, batched), list(model.parameters())
    )
    assert relative(ours, reference) < 1e-12


def test_the_port_gives_learn2learns_own_meta_gradients(tasks):
    l2l = pytest.importorskip(
        "learn2learn",
        reason="learn2learn is not installed: bash benchmarks/peers/build_learn2learn.sh",
    )
    m, model, (support, query) = tasks
    maml = l2l.algorithms.MAML(model, lr=0.5, first_order=False)
    for p in maml.parameters():
        p.grad = None
    for t in range(support[0].shape[0]):
        learner = maml.clone()
        learner.adapt(F.cross_entropy(learner(support[0][t]), support[1][t]))
        F.cross_entropy(learner(query[0][t]), query[1][t]).backward()
    theirs = [p.grad / support[0].shape[0] for p in maml.parameters()]
    fmodel = fm.functional_model(model)
    ours = torch.autograd.grad(
        m.meta_loss(fmodel, support, query, 0.5, 1, False), list(model.parameters())
    )
    assert relative(ours, theirs) < 1e-12


def test_the_port_runs_on_the_real_files():
    m = port()
    folder = shared_file("omniglot/images_background_small1.zip").parent
    history = m.main(
        [
            "--data",
            str(folder),
            "--iterations",
            "3",
            "--meta-batch",
            "4",
            "--test-characters",
            "20",
            "--batched",
        ]
    )
    assert len(history["loss"]) == 3 and len(history["test_accuracy"]) == 3


@pytest.mark.parametrize("batched", [False, True], ids=["loop", "batched"])
def test_metasgd_port_gives_learn2learns_meta_gradients(tasks, batched):
    """learn2learn's MetaSGD: one learnable rate per element, all starting at lr, trained with
    the model: fm.hyper.per_element(params, lr) gives the same meta-gradients for the model
    and the rates (float64, real tasks), in the loop and batched."""
    _, model, (support, query) = tasks
    fmodel = fm.functional_model(model)
    rates = fm.hyper.per_element(fmodel.params, 0.5)
    names = [n for n, _ in model.named_parameters()]
    # by hand: p - lr_p * grad, every lr_p a leaf starting at 0.5 (MetaSGD's lrs)
    lrs = {n: torch.full_like(p, 0.5, requires_grad=True) for n, p in model.named_parameters()}
    total = 0
    for t in range(support[0].shape[0]):
        params = {n: p.clone() for n, p in model.named_parameters()}
        loss = F.cross_entropy(functional_call(model, params, (support[0][t],)), support[1][t])
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {n: params[n] - lrs[n] * g for n, g in zip(names, grads, strict=True)}
        total = total + F.cross_entropy(functional_call(model, params, (query[0][t],)), query[1][t])
    total = total / support[0].shape[0]
    reference = torch.autograd.grad(total, [*model.parameters(), *(lrs[n] for n in names)])
    if batched:
        loss = fm.recipes.metasgd(
            fmodel, fmodel.params, F.cross_entropy, support, query, steps=1, lr=rates
        ).loss
    else:
        loss = 0
        for t in range(support[0].shape[0]):
            r = fm.adapt(
                fmodel,
                fmodel.params,
                F.cross_entropy,
                (support[0][t], support[1][t]),
                fm.optim.sgd(lr=rates),
                steps=1,
            )
            loss = loss + F.cross_entropy(fmodel(r.params, query[0][t]), query[1][t])
        loss = loss / support[0].shape[0]
    by_name = dict(zip(rates.groups, rates.raw, strict=True))
    ours = torch.autograd.grad(loss, [*model.parameters(), *(by_name[n] for n in names)])
    assert relative(ours, reference) < 1e-12
