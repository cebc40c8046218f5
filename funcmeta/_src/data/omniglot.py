"""Omniglot (Lake et al., 2015): the official archives or folders, and the one-shot runs.

The official archives unpack to ``images_background/`` (30 alphabets, 964 characters),
``images_evaluation/`` (20 alphabets, 659 characters) and the two "minimal" background
splits ``images_background_small1/`` (5 alphabets, 136 characters) and
``images_background_small2/`` (5 alphabets, 156). Each holds
``<alphabet>/<characterNN>/<drawing>.png``, with 20 drawings of 105x105 per character.
:func:`load_omniglot` reads one of them into tensors, from the zip archive as published or
from the unpacked folder; with ``download=True`` it fetches the archive first
(:func:`funcmeta.data.download_omniglot`). :func:`load_omniglot_runs` reads the official
one-shot classification benchmark (``all_runs.zip``: 20 within-alphabet 20-way one-shot runs
of the evaluation set) as 20 episodes with their answers.

Example (a two-character folder made on the spot; point ``root`` at a downloaded copy):
    >>> import tempfile, pathlib, funcmeta as fm
    >>> from PIL import Image
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for char in ("character01", "character02"):
    ...     folder = root / "images_background" / "Alphabet" / char
    ...     folder.mkdir(parents=True)
    ...     for i in range(3):
    ...         Image.new("L", (105, 105), 255).save(folder / f"{i}.png")
    >>> images, labels, names = fm.data.load_omniglot(root, "background", size=28)
    >>> images.shape, labels.tolist(), names
    (torch.Size([6, 1, 28, 28]), [0, 0, 0, 1, 1, 1], ['Alphabet/character01', 'Alphabet/character02'])
"""

from __future__ import annotations

import contextlib
import functools
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, cast

import torch
from torch import Tensor

from funcmeta._src.core.checks import check_choice, check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.data.download import OMNIGLOT_FILES, OMNIGLOT_URL, download_omniglot
from funcmeta._src.data.episodes import ClassLabels, EpisodeBatch, omniglot_characters
from funcmeta._src.data.files import check_sha256, safe_members

__all__ = ["RESAMPLE", "load_omniglot", "load_omniglot_runs", "missing_omniglot_files"]

SPLITS = {
    "background": "images_background",
    "evaluation": "images_evaluation",
    "background_small1": "images_background_small1",
    "background_small2": "images_background_small2",
}

Opener = Callable[[], IO[bytes]]

RESAMPLE = ("lanczos", "bicubic", "bilinear", "hamming", "box", "nearest")
"""The resize filters :func:`load_omniglot` takes (Pillow's, by name). ``"lanczos"`` is the
default; ``"bicubic"`` is what Pillow's ``Image.resize`` uses when given no filter, for a
grayscale image: the Omniglot loaders of ``higher``'s and TorchOpt's MAML examples resize that
way, and their 28x28 pixels differ from the Lanczos ones by up to 0.11."""


def _check_resample(resample: str) -> str:
    return check_choice(resample, "resample", RESAMPLE)


def _fetched(root: Path, name: str, download: bool, what: str, url: str) -> Path | None:
    """``root/name`` if it is there; fetched first when ``download``; else ``None``."""
    archive = root / name
    if archive.is_file():
        return archive
    if not download:
        return None
    if name not in OMNIGLOT_FILES:
        raise ValueError(
            f"download=True fetches only the files with a known sha256 ({sorted(OMNIGLOT_FILES)}); "
            f"put {what} ({name} or its unpacked folder) in {root} yourself"
        )
    return download_omniglot(root, [name], url=url)[name]


def _folder_drawings(folder: Path) -> dict[str, list[tuple[str, Opener]]]:
    drawings: dict[str, list[tuple[str, Opener]]] = {}
    for character in sorted(p for p in folder.glob("*/*") if p.is_dir()):
        files = sorted(character.glob("*.png"))
        if files:
            key = f"{character.parent.name}/{character.name}"
            # typeshed's partial takes Path.open's first (text) overload: this one is binary
            drawings[key] = [(str(f), cast(Opener, functools.partial(f.open, "rb"))) for f in files]
    return drawings


def _zip_members(path: Path, stack: contextlib.ExitStack) -> dict[str, Opener]:
    """An archive's file members, each with an opener, once its checksum (for an official
    name), its format and its member paths have passed; it stays open as long as ``stack``."""
    check_sha256(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a zip archive (truncated or corrupt?)")
    archive = stack.enter_context(zipfile.ZipFile(path))
    names = [n for n in safe_members(archive, path) if not n.endswith("/")]
    return {n: functools.partial(archive.open, n) for n in names}


def _zip_drawings(path: Path, stack: contextlib.ExitStack) -> dict[str, list[tuple[str, Opener]]]:
    members = _zip_members(path, stack)
    drawings: dict[str, list[tuple[str, Opener]]] = {}
    for name in sorted(members):
        parts = name.split("/")
        if len(parts) < 3 or not name.endswith(".png"):
            continue
        key = f"{parts[-3]}/{parts[-2]}"
        drawings.setdefault(key, []).append((f"{path}:{name}", members[name]))
    return dict(sorted(drawings.items()))


def _decode(where: str, opener: Opener, size: int, resample: str = "lanczos") -> Tensor:
    from PIL import Image, UnidentifiedImageError

    try:
        with opener() as f, Image.open(f) as img:
            gray = img.convert("L").resize((size, size), Image.Resampling[resample.upper()])
    except Image.DecompressionBombError as e:
        raise ValueError(f"{where} is refused: a decompression bomb ({e})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{where} is not a readable image: {e}") from None
    pixels = torch.frombuffer(bytearray(gray.tobytes()), dtype=torch.uint8)
    return pixels.reshape(size, size).float() / 255


@exposed_in("funcmeta.data")
def load_omniglot(
    root: str | Path,
    split: str | Sequence[str] = "background",
    *,
    size: int = 28,
    invert: bool = True,
    rotations: bool = False,
    resample: str = "lanczos",
    download: bool = False,
    url: str = OMNIGLOT_URL,
) -> tuple[Tensor, Tensor, list[str]]:
    """``(images, labels, class_names)`` of one Omniglot split, or of several.

    ``root`` is one split's zip archive as published (``images_background.zip``,
    ``images_background_small1.zip``, ...), read without unpacking, or a folder holding the
    split chosen by ``split`` (``"background"``, ``"evaluation"``, ``"background_small1"``,
    ``"background_small2"``) unpacked (``images_background/`` ...) or as its archive
    (``images_background.zip`` ...), the folder first. With ``download=True`` a split missing
    from the folder is fetched into it from the dataset's public repository and verified
    (the minimal splits, whose sha256 is known; ``url`` is the base address, a mirror with
    the repository's layout works). An archive named like an
    official file must have its sha256 (the checksums funcmeta knows); member
    names that would leave the archive (absolute, ``..``) are refused; an image that does not
    decode raises ``ValueError`` naming it.

    ``split`` may name several splits (``["background_small1", "background_small2"]``): their
    characters are loaded together, and a character that is in more than one of them (Greek
    and Latin are in both minimal splits, drawing for drawing; the minimal splits are part of
    ``"background"``) comes once. A character found in two splits with different drawings
    raises ``ValueError`` naming it.

    ``images``: ``(N, 1, size, size)`` float32 in [0, 1], strokes 1 when ``invert`` (the
    drawings are black on white), resized from 105x105 with Pillow's filter ``resample`` (one
    of ``"lanczos"``, ``"bicubic"``, ``"bilinear"``, ``"hamming"``, ``"box"``, ``"nearest"``;
    ``"bicubic"`` is Pillow's own default, which other loaders use).
    ``labels``: ``(N,)`` class index per image, as :class:`~funcmeta.data.ClassLabels` that
    carry each class's character (``labels.groups``). ``class_names``:
    ``"alphabet/characterNN"`` per class, sorted. With ``rotations``, each character also
    appears rotated by 90, 180 and 270 degrees as three further classes (``.../rot90`` and
    so on), the usual augmentation; ``fm.data.split_classes(labels, sizes)`` keeps the four
    classes of a character on one side (sizes in multiples of 4), so no held-out class is a
    rotation of a character trained on. Raises ``FileNotFoundError`` naming the expected
    files and where they are published (:func:`missing_omniglot_files`), and ``ValueError``
    for an unknown split or a source without images.
    """
    try:
        import PIL  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_omniglot reads PNG files with Pillow: pip install pillow") from e
    check_int(size, "size (the side of the images, in pixels)", low=1)
    _check_resample(resample)
    source = Path(root).expanduser()
    splits = [split] if isinstance(split, str) else list(split)
    if not splits or not all(isinstance(s, str) for s in splits):
        raise TypeError(f"split must be a split's name or a list of names, got {split!r}")
    if source.is_file() and len(splits) > 1:
        raise ValueError(f"{source} is one split's archive; pass a folder to load {splits}")
    if not source.is_file():
        for s in splits:
            check_choice(s, "split", sorted(SPLITS))
    decoded: dict[str, Tensor] = {}
    found_in: dict[str, str] = {}
    wheres = []
    for s in dict.fromkeys(splits):  # a split named twice is read once
        with contextlib.ExitStack() as open_archive:
            drawings, where = _split_drawings(source, s, download, url, open_archive)
            wheres.append(where)
            for base, files in drawings.items():
                stack = torch.stack([_decode(w, o, size, resample) for w, o in files]).unsqueeze(1)
                if base in decoded:
                    if not torch.equal(decoded[base], stack):
                        raise ValueError(
                            f"{base} is in the splits {found_in[base]!r} and {s!r} with "
                            "different drawings: not the same character twice; load the splits "
                            "one at a time"
                        )
                    continue
                decoded[base], found_in[base] = stack, s
    decoded = dict(sorted(decoded.items()))
    searched = " and ".join(str(w) for w in wheres)
    images: list[Tensor] = []
    labels: list[Tensor] = []
    names: list[str] = []
    for base, stack in decoded.items():
        if invert:
            stack = 1 - stack
        turns = range(4) if rotations else range(1)
        for k in turns:
            images.append(torch.rot90(stack, k, dims=(2, 3)))
            labels.append(torch.full((len(stack),), len(names)))
            names.append(base if k == 0 else f"{base}/rot{90 * k}")
    if not images:
        raise ValueError(f"no PNG drawings under {searched}")
    return torch.cat(images), ClassLabels(torch.cat(labels), omniglot_characters(names)), names


def _split_drawings(
    source: Path, split: str, download: bool, url: str, stack: contextlib.ExitStack
) -> tuple[dict[str, list[tuple[str, Opener]]], Path]:
    """One split's drawings by character, from an archive ``source``, or a folder holding the
    split unpacked or as its archive (fetched first when ``download``)."""
    if source.is_file():
        return _zip_drawings(source, stack), source
    if (source / SPLITS[split]).is_dir():
        where = source / SPLITS[split]
        return _folder_drawings(where), where
    name = SPLITS[split] + ".zip"
    archive = _fetched(source, name, download, f"the {split} split", url)
    if archive is None:
        address = missing_omniglot_files(source, split, url=url).get(name, "")
        how = (
            ", or pass download=True to fetch it"
            if name in OMNIGLOT_FILES
            else " (download=True fetches only the minimal splits and the runs)"
        )
        raise FileNotFoundError(
            f"no Omniglot split {split!r} at {source}: expected {name} ({address}), as "
            f"published or unpacked ({SPLITS[split]}/<alphabet>/<character>/*.png); put it "
            f"there{how}"
        )
    return _zip_drawings(archive, stack), archive


def _has_runs(folder: Path) -> bool:
    return (
        (folder / "all_runs.zip").is_file()
        or (folder / "all_runs").is_dir()
        or any(folder.glob("run*/class_labels.txt"))
    )


@exposed_in("funcmeta.data")
def missing_omniglot_files(
    root: str | Path,
    splits: str | Sequence[str] = (),
    *,
    runs: bool = False,
    url: str = OMNIGLOT_URL,
) -> dict[str, str]:
    """The official Omniglot files that :func:`load_omniglot` (for ``splits``) and, with
    ``runs``, :func:`load_omniglot_runs` would not find in the folder ``root``: each file's
    name, with the address it is published at (``url`` followed by its path in the dataset's
    repository). A split counts as there unpacked (``images_background/``) or as its archive;
    the runs as ``all_runs.zip``, ``all_runs/`` or ``runNN/``. Empty when everything is there,
    or when ``root`` is a file (an archive, read as given). Only the minimal splits and the
    runs can be fetched (``download=True``, :data:`funcmeta.data.OMNIGLOT_FILES`); the others must be put in
    ``root`` by hand. Raises ``ValueError`` for an unknown split.

    Example:
        >>> import tempfile, funcmeta as fm
        >>> missing = fm.data.missing_omniglot_files(tempfile.mkdtemp(), "background_small1", runs=True)
        >>> for name, address in missing.items():
        ...     print(name, address)
        images_background_small1.zip https://github.com/brendenlake/omniglot/raw/master/python/images_background_small1.zip
        all_runs.zip https://github.com/brendenlake/omniglot/raw/master/python/one-shot-classification/all_runs.zip
    """
    source = Path(root).expanduser()
    names = [splits] if isinstance(splits, str) else list(splits)
    for s in names:
        check_choice(s, "split", sorted(SPLITS))
    if source.is_file():
        return {}
    base = url if url.endswith("/") else url + "/"
    missing = [
        SPLITS[s] + ".zip"
        for s in dict.fromkeys(names)
        if not ((source / SPLITS[s]).is_dir() or (source / (SPLITS[s] + ".zip")).is_file())
    ]
    if runs and not _has_runs(source):
        missing.append("all_runs.zip")
    return {name: base + OMNIGLOT_FILES.get(name, f"python/{name}") for name in missing}


def _run_files(source: Path, stack: contextlib.ExitStack) -> tuple[dict[str, Opener], str]:
    """Every file of the runs, by its path relative to the folder holding ``runNN/``."""
    if source.is_file():
        return _zip_members(source, stack), f"{source}:"
    base = source / "all_runs" if (source / "all_runs").is_dir() else source
    files = {
        p.relative_to(base).as_posix(): cast(Opener, functools.partial(p.open, "rb"))
        for p in sorted(base.glob("run*/**/*"))
        if p.is_file()
    }
    return files, f"{base}/"


@exposed_in("funcmeta.data")
def load_omniglot_runs(
    root: str | Path,
    *,
    size: int = 28,
    invert: bool = True,
    resample: str = "lanczos",
    download: bool = False,
    url: str = OMNIGLOT_URL,
) -> EpisodeBatch:
    """The official one-shot classification benchmark as one :class:`EpisodeBatch` of its
    runs (20 in ``all_runs.zip``): each a 20-way one-shot episode within one alphabet of the
    evaluation set.

    ``root`` is ``all_runs.zip``, a folder holding it, or the unpacked runs (``runNN/`` in
    ``root`` or in ``root/all_runs``). With ``download=True`` a missing ``all_runs.zip`` is
    fetched into ``root`` from ``url`` and verified. Per run: ``x_support`` holds ``training/classMM.png``
    in the order of ``MM`` (``y_support`` is ``MM - 1``), ``x_query`` holds
    ``test/itemKK.png`` in the order of ``KK``, and ``y_query`` is the answer from
    ``class_labels.txt``. Images are preprocessed as :func:`load_omniglot` does (``size``,
    ``invert``, ``resample``); ``classes``
    is ``0 .. ways-1`` (the runs have no global labels). A run whose answers name a missing
    image, or runs of different sizes, raise ``ValueError``.

    Example (needs the file; ``download=True`` fetches it):
        >>> import funcmeta as fm
        >>> runs = fm.data.load_omniglot_runs("data/omniglot/all_runs.zip")  # doctest: +SKIP
        >>> runs.x_support.shape, runs.y_query.shape  # doctest: +SKIP
        (torch.Size([20, 20, 1, 28, 28]), torch.Size([20, 20]))
    """
    check_int(size, "size (the side of the images, in pixels)", low=1)
    _check_resample(resample)
    source = Path(root).expanduser()
    if download and not source.exists():
        if source.name == "all_runs.zip":
            source = source.parent
        source.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and not any(source.glob("run*")) and not (source / "all_runs").is_dir():
        fetched = _fetched(source, "all_runs.zip", download, "the one-shot runs", url)
        if fetched is None:
            raise FileNotFoundError(
                f"no one-shot runs at {source}: expected all_runs.zip "
                f"({url.rstrip('/')}/{OMNIGLOT_FILES['all_runs.zip']}), as published or "
                "unpacked (runNN/class_labels.txt); put it there, or pass download=True to "
                "fetch it"
            )
        source = fetched
    elif not source.exists():
        raise FileNotFoundError(f"no one-shot runs at {source}")
    with contextlib.ExitStack() as stack:
        files, where = _run_files(source, stack)
        label_files = sorted(n for n in files if n.endswith("/class_labels.txt"))
        if not label_files:
            raise ValueError(f"no runNN/class_labels.txt under {source}")
        runs = []
        for labels_name in label_files:
            with files[labels_name]() as f:
                raw = f.read()
            try:
                text = raw.decode()
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}{labels_name} is not UTF-8 text ({e})") from None
            lines = [ln.split() for ln in text.splitlines() if ln.strip()]
            if any(len(ln) != 2 for ln in lines):
                raise ValueError(
                    f"{where}{labels_name}: expected lines '<test image> <training image>'"
                )
            training = sorted({train for _, train in lines})
            index = {name: i for i, name in enumerate(training)}
            missing = [n for pair in lines for n in pair if n not in files]
            if missing:
                raise ValueError(
                    f"{where}{labels_name} names images that are absent: {missing[:3]}"
                )
            support = torch.stack([_decode(where + n, files[n], size, resample) for n in training])
            query = torch.stack(
                [_decode(where + t, files[t], size, resample) for t, _ in sorted(lines)]
            )
            answers = torch.tensor([index[train] for _, train in sorted(lines)])
            runs.append((support, query, answers))
    shapes = {(len(s), len(q)) for s, q, _ in runs}
    if len(shapes) != 1:
        raise ValueError(
            f"the runs under {source} differ in size (ways, queries): {sorted(shapes)}"
        )
    x_s = torch.stack([s for s, _, _ in runs]).unsqueeze(2)
    x_q = torch.stack([q for _, q, _ in runs]).unsqueeze(2)
    if invert:
        x_s, x_q = 1 - x_s, 1 - x_q
    ways = x_s.shape[1]
    y_s = torch.arange(ways).repeat(len(runs), 1)
    y_q = torch.stack([a for _, _, a in runs])
    return EpisodeBatch(x_s, y_s, x_q, y_q, y_s.clone())
