"""Threads: models in different threads are independent; one model run by two threads at once
either gives each thread its single-threaded result or raises fm.ConcurrentUseError, which
names the concurrent use and the fix, never torch's vmap message or a wrong number."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

THREADS, CALLS = 4, 5
SGD = fm.optim.sgd(lr=0.1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def _batch(thread: int, call: int, tasks: int | None):
    g = torch.Generator().manual_seed(100 * thread + call)
    lead = (tasks,) if tasks else ()
    x = torch.randn(*lead, 5, 1, 6, 6, generator=g)
    y = torch.randint(0, 3, (*lead, 5), generator=g)
    return x, y


def _one_call(fmodel, params, thread: int, call: int, batch=None):
    """fm.adapt on even calls, fm.adapt_tasks on odd ones; the adapted parameters and the
    meta-gradient of the query loss. ``batch(thread, call, tasks)`` makes the inputs and
    targets (default: the conv net's images)."""
    batched = call % 2 == 1
    x, y = (batch or _batch)(thread, call, 3 if batched else None)
    if batched:
        result = fm.adapt_tasks(fmodel, params, F.cross_entropy, (x, y), SGD, steps=2)
        query = fm.task_losses(fmodel, result.params, F.cross_entropy, (x, y)).losses.mean()
    else:
        result = fm.adapt(fmodel, params, F.cross_entropy, (x, y), SGD, steps=2)
        query = F.cross_entropy(fmodel(result.params, x), y)
    grads = torch.autograd.grad(query, list(params.values()))
    return [t.detach() for t in result.params.values()] + list(grads)


def _run_threads(work):
    """Runs ``work(thread, call)`` in THREADS threads at once. Each thread first takes this
    thread's intra-op thread count: torch.set_num_threads reaches only the thread that calls
    it (a new thread's oneDNN kernels use OpenMP's count from the start: the cores), and
    oneDNN's convolution weight gradient rounds differently with another count."""
    barrier = threading.Barrier(THREADS)
    outcomes: dict[tuple[int, int], object] = {}
    intra_op = torch.get_num_threads()

    def body(thread: int) -> None:
        torch.set_num_threads(intra_op)
        barrier.wait()
        for call in range(CALLS):
            try:
                outcomes[thread, call] = work(thread, call)
            except Exception as error:  # every outcome is judged below
                outcomes[thread, call] = error

    threads = [threading.Thread(target=body, args=(i,), name=f"worker-{i}") for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return outcomes


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("checkpoint_layers", [None, "sequential"])
def test_one_model_in_four_threads_gives_each_its_own_result_or_the_named_error(
    checkpoint_layers,
):
    net = _net()
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint_layers)
    expected = {
        (i, j): _one_call(fmodel, fmodel.params, i, j) for i in range(THREADS) for j in range(CALLS)
    }
    outcomes = _run_threads(lambda i, j: _one_call(fmodel, fmodel.params, i, j))
    assert len(outcomes) == THREADS * CALLS
    for key, outcome in outcomes.items():
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, fm.ConcurrentUseError), f"{key}: {outcome!r}"
            assert "one model cannot run in two threads at once" in str(outcome)
        else:
            assert _same(outcome, expected[key]), f"{key}: another result than alone"


def test_models_in_different_threads_are_independent():
    """A model per thread (the fix the error names), the shared parameters passed in: every
    call gives its single-threaded result, bit for bit, and nothing is refused."""
    net = _net()
    shared = fm.functional_model(net)
    expected = {
        (i, j): _one_call(shared, shared.params, i, j) for i in range(THREADS) for j in range(CALLS)
    }
    local = [fm.functional_model(copy.deepcopy(net)) for _ in range(THREADS)]
    outcomes = _run_threads(lambda i, j: _one_call(local[i], shared.params, i, j))
    for key, outcome in outcomes.items():
        assert not isinstance(outcome, BaseException), f"{key}: {outcome!r}"
        assert _same(outcome, expected[key]), key


class _Held(nn.Module):
    """A layer whose forward waits for a signal when asked: one thread stays inside a run."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.inside = threading.Event()
        self.release = threading.Event()
        self.hold = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hold:
            self.inside.set()
            assert self.release.wait(timeout=60)
        return self.fc(x)


def _held_run(fmodel, net: _Held, out: dict) -> threading.Thread:
    def body() -> None:
        out["held"] = fmodel(fmodel.params, torch.ones(3, 2))

    net.hold = True
    thread = threading.Thread(target=body, name="holder")
    thread.start()
    assert net.inside.wait(timeout=60)
    return thread


def test_a_second_thread_is_refused_by_name_and_the_first_finishes_right():
    net = _Held()
    fmodel = fm.functional_model(net)
    expected = net.fc(torch.ones(3, 2)).detach()
    out: dict = {}
    holder = _held_run(fmodel, net, out)
    try:
        with pytest.raises(fm.ConcurrentUseError) as raised:
            fm.adapt(
                fmodel,
                fmodel.params,
                F.mse_loss,
                (torch.ones(3, 2), torch.ones(3, 2)),
                SGD,
                steps=1,
            )
    finally:
        net.release.set()
        holder.join(timeout=60)
    text = str(raised.value)
    assert "the model _Held is running in thread 'holder'" in text
    assert f"thread {threading.current_thread().name!r} started another run" in text
    assert "fm.functional_model(copy.deepcopy(net))" in text
    assert torch.equal(out["held"].detach(), expected)
    net.hold = False  # and the model works again for this thread
    fm.adapt(fmodel, fmodel.params, F.mse_loss, (torch.ones(3, 2), torch.ones(3, 2)), SGD, steps=1)


def test_a_recomputation_in_a_backward_meets_another_threads_run():
    """A checkpointed layer recomputed in one thread's backward while another thread runs the
    model: refused before it puts a tensor in place; the run in progress is unharmed."""
    torch.manual_seed(0)
    net = nn.Sequential(_Held(), nn.Tanh(), nn.Linear(2, 1))
    fmodel = fm.functional_model(net, checkpoint_layers=["0", "2"])
    x, y = torch.randn(4, 2), torch.randn(4, 1)
    result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), SGD, steps=1)
    query = F.mse_loss(fmodel(result.params, x), y)
    out: dict = {}
    holder = _held_run(fmodel, net[0], out)
    try:
        with pytest.raises(fm.ConcurrentUseError, match="running in thread 'holder'"):
            query.backward()
    finally:
        net[0].release.set()
        holder.join(timeout=60)
    assert out["held"].shape == (3, 1)


def _attention_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(8 * 4, 3),
    )


def _sequences(thread: int, call: int, tasks: int | None):
    g = torch.Generator().manual_seed(100 * thread + call)
    lead = (tasks,) if tasks else ()
    return torch.randn(*lead, 5, 4, 8, generator=g), torch.randint(0, 3, (*lead, 5), generator=g)


def _attention_call(fmodel, params, thread: int, call: int):
    """A second-order step of a transformer layer (math attention only, no fast path: torch's
    process-wide flags)."""
    return _one_call(fmodel, params, thread, call, batch=_sequences)


@pytest.mark.parametrize("checkpoint_layers", [None, ["0"]])
def test_attention_models_in_different_threads_are_independent(checkpoint_layers):
    """Second-order steps need math attention and no MHA fast path, flags torch keeps for the
    whole process: a step ending in one thread leaves them set while another thread's step
    runs (before, flash attention came back mid-step: torch's missing-derivative error).
    Each thread's adapted parameters are its single-threaded ones, bit for bit. The query
    forward runs outside the step, on the kernels in force: math attention while another
    thread's step holds it, where alone it may run flash attention, so the meta-gradients
    agree to float32 round-off (docs/guarantees.md, "Threads"). The flags are the user's
    again afterwards."""
    from torch.backends import cuda as backends

    net = _attention_net()
    shared = fm.functional_model(net, checkpoint_layers=checkpoint_layers)
    flash_before = backends.flash_sdp_enabled()
    expected = {
        (i, j): _attention_call(shared, shared.params, i, j)
        for i in range(THREADS)
        for j in range(CALLS)
    }
    local = [
        fm.functional_model(copy.deepcopy(net), checkpoint_layers=checkpoint_layers)
        for _ in range(THREADS)
    ]
    outcomes = _run_threads(lambda i, j: _attention_call(local[i], shared.params, i, j))
    adapted = len(shared.params)
    for key, outcome in outcomes.items():
        assert not isinstance(outcome, BaseException), f"{key}: {outcome!r}"
        assert _same(outcome[:adapted], expected[key][:adapted]), key
        for ours, alone in zip(outcome[adapted:], expected[key][adapted:], strict=True):
            torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-6)
    assert backends.flash_sdp_enabled() == flash_before
    assert torch.backends.mha.get_fastpath_enabled()
