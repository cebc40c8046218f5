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
    """The README names the torch releases make test-matrix runs, and the floors it states
    are those of funcmeta/_src/core/capabilities.py."""
    from funcmeta._src.core.capabilities import CAPABILITIES

    spec = _claimed()
    floor = spec.split(">=")[1]
    makefile = (ROOT / "Makefile").read_text()
    named = {
        key: re.search(rf"^TORCH_{key} \?= (\S+)", makefile, re.M).group(1)
        for key in ("FLOOR", "MIDDLE", "NEWEST")
    }
    assert _version(named["FLOOR"])[:2] == _version(floor)[:2], (
        f"make test-matrix tests torch {named['FLOOR']}, but pyproject.toml claims {spec}"
    )
    readme = (ROOT / "README.md").read_text()
    for version in named.values():
        assert f"**torch {version}**" in readme, (
            f"the README must name torch {version}, which make test-matrix runs"
        )
    for name, words in (
        ("checkpoint_steps", "`checkpoint_steps` needs torch"),
        ("sharded models", "sharded runtime (`fm.distributed.shard_model`)\ntorch"),
    ):
        wanted = ".".join(map(str, CAPABILITIES[name].floor))
        assert f"{words} {wanted}" in readme, (name, wanted)


def test_the_generated_table_covers_the_matrix_and_agrees_with_the_floors():
    """docs/torch-versions.md (scripts/torch_matrix.py) has a row without a failure for each
    torch make test-matrix runs, and each capability's floor as capabilities.py has it."""
    from funcmeta._src.core.capabilities import CAPABILITIES

    table = (ROOT / "docs" / "torch-versions.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for key in ("FLOOR", "MIDDLE", "NEWEST"):
        version = re.search(rf"^TORCH_{key} \?= (\S+)", makefile, re.M).group(1)
        row = re.search(rf"^\| {re.escape(version)} \|.*$", table, re.M)
        assert row, f"docs/torch-versions.md has no row for {version}"
        assert "failed**" not in row.group(0), f"torch {version} has failures: {row.group(0)}"
    for name, capability in CAPABILITIES.items():
        floor = ".".join(map(str, capability.floor))
        found = re.search(rf"^- {re.escape(name)}: torch (\d+\.\d+)", table, re.M)
        assert found and found.group(1) == floor, (name, floor, found and found.group(0))


def test_make_test_floors_runs_each_capability_at_its_floor():
    """CI's make test-floors runs tests on the torch of each capability's floor: one
    FLOOR_TESTS_<version> per floor, each run by the target."""
    from funcmeta._src.core.capabilities import CAPABILITIES

    makefile = (ROOT / "Makefile").read_text()
    versions = re.findall(r"^FLOOR_TESTS_(\S+) :=", makefile, re.M)
    target = makefile[makefile.index("test-floors:") :]
    for version in versions:
        assert f"$(FLOOR_TESTS_{version})" in target and f"test_matrix.sh {version} ||" in target
    floors = {_version(v)[:2] for v in versions}
    assert {c.floor for c in CAPABILITIES.values()} <= floors, (floors, CAPABILITIES)
