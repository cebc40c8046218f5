"""Resumable meta-training: a run killed mid-way and resumed ends bit-identical to an
uninterrupted one; states are written atomically; names are checked."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import funcmeta as fm

SCRIPT = Path(__file__).with_name("snapshot_train.py")
STEPS = 40


def run(state, out, *extra):
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(state), str(out), str(STEPS), *extra],
        check=True,
        timeout=300,
    )


def saved_step(path):
    try:
        return torch.load(path, weights_only=False)["step"]
    except (FileNotFoundError, EOFError, RuntimeError):
        return 0


def test_killed_and_resumed_run_is_bit_identical(tmp_path):
    run(tmp_path / "a.pt", tmp_path / "a_out.pt")
    state = tmp_path / "b.pt"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(state), str(tmp_path / "b_out.pt"), str(STEPS), "--slow"]
    )
    deadline = time.monotonic() + 240
    while saved_step(state) < 8 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = saved_step(state)
    assert 8 <= killed_at < STEPS, f"the run was not killed mid-way (state at step {killed_at})"
    assert not (tmp_path / "b_out.pt").exists()
    assert (
        not list(tmp_path.glob(".b.pt.*.tmp")) or saved_step(state) == killed_at
    )  # the last state is whole
    run(state, tmp_path / "b_out.pt")
    a, b = torch.load(tmp_path / "a_out.pt"), torch.load(tmp_path / "b_out.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_names_are_checked_and_writes_are_atomic(tmp_path, monkeypatch):
    net = torch.nn.Linear(2, 1)
    path = tmp_path / "state.pt"
    fm.snapshot.save(path, step=3, modules={"net": net})
    with pytest.raises(ValueError, match=r"not given \['net'\], not saved \['model'\]"):
        fm.snapshot.load(path, modules={"model": net})
    with pytest.raises(ValueError, match="step"):
        fm.snapshot.save(path, step=-1)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        fm.snapshot.save(path, step=4, modules={"net": net})
    monkeypatch.undo()
    assert fm.snapshot.load(path, modules={"net": net}).step == 3  # the old state survives
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_restores_global_random_state(tmp_path):
    torch.manual_seed(5)
    fm.snapshot.save(tmp_path / "s.pt", step=0)
    expected = torch.rand(3)
    torch.rand(10)
    fm.snapshot.load(tmp_path / "s.pt")
    assert torch.equal(torch.rand(3), expected)
