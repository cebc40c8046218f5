"""Resumable meta-training: a run killed mid-way and resumed ends bit-identical to an
uninterrupted one; states are written atomically; names are checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import flip_stored_bit

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


@pytest.mark.slow
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


class _Payload:
    """Unpickling this runs ``touch`` on a marker file: the trace a crafted file would leave."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_file_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "crafted.pt"
    fake = {"format": fm.snapshot.FORMAT, "step": 0, "modules": {}, "optimizers": {}}
    torch.save({**fake, "generators": {}, "random": {}, "extra": _Payload(marker)}, path)
    with pytest.raises(fm.snapshot.SnapshotError, match=r"crafted\.pt holds objects other than"):
        fm.snapshot.load(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is real: an unsafe load runs it
    assert marker.exists()


def test_files_that_are_not_snapshots_are_named(tmp_path):
    net = torch.nn.Linear(2, 1)
    good = tmp_path / "good.pt"
    fm.snapshot.save(good, step=1, modules={"net": net})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(fm.snapshot.SnapshotError, match=r"cut\.pt is truncated, corrupt"):
        fm.snapshot.load(cut, modules={"net": net})
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file at all" * 10)
    with pytest.raises(fm.snapshot.SnapshotError, match=r"junk\.pt is truncated, corrupt"):
        fm.snapshot.load(junk)
    weights = tmp_path / "weights.pt"
    torch.save(net.state_dict(), weights)
    with pytest.raises(fm.snapshot.SnapshotError, match=r"weights\.pt is not a funcmeta snapshot"):
        fm.snapshot.load(weights)
    future = tmp_path / "future.pt"
    torch.save({"format": fm.snapshot.FORMAT + 1, "step": 0}, future)
    with pytest.raises(
        fm.snapshot.SnapshotError,
        match=rf"future\.pt has snapshot format {fm.snapshot.FORMAT + 1}, newer",
    ):
        fm.snapshot.load(future)
    with pytest.raises(FileNotFoundError, match=r"no snapshot at .*missing\.pt"):
        fm.snapshot.load(tmp_path / "missing.pt")
    assert fm.snapshot.load(good, modules={"net": net}).step == 1


def test_extra_is_checked_when_saving(tmp_path):
    fine = {"loss": 0.5, "tag": "run", "none": None, "t": torch.ones(2), "hist": [1, (2.0, "x")]}
    fm.snapshot.save(tmp_path / "s.pt", step=0, extra={**fine, "nested": {"a": [True]}})
    back = fm.snapshot.load(tmp_path / "s.pt").extra
    assert back["hist"] == [1, (2.0, "x")] and torch.equal(back["t"], torch.ones(2))
    with pytest.raises(TypeError, match=r"extra\['nested'\]\['f'\] is a function"):
        fm.snapshot.save(tmp_path / "s.pt", step=0, extra={"nested": {"f": lambda: 0}})
    with pytest.raises(TypeError, match=r"extra\['s'\]\[1\] is a set"):
        fm.snapshot.save(tmp_path / "s.pt", step=0, extra={"s": [1, {2}]})
    with pytest.raises(TypeError, match="string keys only"):
        fm.snapshot.save(tmp_path / "s.pt", step=0, extra={"d": {1: 2}})


def test_restores_numpy_random_state(tmp_path):
    numpy = pytest.importorskip("numpy")
    numpy.random.seed(3)
    numpy.random.standard_normal()  # a cached Gaussian in the state
    fm.snapshot.save(tmp_path / "s.pt", step=0)
    expected = numpy.random.standard_normal(4)
    numpy.random.standard_normal(7)
    fm.snapshot.load(tmp_path / "s.pt")
    assert (numpy.random.standard_normal(4) == expected).all()


def _numpy_generators():
    numpy = pytest.importorskip("numpy")
    r = numpy.random
    return {
        "default_rng": r.default_rng(1),
        "mt19937": r.Generator(r.MT19937(2)),
        "philox": r.Generator(r.Philox(3)),
        "sfc64": r.Generator(r.SFC64(4)),
        "pcg64dxsm": r.Generator(r.PCG64DXSM(5)),
        "bit_generator": r.PCG64(6),
        "random_state": r.RandomState(7),
    }


def _draw(g):
    import random as pyrandom

    if isinstance(g, torch.Generator):
        return torch.rand(3, generator=g).tolist()
    if isinstance(g, pyrandom.Random):
        return [g.random(), g.gauss(0, 1), g.random()]
    if hasattr(g, "random_raw"):  # a bare bit generator
        return g.random_raw(3).tolist()
    if hasattr(g, "standard_normal"):
        return [float(g.standard_normal()), *g.random(2).tolist()]
    raise AssertionError(type(g))


def test_numpy_and_python_generators_resume_exactly(tmp_path):
    import random as pyrandom

    gens = {**_numpy_generators(), "python": pyrandom.Random(8), "torch": torch.Generator()}
    gens["torch"].manual_seed(9)
    for g in gens.values():  # a state mid-stream: cached Gaussians, half-used 64-bit words
        _draw(g)
    if hasattr(gens["random_state"], "standard_normal"):
        gens["random_state"].standard_normal()
    fm.snapshot.save(tmp_path / "s.pt", step=5, generators=gens)
    expected = {k: _draw(g) for k, g in gens.items()}
    for g in gens.values():
        _draw(g)
    assert fm.snapshot.load(tmp_path / "s.pt", generators=gens).step == 5
    assert {k: _draw(g) for k, g in gens.items()} == expected
    # the file still loads safely: weights_only, no NumPy object in it
    torch.load(tmp_path / "s.pt", weights_only=True)


def test_generator_kinds_are_checked(tmp_path):
    numpy = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"generators\['x'\] is a list; a generator is a"):
        fm.snapshot.save(tmp_path / "s.pt", step=0, generators={"x": [1, 2]})
    rng = numpy.random.default_rng(0)
    fm.snapshot.save(tmp_path / "s.pt", step=0, generators={"g": rng})
    before = torch.Generator().manual_seed(1)
    state = before.get_state()
    with pytest.raises(fm.snapshot.SnapshotError, match=r"is a torch\.Generator, but the saved"):
        fm.snapshot.load(tmp_path / "s.pt", generators={"g": before})
    assert torch.equal(before.get_state(), state)  # untouched
    other = numpy.random.Generator(numpy.random.MT19937(0))
    with pytest.raises(fm.snapshot.SnapshotError, match="draws from MT19937, but the saved state"):
        fm.snapshot.load(tmp_path / "s.pt", generators={"g": other})


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.eye(3).to_sparse(), r"extra\['t'\] is a torch.sparse_coo tensor.*to_dense"),
        (lambda: torch.eye(3).to_sparse_csr(), r"extra\['t'\] is a torch.sparse_csr tensor"),
        (lambda: torch.empty(3, device="meta"), r"extra\['t'\] is a tensor on the meta device"),
        (
            lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
            r"extra\['t'\] is a quantized tensor.*dequantize",
        ),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            r"extra\['t'\] is a nested tensor.*unbind",
        ),
    ],
    ids=["sparse", "sparse-csr", "meta", "quantized", "nested"],
)
def test_tensors_a_snapshot_cannot_hold_are_named(tmp_path, make, match):
    with pytest.raises(TypeError, match=match):
        fm.snapshot.save(tmp_path / "s.pt", step=0, extra={"t": make()})
    assert not (tmp_path / "s.pt").exists()


def test_checksums_are_those_of_the_bytes_as_before(tmp_path):
    """The digest hashed straight from memory equals the one the earlier releases wrote
    (the storage's bytes, copied): their files load, and a view, a transposed or conjugated
    tensor and an empty one hash as their contiguous copies."""
    import hashlib

    from funcmeta._src.snapshot.files import _digest_tensor

    def before(t):
        data = t.detach().cpu().contiguous().clone()
        h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
        h.update(bytes(data.untyped_storage()))
        return h.hexdigest()

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    cases = [
        base,
        base.t(),
        base[1:4, ::2],
        torch.empty(0, 3),
        base.to(torch.bfloat16),
        torch.arange(7),
        torch.tensor(2.5),
    ]
    for t in cases:
        assert _digest_tensor(t) == before(t)
    z = torch.randn(4, dtype=torch.complex64, generator=g)
    assert _digest_tensor(z.conj()) == before(z.conj().resolve_conj())


def _member(path, suffix):
    import zipfile

    with zipfile.ZipFile(path) as z:
        return next(n for n in z.namelist() if n.endswith(suffix))


def test_a_damaged_structure_record_is_refused_before_it_is_unpickled(tmp_path):
    net = torch.nn.Linear(3, 2)
    path = tmp_path / "s.pt"
    fm.snapshot.save(path, step=5, modules={"net": net}, extra={"note": "x" * 50})
    flip_stored_bit(path, _member(path, "data.pkl"), at=40, bit=0x01)
    with pytest.raises(
        fm.snapshot.SnapshotError, match=r"s\.pt is corrupt: .*the numbers and structure"
    ):
        fm.snapshot.load(path, modules={"net": torch.nn.Linear(3, 2)})


#: torch.save's switch for the records' CRC-32s (torch 2.6 on); before it every file has them,
#: and torch cannot write one without (what the tests below make to check the refusal).
CRC_SWITCH = pytest.mark.skipif(
    not hasattr(torch.serialization, "set_crc32_options"),
    reason="torch before 2.6 always stores each record's CRC-32: no file without them to test",
)


@CRC_SWITCH
def test_saves_store_crcs_even_when_torch_is_told_not_to(tmp_path):
    from funcmeta._src.snapshot.records import check_records

    net = torch.nn.Linear(3, 2)
    torch.serialization.set_crc32_options(False)
    try:
        fm.snapshot.save(tmp_path / "s.pt", step=1, modules={"net": net})
        assert not torch.serialization.get_crc32_options()  # the user's setting is kept
    finally:
        torch.serialization.set_crc32_options(True)
    check = check_records(tmp_path / "s.pt")
    assert check.has_crcs and check.bad == []
    flip_stored_bit(tmp_path / "s.pt", _member(tmp_path / "s.pt", "data/0"), bit=0x01)
    assert check_records(tmp_path / "s.pt").bad == [_member(tmp_path / "s.pt", "data/0")]


def _payload(fmt, net):
    from funcmeta._src.snapshot.files import _random_states

    return {
        "format": fmt,
        "step": 2,
        "modules": {"net": net.state_dict()},
        "optimizers": {},
        "generators": {},
        "random": _random_states(),
        "extra": {},
    }


@CRC_SWITCH
def test_a_format_4_file_without_crcs_is_refused(tmp_path):
    net = torch.nn.Linear(3, 2)
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(_payload(4, net), tmp_path / "s.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    with pytest.raises(fm.snapshot.SnapshotError, match="stores no CRC-32 of its records"):
        fm.snapshot.load(tmp_path / "s.pt", modules={"net": torch.nn.Linear(3, 2)})


@CRC_SWITCH
def test_format_3_files_load_and_their_sha256_checksums_are_checked(tmp_path):
    """Format 3 kept SHA-256 checksums in the payload; its files still load, and one written
    without record CRCs (so that only the SHA-256 can catch it) is refused when damaged."""
    from funcmeta._src.snapshot.files import _checksums

    net = torch.nn.Linear(3, 2)
    payload = _payload(3, net)
    payload["checksums"] = _checksums(payload)
    good = tmp_path / "good.pt"
    torch.save(payload, good)
    other = torch.nn.Linear(3, 2)
    assert fm.snapshot.load(good, modules={"net": other}).step == 2
    assert torch.equal(other.weight, net.weight)
    bad = tmp_path / "bad.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(payload, bad)
    finally:
        torch.serialization.set_crc32_options(True)
    flip_stored_bit(bad, _member(bad, "data/0"), bit=0x01)
    with pytest.raises(fm.snapshot.SnapshotError, match=r"bad\.pt is corrupt: .*\['net'\]"):
        fm.snapshot.load(bad, modules={"net": other})


def test_a_file_replaced_while_it_is_read_is_refused(tmp_path, monkeypatch):
    import funcmeta._src.snapshot.files as snapshot

    net = torch.nn.Linear(3, 2)
    path = tmp_path / "s.pt"
    fm.snapshot.save(path, step=1, modules={"net": net})
    real = snapshot.torch.load

    def load_after_a_replace(*args, **kwargs):  # another writer renames a new file over it
        fm.snapshot.save(path, step=2, modules={"net": net})
        return real(*args, **kwargs)

    monkeypatch.setattr(snapshot.torch, "load", load_after_a_replace)
    with pytest.raises(fm.snapshot.SnapshotError, match="replaced or changed while it was read"):
        fm.snapshot.load(path, modules={"net": torch.nn.Linear(3, 2)})


@pytest.mark.parametrize("damage", ["signature", "compressed", "extra-length"])
def test_record_checks_refuse_damaged_archives(tmp_path, damage):
    import zipfile

    from funcmeta._src.snapshot.records import check_records

    path = tmp_path / "t.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    raw = bytearray(path.read_bytes())
    if damage == "signature":  # the index survives, a record's local header does not
        with zipfile.ZipFile(path) as z:
            info = z.getinfo(_member(path, "data/0"))
        raw[info.header_offset : info.header_offset + 4] = b"XXXX"
        match = "damaged header"
    elif damage == "compressed":
        with zipfile.ZipFile(path) as z, zipfile.ZipFile(tmp_path / "c.pt", "w") as out:
            for name in z.namelist():
                out.writestr(name, z.read(name), compress_type=zipfile.ZIP_DEFLATED)
        raw = bytearray((tmp_path / "c.pt").read_bytes())
        match = "is compressed"
    else:
        with zipfile.ZipFile(path) as z:
            info = z.getinfo(_member(path, "data/0"))
        raw[info.header_offset + 28] = 0xFF  # a local extra length beyond the file
        raw[info.header_offset + 29] = 0xFF
        match = "runs past the end of the file"
    path.write_bytes(bytes(raw))
    with pytest.raises((zipfile.BadZipFile, ValueError), match=match):
        check_records(path)
    with pytest.raises(fm.snapshot.SnapshotError, match="truncated, corrupt or not a torch file"):
        fm.snapshot.load(path)


def test_only_torchs_own_load_path_goes_without_a_copy_to_put_back():
    from funcmeta._src.snapshot.files import _plain_load

    plain = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    assert _plain_load(plain)
    hooked = torch.nn.Sequential(torch.nn.Linear(2, 3))
    hooked[0]._register_load_state_dict_pre_hook(lambda *a, **k: None)
    assert not _plain_load(hooked)

    class Own(torch.nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):
            return super()._load_from_state_dict(*args, **kwargs)

    assert not _plain_load(torch.nn.Sequential(Own(2, 3)))


def test_a_last_module_that_fails_to_load_puts_everything_back(tmp_path):
    """A module whose own loading raises (a hook here) keeps a copy to put back, also when
    it is restored last; the module and optimizer restored before it are put back too."""
    first, last = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    opt = torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1, momentum=0.9)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    path = tmp_path / "s.pt"
    fm.snapshot.save(path, step=1, modules={"first": first, "last": last}, optimizers={"o": opt})
    a, b = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    opt2 = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1, momentum=0.9)
    before = [t.detach().clone() for t in (a.weight, a.bias, b.weight, b.bias)]

    def refuse(module, state_dict, prefix, *args):  # after the first entry is copied
        raise RuntimeError("refused by a hook")

    b.register_load_state_dict_post_hook(lambda *args: refuse(*args[:3]))
    with pytest.raises(
        fm.snapshot.SnapshotError,
        match=r"restoring modules\['last'\] failed .*nothing was restored",
    ):
        fm.snapshot.load(path, modules={"first": a, "last": b}, optimizers={"o": opt2})
    assert all(
        torch.equal(x, y) for x, y in zip(before, (a.weight, a.bias, b.weight, b.bias), strict=True)
    )
    assert opt2.state_dict()["state"] == {}


def test_a_plain_last_module_whose_device_fails_is_named_as_partly_restored(tmp_path, monkeypatch):
    """torch's own loading of a last module keeps no copy; if copying into it fails anyway
    (a device out of memory), the error says that this module may be partly restored and
    everything else was put back."""
    first, last = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    path = tmp_path / "s.pt"
    fm.snapshot.save(path, step=1, modules={"first": first, "last": last})
    a, b = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    a_before = a.weight.detach().clone()
    real = torch.Tensor.copy_

    def copy_(self, other, *args, **kwargs):
        if self is b.bias:
            raise RuntimeError("out of memory")
        return real(self, other, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with pytest.raises(
        fm.snapshot.SnapshotError,
        match=r"(?s)modules\['last'\] failed .*may be partly restored, the rest was put back",
    ):
        fm.snapshot.load(path, modules={"first": a, "last": b})
    monkeypatch.undo()
    assert torch.equal(a.weight, a_before)
