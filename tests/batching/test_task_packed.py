"""Packed sequences under task batching (funcmeta._src.batching.packed): ``pack_padded_sequence`` ->
``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` -> ``pad_packed_sequence`` inside a model, with lengths
that differ within and across tasks, exact against a loop of ``fm.adapt`` over the tasks
(torch's own packed kernels) in float64, second and first order; what it hands to the loop,
said once; torch's own errors for lengths it refuses."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from helpers import DEVICES, per_task
from test_task_recurrent import _counting, _layer, _meta_grads
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import funcmeta as fm

DTYPE = torch.float64
T, N, L, IN, HID = 3, 4, 6, 3, 4


class Reader(nn.Module):
    """Packs its input, runs the recurrent layer, pads the output back and reads out the
    mean over each sequence's steps and the last layer's final state."""

    def __init__(self, rnn: nn.RNNBase, *, total: bool = True, presorted: bool = False) -> None:
        super().__init__()
        self.rnn, self.total, self.presorted = rnn, total, presorted
        width = rnn.proj_size or rnn.hidden_size
        self.out = nn.Linear(width * (3 if rnn.bidirectional else 2), 2)

    def forward(self, x: Tensor, lengths: Tensor, h0=None) -> Tensor:
        bf = self.rnn.batch_first
        packed = pack_padded_sequence(x, lengths, batch_first=bf, enforce_sorted=self.presorted)
        out, state = self.rnn(packed) if h0 is None else self.rnn(packed, h0)
        h = state[0] if isinstance(state, tuple) else state
        total = x.shape[1 if bf else 0] if self.total else None
        padded, lens = pad_packed_sequence(out, batch_first=bf, total_length=total)
        # pad_packed_sequence gives the lengths on the CPU, whatever the device
        pooled = padded.sum(1 if bf else 0) / lens.unsqueeze(-1).to(padded.device, padded.dtype)
        return self.out(torch.cat([pooled, h[-1]], -1))


def _data(batch_first: bool, seed: int = 0, *, presorted: bool = False, nan: bool = False):
    """Inputs, lengths (each task's longest a different length) and labels."""
    g = torch.Generator().manual_seed(seed)
    shape = (T, N, L, IN) if batch_first else (T, L, N, IN)
    x = torch.randn(shape, generator=g, dtype=DTYPE)
    lengths = torch.stack(
        [torch.randint(1, L + 1 - t, (N,), generator=g) for t in range(T)]
    )  # task t's sequences at most L - t long
    lengths[0, 1] = L
    if presorted:
        lengths = lengths.sort(1, descending=True).values
    if nan:  # the padding past each length holds NaN; a packed sequence never reads it
        steps = torch.arange(L).view(1, L, 1)
        past = (steps >= lengths.unsqueeze(1)).unsqueeze(-1)  # (T, L, N, 1)
        x = x.masked_fill(past.transpose(1, 2) if batch_first else past, float("nan"))
    return x, lengths, torch.randint(0, 2, (T, N), generator=g)


@pytest.fixture
def passes(monkeypatch):
    """Counts the one-pass computations of a recurrent layer's stack (packed or not)."""
    return _counting(monkeypatch, "_layers")


def _compare(net, x, extra, y, *, first_order=False, rtol=1e-9):
    fmodel = fm.functional_model(net)
    ref_loss, ref = _meta_grads(fmodel, x, y, False, first_order=first_order, extra=extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, ours = _meta_grads(fmodel, x, y, True, first_order=first_order, extra=extra)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    scale = max(float(g.abs().max()) for g in ref)
    assert scale > 0
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale)
    return fmodel


def _once_per_task(fmodel, x, lengths, y, match: str, reference=None) -> None:
    """The task-batched run falls back to once per task, saying ``match``, and its
    meta-gradients are the loop's (of ``reference``, by default ``fmodel`` itself)."""
    _, ref = _meta_grads(reference or fmodel, x, y, False, extra=(lengths,))
    with pytest.warns(UserWarning, match=match):
        _, ours = _meta_grads(fmodel, x, y, True, extra=(lengths,))
    assert fmodel.per_task is True
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


CONFIGS = [
    dict(kind=kind, num_layers=layers, bidirectional=bi, batch_first=bf)
    for kind, layers, bi, bf in itertools.product(
        ["rnn_tanh", "lstm", "gru"], [1, 2], [False, True], [False, True]
    )
    if not (layers == 2 and not bi and bf)
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_packed_layers_equal_the_per_task_loop_in_second_order(config, passes):
    torch.manual_seed(0)
    kind = config.pop("kind")
    net = Reader(_layer(kind, **config)).to(DTYPE)
    x, lengths, y = _data(config["batch_first"])
    fmodel = _compare(net, x, (lengths,), y)
    assert fmodel.per_task is False and not fmodel.per_task_layers
    assert len(passes) >= 3  # two inner steps and the query pass, all tasks at once


@pytest.mark.parametrize("kind", ["rnn_relu", "lstm", "gru"])
def test_first_order_and_presorted_lengths(kind, passes):
    torch.manual_seed(1)
    net = Reader(_layer(kind, bidirectional=True), presorted=True).to(DTYPE)
    x, lengths, y = _data(False, 1, presorted=True)
    _compare(net, x, (lengths,), y, first_order=True)
    assert len(passes) >= 3


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_initial_state_per_task_follows_the_sort(kind, passes):
    """A given ``hx`` is in the caller's order; the layer sorts it as it sorts the batch, and
    ``h_n`` comes back in the caller's order."""
    torch.manual_seed(2)
    net = Reader(_layer(kind, num_layers=2, bidirectional=True)).to(DTYPE)
    x, lengths, y = _data(False, 2)
    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(T, 4, N, HID, generator=g, dtype=DTYPE)
    extra = (lengths, (h0, torch.randn_like(h0)) if kind == "lstm" else h0)
    _compare(net, x, extra, y)
    assert len(passes) >= 3


def test_lstm_with_a_projection(passes):
    torch.manual_seed(3)
    net = Reader(nn.LSTM(IN, HID, proj_size=2, num_layers=2, bidirectional=True)).to(DTYPE)
    x, lengths, y = _data(False, 3)
    _compare(net, x, (lengths,), y)
    assert len(passes) >= 3


class Shared(Reader):
    """The same lengths for every task, given as a Python list."""

    def forward(self, x: Tensor, h0=None) -> Tensor:
        return super().forward(x, [L, 2, 5, 1], h0)


def test_lengths_shared_by_the_tasks_as_a_list(passes):
    torch.manual_seed(4)
    net = Shared(_layer("gru")).to(DTYPE)
    x, _, y = _data(False, 4)
    _compare(net, x, (), y)
    assert len(passes) >= 3


def test_nan_in_the_padding_stays_out(passes):
    """What lies past a sequence's length is never read by a packed layer, so NaN there
    changes nothing, in the gradients either."""
    torch.manual_seed(5)
    net = Reader(_layer("lstm", bidirectional=True)).to(DTYPE)
    x, lengths, y = _data(False, 5, nan=True)
    _compare(net, x, (lengths,), y)
    assert len(passes) >= 3


def test_pad_without_total_length_where_the_longest_agree(passes):
    torch.manual_seed(6)
    net = Reader(_layer("gru"), total=False).to(DTYPE)
    x, lengths, y = _data(False, 6)
    lengths[:, 0] = L  # every task's longest sequence is L long
    _compare(net, x, (lengths,), y)
    assert len(passes) >= 3


def test_pad_without_total_length_where_the_longest_differ_runs_once_per_task():
    """Each task's padded output would be as long as its own longest sequence: a loop's
    shapes differ, so the model runs once per task, exactly, and says why."""
    torch.manual_seed(7)
    net = Reader(_layer("gru"), total=False).to(DTYPE)
    x, lengths, y = _data(False, 7)
    _once_per_task(fm.functional_model(net), x, lengths, y, "once per task.*total_length")


class DataReader(nn.Module):
    """Reads the packed output's ``data`` directly (one row per valid step)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.GRU(IN, HID), nn.Linear(HID, 2)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return self.out(out.data.mean(0, keepdim=True)).expand(x.shape[1], 2)


def test_reading_the_packed_data_runs_once_per_task():
    torch.manual_seed(8)
    net = DataReader().to(DTYPE)
    x, lengths, y = _data(False, 8)
    fmodel = fm.functional_model(net)
    _once_per_task(fmodel, x, lengths, y, "once per task.*packed sequence")
    assert "packed sequence" in next(iter(fmodel.per_task_layers.values()))


def test_hooks_run_each_task_on_its_own_packed_sequence(passes):
    """A layer with hooks steps aside: it runs once per task, on each task's own
    ``PackedSequence``, and the hook sees one."""
    torch.manual_seed(9)
    net = Reader(_layer("lstm", num_layers=2)).to(DTYPE)
    seen: list[type] = []
    net.rnn.register_forward_hook(lambda m, a, out: seen.append(type(a[0])))
    x, lengths, y = _data(False, 9)
    fmodel = fm.functional_model(net)
    _, ref = _meta_grads(fmodel, x, y, False, extra=(lengths,))
    with pytest.warns(UserWarning, match="once per task: it has hooks"):
        _, ours = _meta_grads(fmodel, x, y, True, extra=(lengths,))
    assert fmodel.per_task is False and "rnn" in fmodel.per_task_layers
    assert set(seen) == {torch.nn.utils.rnn.PackedSequence}
    assert not passes
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_float32_lstm_runs_one_pass_in_first_order_too(passes):
    """oneDNN's fused LSTM takes padded input only: torch runs a packed sequence op by op on
    CPU, so the one pass serves first order in float32 too."""
    torch.manual_seed(10)
    net = Reader(_layer("lstm", bidirectional=True))
    x, lengths, y = _data(False, 10)
    x = x.float()
    _compare(net, x, (lengths,), y, first_order=True, rtol=1e-5)
    assert passes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["first", "second"])
def test_packed_lstm_on_the_device_equals_the_loop(order, passes, device):
    """On CUDA first-order steps run cuDNN's packed kernel once per task (each task's own
    packed sequence); second-order steps the one pass (cuDNN has no double backward). A CPU
    has no fused packed kernel: the one pass in both orders. The lengths stay on the host
    (``pack_padded_sequence`` takes them there) while the sequences are on the device."""
    torch.manual_seed(10)
    net = Reader(_layer("lstm", num_layers=2, bidirectional=True)).to(device)
    x, lengths, y = _data(False, 10)
    x, y = x.float().to(device), y.to(device)
    assert lengths.device.type == "cpu"
    _compare(net, x, (lengths,), y, first_order=order == "first", rtol=1e-4)
    assert bool(passes) == (order == "second" or device == "cpu")


def test_a_zero_length_gives_torchs_error():
    net = Reader(_layer("gru")).to(DTYPE)
    x, lengths, y = _data(False, 11)
    lengths[2, 3] = 0
    fmodel = fm.functional_model(net)
    with pytest.raises(RuntimeError, match="greater than 0") as loop:
        _meta_grads(fmodel, x, y, False, extra=(lengths,))
    with pytest.raises(RuntimeError) as ours:
        _meta_grads(fmodel, x, y, True, extra=(lengths,))
    assert str(ours.value) == str(loop.value)
    assert fmodel.per_task is not True


def test_a_length_beyond_the_input_is_an_error_naming_the_task():
    """torch does not check it (it reads past the input's end); here it is refused."""
    net = Reader(_layer("gru")).to(DTYPE)
    x, lengths, y = _data(False, 11)
    lengths[2, 0] = L + 1
    fmodel = fm.functional_model(net)
    with pytest.raises(ValueError, match=r"task 2's lengths \[7, .*exceed the input's 6"):
        _meta_grads(fmodel, x, y, True, extra=(lengths,))


def test_unsorted_lengths_with_enforce_sorted_give_torchs_error():
    net = Reader(_layer("gru"), presorted=True).to(DTYPE)
    x, lengths, _ = _data(False, 12)
    lengths[1] = torch.tensor([1, 2, 2, 1])
    fmodel = fm.functional_model(net)
    with pytest.raises(RuntimeError, match="sorted") as ours:
        fm.apply_tasks(fmodel, fmodel.params, (x, lengths))
    assert "sorted" in str(ours.value)
    assert fmodel.per_task is not True


def test_nothing_else_is_refused_for_a_model_without_packing():
    """Models that never pack keep their fast paths: the token checks never fire."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)
    fmodel = fm.functional_model(net)
    x = torch.randn(T, N, 3, dtype=DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = fm.apply_tasks(fmodel, fmodel.params, x)
    torch.testing.assert_close(out, torch.stack([net(x[t]) for t in range(T)]))


def test_two_task_axes_run_once_per_task_exactly():
    """Packing under two vmap levels would need a task-batched sequence at each: the model
    runs once per task of both, exactly, and says so."""
    torch.manual_seed(13)
    net = Reader(_layer("lstm", bidirectional=True)).to(DTYPE)
    fmodel = fm.functional_model(net)
    params = per_task(dict(fmodel.params), T, 13, 0.1)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, T, L, N, IN, generator=g, dtype=DTYPE)
    lengths = torch.randint(1, L + 1, (2, T, N), generator=g)
    with pytest.warns(UserWarning, match="outer vmap level"):
        out = torch.func.vmap(torch.func.vmap(fmodel), in_dims=(None, 0, 0))(params, x, lengths)
    for i, t in itertools.product(range(2), range(T)):
        one = {k: v[t] for k, v in params.items()}
        want = torch.func.functional_call(net, one, (x[i, t], lengths[i, t]))
        torch.testing.assert_close(out[i, t], want, rtol=1e-13, atol=1e-14)


def test_a_checkpointed_recurrent_layer_runs_once_per_task_exactly():
    """A checkpointed layer runs outside the vmap level, where a task-batched packed sequence
    cannot go: the model runs once per task, and the meta-gradients are the loop's."""
    torch.manual_seed(14)
    net = Reader(_layer("gru", num_layers=2)).to(DTYPE)
    x, lengths, y = _data(False, 14)
    fmodel = fm.functional_model(net, checkpoint_layers=["rnn"])
    _once_per_task(fmodel, x, lengths, y, "packed sequence", fm.functional_model(net))


class Packer(nn.Module):
    """Returns the packed output itself."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(IN, HID)

    def forward(self, x: Tensor, lengths: Tensor):
        return self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))[0]


def test_a_packed_sequence_as_the_output_runs_once_per_task():
    """Tasks whose sums of lengths agree stack in a loop: the output is each task's real
    packed data, never the padded steps behind the tokens."""
    net = Packer().to(DTYPE)
    fmodel = fm.functional_model(net)
    x, _, _ = _data(False, 15)
    lengths = torch.tensor([[4, 3, 3, 2], [4, 4, 2, 2], [4, 2, 3, 3]])  # 12 steps, 4 at most
    with pytest.warns(UserWarning, match="packed sequence in the model's output"):
        out, _ = fm.apply_tasks(fmodel, fmodel.params, (x, lengths))
    assert fmodel.per_task is True
    for t in range(T):
        want = net(x[t], lengths[t])
        torch.testing.assert_close(out.data[t], want.data, rtol=1e-13, atol=1e-14)
        assert torch.equal(out.batch_sizes[t], want.batch_sizes)


def test_host_lengths_meet_device_steps_on_the_device():
    """``pack_padded_sequence`` keeps lengths on the host while the steps live on the
    device; every tensor the batched pack derives from both is made on the steps' device.
    On a CPU the "meta" device stands in for CUDA: mixing it with host tensors raises as
    CUDA does ("not on the expected device")."""
    from funcmeta._src.batching.packed import TaskPacked

    lengths = torch.tensor([[3, 2, 1], [2, 2, 1]])
    padded = torch.zeros(2, 3, 3, 4, device="meta")
    packed = TaskPacked(padded, lengths, level=1)
    assert packed.valid().device.type == "meta"
    assert packed.valid().shape == (2, 3, 3)
    assert packed.empty((2, 3)).device.type == "meta"
    assert packed.batch_sizes().device.type == "cpu"  # torch's PackedSequence keeps them there
    assert packed.batch_sizes().tolist() == [[3, 2, 1], [3, 2, 0]]
    with pytest.raises(RuntimeError, match="device"):  # the mistake the stand-in avoids
        _ = torch.arange(3, device="meta").view(1, -1, 1) < lengths.unsqueeze(1)
