"""Task data: sinusoids, N-way K-shot episodes, class splits, the Omniglot folder loader."""

from __future__ import annotations

import math
import zipfile

import pytest
import torch
from helpers import shared_file, write_zip

import funcmeta as fm


def test_sinusoid_distribution_and_reproducibility():
    tasks = fm.data.Sinusoid()
    b = tasks.sample(500, 10, 20, generator=torch.Generator().manual_seed(0))
    assert b.x_support.shape == (500, 10, 1) and b.y_query.shape == (500, 20, 1)
    assert b.amplitude.min() >= 0.1 and b.amplitude.max() <= 5.0
    assert b.phase.min() >= 0 and b.phase.max() <= math.pi
    assert b.x_support.min() >= -5 and b.x_query.max() <= 5
    torch.testing.assert_close(
        b.y_support, b.amplitude[:, None, None] * torch.sin(b.x_support - b.phase[:, None, None])
    )
    assert b.support == (b.x_support, b.y_support) and b.query == (b.x_query, b.y_query)
    again = tasks.sample(500, 10, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.x_support, b.x_support)
    with pytest.raises(ValueError, match="num_tasks"):
        tasks.sample(0, 10, 10)
    with pytest.raises(ValueError, match="amplitude"):
        fm.data.Sinusoid(amplitude=(5, 1))


def labelled(classes=10, per_class=8):
    labels = torch.arange(classes).repeat_interleave(per_class)
    inputs = torch.stack([labels.float(), torch.arange(len(labels)).float()], dim=1)  # (label, id)
    return inputs, labels


def test_episodes_relabel_and_keep_support_and_query_apart():
    inputs, labels = labelled()
    episodes = fm.data.Episodes(inputs, labels, ways=4, shots=2, query=3)
    b = episodes.sample(50, generator=torch.Generator().manual_seed(0))
    assert b.x_support.shape == (50, 8, 2) and b.x_query.shape == (50, 12, 2)
    for t in range(50):
        classes = b.classes[t]
        assert len(set(classes.tolist())) == 4
        # each relabelled way holds examples of exactly the original class it stands for
        assert torch.equal(b.x_support[t, :, 0].long(), classes[b.y_support[t]])
        assert torch.equal(b.x_query[t, :, 0].long(), classes[b.y_query[t]])
        ids_s, ids_q = set(b.x_support[t, :, 1].tolist()), set(b.x_query[t, :, 1].tolist())
        assert not ids_s & ids_q and len(ids_s) == 8 and len(ids_q) == 12
    # relabelling is random: way 0 is not always the smallest class
    assert len({int(b.classes[t, 0]) for t in range(50)}) > 3
    again = episodes.sample(50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.x_query, b.x_query)


def test_class_splits_restrict_episodes():
    inputs, labels = labelled(classes=20)
    train, val, test = fm.data.split_classes(
        labels, [12, 4, 4], generator=torch.Generator().manual_seed(0)
    )
    assert not set(train) & set(val) and not set(train) & set(test) and not set(val) & set(test)
    assert len(train) == 12 and len(set(train + val + test)) == 20
    b = fm.data.Episodes(inputs, labels, ways=3, shots=1, query=1, classes=test).sample(30)
    assert set(b.classes.flatten().tolist()) <= set(test)
    with pytest.raises(ValueError, match="cannot split 20 classes"):
        fm.data.split_classes(labels, [15, 10])


def rotated(characters=6, per_class=2):
    """Labels of ``characters`` characters in 4 rotations each (class ``4 * char + turn``),
    carrying their groups as load_omniglot's do."""
    labels = torch.arange(4 * characters).repeat_interleave(per_class)
    return fm.data.ClassLabels(labels, [f"a/character{c // 4:02d}" for c in range(4 * characters)])


def test_class_labels_keep_their_groups_through_selections_and_copies(tmp_path):
    import copy

    labels = rotated()
    for kept in (
        labels[labels >= 8],
        labels[3:],
        labels.index_select(0, torch.tensor([0, 5])),
        labels.masked_select(labels < 4),
        labels.clone(),
        labels.detach(),
        labels.to("cpu"),
        labels.contiguous(),
        labels.reshape(-1),
        labels.long(),
        copy.deepcopy(labels),
    ):
        assert type(kept) is fm.data.ClassLabels and kept.groups == labels.groups
    for plain in (
        labels + 1,
        labels == 2,
        torch.cat([labels, labels]),
        labels.unique(),
        labels.float(),
    ):
        assert type(plain) is torch.Tensor
    torch.save(labels, tmp_path / "labels.pt")
    back = torch.load(tmp_path / "labels.pt")  # the default, weights_only=True
    assert type(back) is fm.data.ClassLabels and back.groups == labels.groups
    assert torch.equal(back, labels) and labels.tolist()[:3] == [0, 0, 1]
    inputs = torch.randn(len(labels), 3)
    b = fm.data.Episodes(inputs, labels, ways=3, shots=1, query=1).sample(2)
    assert type(b.classes) is torch.Tensor


@pytest.mark.parametrize(
    "labels, groups, error, match",
    [
        (torch.ones(3), "a", ValueError, "integer tensor, got torch.float32"),
        (torch.tensor([True]), "a", ValueError, "integer tensor, got torch.bool"),
        (torch.tensor([0, -1]), "ab", ValueError, "non-negative class indices, got -1"),
        (torch.tensor([0, 2]), "ab", ValueError, "groups has 2 keys but the labels go up to 2"),
        (torch.tensor([0]), [[1]], TypeError, "must be hashable"),
        ([0, 1], "ab", TypeError, "labels must be a tensor, got list"),
    ],
)
def test_class_labels_refuse_what_is_not_labels_with_groups(labels, groups, error, match):
    with pytest.raises(error, match=match):
        fm.data.ClassLabels(labels, groups)


def test_labels_with_groups_split_by_them_unless_told_otherwise():
    labels = rotated()
    characters = labels.groups
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        train, val, test = fm.data.split_classes(labels, [12, 4, 8], generator=g)
        assert [len({characters[c] for c in s}) for s in (train, val, test)] == [3, 1, 2]
        assert len({characters[c] for c in train + val + test}) == 6
    # the opt-out: the classes split freely, rotations of one character on both sides
    apart = [
        fm.data.split_classes(
            labels, [13, 11], generator=torch.Generator().manual_seed(s), split_rotations_apart=True
        )
        for s in range(10)
    ]
    assert any({characters[c] for c in tr} & {characters[c] for c in te} for tr, te in apart)
    with pytest.raises(ValueError, match=r"of \[4\] classes each.*split_rotations_apart=True"):
        fm.data.split_classes(labels, [13, 11])
    # explicit groups may join the labels' groups (two characters per key), not cut them
    pairs = [c // 8 for c in range(24)]
    train, test = fm.data.split_classes(labels, [16, 8], groups=pairs)
    assert {c // 8 for c in train}.isdisjoint(c // 8 for c in test)
    with pytest.raises(ValueError, match=r"under different keys .*split_rotations_apart=True"):
        fm.data.split_classes(labels, [12, 12], groups=[c % 2 for c in range(24)])
    # ... unless told: then they are the groups
    train, test = fm.data.split_classes(
        labels, [12, 12], groups=[c % 2 for c in range(24)], split_rotations_apart=True
    )
    assert {c % 2 for c in test} == {test[0] % 2}
    # groups of another data set
    with pytest.raises(
        ValueError, match="groups has 20 keys, but the labels carry the groups of 24"
    ):
        fm.data.split_classes(labels, [12, 12], groups=list(range(20)))


def test_split_groups_bad_input():
    labels = torch.arange(6).repeat_interleave(2)
    with pytest.raises(ValueError, match="groups has no key for class 4"):
        fm.data.split_classes(labels, [2, 2], groups=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="groups has no key for class 5"):
        fm.data.split_classes(labels, [2, 2], groups={c: c for c in range(5)})
    with pytest.raises(ValueError, match="negative labels"):
        fm.data.split_classes(labels - 1, [2, 2], groups=list(range(6)))
    pairs = {c: (c + 1) // 2 for c in range(-1, 5)}  # a mapping takes any label
    train, test = fm.data.split_classes(labels - 1, [2, 2], groups=pairs)
    assert {pairs[c] for c in train}.isdisjoint(pairs[c] for c in test)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ways=11, shots=1, query=1), "11-way episodes need at least 11 classes; there are 10"),
        (dict(ways=2, shots=5, query=4), r"need 9 examples per class.*\{0: 8, 1: 8"),
        (dict(ways=2, shots=1, query=1, classes=[0, 42]), r"classes \[42\] have no examples"),
        (dict(ways=0, shots=1, query=1), "ways must be"),
    ],
)
def test_episode_errors(kwargs, match):
    inputs, labels = labelled()
    with pytest.raises(ValueError, match=match):
        fm.data.Episodes(inputs, labels, **kwargs)


def test_episode_label_checks():
    inputs, labels = labelled()
    with pytest.raises(ValueError, match="integer"):
        fm.data.Episodes(inputs, labels.float(), ways=2, shots=1, query=1)
    with pytest.raises(ValueError, match="examples but labels"):
        fm.data.Episodes(inputs[:5], labels, ways=2, shots=1, query=1)


def make_omniglot(root, alphabets=2, characters=2, drawings=3):
    from PIL import Image, ImageDraw

    for a in range(alphabets):
        for c in range(characters):
            folder = root / "images_background" / f"Alphabet_{a}" / f"character{c + 1:02d}"
            folder.mkdir(parents=True)
            for d in range(drawings):
                img = Image.new("L", (105, 105), 255)
                # a black bar in the top-left quarter: its place tells rotations apart
                ImageDraw.Draw(img).rectangle([0, 0, 52, 10 + 5 * d], fill=0)
                img.save(folder / f"{a}{c}_{d:02d}.png")


def test_omniglot_folder_loader(tmp_path):
    make_omniglot(tmp_path)
    images, labels, names = fm.data.load_omniglot(tmp_path, "background", size=28)
    assert images.shape == (12, 1, 28, 28) and images.dtype == torch.float32
    assert names == [
        "Alphabet_0/character01",
        "Alphabet_0/character02",
        "Alphabet_1/character01",
        "Alphabet_1/character02",
    ]
    assert labels.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert images[0, 0, 0, 0] > 0.9 and images[0, 0, -1, -1] < 0.1  # inverted: strokes are 1
    raw, _, _ = fm.data.load_omniglot(tmp_path, "background", size=28, invert=False)
    torch.testing.assert_close(raw, 1 - images)
    rotated, rlabels, rnames = fm.data.load_omniglot(
        tmp_path, "background", size=28, rotations=True
    )
    assert len(rnames) == 16 and rnames[1] == "Alphabet_0/character01/rot90"
    torch.testing.assert_close(
        rotated[rlabels == 1], torch.rot90(images[labels == 0], 1, dims=(2, 3))
    )
    b = fm.data.Episodes(images, labels, ways=3, shots=1, query=2).sample(2)
    assert b.x_support.shape == (2, 3, 1, 28, 28)
    assert b.support == (b.x_support, b.y_support) and b.query == (b.x_query, b.y_query)


def test_omniglot_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="images_evaluation"):
        fm.data.load_omniglot(tmp_path, "evaluation")
    with pytest.raises(ValueError, match="split must be"):
        fm.data.load_omniglot(tmp_path, "train")
    (tmp_path / "images_background" / "A" / "character01").mkdir(parents=True)
    with pytest.raises(ValueError, match="no PNG drawings"):
        fm.data.load_omniglot(tmp_path)


def test_omniglot_zip_equals_its_unpacked_folder(tmp_path):
    archive = shared_file("omniglot/images_background_small1.zip")
    images, labels, names = fm.data.load_omniglot(archive, size=20)
    assert images.shape == (136 * 20, 1, 20, 20) and len(names) == 136  # the official counts
    assert names[0] == "Balinese/character01"
    with zipfile.ZipFile(archive) as z:
        z.extractall(tmp_path)
    (tmp_path / "images_background_small1").rename(tmp_path / "images_background")
    f_images, f_labels, f_names = fm.data.load_omniglot(tmp_path, "background", size=20)
    assert f_names == names and torch.equal(f_labels, labels) and torch.equal(f_images, images)


def test_omniglot_archives_are_checked_before_use(tmp_path):
    make_omniglot(tmp_path)
    folder = tmp_path / "images_background"

    def pack(name, members):
        return write_zip(tmp_path / name, members)

    drawings = [
        (f"images_background/{p.relative_to(folder).as_posix()}", p.read_bytes())
        for p in sorted(folder.rglob("*.png"))
    ]
    fine = pack("mine.zip", drawings)
    assert fm.data.load_omniglot(fine)[0].shape == (12, 1, 28, 28)
    for bad in ("../../escape.png", "/etc/escape.png", "C:/escape.png"):
        with pytest.raises(ValueError, match=r"a path outside the archive: refused"):
            fm.data.load_omniglot(pack("evil.zip", [*drawings, (bad, b"x")]))
    broken = pack("broken.zip", [*drawings, ("images_background/A/character09/0.png", b"junk")])
    with pytest.raises(
        ValueError,
        match=r"broken\.zip:images_background/A/character09/0\.png is not a readable image",
    ):
        fm.data.load_omniglot(broken)
    png = next(folder.rglob("*.png"))
    png.write_bytes(png.read_bytes()[:40])  # a cut file in a folder
    with pytest.raises(ValueError, match=rf"{png.name} is not a readable image"):
        fm.data.load_omniglot(tmp_path)
    # a file named like an official archive must be that archive
    impostor = pack("images_background_small1.zip", drawings)
    with pytest.raises(
        ValueError,
        match=r"has sha256 .*, but the official images_background_small1\.zip has f38eb80f",
    ):
        fm.data.load_omniglot(impostor)
    cut = tmp_path / "cut.zip"
    cut.write_bytes(fine.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cut\.zip is not a zip archive"):
        fm.data.load_omniglot(cut)


def test_omniglot_several_splits_keep_a_shared_character_once(tmp_path):
    import shutil

    make_omniglot(tmp_path)
    small = tmp_path / "images_background_small1"
    shutil.copytree(tmp_path / "images_background" / "Alphabet_1", small / "Alphabet_1")
    extra = small / "Alphabet_9" / "character01"
    shutil.copytree(tmp_path / "images_background" / "Alphabet_0" / "character01", extra)
    images, labels, names = fm.data.load_omniglot(tmp_path, ["background", "background_small1"])
    assert names == [
        "Alphabet_0/character01",
        "Alphabet_0/character02",
        "Alphabet_1/character01",
        "Alphabet_1/character02",
        "Alphabet_9/character01",
    ]
    one, _, _ = fm.data.load_omniglot(tmp_path, "background")
    torch.testing.assert_close(images[:12], one, rtol=0, atol=0)
    assert labels.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    # same order of splits or the other: the same classes, each once
    _, _, again = fm.data.load_omniglot(tmp_path, ["background_small1", "background"])
    assert again == names
    # a character under the same name with other drawings is not the same character
    from PIL import Image

    png = sorted((small / "Alphabet_1" / "character02").glob("*.png"))[0]
    Image.new("L", (105, 105), 0).save(png)
    with pytest.raises(ValueError, match=r"Alphabet_1/character02 is in the splits 'background'"):
        fm.data.load_omniglot(tmp_path, ["background", "background_small1"])
    with pytest.raises(
        ValueError, match=r"split must be 'background', .* or 'evaluation', got 'nope'"
    ):
        fm.data.load_omniglot(tmp_path, ["background", "nope"])
    with pytest.raises(TypeError, match="split must be a split's name or a list"):
        fm.data.load_omniglot(tmp_path, [])


def test_omniglot_resize_filter_is_pillows_by_name(tmp_path):
    from PIL import Image

    make_omniglot(tmp_path, alphabets=1, characters=1, drawings=1)
    png = next((tmp_path / "images_background").glob("*/*/*.png"))
    with Image.open(png) as img:  # Pillow's own default for a grayscale resize: bicubic
        expected = torch.tensor(list(img.convert("L").resize((28, 28)).getdata())).float() / 255
    bicubic, _, _ = fm.data.load_omniglot(tmp_path, size=28, invert=False, resample="bicubic")
    torch.testing.assert_close(bicubic.flatten(), expected, rtol=0, atol=0)
    lanczos, _, _ = fm.data.load_omniglot(tmp_path, size=28, invert=False)
    assert not torch.equal(lanczos, bicubic)
    with pytest.raises(
        ValueError, match=r"resample must be 'lanczos', .* or 'nearest', got 'cubic'"
    ):
        fm.data.load_omniglot(tmp_path, resample="cubic")


def test_missing_omniglot_files_names_what_the_loaders_would_not_find(tmp_path):
    small1 = fm.data.OMNIGLOT_URL + "python/images_background_small1.zip"
    missing = fm.data.missing_omniglot_files(
        tmp_path, ["background_small1", "evaluation"], runs=True
    )
    assert missing == {
        "images_background_small1.zip": small1,
        "images_evaluation.zip": fm.data.OMNIGLOT_URL + "python/images_evaluation.zip",
        "all_runs.zip": fm.data.OMNIGLOT_URL + fm.data.OMNIGLOT_FILES["all_runs.zip"],
    }
    (tmp_path / "images_background_small1.zip").write_bytes(b"")  # an archive, or
    (tmp_path / "images_evaluation" / "A").mkdir(parents=True)  # the unpacked folder
    (tmp_path / "run01").mkdir()
    (tmp_path / "run01" / "class_labels.txt").write_text("")
    assert (
        fm.data.missing_omniglot_files(tmp_path, ["background_small1", "evaluation"], runs=True)
        == {}
    )
    assert (
        fm.data.missing_omniglot_files(tmp_path / "images_background_small1.zip", "background")
        == {}
    )
    mirror = fm.data.missing_omniglot_files(tmp_path / "new", "background_small2", url="http://m/o")
    assert mirror == {
        "images_background_small2.zip": "http://m/o/python/images_background_small2.zip"
    }
    with pytest.raises(ValueError, match="split must be"):
        fm.data.missing_omniglot_files(tmp_path, "train")
