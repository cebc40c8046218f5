"""The package as pip builds it: the wheel carries every module and ``py.typed`` (type
checkers then read funcmeta's hints), and nothing but the package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_py_typed_and_the_package_alone(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("funcmeta-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "funcmeta/py.typed" in names
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "funcmeta").rglob("*.py")}
    assert modules <= set(names)
    assert all(n.startswith(("funcmeta/", "funcmeta-")) for n in names), names
