"""Every docstring example in the package runs and gives the output it shows, every Python
block of the docs runs, and the docs cite the decision records by path, never by number."""

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


class _Runner(doctest.DocTestRunner):
    """doctest's runner, keeping the capability refusals examples met
    (``fm.UnsupportedTorchError``: the example needs a newer torch than this one), by the
    name of the docstring they are in."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.refused: dict[str, BaseException] = {}

    def report_unexpected_exception(self, out, test, example, exc_info):  # type: ignore[no-untyped-def]
        if isinstance(exc_info[1], funcmeta.UnsupportedTorchError):
            self.refused.setdefault(test.name, exc_info[1])
        super().report_unexpected_exception(out, test, example, exc_info)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    """Every example runs as shown; one that needs a capability this torch refuses ends in
    the refusal (tests/conftest.py reports it as skipped there, a failure elsewhere)."""
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = _Runner(optionflags=flags, verbose=False)
    said: list[str] = []
    failed = []  # the docstrings with a failure that is no refusal
    for test in doctest.DocTestFinder().find(module, name):
        if runner.run(test, out=said.append).failed and test.name not in runner.refused:
            failed.append(test.name)
    assert not failed, "".join(said)[-4000:]
    if runner.refused:  # what is left: refusals alone, each ending its docstring's examples
        raise next(iter(runner.refused.values()))


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
        except funcmeta.UnsupportedTorchError:
            raise  # a capability this torch refuses (tests/conftest.py judges it)
        except Exception as exc:  # pragma: no cover - the message says which block failed
            raise AssertionError(f"{page}, python block {i} failed: {exc!r}\n{block}") from exc


# The torch facts the design rests on are decision records, one file per topic, cited by path
# (docs/decisions/<topic>.md). A citation by number breaks silently when a list is renumbered.
DECISIONS = ROOT / "docs" / "decisions"
CITING = ["funcmeta", "tests", "benchmarks", "examples", "scripts", "docs"]
CITING_FILES = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "Makefile"]
TEXT = {".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".sh", ".yml", ".yaml"}
SKIP = {"_build", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
NUMBERED = [
    re.compile(r"\bfacts?\s+\d", re.I),  # "fact" and a number: always a numbered citation
    re.compile(r"\bdesign(?:\.md)?\b[^.;]{0,40}?\bpoints?\s+\d", re.I),  # design.md's points
]
RECORD = re.compile(r"decisions/([A-Za-z0-9_-]+\.md)")


def citing_files() -> list[Path]:
    files = [ROOT / name for name in CITING_FILES if (ROOT / name).exists()]
    for top in CITING:
        for path in sorted((ROOT / top).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if path.is_file() and path.suffix in TEXT and not parts & SKIP:
                files.append(path)
    return files


def _where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT).as_posix()}:{text.count(chr(10), 0, offset) + 1}"


def test_no_design_fact_is_cited_by_number():
    found = []
    for path in citing_files():
        text = path.read_text(errors="replace")
        for pattern in NUMBERED:
            for m in pattern.finditer(text):
                found.append(f"{_where(path, text, m.start())}: {' '.join(m.group().split())!r}")
    assert found == [], (
        "cite a decision record by its path (docs/decisions/<topic>.md), not a fact by "
        "number:\n" + "\n".join(found)
    )


def test_every_decision_record_is_in_the_index_and_every_cited_record_exists():
    index = (DECISIONS / "README.md").read_text()
    records = sorted(p.name for p in DECISIONS.glob("*.md") if p.name != "README.md")
    assert records, "docs/decisions/ holds no records"
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    assert [r for r in records if r not in linked] == [], "records missing from the index"
    assert sorted(r for r in linked if not (DECISIONS / r).exists()) == [], (
        "the index links a missing record"
    )
    toctree = re.search(r"```\{toctree\}\n(.*?)```", index, flags=re.S)
    assert toctree is not None, "docs/decisions/README.md has no toctree"
    entries = {line.strip() for line in toctree.group(1).splitlines()}
    assert [r for r in records if r[: -len(".md")] not in entries] == [], "records off the toctree"
    missing = []
    for path in citing_files():
        text = path.read_text(errors="replace")
        for m in RECORD.finditer(text):
            if not (DECISIONS / m.group(1)).exists():
                missing.append(f"{_where(path, text, m.start())}: {m.group()}")
    assert missing == [], "cited decision records that do not exist:\n" + "\n".join(missing)


REPO_PATH = re.compile(r"`((?:funcmeta|tests|benchmarks|docs|examples|scripts)/[\w./-]+\.\w+)`")


def test_the_paths_the_design_and_its_records_name_exist():
    pages = [ROOT / "docs" / "design.md", *sorted(DECISIONS.glob("*.md"))]
    missing = []
    for page in pages:
        text = page.read_text()
        for m in REPO_PATH.finditer(text):
            if not (ROOT / m.group(1)).exists():
                missing.append(f"{_where(page, text, m.start())}: {m.group(1)}")
    said = "named in docs/design.md or a decision record, these paths do not exist:\n"
    assert missing == [], said + "\n".join(missing)


def test_the_checks_of_citations_can_fail():
    n = 53  # the cited numbers come from a variable, so that this file cites nothing itself
    assert NUMBERED[0].search(f"as measured (fact\n{n})") and NUMBERED[0].search(f"facts {n}-55")
    assert NUMBERED[1].search(f"(`docs/design.md`, point {n})")
    assert NUMBERED[1].search(f"(design.md, point {n})")
    assert not any(p.search(f"funcmeta +2.6 points {n}-way in") for p in NUMBERED)
    absent = "no-such-record.md"
    assert RECORD.search(f"`docs/decisions/{absent}`").group(1) == absent
    assert REPO_PATH.search(f"(`funcmeta/_src/core/{absent}`)").group(1).endswith(absent)
