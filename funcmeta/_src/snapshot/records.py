"""The CRC-32 of every record of a zip archive that ``torch.save`` wrote, checked against the
one stored with the record, straight from a mapping of the file.

``torch.save`` writes a zip archive of uncompressed records (the pickled structure, one record
per storage) and stores each record's CRC-32 in the archive's index. Checking them all reads
each byte once, in parallel threads (``zlib`` releases the GIL), at memory speed.

Example:
    >>> import tempfile, pathlib, torch
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.pt"
    >>> torch.save({"w": torch.ones(3)}, path)
    >>> check_records(path).bad
    []
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

__all__ = ["RecordCheck", "check_records", "compute_crc32", "file_stamp"]

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # a zip local file header: 30 bytes
_LOCAL_SIGNATURE = b"PK\x03\x04"
_CHUNK = 1 << 26  # records are split in 64 MiB pieces, so that two threads share a large one


class RecordCheck(NamedTuple):
    """What :func:`check_records` found: the records whose bytes do not match their CRC-32,
    whether the archive stores CRCs at all (``torch.save`` with CRCs turned off writes 0),
    and the file's stamp when it was checked (:func:`file_stamp`)."""

    bad: list[str]
    has_crcs: bool
    stamp: tuple[int, int, int, int]


def file_stamp(path: Path | int) -> tuple[int, int, int, int]:
    """The file's device, inode, size and modification time: a file replaced or rewritten
    since has another."""
    s = os.stat(path)
    return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)


def _crc(view: memoryview) -> int:
    crc = 0
    for start in range(0, len(view), _CHUNK):
        crc = zlib.crc32(view[start : start + _CHUNK], crc)
    return crc


def check_records(path: str | os.PathLike[str]) -> RecordCheck:
    """Check the CRC-32 of every record of the zip archive at ``path`` against the stored one.

    Raises ``zipfile.BadZipFile`` (or ``ValueError``) for an archive whose index or local
    headers are damaged or that holds a compressed record (``torch.save`` writes none)."""
    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        infos = archive.infolist()
        size = os.fstat(f.fileno()).st_size
        ident = file_stamp(f.fileno())
        if size == 0:
            raise zipfile.BadZipFile("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                regions = [_region(view, info, size) for info in infos]
                # the largest first, so that the threads finish together
                regions.sort(key=lambda r: -(r[2] - r[1]))
                workers = min(8, os.cpu_count() or 1, max(1, len(regions)))
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    found = list(pool.map(lambda r: _crc(view[r[1] : r[2]]) == r[3], regions))
            finally:
                view.release()
    bad = sorted(r[0] for r, ok in zip(regions, found, strict=True) if not ok)
    return RecordCheck(bad, any(info.CRC != 0 for info in infos), ident)


def _region(view: memoryview, info: zipfile.ZipInfo, size: int) -> tuple[str, int, int, int]:
    """``(name, start, end, crc)`` of a stored record's bytes in the file."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"record {info.filename} is compressed; torch.save writes none")
    start = info.header_offset
    if start + _LOCAL_HEADER.size > size:
        raise zipfile.BadZipFile(f"record {info.filename} lies beyond the end of the file")
    header = _LOCAL_HEADER.unpack(view[start : start + _LOCAL_HEADER.size])
    if header[0] != _LOCAL_SIGNATURE:
        raise zipfile.BadZipFile(f"record {info.filename} has a damaged header")
    name_len, extra_len = header[-2], header[-1]
    begin = start + _LOCAL_HEADER.size + name_len + extra_len
    end = begin + info.compress_size
    if end > size:
        raise zipfile.BadZipFile(f"record {info.filename} runs past the end of the file")
    return info.filename, begin, end, info.CRC


def compute_crc32() -> bool:
    """Whether ``torch.save`` stores each record's CRC-32 now (it can be turned off with
    ``torch.serialization.set_crc32_options``; releases before 2.4 always store them)."""
    import torch.serialization as serialization

    get = getattr(serialization, "get_crc32_options", None)
    return True if get is None else bool(get())
