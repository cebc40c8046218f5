"""What the test suite and the examples may import: no test outside ``benchmarks/tests``
imports a benchmark (or puts ``benchmarks/`` on ``sys.path`` to do so), and the examples are
self-contained: no example edits ``sys.path``, and the only modules of ``examples/`` that an
example imports are its shared helper modules (``_name.py``), which say so."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
EXAMPLES = ROOT / "examples"


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imported_modules(module: ast.Module) -> set[str]:
    """The top-level names of the modules imported anywhere in ``module`` (absolute imports)."""
    names = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def sys_path_edits(module: ast.Module) -> list[ast.AST]:
    """Every use of ``sys.path`` other than reading it in a test (``x in sys.path``)."""
    reads = {
        id(c.comparators[0])
        for c in ast.walk(module)
        if isinstance(c, ast.Compare) and len(c.comparators) == 1 and is_sys_path(c.comparators[0])
    }
    return [n for n in ast.walk(module) if is_sys_path(n) and id(n) not in reads]


def benchmark_modules() -> set[str]:
    """The names a benchmark or one of its support modules imports as."""
    return {p.stem for p in BENCHMARKS.glob("*/*.py") if p.parent.name != "tests"} | {
        "benchmarks",
        "_common",
    }


def test_no_test_outside_the_benchmarks_imports_a_benchmark():
    benchmarks = benchmark_modules()
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        module = tree(path)
        imported = imported_modules(module) & benchmarks
        onto_path = [
            n.lineno
            for n in ast.walk(module)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and is_sys_path(n.func.value)
            and any(
                isinstance(c, ast.Constant) and isinstance(c.value, str) and "benchmarks" in c.value
                for c in ast.walk(n)
            )
        ]
        if imported or onto_path:
            found[str(path.relative_to(ROOT))] = (sorted(imported), onto_path)
    assert found == {}, "move these tests to benchmarks/tests (or copy what they need)"


def test_the_check_sees_an_import_of_a_benchmark():
    module = ast.parse("import sys\nsys.path.insert(0, 'benchmarks/speed')\nfrom tasks import x\n")
    assert "tasks" in imported_modules(module) & benchmark_modules()


def test_no_example_edits_sys_path():
    edits = {
        str(path.relative_to(ROOT)): [n.lineno for n in sys_path_edits(tree(path))]
        for path in sorted(EXAMPLES.glob("*.py"))
    }
    assert {k: v for k, v in edits.items() if v} == {}


def test_the_sys_path_check_sees_an_edit_and_not_a_read():
    edit = ast.parse("import sys\nsys.path.insert(0, 'x')\n")
    read = ast.parse("import sys\nif 'x' not in sys.path:\n    pass\n")
    assert len(sys_path_edits(edit)) == 1 and sys_path_edits(read) == []


def test_examples_import_only_the_shared_helper_modules_beside_them():
    local = {p.stem for p in EXAMPLES.glob("*.py")}
    imports = {
        path.stem: imported_modules(tree(path)) & local for path in sorted(EXAMPLES.glob("*.py"))
    }
    used = set().union(*imports.values())
    assert all(name.startswith("_") for name in used), imports
    for name in used:
        doc = ast.get_docstring(tree(EXAMPLES / f"{name}.py")) or ""
        assert "shared" in doc.lower(), f"examples/{name}.py does not say it is shared"


# A path of this repository, as code, docs and tests name one (``benchmarks/speed/tasks.py``).
_PATH = re.compile(
    r"(?<![\w/.-])((?:benchmarks|tests|examples|funcmeta|docs|scripts|\.ci)/[\w./-]*\w"
    r"\.(?:py|md|sh|png|json|toml))"
)
# Paths in other repositories that the porting examples name as their sources.
_UPSTREAM = {
    "examples/vision/maml_omniglot.py",  # learn2learn's
    "examples/few-shot/maml_omniglot.py",  # higher's
    "examples/maml-omniglot.py",  # higher's, before its move
}


def test_every_repository_path_named_in_code_docs_and_tests_exists():
    """A file moved is a name changed: every path of this repository that a module, a test,
    a page or a script names exists (files a run writes, under an ``out/`` folder, aside;
    ``CHANGELOG.md`` and the benchmark history keep the paths of their day)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    missing = []
    for name in tracked:
        if not name.endswith((".py", ".md", ".sh", ".toml", "Makefile")):
            continue
        if name in ("CHANGELOG.md", "benchmarks/RESULTS.md"):
            continue
        for found in _PATH.findall((ROOT / name).read_text(errors="ignore")):
            if "/out/" in found or found in _UPSTREAM or (ROOT / found).exists():
                continue
            missing.append(f"{name} names {found}")
    assert missing == []
