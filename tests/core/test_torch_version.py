"""The torch this suite runs on: within the range we claim, and providing the private
functorch primitives that task batching relies on."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import funcmeta._src.core.fence as fence
import funcmeta._src.core.vmap as functorch_glue

ROOT = Path(__file__).resolve().parents[2]


def _claimed() -> str:
    """The torch requirement in pyproject.toml's dependencies, e.g. ``torch>=2.5``."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    return re.search(r'"(torch>=[^"]+)"', deps).group(1)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def test_functorch_primitives_present():
    missing = fence.missing_functorch()
    assert not missing, (
        f"torch {torch.__version__}'s torch._C._functorch lacks {missing}, which "
        "funcmeta/_src/core/fence/functorch.py takes. Without them, checkpointed layers and recurrent "
        "layers cannot run under task batching (call_outside_vmap raises), and nn.Linear "
        "loses its task-batched fast path. Port funcmeta/_src/core/fence/ to this release, or lower the "
        "claimed torch range in pyproject.toml and the README."
    )
    assert functorch_glue.USE_PRIMITIVES


def test_torch_within_the_claimed_range():
    spec = _claimed()
    floor = _version(spec.split(">=")[1])
    assert _version(torch.__version__) >= floor, (
        f"torch {torch.__version__} is older than the floor {spec} in pyproject.toml"
    )


def test_readme_records_the_tested_range():
    spec = _claimed()
    floor = spec.split(">=")[1]
    makefile = (ROOT / "Makefile").read_text()
    tested_floor = re.search(r"^TORCH_FLOOR \?= (\S+)", makefile, re.M).group(1)
    newest = re.search(r"^TORCH_NEWEST \?= (\S+)", makefile, re.M).group(1)
    assert _version(tested_floor)[:2] == _version(floor)[:2], (
        f"make test-matrix tests torch {tested_floor}, but pyproject.toml claims {spec}"
    )
    readme = (ROOT / "README.md").read_text()
    assert f"torch {tested_floor}" in readme and f"torch {newest}" in readme, (
        "the README must name the torch versions make test-matrix runs"
    )
