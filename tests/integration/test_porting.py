"""The port of higher's and TorchOpt's MAML-Omniglot example (examples/maml_omniglot_port.py)
reproduces their meta-training bit for bit: against a hand-written loop with higher's
semantics always, and against higher and TorchOpt themselves where they are installed."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import shared_file
from torch.func import functional_call

import funcmeta as fm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ITERATIONS = 2


def port():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("port", EXAMPLES / "maml_omniglot_port.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup():
    """The example's module, a small database of random 'drawings' and the settings."""
    m = port()
    images = np.random.default_rng(0).random((30, 20, 1, 28, 28))
    args = argparse.Namespace(
        n_way=5, k_spt=2, k_qry=3, task_num=3, inner_steps=3, inner_lr=0.1, meta_lr=1e-3
    )
    return m, images, args


def database(m, images, args, seed=1):
    return m.NShot(
        images,
        20,
        batchsz=args.task_num,
        n_way=args.n_way,
        k_shot=args.k_spt,
        k_query=args.k_qry,
        rng=np.random.default_rng(seed),
    )


def run_port(m, images, args, style, batched=False):
    torch.manual_seed(0)
    net = m.network(args.n_way)
    fmodel = fm.functional_model(net)
    opt = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    db = database(m, images, args)
    given = argparse.Namespace(**vars(args), style=style, batched=batched)
    for _ in range(ITERATIONS):
        m.meta_step(fmodel, db.next(), opt, given)
    return net


def train(m, images, args, meta_gradient):
    """The peers' outer loop: the same initial weights and episodes, Adam on the
    meta-gradient that ``meta_gradient(net, batch)`` leaves in ``.grad``."""
    torch.manual_seed(0)
    net = m.network(args.n_way)
    opt = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    db = database(m, images, args)
    for _ in range(ITERATIONS):
        batch = db.next()
        opt.zero_grad()
        meta_gradient(net, batch)
        opt.step()
    return net


def run_by_hand(m, images, args, style):
    """higher's semantics written out: each task from the module's parameters, SGD steps
    with a graph, per-task backward (higher) or backward of the mean (TorchOpt)."""

    def meta_gradient(net, batch):
        x_spt, y_spt, x_qry, y_qry = batch
        losses = []
        for i in range(args.task_num):
            params = dict(net.named_parameters())
            buffers = {k: v.clone() for k, v in net.named_buffers()}
            for _ in range(args.inner_steps):
                out = functional_call(net, (params, buffers), (x_spt[i],))
                loss = F.cross_entropy(out, y_spt[i])
                grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
                params = {
                    k: p - args.inner_lr * g
                    for (k, p), g in zip(params.items(), grads, strict=True)
                }
            loss = F.cross_entropy(functional_call(net, (params, buffers), (x_qry[i],)), y_qry[i])
            if style == "higher":
                loss.backward()
            losses.append(loss)
        if style == "torchopt":
            torch.stack(losses).mean().backward()

    return train(m, images, args, meta_gradient)


def assert_identical(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs by {(p - q).abs().max().item():.3e}"


@pytest.mark.parametrize("style", ["higher", "torchopt"])
def test_port_is_bit_identical_to_the_loop_written_by_hand(setup, style):
    m, images, args = setup
    assert_identical(run_port(m, images, args, style), run_by_hand(m, images, args, style))


def one_meta_gradient(m, images, args, batched, dtype):
    torch.manual_seed(0)
    net = m.network(args.n_way).to(dtype)
    batch = [x.to(dtype) if x.is_floating_point() else x for x in database(m, images, args).next()]
    given = argparse.Namespace(**vars(args), style="higher", batched=batched)
    m.meta_step(fm.functional_model(net), batch, torch.optim.SGD(net.parameters(), lr=0.0), given)
    return [p.grad for p in net.parameters()]


def test_the_batched_port_gives_the_loops_meta_gradients(setup):
    """All tasks as one computation: the loop's meta-gradients (the sum over tasks), to
    float64 rounding; in float32 to its rounding. Relative to the largest entry of all: the
    conv biases in front of BatchNorm have true gradients of zero, round-off only."""
    m, images, args = setup
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-3)):
        loop = one_meta_gradient(m, images, args, False, dtype)
        batched = one_meta_gradient(m, images, args, True, dtype)
        scale = max(g.abs().max().item() for g in loop)
        for g, h in zip(loop, batched, strict=True):
            torch.testing.assert_close(h, g, rtol=0, atol=tol * scale)


def test_port_is_bit_identical_to_higher(setup):
    higher = pytest.importorskip(
        "higher", reason="higher is not installed: pip install -e '.[bench]'"
    )
    m, images, args = setup

    def meta_gradient(net, batch):
        x_spt, y_spt, x_qry, y_qry = batch
        inner_opt = torch.optim.SGD(net.parameters(), lr=args.inner_lr)
        for i in range(args.task_num):
            with higher.innerloop_ctx(net, inner_opt, copy_initial_weights=False) as (fnet, diff):
                for _ in range(args.inner_steps):
                    diff.step(F.cross_entropy(fnet(x_spt[i]), y_spt[i]))
                F.cross_entropy(fnet(x_qry[i]), y_qry[i]).backward()

    net = train(m, images, args, meta_gradient)
    assert_identical(run_port(m, images, args, "higher"), net)


def test_port_is_bit_identical_to_torchopt(setup):
    torchopt = pytest.importorskip(
        "torchopt", reason="torchopt is not installed: pip install -e '.[bench]'"
    )
    m, images, args = setup
    inner: dict = {}

    def meta_gradient(net, batch):
        x_spt, y_spt, x_qry, y_qry = batch
        if not inner:  # one MetaSGD for the run, as the example makes it
            inner["opt"] = torchopt.MetaSGD(net, lr=args.inner_lr)
        inner_opt = inner["opt"]
        net_state = torchopt.extract_state_dict(net, by="reference", detach_buffers=True)
        opt_state = torchopt.extract_state_dict(inner_opt, by="reference")
        losses = []
        for i in range(args.task_num):
            for _ in range(args.inner_steps):
                inner_opt.step(F.cross_entropy(net(x_spt[i]), y_spt[i]))
            losses.append(F.cross_entropy(net(x_qry[i]), y_qry[i]))
            torchopt.recover_state_dict(net, net_state)
            torchopt.recover_state_dict(inner_opt, opt_state)
        torch.stack(losses).mean().backward()

    net = train(m, images, args, meta_gradient)
    assert_identical(run_port(m, images, args, "torchopt"), net)


def test_the_sampler_draws_disjoint_balanced_episodes_and_resumes_from_a_snapshot(setup, tmp_path):
    m, images, args = setup
    db = database(m, images, args)
    x_spt, y_spt, x_qry, y_qry = db.next()
    assert x_spt.shape == (3, 10, 1, 28, 28) and x_qry.shape == (3, 15, 1, 28, 28)
    for t in range(3):
        assert sorted(y_spt[t].tolist()) == sorted(list(range(5)) * 2)
        assert sorted(y_qry[t].tolist()) == sorted(list(range(5)) * 3)
    train = torch.from_numpy(images[:20]).float()
    test_batch = db.next("test")[0]
    assert not any(torch.equal(x, c) for x in test_batch[0] for c in train.flatten(0, 1))
    # the sampler draws from a NumPy Generator, which a snapshot saves and restores
    fm.snapshot.save(tmp_path / "s.pt", step=1, generators={"episodes": db.rng})
    expected = db._fill(db.data["train"])[0][0]
    fm.snapshot.load(tmp_path / "s.pt", generators={"episodes": db.rng})
    assert torch.equal(db._fill(db.data["train"])[0][0], expected)


def test_the_example_runs_on_the_real_files(capsys):
    m = port()
    before = torch.get_num_threads()
    try:
        log = m.main(
            [
                "--data",
                str(shared_file("omniglot/images_background_small1.zip").parent),
                "--iterations",
                "2",
                "--test-every",
                "2",
                "--task-num",
                "2",
                "--threads",
                str(before),
                "--no-keep-freed-memory",  # a process-wide setting: not for the test process
            ]
        )
    finally:
        torch.set_num_threads(before)
    assert len(log["train"]) == 2 and len(log["test"]) == 1
    assert 20 < log["test"][0]["acc"] <= 100  # 5-way: chance is 20%
    assert "test acc" in capsys.readouterr().out
