"""Omniglot as a user gets it: the official archives (read in place, or downloaded from a
local HTTP server on the loopback address and verified), the minimal splits by name, and the
official one-shot runs with their answers. The shared data folder beside the project holds
the real files; CI has it (a missing file fails there rather than skipping)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import re
import shutil
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import shared_file, write_zip

import funcmeta as fm
from funcmeta._src.data import files


def shared(name: str) -> Path:
    return shared_file(f"omniglot/{name}")


class _Files(http.server.BaseHTTPRequestHandler):
    """Serves ``files[basename]`` for any path ending in that name; counts the requests."""

    def __init__(self, *args, files, log, **kwargs):
        self.files, self.log = files, log
        super().__init__(*args, **kwargs)

    def do_GET(self):
        self.log.append(self.path)
        body = self.files.get(self.path.rsplit("/", 1)[-1])
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A loopback HTTP server: ``(base_url, files, requests)``; tests fill ``files``."""
    files: dict[str, bytes] = {}
    requests: list[str] = []
    handler = functools.partial(_Files, files=files, log=requests)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/omniglot/", files, requests
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_download_fetches_verifies_and_reuses(tmp_path, server):
    url, files, requests = server
    for name in fm.data.OMNIGLOT_FILES:
        files[name] = shared(name).read_bytes()
    cache = tmp_path / "cache"
    paths = fm.data.download_omniglot(cache, url=url)
    assert sorted(paths) == sorted(fm.data.OMNIGLOT_FILES)
    assert sorted(requests) == sorted(
        f"/omniglot/{path}" for path in fm.data.OMNIGLOT_FILES.values()
    )  # the repository's layout under the base address
    for name, path in paths.items():
        assert path.read_bytes() == files[name]
    # present and intact: not fetched again
    fm.data.download_omniglot(cache, url=url)
    assert len(requests) == 3
    # the loaders fetch what is missing from a folder, and read what they fetched
    other = tmp_path / "other"
    images, _, names = fm.data.load_omniglot(
        other, "background_small2", size=14, download=True, url=url
    )
    assert images.shape == (156 * 20, 1, 14, 14) and len(names) == 156
    runs = fm.data.load_omniglot_runs(other, download=True, url=url)
    assert runs.x_support.shape == (20, 20, 1, 28, 28)
    assert sorted(p.name for p in other.iterdir()) == [
        "all_runs.zip",
        "images_background_small2.zip",
    ]


def test_download_refuses_a_wrong_checksum_and_leaves_nothing(tmp_path, server):
    url, files, _ = server
    good = shared("all_runs.zip").read_bytes()
    files["all_runs.zip"] = good[:-10] + b"0123456789"  # same size, other bytes
    with pytest.raises(ValueError, match=r"sha256 .*but the official all_runs\.zip has 437c1eea"):
        fm.data.download_omniglot(tmp_path, ["all_runs.zip"], url=url)
    assert list(tmp_path.iterdir()) == []
    # a corrupt file already in the cache is replaced by a verified download
    (tmp_path / "all_runs.zip").write_bytes(b"junk")
    files["all_runs.zip"] = good
    path = fm.data.download_omniglot(tmp_path, ["all_runs.zip"], url=url)["all_runs.zip"]
    assert hashlib.sha256(path.read_bytes()).hexdigest().startswith("437c1eea")


def test_download_errors(tmp_path, server):
    url, _, _ = server
    with pytest.raises(OSError, match=r"could not download http://127\.0\.0\.1:\d+/omniglot/"):
        fm.data.download_omniglot(tmp_path, ["all_runs.zip"], url=url)  # 404
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no known download with a checksum for"):
        fm.data.download_omniglot(tmp_path, ["images_evaluation.zip"], url=url)
    with pytest.raises(ValueError, match="download=True fetches only the files with a known"):
        fm.data.load_omniglot(tmp_path, "evaluation", download=True, url=url)
    address = re.escape(fm.data.OMNIGLOT_URL + "python/images_background_small1.zip")
    with pytest.raises(FileNotFoundError, match=rf"\({address}\).*or pass download=True"):
        fm.data.load_omniglot(tmp_path, "background_small1")
    with pytest.raises(FileNotFoundError, match=r"download=True fetches only the minimal splits"):
        fm.data.load_omniglot(tmp_path, "evaluation")
    with pytest.raises(FileNotFoundError, match=r"one-shot-classification/all_runs\.zip\).*pass"):
        fm.data.load_omniglot_runs(tmp_path)


def test_minimal_splits_by_name_from_a_folder_of_archives(tmp_path):
    for name in ("images_background_small1.zip", "images_background_small2.zip"):
        shutil.copy(shared(name), tmp_path / name)
    a_images, _, a_names = fm.data.load_omniglot(tmp_path, "background_small1", size=14)
    b_images, _, b_names = fm.data.load_omniglot(shared("images_background_small1.zip"), size=14)
    assert a_names == b_names and torch.equal(a_images, b_images)
    _, _, names2 = fm.data.load_omniglot(tmp_path, "background_small2", size=14)
    assert len(names2) == 156 and len(set(a_names) & set(names2)) == 50  # Greek and Latin
    both, labels, names = fm.data.load_omniglot(
        tmp_path, ["background_small1", "background_small2"], size=14
    )
    assert names == sorted(set(a_names) | set(names2)) and len(names) == 242
    assert len(both) == 20 * 242 and labels.max() == 241
    first = names.index(a_names[0])
    torch.testing.assert_close(both[labels == first], a_images[:20], rtol=0, atol=0)


def runs_answers(archive: Path) -> list[list[tuple[str, str]]]:
    """The answers read independently: per run, (test image, training image) pairs."""
    with zipfile.ZipFile(archive) as z:
        runs = sorted(n for n in z.namelist() if n.endswith("class_labels.txt"))
        return [
            sorted(tuple(line.split()) for line in z.read(r).decode().split("\n") if line)
            for r in runs
        ]


def test_runs_reader_gives_the_official_episodes_with_their_answers(tmp_path):
    archive = shared("all_runs.zip")
    runs = fm.data.load_omniglot_runs(archive, size=105, invert=False)
    assert runs.x_support.shape == (20, 20, 1, 105, 105) and runs.x_query.shape == (
        20,
        20,
        1,
        105,
        105,
    )
    assert torch.equal(runs.y_support, torch.arange(20).repeat(20, 1))
    answers = runs_answers(archive)
    from PIL import Image

    with zipfile.ZipFile(archive) as z:
        for r in (0, 7, 19):
            for k, (test, train) in enumerate(answers[r]):
                assert test.endswith(f"test/item{k + 1:02d}.png")
                cls = int(train.split("class")[-1][:2]) - 1
                assert runs.y_query[r, k].item() == cls
                with z.open(train) as f:  # the training image of the answer is that support
                    raw = bytearray(Image.open(f).convert("L").tobytes())
                pixels = torch.frombuffer(raw, dtype=torch.uint8).float()
                assert torch.equal(runs.x_support[r, cls, 0].flatten(), pixels / 255)
    # the unpacked folder, in either layout, reads the same
    with zipfile.ZipFile(archive) as z:
        z.extractall(tmp_path / "all_runs")
    for root in (tmp_path, tmp_path / "all_runs"):
        again = fm.data.load_omniglot_runs(root, size=105, invert=False)
        assert all(torch.equal(a, b) for a, b in zip(again, runs, strict=True))
    # the default: 28x28, ink 1, as load_omniglot gives the background images
    small = fm.data.load_omniglot_runs(archive)
    assert small.x_query.shape == (20, 20, 1, 28, 28)
    assert small.x_query.mean() < 0.2  # mostly background, now 0


def test_runs_reader_errors(tmp_path):
    def pack(name, members):
        return write_zip(tmp_path / name, members)

    with pytest.raises(ValueError, match=r"no runNN/class_labels\.txt"):
        fm.data.load_omniglot_runs(pack("empty.zip", [("readme.txt", b"x")]))
    bad = pack("bad.zip", [("run01/class_labels.txt", b"run01/test/item01.png\n")])
    with pytest.raises(ValueError, match="expected lines '<test image> <training image>'"):
        fm.data.load_omniglot_runs(bad)
    missing = pack(
        "missing.zip",
        [("run01/class_labels.txt", b"run01/test/item01.png run01/training/class01.png\n")],
    )
    with pytest.raises(ValueError, match="names images that are absent"):
        fm.data.load_omniglot_runs(missing)
    with pytest.raises(ValueError, match=r"all_runs\.zip has sha256"):
        fm.data.load_omniglot_runs(pack("all_runs.zip", [("x", b"y")]))
    with pytest.raises(FileNotFoundError, match="no one-shot runs"):
        fm.data.load_omniglot_runs(tmp_path / "nowhere")


class _Hostile(http.server.BaseHTTPRequestHandler):
    """``/slow/...``: the official length announced, one byte a second; ``/endless/...``: a
    body without end."""

    def do_GET(self):
        self.send_response(200)
        if self.path.startswith("/slow/"):
            self.send_header("Content-Length", str(files.KNOWN_SIZE["all_runs.zip"]))
            self.end_headers()
            try:
                for _ in range(60):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(1.0)
            except OSError:
                return
        else:
            self.end_headers()
            block = b"\0" * (1 << 16)
            try:
                for _ in range(1 << 15):  # 2 GiB at most, then the handler stops by itself
                    self.wfile.write(block)
            except OSError:
                return

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_slow_sender_is_cut_off_at_the_deadline(tmp_path, hostile):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not finished after 2 s .*raise deadline="):
        fm.data.download_omniglot(
            tmp_path, ["all_runs.zip"], url=hostile + "/slow/", timeout=3, deadline=2
        )
    assert time.monotonic() - start < 6  # the deadline, plus at most one read's timeout
    assert list(tmp_path.iterdir()) == []


def test_an_endless_body_is_cut_off_at_the_official_size(tmp_path, hostile):
    with pytest.raises(ValueError, match=r"more than the official all_runs\.zip's 352787 bytes"):
        fm.data.download_omniglot(tmp_path, ["all_runs.zip"], url=hostile + "/endless/")
    assert list(tmp_path.iterdir()) == []


def test_partial_files_of_interrupted_downloads_are_removed(tmp_path, server):
    url, files, _ = server
    files["all_runs.zip"] = shared("all_runs.zip").read_bytes()
    dead = tmp_path / ".all_runs.zip.999999999.abcd.part"  # a process id that is not running
    dead.write_bytes(b"x" * 1000)
    fm.data.download_omniglot(tmp_path, ["all_runs.zip"], url=url)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all_runs.zip"]


def test_runs_download_into_a_folder_that_does_not_exist(tmp_path, server):
    url, files, _ = server
    files["all_runs.zip"] = shared("all_runs.zip").read_bytes()
    for root in (tmp_path / "new" / "runs", tmp_path / "other" / "all_runs.zip"):
        runs = fm.data.load_omniglot_runs(root, download=True, url=url)
        assert runs.x_support.shape == (20, 20, 1, 28, 28)
    assert (tmp_path / "new" / "runs" / "all_runs.zip").is_file()
    assert (tmp_path / "other" / "all_runs.zip").is_file()


def test_hostile_run_files_are_named(tmp_path, monkeypatch):
    from PIL import Image

    with zipfile.ZipFile(shared("all_runs.zip")) as z:
        names = [n for n in z.namelist() if n.startswith("run01/") and not n.endswith("/")]
        members = [(n, z.read(n)) for n in names]
    labels = "run01/class_labels.txt"
    latin1 = [(n, b"\xff\xfe" + d if n == labels else d) for n, d in members]
    with pytest.raises(ValueError, match=r"run01/class_labels\.txt is not UTF-8 text"):
        fm.data.load_omniglot_runs(write_zip(tmp_path / "latin1.zip", latin1))
    # a decompression bomb (here: any image larger than the limit, lowered for the test)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(
        ValueError, match=r"run01/training/class\d\d\.png is refused: a decompression bomb"
    ):
        fm.data.load_omniglot_runs(write_zip(tmp_path / "bomb.zip", members))
    monkeypatch.undo()
    with pytest.raises(
        ValueError, match=r"size \(the side of the images, in pixels\) must be an int >= 1, got 0"
    ):
        fm.data.load_omniglot_runs(write_zip(tmp_path / "ok.zip", members), size=0)


def characters_on_both_sides(characters, train, test) -> int:
    """How many held-out classes share their character with a training class."""
    trained = {characters[c] for c in train}
    return sum(characters[c] in trained for c in test)


def test_the_plain_split_of_rotated_omniglot_holds_out_whole_characters():
    """Omniglot with rotations (four classes per character), split as a user writes it,
    ``split_classes(labels, sizes)``: no held-out class shares its character with a training
    class. The opt-out, named for what it does, gives back the class split, where (almost)
    every held-out class is a rotation of a character trained on."""
    shared("images_background_small2.zip")  # both minimal splits, or skip/fail by name
    folder = shared("images_background_small1.zip").parent
    splits = ["background_small1", "background_small2"]
    _images, labels, names = fm.data.load_omniglot(folder, splits, size=8, rotations=True)
    characters = fm.data.omniglot_characters(names)
    assert len(names) == 4 * 242 and labels.groups == tuple(characters)
    for seed in range(3):
        train, test = fm.data.split_classes(
            labels, [800, 168], generator=torch.Generator().manual_seed(seed)
        )
        assert len(test) == 168 and len({characters[c] for c in test}) == 42
        assert characters_on_both_sides(characters, train, test) == 0
    # what the split did before it kept characters together (168 of 168 with seed 0)
    train, test = fm.data.split_classes(
        labels,
        [800, 168],
        generator=torch.Generator().manual_seed(0),
        split_rotations_apart=True,
    )
    assert characters_on_both_sides(characters, train, test) == 168
    # the labels of a selection keep their groups: one alphabet's classes, split
    greek = [c for c, name in enumerate(names) if name.startswith("Greek/")]
    picked = labels[torch.isin(labels, torch.tensor(greek))]
    assert isinstance(picked, fm.data.ClassLabels) and picked.groups == labels.groups
    train, test = fm.data.split_classes(picked, [64, 32])
    assert characters_on_both_sides(characters, train, test) == 0
    # sizes that would cut a character are refused, with the fix
    with pytest.raises(ValueError, match=r"whole groups .*split_rotations_apart=True"):
        fm.data.split_classes(labels, [801, 167])
    # without rotations each character is one class: the split is the class split
    _, plain_labels, plain_names = fm.data.load_omniglot(folder, "background_small1", size=8)
    assert plain_labels.groups == tuple(plain_names)
    grouped = fm.data.split_classes(plain_labels, [100, 36], generator=torch.Generator())
    assert grouped == fm.data.split_classes(
        plain_labels + 0, [100, 36], generator=torch.Generator()
    )


def test_the_tests_find_omniglot_through_one_setting(tmp_path, monkeypatch):
    """``FUNCMETA_OMNIGLOT`` names the folder; unset, the shared folder beside the project.
    Missing files skip with how to get them, or fail where the data must be (CI, or the
    setting naming a folder without them)."""
    import helpers

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("FUNCMETA_OMNIGLOT", str(tmp_path))
    (tmp_path / "all_runs.zip").write_bytes(b"x")
    assert helpers.shared_file("omniglot/all_runs.zip") == tmp_path / "all_runs.zip"
    with pytest.raises(
        pytest.fail.Exception, match=f"FUNCMETA_OMNIGLOT={re.escape(str(tmp_path))}"
    ):
        helpers.shared_file("omniglot/images_background_small1.zip")
    monkeypatch.delenv("FUNCMETA_OMNIGLOT")
    monkeypatch.setattr(helpers, "SHARED_DATA", tmp_path / "nowhere")
    assert helpers.omniglot_folder() == tmp_path / "nowhere" / "omniglot"
    with pytest.raises(pytest.skip.Exception) as skipped:
        helpers.shared_file("omniglot/all_runs.zip")
    message = str(skipped.value)
    for how in ("set FUNCMETA_OMNIGLOT", "fm.data.download_omniglot('DIR')", "--download"):
        assert how in message
    assert fm.data.OMNIGLOT_URL + "python/" in message
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="in CI"):
        helpers.shared_file("omniglot/all_runs.zip")
