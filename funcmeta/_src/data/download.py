"""Fetching the official Omniglot files into a cache directory, verified by sha256.

Only files whose checksum funcmeta knows (``KNOWN_SHA256``) are
downloaded: a file is written under its final name only after its sha256 matched.
"""

from __future__ import annotations

import hashlib
import os
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from funcmeta._src.core.checks import check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tempfiles import make_temp, remove_stale
from funcmeta._src.data.files import KNOWN_SHA256, KNOWN_SIZE, sha256

__all__ = ["OMNIGLOT_FILES", "OMNIGLOT_URL", "download_omniglot"]

OMNIGLOT_URL = "https://github.com/brendenlake/omniglot/raw/master/"
"""Where the dataset's public repository serves its files; a file's address is this
followed by its path in :data:`funcmeta.data.OMNIGLOT_FILES`."""

OMNIGLOT_FILES = {
    "images_background_small1.zip": "python/images_background_small1.zip",
    "images_background_small2.zip": "python/images_background_small2.zip",
    "all_runs.zip": "python/one-shot-classification/all_runs.zip",
}
"""The official files :func:`download_omniglot` can fetch, by name: their path in the
repository. Each has a known sha256."""

DEFAULT_FILES = tuple(OMNIGLOT_FILES)


def _fetch(
    url: str, target: Path, expected: str, size: int, timeout: float, deadline: float
) -> None:
    """Stream ``url`` into a temporary file beside ``target``; rename it into place only
    once its sha256 is ``expected``. More than ``size`` bytes, or a transfer still running
    ``deadline`` seconds after it began, is cut off and nothing is kept."""
    digest = hashlib.sha256()
    remove_stale(target, ".part")  # of downloads of this file that were interrupted
    fd, tmp = make_temp(target, ".part")
    end = time.monotonic() + deadline
    received = 0
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            # read1: what has arrived (up to 1 MiB), so that a slow sender cannot hold one
            # read open past the deadline
            read = getattr(response, "read1", response.read)
            for block in iter(lambda: read(1 << 20), b""):
                received += len(block)
                if received > size:
                    raise ValueError(
                        f"downloading {url}: the server sent more than the official "
                        f"{target.name}'s {size} bytes; cut off, nothing was kept"
                    )
                if time.monotonic() > end:
                    raise TimeoutError(
                        f"not finished after {deadline:g} s ({received} of "
                        f"{size} bytes); cut off, nothing was kept (raise deadline= for a "
                        "slow connection)"
                    )
                digest.update(block)
                out.write(block)
        found = digest.hexdigest()
        if found != expected:
            raise ValueError(
                f"downloaded {url}: sha256 {found}, but the official {target.name} has "
                f"{expected}; nothing was kept (a changed file or a broken transfer)"
            )
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@exposed_in("funcmeta.data")
def download_omniglot(
    root: str | Path,
    files: Iterable[str] = DEFAULT_FILES,
    *,
    url: str = OMNIGLOT_URL,
    timeout: float = 60.0,
    deadline: float = 600.0,
) -> dict[str, Path]:
    """Fetch official Omniglot ``files`` (names in :data:`funcmeta.data.OMNIGLOT_FILES`) into ``root``
    and return their paths by name.

    A file already in ``root`` with the right sha256 is kept and not fetched again; one with
    another checksum is fetched anew. Every download is checked against the known sha256
    before it takes its name; a mismatch raises ``ValueError`` and leaves nothing behind.
    ``url`` is the base address (the dataset's public repository by default; a mirror with
    the same layout works). Network failures raise ``OSError`` (``urllib.error.URLError``)
    naming the address. ``timeout`` bounds each network operation (seconds), ``deadline``
    each file's whole transfer (``TimeoutError``); a server that sends more bytes than the
    official file has is cut off (``ValueError``). Nothing of a failed download is kept.

    Example (the files of this release of the dataset; needs the network):
        >>> import funcmeta as fm
        >>> paths = fm.data.download_omniglot("~/.cache/funcmeta/omniglot")  # doctest: +SKIP
        >>> images, labels, names = fm.data.load_omniglot(paths["images_background_small1.zip"])  # doctest: +SKIP
    """
    check_real(timeout, "timeout (seconds per network operation)", low=0.0, low_open=True)
    check_real(deadline, "deadline (seconds per file)", low=0.0, low_open=True)
    names = list(files)
    unknown = [n for n in names if n not in OMNIGLOT_FILES]
    if unknown:
        raise ValueError(
            f"no known download with a checksum for {unknown}; the files are "
            f"{sorted(OMNIGLOT_FILES)}"
        )
    folder = Path(root).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    base = url if url.endswith("/") else url + "/"
    paths = {}
    for name in names:
        target = folder / name
        expected = KNOWN_SHA256[name]
        if not (target.is_file() and sha256(target) == expected):
            address = base + OMNIGLOT_FILES[name]
            try:
                _fetch(address, target, expected, KNOWN_SIZE[name], timeout, deadline)
            except TimeoutError as e:  # the deadline, or a network operation's timeout
                raise TimeoutError(f"could not download {address}: {e}") from e
            except OSError as e:
                raise OSError(f"could not download {address}: {e}") from e
        paths[name] = target
    return paths
