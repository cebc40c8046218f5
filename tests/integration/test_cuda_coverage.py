"""CI has no GPU, so every test of CUDA code runs on the CPU too: a test marked ``cuda`` takes
``device`` from ``helpers.DEVICES`` (its CPU twin runs in CI), or is listed here with what
only a GPU can show. A new CUDA-only test without a reason fails this test."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Tests that need the device itself, and why (their logic runs on the CPU elsewhere).
GPU_ONLY = {
    "tests/compiled/test_compiled_cuda_plan.py::test_cuda_graphs_on_a_gpu_give_the_plain_paths_meta_gradients": (
        "CUDA graph capture and replay; the CUDA plan's logic runs on a CPU in the same file"
    ),
    "tests/compiled/test_compiled_cuda_plan.py::test_a_conv_net_on_a_gpu_runs_one_task_per_graph_replay": (
        "CUDA graph replays of a conv net; the plan and the chunking run on a CPU in the same file"
    ),
}


def _marked_cuda(node: ast.FunctionDef) -> bool:
    return any(
        isinstance(d, ast.Attribute) and d.attr == "cuda" and "mark" in ast.unparse(d)
        for d in node.decorator_list
    )


def test_every_cuda_test_runs_on_the_cpu_too_or_says_why_not():
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef)
                and node.name.startswith("test")
                and _marked_cuda(node)
            ):
                found[f"{path.relative_to(ROOT).as_posix()}::{node.name}"] = node
    assert set(found) == set(GPU_ONLY), (
        "a test marked cuda runs only on a GPU, which CI does not have: parametrize it over "
        "helpers.DEVICES, or list it in GPU_ONLY with what only a GPU shows; "
        f"marked: {sorted(found)}"
    )
