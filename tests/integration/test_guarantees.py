"""The promises of docs/guarantees.md that are about numbers and files: non-finite values are
caught where they are made, memory failures in the inner loop say what bounds the memory, and
snapshots restore all of a file or nothing, never a corrupt one."""

from __future__ import annotations

import os
import zipfile

import pytest
import torch
import torch.nn.functional as F
from helpers import flip_stored_bit
from torch import nn

import funcmeta as fm

D = torch.float64


def _linear(dtype=torch.float32):
    torch.manual_seed(0)
    return fm.functional_model(nn.Linear(3, 1).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_overflowing_step_raises_and_names_the_parameters(dtype):
    """Finite loss and gradients, non-finite parameters after the update: lr=1e38 in float32,
    lr=6e4 in float16 (whose largest value is 65504)."""
    fmodel = _linear(dtype)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g).to(dtype), torch.randn(8, 1, generator=g).to(dtype)
    lr = 1e38 if dtype == torch.float32 else 6e4
    opt = fm.optim.sgd(lr=lr)

    def mse(out, target):  # torch 2.5 has no float16 mse_loss backward on CPU
        return ((out - target) ** 2).mean()

    unchecked = fm.adapt(fmodel, fmodel.params, mse, (x, y), opt, steps=1)
    assert not all(bool(torch.isfinite(v).all()) for v in unchecked.params.values())
    with pytest.raises(
        fm.NonFiniteError,
        match=r"inner step 0: the loss and gradients were finite, but the update made the parameters \[.*'weight'.*\] non-finite",
    ):
        fm.adapt(fmodel, fmodel.params, mse, (x, y), opt, steps=1, on_nonfinite="raise")


def test_skip_skips_the_overflowing_step_itself():
    fmodel = _linear()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    # a schedule by update count: the second update overflows (1e39 is beyond float32). A
    # skipped step leaves the optimizer state, its count included, as it was, so every later
    # step is that second update again: skipped too, and the parameters stay finite
    opt = fm.optim.sgd(lr=lambda step: 1e39 if step == 1 else 0.1)
    r = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=3, on_nonfinite="skip")
    assert r.skipped == (1, 2)
    # the reference: one step of plain SGD, by hand
    p = {k: v.detach() for k, v in fmodel.params.items()}
    for _ in range(1):
        q = {k: v.clone().requires_grad_() for k, v in p.items()}
        loss = F.mse_loss(fmodel(q, x), y)
        grads = torch.autograd.grad(loss, list(q.values()))
        p = {k: v - 0.1 * gr for (k, v), gr in zip(p.items(), grads, strict=True)}
    for k in p:
        torch.testing.assert_close(r.params[k].detach(), p[k], rtol=1e-6, atol=1e-7)


def test_an_overflowing_task_is_named():
    fmodel = _linear()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 8, 3, generator=g) * 100, torch.randn(2, 8, 1, generator=g) * 100
    lr = {
        "weight": torch.tensor([1e-4, 1e38]).view(2, 1, 1),
        "bias": torch.tensor([1e-4, 1e38]).view(2, 1),
    }
    opt = fm.optim.sgd(lr=lr)
    with pytest.raises(fm.NonFiniteError, match=r"non-finite in tasks \[1\]"):
        fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=1, on_nonfinite="raise"
        )


def test_running_out_of_memory_in_the_inner_loop_names_the_step_and_the_knobs():
    fmodel = _linear(D)
    x, y = torch.randn(8, 3, dtype=D), torch.randn(8, 1, dtype=D)
    calls = [0]

    def loss_fn(out, targets):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return F.mse_loss(out, targets)

    with pytest.raises(torch.OutOfMemoryError) as info:
        fm.adapt(fmodel, fmodel.params, loss_fn, (x, y), fm.optim.sgd(lr=0.1), steps=4)
    message = str(info.value)
    assert "out of memory at inner step 2 of 4 (each second-order step keeps its graph)" in message
    assert "Tried to allocate 2.00 GiB" in message
    assert "checkpoint_steps=True" in message and "first_order=True" in message
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
    )
    calls[0] = 0

    def cpu_loss(out, targets):
        calls[0] += 1
        if calls[0] == 2:
            raise cpu
        return F.mse_loss(out, targets)

    with pytest.raises(RuntimeError, match="out of memory at inner step 1 of 2"):
        fm.adapt(fmodel, fmodel.params, cpu_loss, (x, y), fm.optim.sgd(lr=0.1), steps=2)


def test_evaluate_refuses_logits_that_turn_non_finite_in_the_inner_loop():
    torch.manual_seed(4)
    fmodel = fm.functional_model(nn.Linear(3, 5))
    episodes = fm.data.Episodes(
        torch.randn(50, 3) * 1e3, torch.arange(10).repeat_interleave(5), ways=5, shots=2, query=2
    )
    opt = fm.optim.sgd(lr=1e38)
    with pytest.raises(fm.NonFiniteError, match="NaN or infinite"):
        fm.evaluate(fmodel, fmodel.params, F.cross_entropy, episodes, opt, steps=2, num_episodes=4)


# ---------------------------------------------------------------- snapshots


def _training_state(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net(torch.randn(6, 3)).sum().backward()
    opt.step()
    gen = torch.Generator().manual_seed(seed)
    return net, opt, gen


def _values(net, opt, gen):
    state = {k: v.clone() for k, v in net.state_dict().items()}
    moments = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    return state, moments, gen.get_state().clone()


def _same(a, b):
    (s1, m1, g1), (s2, m2, g2) = a, b
    return (
        all(torch.equal(s1[k], s2[k]) for k in s1)
        and all(torch.equal(m1[k], m2[k]) for k in m1)
        and torch.equal(g1, g2)
    )


def test_a_flipped_bit_in_any_stored_tensor_is_refused_and_restores_nothing(tmp_path):
    net, opt, gen = _training_state()
    path = tmp_path / "state.pt"
    fm.snapshot.save(
        path, step=3, modules={"net": net}, optimizers={"opt": opt}, generators={"g": gen}
    )
    with zipfile.ZipFile(path) as z:
        records = [n for n in z.namelist() if "/data/" in n]
    assert len(records) >= 10
    other = _training_state(seed=1)
    before = _values(*other)
    for member in records:
        bad = flip_stored_bit(path, member, out=tmp_path / "bad.pt")
        with pytest.raises(
            fm.snapshot.SnapshotError,
            match=r"bad\.pt is corrupt: its data does not match the checksums",
        ):
            fm.snapshot.load(
                bad,
                modules={"net": other[0]},
                optimizers={"opt": other[1]},
                generators={"g": other[2]},
            )
        assert _same(_values(*other), before)
    # the intact file restores everything
    fm.snapshot.load(
        path, modules={"net": other[0]}, optimizers={"opt": other[1]}, generators={"g": other[2]}
    )
    assert _same(_values(*other), _values(net, opt, gen))


def test_a_load_that_fails_part_way_changes_nothing(tmp_path):
    net, opt, gen = _training_state()
    head = nn.Linear(2, 2)
    path = tmp_path / "state.pt"
    fm.snapshot.save(
        path,
        step=1,
        modules={"net": net, "head": head},
        optimizers={"opt": opt},
        generators={"g": gen},
    )
    other_net, other_opt, other_gen = _training_state(seed=1)
    wrong_head = nn.Linear(2, 3)  # a later module of another shape
    before = _values(other_net, other_opt, other_gen)
    head_before = wrong_head.weight.detach().clone()
    with pytest.raises(
        fm.snapshot.SnapshotError,
        match=r"modules\['head'\]\['weight'\] has shape \(2, 2\); the module has \(3, 2\); nothing was restored",
    ):
        fm.snapshot.load(
            path,
            modules={"net": other_net, "head": wrong_head},
            optimizers={"opt": other_opt},
            generators={"g": other_gen},
        )
    assert _same(_values(other_net, other_opt, other_gen), before)
    assert torch.equal(wrong_head.weight, head_before)
    # an optimizer that refuses its state (another parameter layout): the module restored
    # before it is put back, and the random state too
    lone = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=1e-2)
    right_head = nn.Linear(2, 2)
    rng_before = torch.get_rng_state()
    with pytest.raises(
        fm.snapshot.SnapshotError,
        match=r"restoring optimizers\['opt'\] failed .*nothing was restored",
    ):
        fm.snapshot.load(
            path,
            modules={"net": other_net, "head": right_head},
            optimizers={"opt": lone},
            generators={"g": other_gen},
        )
    assert _same(_values(other_net, other_opt, other_gen), before)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_temporary_files_of_interrupted_saves_are_removed(tmp_path):
    path = tmp_path / "state.pt"
    dead = tmp_path / ".state.pt.999999999.abcd.tmp"  # a process id that is not running
    live = tmp_path / f".state.pt.{os.getppid()}.efgh.tmp"  # one being written now
    old = tmp_path / ".state.pt.x1y2z3.tmp"  # an older release's name, an hour old
    fresh = tmp_path / ".state.pt.q9w8e7.tmp"  # the same, but new: maybe being written
    for f in (dead, live, old, fresh):
        f.write_bytes(b"x" * 100)
    os.utime(old, (0, 0))
    other = tmp_path / ".other.pt.999999999.abcd.tmp"  # another file's
    other.write_bytes(b"x")
    fm.snapshot.save(path, step=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, live.name, fresh.name, other.name]
    )


def test_everything_extra_accepts_loads_back(tmp_path):
    extra = {
        "loss": 0.5,
        "n": 3,
        "ok": True,
        "none": None,
        "name": "run",
        "t": torch.arange(3),
        "p": nn.Parameter(torch.ones(2)),
        "nested": {"a": [1, (2.0, "x")], "b": ()},
    }
    fm.snapshot.save(tmp_path / "s.pt", step=0, extra=extra)
    back = fm.snapshot.load(tmp_path / "s.pt").extra
    assert back["nested"] == extra["nested"] and back["name"] == "run"
    assert torch.equal(back["p"], extra["p"]) and torch.equal(back["t"], extra["t"])


def test_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(
        IsADirectoryError, match="is a directory; pass the path of the snapshot file"
    ):
        fm.snapshot.load(tmp_path)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        fm.snapshot.save(tmp_path, step=0)
