"""The public API is its modules' ``__all__``: each public module (every module outside
``funcmeta/_src``) exports exactly what it lists, and every public name has one public home,
its ``__module__``, where it can be found under its ``__qualname__`` (so ``repr``, errors,
pickling and the reference show public names)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from types import ModuleType

import pytest
import torch

import funcmeta as fm

PUBLIC = [
    "funcmeta",
    *sorted(
        m.name
        for m in pkgutil.walk_packages(fm.__path__, prefix="funcmeta.")
        if not any(part.startswith("_") for part in m.name.split("."))
    ),
]


def dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def exported(module: ModuleType) -> list[tuple[str, object]]:
    return [(name, getattr(module, name)) for name in module.__all__]


def test_the_public_modules_are_the_documented_ones():
    assert "funcmeta.snapshot" in PUBLIC and "funcmeta.checkpoint.kernels" in PUBLIC
    assert not [name for name in PUBLIC if "_src" in name]
    assert len(PUBLIC) >= 15, PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_a_public_module_holds_exactly_its_all(name):
    module = importlib.import_module(name)
    private = {"_src"} if name == "funcmeta" else set()  # the package of the implementation
    names = {n for n in dir(module) if not dunder(n)} - private
    assert names == {n for n in module.__all__ if not dunder(n)}
    assert len(module.__all__) == len(set(module.__all__))


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_a_public_home_that_exports_it(name):
    for attr, obj in exported(importlib.import_module(name)):
        if inspect.ismodule(obj):
            assert "_src" not in obj.__name__, f"{name}.{attr}"
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # data and type aliases: no __module__ of their own
        if not obj.__module__.startswith("funcmeta"):
            continue  # a third-party type named in a public alias (optree's PyTreeSpec)
        assert "_src" not in obj.__module__, f"{name}.{attr} is {obj.__module__}.{attr}"
        home = importlib.import_module(obj.__module__)
        assert getattr(home, obj.__qualname__) is obj, f"{name}.{attr}"
        assert obj.__qualname__ in home.__all__


def test_a_public_class_shows_its_public_name_and_pickles_by_it():
    assert repr(fm.AdaptResult) == "<class 'funcmeta.AdaptResult'>"
    assert repr(fm.snapshot.SnapshotError) == "<class 'funcmeta.snapshot.SnapshotError'>"
    assert fm.recipes.maml.__module__ == "funcmeta.recipes"
    assert fm.checkpoint.kernels.twice_differentiable.__module__ == "funcmeta.checkpoint.kernels"
    assert fm.exact_float32.__module__ == "funcmeta"  # a context manager: its wrapper's home
    result = fm.AdaptResult(*([torch.ones(2)] * len(fm.AdaptResult._fields)))
    again = pickle.loads(pickle.dumps(result))
    assert type(again) is fm.AdaptResult and torch.equal(again[0], result[0])
    assert pickle.loads(pickle.dumps(fm.recipes.maml)) is fm.recipes.maml
    assert b"_src" not in pickle.dumps(fm.Evaluation(0.5, 0.1, torch.ones(2)))


def test_a_public_class_s_methods_share_its_home():
    """doctest collects a method's examples from the module its ``__module__`` names: the
    methods go with their class, or their examples would run nowhere."""
    for cls in (fm.FunctionalModel, fm.hyper.HyperTree, fm.data.Episodes, fm.MetaStep):
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and value.__qualname__.startswith(cls.__qualname__):
                assert value.__module__ == cls.__module__, f"{cls.__qualname__}.{name}"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_docstrings_name_public_places_only(name):
    """The reference renders these: they name public modules and names, never ``_src``."""
    module = importlib.import_module(name)
    assert "_src" not in (module.__doc__ or ""), name
    for attr, obj in exported(module):
        if inspect.ismodule(obj):
            continue
        members = list(vars(obj).values()) if inspect.isclass(obj) else []
        for x in [obj, *members]:
            doc = getattr(x, "__doc__", None)
            if isinstance(doc, str) and (inspect.isclass(x) or callable(x) or x is obj):
                assert "_src" not in doc, f"{name}.{attr}: {getattr(x, '__name__', x)}"
