"""Stand-ins for packages that learn2learn 0.2.0 imports at import time but its MAML and
MetaSGD never use: ``torchvision`` (its datasets and benchmarks) and ``gym`` (its RL
environments).

:func:`install` adds an import hook for those of the named packages that are absent. Every
module and attribute under them then resolves to a stand-in; instantiating or calling one
raises ``ImportError`` naming the missing package, except gym's ``register``, which
learn2learn calls at import time to register its environments and which does nothing here.
Installed packages are left alone.

A support module of the peer benchmarks (``_peer_maml.py`` and ``build_learn2learn.sh`` use it),
not a benchmark.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

# called while learn2learn imports (gym's environment registry): a no-op stand-in
_NO_OPS = {"register"}


class _Absent(type):
    """The type of a stand-in: usable as a base class, raises when instantiated or called."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.__name__ in _NO_OPS:
            return None
        raise ImportError(
            f"{cls.__module__}.{cls.__name__} is a stand-in: {cls._package} is not installed"
        )

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(cls._package, f"{cls.__module__}.{cls.__name__}", name)


def _stand_in(package: str, module: str, name: str) -> type:
    return _Absent(name, (), {"__module__": module, "_package": package})


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stand_in(self.__name__.split(".")[0], self.__name__, name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: set[str]) -> None:
        self.packages = packages

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(packages: Sequence[str]) -> list[str]:
    """Stand in for those of ``packages`` that are not installed; returns their names."""
    absent = [p for p in packages if importlib.util.find_spec(p) is None]
    if absent:
        sys.meta_path.append(_Finder(set(absent)))
    return absent
