"""Checks on the files funcmeta reads, made before their contents are trusted: archive
member names, checksums of files whose source is known, and images that do not decode."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path, PurePosixPath

__all__ = ["KNOWN_SHA256", "KNOWN_SIZE", "check_sha256", "safe_members", "sha256"]

KNOWN_SHA256 = {
    # the Omniglot dataset's public repository (github.com/brendenlake/omniglot), python/
    "images_background_small1.zip": "f38eb80f801274ac2b4dff5b24289016bfaba4a7d5bb50deebf27104ad6cb8a4",
    "images_background_small2.zip": "3ccaa407515a8778e5d0861875af38b17e418f301ad5bb3b5a6b65d901a41c7f",
    "all_runs.zip": "437c1eeab0af8484112e1b4cc0f3d541ec727f7c47b9b202da738af9dfd6c325",
}
"""sha256 of the official files funcmeta knows by name."""

KNOWN_SIZE = {
    "images_background_small1.zip": 1319022,
    "images_background_small2.zip": 1580917,
    "all_runs.zip": 352787,
}
"""Size in bytes of the official files: a download that sends more is cut off."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path) -> None:
    """For a file named like a known official file, its sha256 must match."""
    expected = KNOWN_SHA256.get(path.name)
    if expected is None:
        return
    found = sha256(path)
    if found != expected:
        raise ValueError(
            f"{path} has sha256 {found}, but the official {path.name} has {expected}: the file "
            "is corrupt or modified"
        )


def safe_members(archive: zipfile.ZipFile, path: Path) -> list[str]:
    """The archive's member names, each checked: no absolute path, drive or ``..``."""
    names = archive.namelist()
    for name in names:
        parts = PurePosixPath(name.replace("\\", "/")).parts
        drive = bool(parts) and ":" in parts[0]
        if name.startswith(("/", "\\")) or ".." in parts or drive:
            raise ValueError(f"{path} has the member {name!r}, a path outside the archive: refused")
    return names
