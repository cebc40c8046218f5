"""Distributed runs fail loudly: ranks that average different things raise the same named
error on every rank (never an abort or a hang), and a dead peer makes the survivors raise
within the timeout instead of waiting for ever. Two gloo processes on one CPU."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import init_gloo
from torch import nn

import funcmeta as fm
from funcmeta._src.distributed import collectives

LIMIT = 30.0  # seconds within which every rank must have raised


def _setup(case: str, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` averages in ``case``, its gradients set."""
    torch.manual_seed(0)
    if case in ("models", "stalled-naming"):
        net = nn.Linear(3, 2 if rank == 0 else 3)
    elif case == "dtypes":
        net = nn.Linear(3, 2).to(torch.float32 if rank == 0 else torch.float64)
    else:
        net = nn.Linear(3, 2)
    tensors = dict(net.named_parameters())
    if case == "hyperparameters" and rank == 0:  # only rank 0 learns its rates
        rates = fm.hyper.per_tensor(tensors, 0.1)
        tensors.update({f"rates.{k}": v for k, v in rates.named_parameters()})
    for t in tensors.values():
        t.grad = torch.ones_like(t)
    return tensors


def _worker(rank: int, case: str, rendezvous: str, out: str) -> None:
    init_gloo(rank, rendezvous)
    tensors = _setup(case, rank)
    if case == "dead" and rank == 1:
        os._exit(3)  # a rank killed mid-iteration, before it averages
    if case == "stalled" and rank == 1:
        time.sleep(15)  # alive, but reaches the collective after the 8 s timeout
        os._exit(0)
    if case == "stalled-naming" and rank == 1:
        # it compares digests with rank 0, then stalls before the gather that names the
        # difference
        def stall(*args: object) -> None:
            time.sleep(15)
            os._exit(0)

        collectives._gather_signatures = stall
        torch.distributed.all_gather_object = stall
    start = time.monotonic()
    result: dict[str, object] = {}
    try:
        fm.distributed.average_gradients(tensors, 1, timeout=8.0)
        result["error"] = None
    except Exception as e:
        result["error"], result["message"] = type(e).__name__, str(e)
    result["seconds"] = time.monotonic() - start
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no teardown with a peer that may be gone


def _run(case: str, tmp_path: Path) -> list[dict[str, object] | None]:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, case, str(tmp_path / "rdv"), str(tmp_path)))
        for r in range(2)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=LIMIT + 30)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks still running after {time.monotonic() - start:.0f} s: a hang"
    results = []
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


@pytest.mark.parametrize(
    ("case", "difference"),
    [
        (
            "models",
            r"entry 0: rank 0 has 'weight' \(shape \(2, 3\), float32\), rank 1 has 'weight' \(shape \(3, 3\)",
        ),
        (
            "hyperparameters",
            r"rank 0 averages 3 tensors and rank 1 2; the first one only rank 0 has is 'rates\.raw",
        ),
        (
            "dtypes",
            r"rank 0 has 'weight' \(shape \(2, 3\), float32\), rank 1 has 'weight' \(shape \(2, 3\), float64\)",
        ),
    ],
)
def test_mismatched_ranks_raise_the_same_named_error(case, difference, tmp_path):
    results = _run(case, tmp_path)
    messages = set()
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} died instead of raising"
        assert result["error"] == "MismatchError", result
        assert result["seconds"] < LIMIT
        assert re.search(difference, result["message"]), f"rank {rank}: {result['message']}"
        messages.add(result["message"])
    assert len(messages) == 1  # the same words on every rank


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dead", "stalled", "stalled-naming"])
def test_a_lost_peer_makes_the_survivor_raise_within_the_timeout(case, tmp_path):
    survivor, lost = _run(case, tmp_path)
    assert lost is None  # it never averaged
    assert survivor["error"] == "PeerError", survivor
    assert "a peer process is gone or stalled" in survivor["message"]
    assert survivor["seconds"] < LIMIT
    if case == "stalled-naming":  # within the 8 s timeout, not when the peer gives up
        assert survivor["seconds"] < 12, survivor


def test_matching_ranks_average(tmp_path):
    same = _run("same", tmp_path)
    assert [r["error"] for r in same] == [None, None]


def test_arguments_checked_without_a_process_group():
    net = nn.Linear(2, 1)
    fm.distributed.average_gradients(dict(net.named_parameters()))  # one process: a no-op
    assert net.weight.grad is None


RANKS_SCRIPT = Path(__file__).with_name("snapshot_train_ranks.py")


def _launch(folder: Path, rendezvous: str, steps: int, *kill: str) -> list[int]:
    """Both ranks of snapshot_train_ranks.py; their exit codes."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RANKS_SCRIPT),
                str(r),
                str(folder / rendezvous),
                str(folder),
                str(steps),
                *kill,
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    codes = []
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("a rank hung")
        codes.append(p.returncode)
        if p.returncode not in (0, -signal.SIGKILL):
            assert "PeerError" in p.stderr.read(), "the survivor failed for another reason"
    return codes


@pytest.mark.slow
def test_two_ranks_killed_and_resumed_end_bit_identical(tmp_path):
    steps = 12
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    whole.mkdir()
    broken.mkdir()
    assert _launch(whole, "rdv0", steps) == [0, 0]
    codes = _launch(broken, "rdv1", steps, "5")
    assert codes[1] == -signal.SIGKILL and codes[0] != 0  # killed; the survivor raised
    assert not (broken / "final0.pt").exists()
    for rank in range(2):  # both ranks last saved the step before the kill
        assert torch.load(broken / f"state{rank}.pt", weights_only=True)["step"] == 5
    assert _launch(broken, "rdv2", steps) == [0, 0]  # resumed from the snapshots
    for rank in range(2):
        a = torch.load(whole / f"final{rank}.pt")
        b = torch.load(broken / f"final{rank}.pt")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (rank, k)
