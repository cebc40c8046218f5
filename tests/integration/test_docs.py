"""Every docstring example in the package runs and gives the output it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import funcmeta

MODULES = [
    *sorted(m.name for m in pkgutil.walk_packages(funcmeta.__path__, prefix="funcmeta.")),
    "funcmeta",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.failed == 0


def test_every_public_module_has_examples():
    without = []
    for name in (m for m in MODULES if not any(part.startswith("_") for part in m.split("."))):
        module = importlib.import_module(name)
        finder = doctest.DocTestFinder()
        if not any(t.examples for t in finder.find(module)):
            without.append(name)
    assert without == []


ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_markdown_python_blocks_run_in_order(page):
    blocks = python_blocks((ROOT / page).read_text())
    namespace: dict = {"__name__": "__docs__"}
    torch.manual_seed(0)
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{page}[block {i}]", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message says which block failed
            raise AssertionError(f"{page}, python block {i} failed: {exc!r}\n{block}") from exc
