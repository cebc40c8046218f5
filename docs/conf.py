"""Sphinx configuration: the pages in docs/ (Markdown, through MyST) and an API reference
generated from the docstrings (autodoc, Google-style sections through napoleon).

Build with ``make docs`` (warnings are errors)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import funcmeta  # noqa: E402

project = "funcmeta"
author = "the funcmeta authors"
copyright = "the funcmeta authors"
release = version = funcmeta.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"funcmeta {version}"
napoleon_use_ivar = True
