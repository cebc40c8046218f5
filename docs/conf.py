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

# Every cross-reference must resolve (make lint builds with -n -W). There is no intersphinx
# (the build has no network), so references to other projects' objects cannot resolve: those
# of torch, optree, NumPy and the standard library, as autodoc writes them from signatures
# (``torch.Tensor``, ``collections.abc.Callable``) or as annotations name them (``Tensor``,
# ``Module``). Of funcmeta's own, only the bare alias name in annotations is ignored (below).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|optree|numpy|pybind11_builtins)(\..*)?"),
    (
        r"py:.*",
        r"(collections\.abc|contextlib|pathlib|os|abc|typing|typing_extensions|types|enum)\..*",
    ),
    (r"py:class", r"Tensor|Module|GradScaler|Generator|Optimizer|PyTreeSpec"),
    # An annotation names the alias as written (``trainable: Filter``); Sphinx looks it up as a
    # class, unqualified. It is documented as funcmeta.tree.Filter, which references resolve.
    (r"py:class", r"Filter"),
    # Private types in the signatures of public callables, which users never build: the
    # executor FunctionalModel takes (functional_model builds it) and the base of the Krylov
    # solvers.
    (r"py:class", r"funcmeta\._src\.module\.task_protocol\.Executor"),
    (r"py:class", r"funcmeta\._src\.implicit\.solvers\._Krylov"),
]


def _data_docs() -> dict[tuple[str, str], list[str]]:
    """The docstrings of the public modules' data (``fm.snapshot.FORMAT``,
    ``fm.tree.Filter``, ...), read where they are defined: a public module only imports
    them, so autodoc finds no docstring of its own there."""
    import importlib
    import inspect
    import pkgutil

    from sphinx.pycode import ModuleAnalyzer

    private = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(funcmeta.__path__, prefix="funcmeta.")
        if "._src" in m.name
    ]
    public = [
        m.name
        for m in pkgutil.walk_packages(funcmeta.__path__, prefix="funcmeta.")
        if "._" not in m.name
    ]
    docs: dict[tuple[str, str], list[str]] = {}
    for name in ["funcmeta", *public]:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
                continue
            for source in private:
                if getattr(source, attr, None) is obj:
                    found = ModuleAnalyzer.for_module(source.__name__).find_attr_docs()
                    if ("", attr) in found:
                        docs[(name, attr)] = list(found[("", attr)])
                        break
    return docs


_DATA_DOCS = _data_docs()


def _docstring(app, what, name, obj, options, lines) -> None:
    key = tuple(name.rsplit(".", 1))
    if what in ("data", "attribute") and key in _DATA_DOCS:
        lines[:] = _DATA_DOCS[key]


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _docstring)
