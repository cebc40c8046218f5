"""The benchmark scripts as modules, for their tests: :func:`load` imports
``benchmarks/<purpose>/<name>.py`` as ``python benchmarks/<purpose>/<name>.py`` would find its
imports (its own folder first on ``sys.path``: the peers' support modules beside them), and
:func:`script` gives the path to run it by."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1]
PURPOSES = ("speed", "memory", "peers", "checks")


def script(path: str) -> Path:
    """``benchmarks/<path>``, e.g. ``script("speed/overhead.py")``; it must exist."""
    found = BENCHMARKS / path
    assert found.is_file(), f"no benchmark {found}"
    return found


def load(path: str) -> ModuleType:
    """The benchmark ``benchmarks/<path>`` imported as a module named ``bench_<name>``."""
    file = script(path)
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    name = f"bench_{file.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
