"""Renamed and removed public names fail with a pointer to what replaced them: every old name
of CHANGELOG.md and of the table behind the errors (funcmeta/_src/core/renames.py), each
replacement there, and nothing aliased."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

import funcmeta as fm
from funcmeta._src.core import renames

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
TABLE = {entry.old: entry for entry in renames.GONE}
MISSING = object()


def canonical(name: str) -> str:
    """``fm.x`` and ``funcmeta.x`` as ``funcmeta.x``; ``FunctionalModel.x`` under funcmeta."""
    if name.startswith("fm."):
        return "funcmeta." + name[3:]
    if name.startswith("FunctionalModel."):
        return "funcmeta." + name
    return name


def as_written(path: str) -> str:
    """How the messages write a path: ``fm.x``, and ``FunctionalModel.x`` for its attributes."""
    if path.startswith("funcmeta.FunctionalModel."):
        return path[len("funcmeta.") :]
    return "fm." + path[len("funcmeta.") :] if path.startswith("funcmeta.") else path


def instance() -> fm.FunctionalModel:
    return fm.functional_model(torch.nn.Linear(1, 1))


def lookup(path: str) -> object:
    """The object at ``path`` (canonical) as code reaches it: the longest imported module on
    it, then attributes; a class's attributes are looked up on an instance (where the
    pointers are). Raises what the lookup raises."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        found: object = sys.modules.get(".".join(parts[:i]), MISSING)
        if found is not MISSING:
            break
    for j, part in enumerate(parts[i:]):
        if found is fm.FunctionalModel and j == len(parts[i:]) - 1:
            found = instance()
        found = getattr(found, part)
    return found


def exists(path: str) -> bool:
    try:
        lookup(path)
    except AttributeError:
        return False
    return True


def imports(path: str) -> bool:
    try:
        importlib.import_module(path)
    except ImportError:
        return False
    return True


def pointer(path: str) -> renames.Gone:
    """The table's entry whose error a lookup of ``path`` meets: ``path``'s own, or that of
    the nearest gone name above it (``fm.remat.POLICIES`` meets ``fm.remat``'s)."""
    parts = path.split(".")
    for i in range(len(parts), 1, -1):
        entry = TABLE.get(".".join(parts[:i]))
        if entry is not None:
            return entry
    raise AssertionError(f"no entry of renames.GONE covers {path}")


def changelog_lines() -> list[tuple[list[str], str | None]]:
    """The "- `old`, `old` → `new` ..." and "- `old` → removed ..." items of CHANGELOG.md, as
    written: (olds, new or None). Items whose old is not a dotted name (a call, a keyword)
    are changes of signature, not names, and are left out."""
    items = re.split(r"\n(?=- )|\n(?=\S)", CHANGELOG.read_text())
    name = r"(?:fm|funcmeta|FunctionalModel)(?:\.\w+)+"
    found = []
    for item in items:
        item = " ".join(item.split())
        head = re.match(r"- ((?:`[^`]+`(?:, |,? and )?)+) → (`[^`]+`|removed)", item)
        if head is None:
            continue
        olds = re.findall(r"`([^`]+)`", head.group(1))
        if not all(re.fullmatch(name, old) for old in olds):
            continue
        new = head.group(2)
        found.append((olds, None if new == "removed" else new.strip("`")))
    return found


ITEMS = changelog_lines()
NEWEST = {}
for _olds, _new in ITEMS:
    for _old in _olds:
        NEWEST.setdefault(canonical(_old), _new)  # the changelog is newest first


def current(path: str) -> str | None:
    """What ``path`` (canonical) is called now: itself if it exists, else the newest
    replacement of it or of the nearest gone name above it, followed to the end."""
    seen = set()
    while not exists(path):
        above = [o for o in NEWEST if NEWEST[o] and (path == o or path.startswith(o + "."))]
        if not above:
            return None
        old = max(above, key=len)
        if old in seen:
            return None
        seen.add(old)
        path = canonical(NEWEST[old]) + path[len(old) :]
    return path


def test_the_changelog_has_an_unreleased_section_first_and_its_list_of_names():
    headings = re.findall(r"^## (.+)$", CHANGELOG.read_text(), flags=re.M)
    assert headings[0] == "Unreleased"
    assert len(ITEMS) >= 30, ITEMS


@pytest.mark.parametrize(
    ("old", "new"),
    [(old, new) for olds, new in ITEMS for old in olds],
    ids=[f"{old}" for olds, _ in ITEMS for old in olds],
)
def test_each_old_name_of_the_changelog_fails_naming_its_replacement(old, new):
    path = canonical(old)
    as_module = old.startswith("funcmeta.")
    if imports(path) if as_module else exists(path):
        # named again later: it must be the replacement of a newer line
        assert any(n and canonical(n) == path for _, n in ITEMS), f"{old} exists again"
        return
    error: type[Exception] = ImportError if as_module else AttributeError
    with pytest.raises(error) as info:
        importlib.import_module(path) if as_module else lookup(path)
    entry = pointer(path)
    assert entry.message in str(info.value)
    assert "CHANGELOG.md" in str(info.value)
    if new is not None and entry.old == path:
        now = current(canonical(new))
        assert now is not None, f"{new}, the replacement of {old}, exists under no name"
        assert as_written(now) in str(info.value), (now, str(info.value))


@pytest.mark.parametrize("entry", renames.GONE, ids=[e.old for e in renames.GONE])
def test_each_entry_of_the_table_is_in_the_changelog(entry):
    assert entry.old in {canonical(old) for olds, _ in ITEMS for old in olds}


@pytest.mark.parametrize("entry", renames.GONE, ids=[e.old for e in renames.GONE])
def test_each_entry_points_to_replacements_that_exist(entry):
    assert entry.renamed <= (len(entry.new) == 1)
    assert entry.new or entry.how, "a removal without a replacement says what to do instead"
    for new in entry.new:
        assert exists(new), new
        assert renames.short(new) in entry.message
    assert entry.message.startswith(renames.short(entry.old) + " was ")
    assert entry.message.endswith("(see CHANGELOG.md)")


@pytest.mark.parametrize("entry", renames.GONE, ids=[e.old for e in renames.GONE])
def test_each_old_name_fails_and_is_not_an_attribute(entry):
    owner = lookup(entry.owner)
    if isinstance(owner, type):
        owner = instance()
    if entry.module and entry.name in vars(owner):
        return  # fm.optim.adam is the optimizer; the module funcmeta.optim.adam is gone
    with pytest.raises(AttributeError) as info:
        getattr(owner, entry.name)
    assert str(info.value) == entry.message
    assert info.value.name == entry.name
    assert not hasattr(owner, entry.name)
    assert entry.name not in dir(owner)
    assert entry.name not in getattr(owner, "__all__", ())


@pytest.mark.parametrize(
    "entry", [e for e in renames.GONE if e.module], ids=[e.old for e in renames.GONE if e.module]
)
def test_each_removed_module_fails_to_import_with_its_pointer(entry):
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(entry.old)
    assert str(info.value) == f"No module named {entry.old!r}: {entry.message}"
    assert entry.old not in sys.modules


@pytest.mark.parametrize(
    "entry",
    [e for e in renames.GONE if hasattr(sys.modules.get(e.owner), "__path__")],
    ids=[e.old for e in renames.GONE if hasattr(sys.modules.get(e.owner), "__path__")],
)
def test_a_packages_from_import_of_an_old_name_has_the_pointer(entry):
    if entry.name in vars(sys.modules[entry.owner]):
        return
    with pytest.raises(ImportError) as info:
        exec(f"from {entry.owner} import {entry.name}", {})
    assert entry.message in str(info.value)


def test_the_old_names_of_the_issue():
    cases = {
        "fm.remat": "fm.checkpoint",
        "fm.checkpoint.POLICIES": "fm.checkpoint.PRESETS",
        "fm.optim.trace": "fm.optim.momentum_trace",
        "fm.tree.map": "fm.tree.tree_map",
        "FunctionalModel.apply": "FunctionalModel.run",
        "FunctionalModel.task_loop": "FunctionalModel.per_task",
        "FunctionalModel.task_loop_layers": "FunctionalModel.per_task_layers",
    }
    for old, new in cases.items():
        with pytest.raises(AttributeError, match=re.escape(f"{old} was renamed {new} ")):
            lookup(canonical(old))
    assert not hasattr(fm, "remat")
    assert "remat" not in dir(fm)
    assert "remat" not in fm.__all__


def test_other_missing_names_fail_as_before():
    with pytest.raises(AttributeError, match=r"^module 'funcmeta' has no attribute 'nothere'$"):
        fm.nothere  # noqa: B018
    with pytest.raises(AttributeError, match=r"^module 'funcmeta.tree' has no attribute 'x'$"):
        fm.tree.x  # noqa: B018
    with pytest.raises(AttributeError, match=r"^'FunctionalModel' object has no attribute 'x'$"):
        instance().x  # noqa: B018
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("funcmeta.nothere")
    assert info.value.name == "funcmeta.nothere"
    with pytest.raises(ImportError, match=r"^cannot import name 'nothere' from 'funcmeta'"):
        exec("from funcmeta import nothere", {})


def test_install_twice_keeps_one_finder():
    renames.install()
    ours = [f for f in sys.meta_path if getattr(f, "funcmeta_renames", False)]
    assert len(ours) == 1
    assert sys.meta_path[-1] is ours[0]
