"""task_chunk="tune": the first calls of each kind measure all tasks at once, one at a time and
a quarter at a time, and later calls take the fastest; every call's results are the pinned
chunk's (float64), the measurement marks change no gradient, and the choice is reported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import chunks_run
from torch import nn

import funcmeta as fm
from funcmeta._src.batching.chunks import ChunkTuner, candidate_chunks

DTYPE = torch.float64
CPU = torch.device("cpu")


def finish(trial, forward, backward=None):
    """Give a trial the times it would have measured."""
    trial.forward, trial.ran = forward, True
    if backward is not None:
        trial.backward_out, trial.backward_in = 10.0, 10.0 + backward


def test_the_tuner_warms_up_tries_every_candidate_twice_and_keeps_the_fastest():
    tuner = ChunkTuner()
    first = tuner.start("k", "kind", 16, CPU, True)
    assert first.chunk is None and not tuner.timed(first)  # the warm-up
    # each candidate twice, the second round in reverse; the least of its two times counts
    times = {None: [3.0, 2.5], 1: [1.0, 1.9], 4: [2.0, 0.8]}
    for want, r in [(None, 0), (1, 0), (4, 0), (4, 1), (1, 1), (None, 1)]:
        trial = tuner.start("k", "kind", 16, CPU, True)
        assert trial.chunk == want and tuner.timed(trial)
        finish(trial, 0.5, times[want][r] - 0.5)
    later = tuner.start("k", "kind", 16, CPU, True)
    assert later.chunk == 4 and not tuner.timed(later)
    assert tuner.choices["kind"]["chunk"] == 4
    assert tuner.choices["kind"]["seconds"] == pytest.approx({None: 2.5, 1: 1.0, 4: 0.8})
    # another kind of call is measured on its own
    assert tuner.start("other", "other kind", 16, CPU, True).chunk is None  # its warm-up


def test_a_pass_given_a_measured_loops_chunk_counts_with_that_trial_while_it_is_open():
    """ChunkTuner.count_with(trial, run): the pass's forward counts with the trial it was given
    once the loop's forward has finished and until its backward begins; before or after, the
    pass runs uncounted. Another trial of the same kind is left alone."""
    tuner = ChunkTuner()
    tuner.start("k", "kind", 4, CPU, False)  # warm-up
    trial, other = tuner.start("k", "kind", 4, CPU, False), tuner.start("k", "kind", 4, CPU, False)
    assert tuner.timed(trial) and tuner.timed(other)
    ran = []

    def run():
        ran.append(1)
        return torch.ones(2), {}

    tuner.count_with(trial, run)  # the loop's forward has not finished: not counted
    assert trial.query_forward == 0.0 and len(ran) == 1
    finish(trial, 0.1)
    out, buffers = tuner.count_with(trial, run)
    assert torch.equal(out, torch.ones(2)) and buffers == {} and len(ran) == 2
    assert trial.query_forward > 0 and other.query_forward == 0.0
    counted = trial.query_forward
    trial.backward_out = 1.0  # its backward has begun: the trial is closed
    tuner.count_with(trial, run)
    assert trial.query_forward == counted and len(ran) == 3


@pytest.mark.parametrize(
    "tasks, want",
    [
        (1, [None]),
        (2, [None, 1]),
        (4, [None, 1]),
        (5, [None, 1, 4]),
        (16, [None, 1, 4]),
        (17, [None, 1, 4, 16]),
        (64, [None, 1, 4, 16]),
        (65, [None, 1, 4, 16, 64]),
    ],
)
def test_the_candidates_are_all_and_powers_of_four_below_the_task_count(tasks, want):
    assert candidate_chunks(tasks) == want


def test_trials_waiting_for_their_backward_are_not_issued_twice():
    """Several calls of one kind before one backward (MAML++'s steps): each candidate is
    issued once, the rest run all at once until the backward gives the times."""
    tuner = ChunkTuner()
    tuner.start("k", "kind", 4, CPU, True)  # warm-up
    a = tuner.start("k", "kind", 4, CPU, True)
    b = tuner.start("k", "kind", 4, CPU, True)
    c = tuner.start("k", "kind", 4, CPU, True)
    assert (a.chunk, b.chunk, c.chunk) == (None, 1, None) and not tuner.timed(c)
    finish(a, 0.1, 0.1)
    finish(b, 0.1, 0.5)
    d = tuner.start("k", "kind", 4, CPU, True)  # the second round, in reverse
    e = tuner.start("k", "kind", 4, CPU, True)
    assert (d.chunk, e.chunk) == (1, None) and tuner.timed(d) and tuner.timed(e)
    finish(d, 0.1, 0.4)
    finish(e, 0.1, 0.2)
    assert tuner.start("k", "kind", 4, CPU, True).chunk is None  # all at once: 0.2 s < 0.5 s


def test_a_trial_whose_backward_never_comes_is_retried_then_given_up():
    tuner = ChunkTuner()
    tuner.start("k", "kind", 4, CPU, True)
    for _ in range(60):
        tuner.start("k", "kind", 4, CPU, True)  # no backward ever
    assert tuner.choices["kind"]["chunk"] is None
    assert "did not come" in tuner.choices["kind"]["note"]


def test_calls_without_backward_are_timed_by_their_forward():
    tuner = ChunkTuner()
    tuner.start("k", "kind", 2, CPU, False)
    for forward in (2.0, 1.0, 1.2, 2.1):  # all, 1, 1, all
        finish(tuner.start("k", "kind", 2, CPU, False), forward)
    assert tuner.start("k", "kind", 2, CPU, False).chunk == 1


def test_one_task_and_accelerators_run_all_at_once():
    tuner = ChunkTuner()
    for _ in range(4):
        assert tuner.start("one", "one", 1, CPU, True).chunk is None
        assert tuner.start("gpu", "gpu", 8, torch.device("cuda"), True).chunk is None
    assert tuner.choices == {}


def problem(tasks=4):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).to(DTYPE)
    b = fm.data.Sinusoid().sample(
        tasks, 5, 5, generator=torch.Generator().manual_seed(1), dtype=DTYPE
    )
    return net, b


def meta_gradients(fmodel, b, **kwargs):
    out = fm.recipes.maml(
        fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=2, lr=0.1, **kwargs
    )
    grads = torch.autograd.grad(out.loss, list(fmodel.params.values()))
    return out, grads


@pytest.mark.parametrize("first_order", [False, True])
def test_every_tune_call_gives_the_pinned_results(first_order, monkeypatch):
    net, b = problem(tasks=8)
    tuned = fm.functional_model(net)
    pinned = fm.functional_model(net)
    seen = chunks_run(monkeypatch)
    chunks = []
    for _ in range(10):
        seen.clear()
        out, grads = meta_gradients(tuned, b, first_order=first_order, task_chunk="tune")
        chunks.append(out.adapted.chunk.chunk)
        # the two inner steps and the query pass, which follows the inner loop's chunk
        assert seen == [chunks[-1]] * 3
        ref, ref_grads = meta_gradients(pinned, b, first_order=first_order, task_chunk=None)
        assert ref.adapted.chunk.chunk is None
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-12, atol=1e-14)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)
    # the warm-up, then every candidate twice, the second round in reverse
    assert chunks[:7] == [None, None, 1, 4, 4, 1, None]
    (choice,) = tuned.task_chunk_choices.values()
    assert sorted(choice["seconds"], key=str) == sorted([None, 1, 4], key=str)
    assert all(s > 0 for s in choice["seconds"].values())
    best = min(choice["seconds"], key=choice["seconds"].get)
    assert choice["chunk"] == best and chunks[7:] == [best] * 3
    label = next(iter(tuned.task_chunk_choices))
    assert label.startswith("8 tasks, 2 steps, batch (8, 5, 1), (8, 5, 1), with backward")


def test_the_backward_is_timed_when_it_runs():
    net, b = problem()
    fmodel = fm.functional_model(net)
    tuner = fmodel.executor.tuner
    for _ in range(2):
        meta_gradients(fmodel, b, task_chunk="tune")
    (kind,) = tuner.kinds.values()
    (trial,) = kind.pending  # the all-at-once trial, its times taken at the next call
    assert trial.chunk is None and trial.forward > 0
    assert trial.backward_out is not None and trial.backward_in >= trial.backward_out
    # the query pass that followed (fm.task_losses in the recipe, given the inner loop's
    # chunk) is timed with it: its forward, and its backward from the moment the backward
    # reached its outputs
    assert trial.query_forward > 0
    assert trial.backward_query is not None and trial.backward_query <= trial.backward_out
    meta_gradients(fmodel, b, task_chunk="tune")
    assert kind.measured[None] == pytest.approx(
        [trial.forward + trial.query_forward + trial.backward_in - trial.backward_query]
    )
    # evaluation under no_grad is another kind, timed by its forward
    with torch.no_grad():
        for _ in range(6):  # warm-up, two trials twice, and the call that decides
            fm.adapt_tasks(
                fmodel,
                fmodel.params,
                F.mse_loss,
                b.support,
                fm.optim.sgd(lr=0.1),
                steps=2,
                task_chunk="tune",
            )
    labels = list(fmodel.task_chunk_choices)
    assert any("without backward" in label for label in labels)


def test_in_place_changes_to_outputs_and_adapted_parameters_work_through_the_trials():
    """The trials note the backward with gradient hooks, not identity nodes: a user's
    in-place change to the query outputs or the adapted parameters (allowed on ordinary
    autograd results) works on every call, trial or not, with the pinned chunk's
    meta-gradients (float64). An identity ``autograd.Function`` made its outputs views that
    refuse in-place changes, so such code failed only on the measured calls."""
    net, b = problem(tasks=8)
    tuned, pinned = fm.functional_model(net), fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.1)

    def meta(fmodel, task_chunk):
        r = fm.adapt_tasks(
            fmodel, fmodel.params, F.mse_loss, b.support, opt, steps=2, task_chunk=task_chunk
        )
        r.params["2.bias"].mul_(0.5)  # in place, on an adapted parameter
        out, _ = fm.apply_tasks(fmodel, r.params, b.query[0], task_chunk=r.chunk)
        out.mul_(2.0)  # in place, on the query outputs
        losses = fm.task_losses(fmodel, r.params, F.mse_loss, b.query, task_chunk=r.chunk).losses
        losses.add_(1.0)
        loss = F.mse_loss(out, b.query[1]) + losses.mean()
        return torch.autograd.grad(loss, list(fmodel.params.values()))

    for _ in range(10):  # the warm-up, the six trials, and the calls after the choice
        for g, r in zip(meta(tuned, "tune"), meta(pinned, None), strict=True):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)
    (choice,) = tuned.task_chunk_choices.values()
    assert all(s > 0 for s in choice["seconds"].values())


def test_pinned_calls_between_tuned_ones_neither_measure_nor_disturb_the_measuring():
    """The chunk is each call's own: calls of one model with ``task_chunk=2`` between its
    ``"tune"`` calls run on 2, are not measured, and leave the tuned calls' sequence (the
    warm-up, each of the 4 tasks' candidates twice, then the choice) as it is alone."""
    net, b = problem()
    alone, mixed = fm.functional_model(net), fm.functional_model(net)
    tuner = mixed.executor.tuner
    chunks, alone_chunks = [], []
    for _ in range(7):
        alone_chunks.append(meta_gradients(alone, b, task_chunk="tune")[0].adapted.chunk.chunk)
        chunks.append(meta_gradients(mixed, b, task_chunk="tune")[0].adapted.chunk.chunk)
        measured = {c: list(t) for kind in tuner.kinds.values() for c, t in kind.measured.items()}
        out, _ = meta_gradients(mixed, b, task_chunk=2)
        assert out.adapted.chunk.chunk == 2
        assert len(tuner.kinds) == 1  # the pinned calls are no kind of their own
        (kind,) = tuner.kinds.values()
        assert kind.measured == measured and all(t.chunk != 2 for t in kind.pending)
    assert chunks[:5] == [None, None, 1, 1, None]
    (choice,) = mixed.task_chunk_choices.values()
    assert sorted(choice["seconds"], key=str) == sorted([None, 1], key=str)
    assert chunks[5:] == [choice["chunk"]] * 2
    assert alone_chunks[:5] == chunks[:5]


def test_inside_a_torch_func_transform_all_tasks_run_at_once_untimed():
    net, b = problem()
    fmodel = fm.functional_model(net)
    params = fmodel.params

    def meta_loss(p):
        out = fm.recipes.maml(
            fmodel, p, F.mse_loss, b.support, b.query, steps=1, lr=0.1, task_chunk="tune"
        )
        return out.loss

    for _ in range(3):
        grads = torch.func.grad(meta_loss)(params)
    assert fmodel.executor.tuner.kinds == {}
    ref = torch.autograd.grad(meta_loss(params), list(params.values()))
    for g, r in zip(grads.values(), ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)


class _Encoder(nn.Module):
    """A transformer layer on PyTorch's attention, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("build, width", [(_Encoder, 8), (_Recurrent, 4)], ids=["encoder", "lstm"])
def test_real_models_give_the_pinned_results_through_the_trials(build, width):
    """A transformer layer and an LSTM through the warm-up, the three trials and the choice:
    every call's meta-gradients are the pinned chunk's (float64)."""
    torch.manual_seed(0)
    net = build().to(DTYPE)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 6, 5, width, generator=g, dtype=DTYPE)  # 8 tasks of 6 sequences
    y = torch.randint(0, 3, (8, 6), generator=g)
    tuned, pinned = fm.functional_model(net), fm.functional_model(net)
    support, query = (x[:, :3], y[:, :3]), (x[:, 3:], y[:, 3:])
    for _ in range(8):
        grads = []
        for fmodel, task_chunk in ((tuned, "tune"), (pinned, None)):
            out = fm.recipes.maml(
                fmodel,
                fmodel.params,
                F.cross_entropy,
                support,
                query,
                steps=2,
                lr=0.1,
                task_chunk=task_chunk,
            )
            grads.append(torch.autograd.grad(out.loss, list(fmodel.params.values())))
        for a, p in zip(*grads, strict=True):
            torch.testing.assert_close(a, p, rtol=1e-10, atol=1e-12)
    assert len(tuned.task_chunk_choices) == 1


def test_a_trial_call_that_raises_is_not_taken_for_a_fast_one():
    """A call that fails (here a non-finite inner loss, refused) leaves its trial unfinished:
    it must not count as zero seconds and win."""
    net, b = problem()
    fmodel = fm.functional_model(net)
    bad = (b.support[0], torch.full_like(b.support[1], float("nan")))
    opt = fm.optim.sgd(lr=0.1)
    tune = {"steps": 1, "task_chunk": "tune"}
    with torch.no_grad():
        fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support, opt, **tune)  # warm-up
        with pytest.raises(fm.NonFiniteError):
            fm.adapt_tasks(
                fmodel, fmodel.params, F.mse_loss, bad, opt, on_nonfinite="raise", **tune
            )
        for _ in range(12):
            fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support, opt, **tune)
    (choice,) = fmodel.task_chunk_choices.values()
    assert all(s > 0 for s in choice["seconds"].values())
