"""`make docs` builds: the pages and the API reference generated from the docstrings, with
warnings as errors (a broken cross-reference, a malformed docstring or a page outside the
table of contents fails here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sphinx_build_has_no_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="sphinx is not installed: pip install -e '.[dev]'")
    pytest.importorskip(
        "myst_parser", reason="myst-parser is not installed: pip install -e '.[dev]'"
    )
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q"]
    run = subprocess.run(
        [*cmd, str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"sphinx-build failed:\n{run.stdout}\n{run.stderr}"
    reference = (tmp_path / "html" / "reference" / "core.html").read_text()
    for name in ("funcmeta.adapt", "funcmeta.adapt_tasks", "funcmeta.AdaptOptions"):
        assert f'id="{name}"' in reference, f"{name} is missing from the API reference"
    assert 'id="funcmeta.optim.from_torch"' in (tmp_path / "html/reference/optim.html").read_text()
