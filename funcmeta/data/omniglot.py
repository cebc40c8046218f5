"""Omniglot (Lake et al., 2015) from a local folder in the official layout.

The official archives unpack to ``images_background/`` (30 alphabets, 964 characters) and
``images_evaluation/`` (20 alphabets, 659 characters). Each holds
``<alphabet>/<characterNN>/<drawing>.png``, with 20 drawings of 105x105 per character.
:func:`load_omniglot` reads one of them into tensors; nothing is downloaded.

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
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch
from torch import Tensor

from funcmeta.data._files import check_sha256, safe_members

__all__ = ["load_omniglot"]

SPLITS = {"background": "images_background", "evaluation": "images_evaluation"}

Opener = Callable[[], IO[bytes]]


def _folder_drawings(root: Path, split: str) -> tuple[dict[str, list[tuple[str, Opener]]], Path]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    folder = root / SPLITS[split]
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no Omniglot split at {folder}: expected {SPLITS[split]}/<alphabet>/<character>/*.png"
        )
    drawings: dict[str, list[tuple[str, Opener]]] = {}
    for character in sorted(p for p in folder.glob("*/*") if p.is_dir()):
        files = sorted(character.glob("*.png"))
        if files:
            key = f"{character.parent.name}/{character.name}"
            drawings[key] = [(str(f), functools.partial(f.open, "rb")) for f in files]
    return drawings, folder


def _zip_drawings(path: Path, stack: contextlib.ExitStack) -> dict[str, list[tuple[str, Opener]]]:
    check_sha256(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a zip archive (truncated or corrupt?)")
    archive = stack.enter_context(zipfile.ZipFile(path))
    drawings: dict[str, list[tuple[str, Opener]]] = {}
    for name in sorted(safe_members(archive, path)):
        parts = name.split("/")
        if len(parts) < 3 or not name.endswith(".png"):
            continue
        key = f"{parts[-3]}/{parts[-2]}"
        drawings.setdefault(key, []).append(
            (f"{path}:{name}", functools.partial(archive.open, name))
        )
    return dict(sorted(drawings.items()))


def _decode(where: str, opener: Opener, size: int) -> Tensor:
    from PIL import Image, UnidentifiedImageError

    try:
        with opener() as f, Image.open(f) as img:
            gray = img.convert("L").resize((size, size), Image.LANCZOS)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{where} is not a readable image: {e}") from None
    pixels = torch.frombuffer(bytearray(gray.tobytes()), dtype=torch.uint8)
    return pixels.reshape(size, size).float() / 255


def load_omniglot(
    root: str | Path,
    split: str = "background",
    *,
    size: int = 28,
    invert: bool = True,
    rotations: bool = False,
) -> tuple[Tensor, Tensor, list[str]]:
    """``(images, labels, class_names)`` of one Omniglot split.

    ``root`` is a folder holding ``images_background/`` or ``images_evaluation/`` (chosen
    by ``split``), or one split's zip archive as published (``images_background.zip``,
    ``images_background_small1.zip``, ...), read without unpacking. An archive named like an
    official file must have its sha256 (:data:`funcmeta.data._files.KNOWN_SHA256`); member
    names that would leave the archive (absolute, ``..``) are refused; an image that does not
    decode raises ``ValueError`` naming it.

    ``images``: ``(N, 1, size, size)`` float32 in [0, 1], strokes 1 when ``invert`` (the
    drawings are black on white). ``labels``: ``(N,)`` class index per image. ``class_names``:
    ``"alphabet/characterNN"`` per class, sorted. With ``rotations``, each character also
    appears rotated by 90, 180 and 270 degrees as three further classes (``.../rot90`` and
    so on), the usual augmentation. Raises ``FileNotFoundError`` naming the expected folder,
    and ``ValueError`` for an unknown split or a source without images.
    """
    try:
        import PIL  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_omniglot reads PNG files with Pillow: pip install pillow") from e
    source = Path(root).expanduser()
    with contextlib.ExitStack() as open_archive:
        if source.is_file():
            drawings, where = _zip_drawings(source, open_archive), source
        else:
            drawings, where = _folder_drawings(source, split)
        decoded = {
            base: torch.stack([_decode(w, opener, size) for w, opener in files]).unsqueeze(1)
            for base, files in drawings.items()
        }
    images, labels, names = [], [], []
    for base, stack in decoded.items():
        if invert:
            stack = 1 - stack
        turns = range(4) if rotations else range(1)
        for k in turns:
            images.append(torch.rot90(stack, k, dims=(2, 3)))
            labels.append(torch.full((len(stack),), len(names)))
            names.append(base if k == 0 else f"{base}/rot{90 * k}")
    if not images:
        raise ValueError(f"no PNG drawings under {where}")
    return torch.cat(images), torch.cat(labels), names
