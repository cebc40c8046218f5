"""The benchmarks' layout: every script in a folder by what it measures, no benchmark importing
another (what they share is in ``benchmarks/_common.py``), and ``_common``'s pieces doing what
the scripts' own copies did."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import _common
import torch
from bench_scripts import BENCHMARKS, PURPOSES, load
from helpers import profiled


def benchmark_scripts() -> list[Path]:
    """The scripts of ``benchmarks/<purpose>/``: support modules (``_name.py``) left out."""
    return sorted(
        path
        for purpose in PURPOSES
        for path in (BENCHMARKS / purpose).glob("*.py")
        if not path.name.startswith("_")
    )


def imported_modules(path: Path) -> set[str]:
    """The top-level names of the modules a file imports, anywhere in it (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_script_sits_in_a_folder_by_purpose():
    loose = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "_common.py")
    assert loose == [], f"benchmarks/ holds scripts outside {PURPOSES}: {loose}"
    assert len(benchmark_scripts()) >= 17


def test_no_benchmark_imports_another_benchmark():
    scripts = benchmark_scripts()
    names = {p.stem for p in scripts}
    offenders = {
        str(p.relative_to(BENCHMARKS)): sorted(imported_modules(p) & names) for p in scripts
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_support_modules_import_no_benchmark_either():
    names = {p.stem for p in benchmark_scripts()}
    support = [*BENCHMARKS.glob("_*.py"), *(BENCHMARKS / "peers").glob("_*.py")]
    assert {str(p.relative_to(BENCHMARKS)): imported_modules(p) & names for p in support} == {
        str(p.relative_to(BENCHMARKS)): set() for p in support
    }


def test_the_common_module_imports_no_torch_at_import_time():
    """The parents of the memory benchmarks' worker processes stay light."""
    top = [
        node
        for node in ast.parse((BENCHMARKS / "_common.py").read_text()).body
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"torch", "funcmeta", "jax", "_threads"}, names


def test_the_benchmarks_share_the_examples_allocator_option():
    _common.examples_importable()
    import _threads

    parser = argparse.ArgumentParser()
    _common.add_allocator_option(parser, False, _common.ALLOCATOR_WHY)
    args = parser.parse_args([])
    assert args.keep_freed_memory is False
    assert _common.use_allocator(args) == "allocator: the C library's defaults"
    assert _common.use_allocator(args) == _threads.use_allocator(args)
    ours, theirs = argparse.ArgumentParser(), argparse.ArgumentParser()
    _common.add_allocator_option(ours, True, "why")
    _threads.add_allocator_option(theirs, True, "why")
    assert ours.format_help() == theirs.format_help()


def test_the_task_batching_benchmark_uses_the_shared_option():
    tasks = load("speed/tasks.py")
    assert tasks._common is sys.modules["_common"]
    assert not hasattr(tasks, "add_allocator_option")


def test_peak_allocated_counts_as_the_suites_helper():
    """``_common.peak_allocated`` (the sequence benchmark's count) and ``tests/helpers.py``'s
    copy agree on the same window."""
    kept = []

    def allocate():
        kept.extend(torch.ones(25, 128) for _ in range(200))

    with (
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof,
        torch.profiler.record_function("window"),
    ):
        allocate()
    ours = _common.peak_allocated(prof, "window")
    assert 200 * 25 * 128 * 4 <= ours < 200 * 25 * 128 * 4 + 2**20
    kept.clear()
    assert abs(profiled(allocate) - ours) < 2**16


def test_timed_grad_and_rounds():
    w = torch.ones(3, requires_grad=True)
    ms, grads = _common.timed_grad(lambda: (2 * w).sum(), [w], "cpu")
    assert ms >= 0 and torch.equal(grads[0], torch.full((3,), 2.0))
    order: list[str] = []

    def call(name: str):
        return lambda: (order.append(name) or 1.0, None)

    times = _common.rounds({"a": call("a"), "b": call("b"), "c": call("c")}, 3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert _common.medians(times) == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert _common.fmt(None, 5, 1) == "    -" and _common.ratio(3.0, 2.0, 5, 2) == " 1.50"
