"""Every docstring example in the package runs and gives the output it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

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
    for name in MODULES:
        module = importlib.import_module(name)
        finder = doctest.DocTestFinder()
        if not any(t.examples for t in finder.find(module)):
            without.append(name)
    assert without == []
