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

from pathlib import Path

import torch
from torch import Tensor

__all__ = ["load_omniglot"]

SPLITS = {"background": "images_background", "evaluation": "images_evaluation"}


def load_omniglot(
    root: str | Path,
    split: str = "background",
    *,
    size: int = 28,
    invert: bool = True,
    rotations: bool = False,
) -> tuple[Tensor, Tensor, list[str]]:
    """``(images, labels, class_names)`` of one Omniglot split under ``root``.

    ``images``: ``(N, 1, size, size)`` float32 in [0, 1], strokes 1 when ``invert`` (the
    drawings are black on white). ``labels``: ``(N,)`` class index per image. ``class_names``:
    ``"alphabet/characterNN"`` per class, sorted. With ``rotations``, each character also
    appears rotated by 90, 180 and 270 degrees as three further classes (``.../rot90`` and
    so on), the usual augmentation. Raises ``FileNotFoundError`` naming the expected folder,
    and ``ValueError`` for an unknown split or a folder without images.
    """
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_omniglot reads PNG files with Pillow: pip install pillow") from e
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    folder = Path(root).expanduser() / SPLITS[split]
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no Omniglot split at {folder}: expected {SPLITS[split]}/<alphabet>/<character>/*.png"
        )
    characters = sorted(p for p in folder.glob("*/*") if p.is_dir())
    images, labels, names = [], [], []
    for character in characters:
        files = sorted(character.glob("*.png"))
        if not files:
            continue
        pictures = []
        for f in files:
            with Image.open(f) as img:
                gray = img.convert("L").resize((size, size), Image.LANCZOS)
                pixels = torch.frombuffer(bytearray(gray.tobytes()), dtype=torch.uint8)
                pictures.append(pixels.reshape(size, size).float() / 255)
        stack = torch.stack(pictures).unsqueeze(1)
        if invert:
            stack = 1 - stack
        turns = range(4) if rotations else range(1)
        for k in turns:
            images.append(torch.rot90(stack, k, dims=(2, 3)))
            labels.append(torch.full((len(files),), len(names)))
            base = f"{character.parent.name}/{character.name}"
            names.append(base if k == 0 else f"{base}/rot{90 * k}")
    if not images:
        raise ValueError(f"no PNG drawings under {folder}")
    return torch.cat(images), torch.cat(labels), names
