"""``examples/checkpointed_maml.py`` at the GPU target's width and as its own judge.

At width 768 the example used to diverge (its head read the raw residual stream, and Adam's
and SGD's steps moved 768-wide layers' outputs about 768 times as far as one weight): here its
query loss falls at that width in bf16 autocast and in fp16 autocast with GradScaler("cpu").
Then the verdict: ``RESULT PASS`` and exit status 0 when it learns, ``RESULT FAIL`` with the
reason and a non-zero exit status when the loss rises, too many iterations are skipped or a
memory or time ratio misses its target."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest
import torch
from test_example import EXAMPLES, load

# a small model that learns within a few iterations (fp32: no scaler, no autocast)
SMALL = [
    "--device",
    "cpu",
    "--precision",
    "fp32",
    "--width",
    "32",
    "--modules",
    "8",
    "--rows",
    "64",
    "--outer-lr",
    "3e-3",
    "--iterations",
    "9",
    "--no-measure",
]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One thread here and in the processes started (the measurement's, the script's): on
    2 cores that other work shares, two threads each made these tests 2-5 times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def example():
    return load("checkpointed_maml")


def fixed_batch_losses(example, argv: list[str], iterations: int) -> tuple[list[float], list]:
    """Meta-iterations on one fixed batch of tasks (a few dozen rows of fresh tasks are too
    noisy to show a fall within a few iterations): the query losses and the skipped flags."""
    args = example.parser().parse_args(argv)
    s = example.build(args)
    g = torch.Generator().manual_seed(args.seed + 1)
    teacher = torch.randn(args.inputs, example.CLASSES, generator=g)
    data = example.sample_tasks(args, teacher, g)
    losses, skipped = [], []
    for _ in range(iterations):
        loss, skip = example.meta_iteration(s, args, data)
        losses.append(loss)
        skipped.append(skip)
    return losses, skipped


def test_the_query_loss_falls_at_width_768_in_bf16(example):
    """40 self-checkpointed blocks of width 768, bf16 autocast, the default rates (scaled to
    the width): the query loss falls at every meta-iteration (before its final LayerNorm and
    width-scaled rates the example's rose here, 8.7, 14.1, 26.6)."""
    argv = ["--device", "cpu", "--precision", "bf16", "--width", "768"]
    losses, _ = fixed_batch_losses(example, [*argv, "--rows", "32", "--tasks", "1"], 3)
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[1] < losses[0] and losses[2] < losses[1], losses
    assert losses[2] < 0.6 * losses[0], losses


def test_the_query_loss_falls_at_width_768_in_fp16_with_the_scaler(example):
    """fp16 autocast with GradScaler("cpu") at its default scale, width 768 (2 blocks: CPU
    fp16 matrix products are some 30 times slower than fp32 ones): no meta-iteration skipped
    and the query loss falls (the example before its final LayerNorm skipped every one)."""
    argv = ["--device", "cpu", "--precision", "fp16", "--width", "768", "--modules", "2"]
    argv += ["--adapt", "2", "--rows", "16", "--tasks", "1"]
    losses, skipped = fixed_batch_losses(example, argv, 3)
    assert not any(skipped), skipped
    assert losses[1] < losses[0] and losses[2] < losses[1], losses
    assert losses[2] < 0.95 * losses[0], losses


def judged(example, losses: list[float], skipped: list[bool], **options) -> dict:
    args = example.parser().parse_args([f"--{k.replace('_', '-')}={v}" for k, v in options.items()])
    history = {"loss": losses, "scale": [None] * len(losses), "skipped": skipped}
    return example.judge(history, args)


def test_the_verdict_compares_the_ends_of_the_run_and_counts_skipped_iterations(example):
    falling = [2.0, 1.8, 1.9, 1.5, 1.2, 1.1, 1.0, 1.05]
    v = judged(example, falling, [False] * 8)
    assert v["failures"] == [] and v["window"] == 3
    assert v["first"] == pytest.approx(1.9) and v["last"] == pytest.approx(1.05)
    # rising, or falling by less than --min-fall
    assert judged(example, falling[::-1], [False] * 8)["failures"]
    assert judged(example, falling, [False] * 8, min_fall=0.5)["failures"]
    # skipped and non-finite iterations are left out of the means; more than --max-skipped fail
    losses = [math.inf, 2.0, 1.9, 2.1, 1.6, 1.5, 1.4, 99.0]
    skipped = [True, False, False, False, False, False, False, True]
    v = judged(example, losses, skipped)
    assert v["failures"] == [] and v["skipped"] == 2 and v["last"] == pytest.approx(1.5)
    v = judged(example, losses, skipped, max_skipped=1)
    assert v["failures"] == ["2 of 8 iterations skipped by the scaler, more than 1"]
    # too few kept iterations to judge
    assert judged(example, [1.0], [False])["failures"]


def test_it_exits_zero_with_a_pass_line_when_it_learns(example, capsys):
    assert example.main(SMALL) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT PASS: query loss "), last
    assert "skipped 0 of 9" in last


def test_it_exits_non_zero_with_a_fail_line_when_the_loss_rises():
    """A run as a script: a huge outer rate makes the loss rise; the process exits 1 and its
    last line says FAIL and why."""
    argv = [*SMALL, "--outer-lr", "1.0", "--iterations", "6"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "checkpointed_maml.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT FAIL (the query loss did not fall by 5%): query loss "), last


def test_a_missed_memory_target_fails_and_a_met_time_target_passes(example, capsys):
    """The two ratios against impossible and generous targets (two meta-iterations: the loss
    may or may not be judged to fall)."""
    argv = ["--device", "cpu", "--precision", "fp32", "--modules", "8", "--rows", "256"]
    argv += ["--iterations", "2"]
    argv += ["--repeats", "1", "--max-memory-ratio", "0.0001", "--max-time-ratio", "1000"]
    assert example.main(argv) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("FAIL memory: checkpointed / unchecked ") for line in lines)
    assert any(line.startswith("PASS time: checkpointed / unchecked ") for line in lines)
    last = lines[-1]
    assert last.startswith("RESULT FAIL (") and "the memory ratio is above its target" in last
    assert "time ratio" not in last.split("):")[0]
    assert "x > 0.0001x" in last and "x <= 1000x" in last, last


def test_targets_need_the_measurement_and_every_option_shows_its_help(example, capsys):
    with pytest.raises(SystemExit) as exit_:
        example.main(["--no-measure", "--max-time-ratio", "2.5"])
    assert exit_.value.code == 2
    assert "need the measurement" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for action in example.parser()._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, action.option_strings
        if action.default not in (None, False):
            # --threads says its default and why (examples/_threads.py): "default N: ..."
            shown = (f"(default: {action.default})", f"default {action.default}:")
            assert any(text in out for text in shown), action.option_strings
