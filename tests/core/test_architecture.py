"""The floor plan holds: modules import only from lower layers, only the fence touches
torch's private internals, every private access exists on this torch, and each package says
what it owns and may import (docs/design.md)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import funcmeta._src.core.fence as fence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import check_layers  # noqa: E402


def test_the_package_keeps_its_layers_and_its_fence():
    assert check_layers.violations() == []


def test_the_layering_check_catches_an_upward_import_and_a_private_access(tmp_path):
    package = tmp_path / "funcmeta"
    for folder in ("_src/core", "_src/inner", "_src/checkpoint", "_src/batching"):
        (package / folder).mkdir(parents=True)
    (package / "_src/inner/tasks.py").write_text("X = 1\n")
    (package / "_src/core/tree.py").write_text("from funcmeta._src.inner.tasks import X\n")
    (package / "_src/checkpoint/engine.py").write_text(
        "from funcmeta._src.batching.layers import Y\n"
    )
    (package / "_src/batching/layers.py").write_text("Y = 1\n")
    (package / "_src/core/kernels.py").write_text(
        'import torch\n"""torch._C in a docstring is words"""\nflag = torch._C._get_math_sdp_enabled\n'
    )
    found = check_layers.violations(package)
    assert any(
        "funcmeta._src.core.tree (_src.core, row 0) imports funcmeta._src.inner.tasks" in v
        and "an upward import" in v
        for v in found
    ), found
    assert any("_src.checkpoint.engine" in v and "a sideways import" in v for v in found), found
    assert any("kernels.py:3: touches private internals" in v for v in found), found
    assert not any("kernels.py:2" in v for v in found), found


def test_the_inner_loop_takes_a_runtime_and_no_traced_flag():
    """How a step runs is one object (``funcmeta._src.runtime``) handed down from the entry
    point: no function of the inner loop or the compiled step takes a ``traced`` flag, and
    none reads one."""
    import ast

    found = []
    for folder in ("inner", "compiled"):
        for path in sorted((ROOT / "funcmeta/_src" / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                args = node.args if isinstance(node, ast.FunctionDef) else None
                names = [a.arg for a in (*args.args, *args.kwonlyargs)] if args else []
                if "traced" in names or (isinstance(node, ast.Attribute) and node.attr == "traced"):
                    found.append(f"{path.name}:{node.lineno}")
                if isinstance(node, ast.keyword) and node.arg == "traced":
                    found.append(f"{path.name}:{node.value.lineno}")
    assert found == []


def test_the_chunk_of_a_call_is_chosen_at_its_entry_point_not_read_off_the_model():
    """The chunk of tasks is an argument of each call (``task_chunk=``), never state of the
    model: no class that runs task-batched calls keeps a chunk for later calls to read (a
    ``task_chunk`` setting, ``chunk_now``, the ``hint`` or ``latest`` call a pass followed),
    nothing reads a chunk off a model or its executor, and the executor's and runtimes'
    methods that choose or run on a chunk take the call's ``task_chunk``."""
    import ast

    stateful = {"task_chunk", "_task_chunk", "chunk_now", "hint", "latest"}
    holders = {
        "module/functional.py": {"FunctionalModel"},
        "module/task_protocol.py": {"Executor"},
        "batching/executor.py": {"TaskExecutor"},
        "batching/chunks.py": {"ChunkRule", "ChunkTuner"},
    }
    takes_it = {
        "module/task_protocol.py": {"Executor": {"chunk_for", "run_following"}},
        "batching/executor.py": {"TaskExecutor": {"chunk_for", "run_following"}},
        "runtime/base.py": {"Runtime": {"chunk_for", "following"}},
        "runtime/eager.py": {"EagerRuntime": {"chunk_for", "following"}},
    }
    found = []
    for path in sorted((ROOT / "funcmeta/_src").rglob("*.py")):
        where = path.relative_to(ROOT / "funcmeta/_src").as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in (
                "chunk_now",
                "count_with_inner_loop",
            ):
                found.append(f"{where}:{node.lineno} reads .{node.attr}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("task_chunk", "_task_chunk")
                and (
                    (isinstance(node.value, ast.Name) and node.value.id in ("fmodel", "executor"))
                    or (
                        isinstance(node.value, ast.Attribute)
                        and node.value.attr in ("fmodel", "executor")
                    )
                )
            ):
                found.append(f"{where}:{node.lineno} reads a chunk off a model")
            if not isinstance(node, ast.ClassDef):
                continue
            if node.name in holders.get(where, ()):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.FunctionDef) and inner.name in stateful:
                        found.append(f"{where}:{inner.lineno} {node.name}.{inner.name}")
                    if (
                        isinstance(inner, ast.Attribute)
                        and isinstance(inner.value, ast.Name)
                        and inner.value.id == "self"
                        and inner.attr in stateful
                    ):
                        found.append(f"{where}:{inner.lineno} {node.name} keeps .{inner.attr}")
            for name in takes_it.get(where, {}).get(node.name, ()):
                (method,) = [
                    f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name
                ]
                if "task_chunk" not in [a.arg for a in method.args.args]:
                    found.append(f"{where}:{method.lineno} {node.name}.{name} takes no task_chunk")
    assert found == []
    # the classes named are where they were looked for
    from funcmeta._src.batching.chunks import ChunkRule, ChunkTuner
    from funcmeta._src.batching.executor import TaskExecutor
    from funcmeta._src.module.functional import FunctionalModel
    from funcmeta._src.module.task_protocol import Executor

    for cls in (ChunkRule, ChunkTuner, TaskExecutor, FunctionalModel, Executor):
        assert not stateful & set(vars(cls)), cls


def _code_nodes(path: Path) -> list:
    import ast

    return list(ast.walk(ast.parse(path.read_text())))


def test_the_runtime_is_owned_not_inferred_and_required_below_the_entry_points():
    """No ``runtime_for`` (a runtime inferred from the parameters), no ``PER_TASK`` identity
    branch, and no parameter ``runtime`` with a default anywhere under ``funcmeta/_src``:
    the model's runtime is chosen where it is made and handed down."""
    import ast

    found = []
    for path in sorted((ROOT / "funcmeta/_src").rglob("*.py")):
        where = path.relative_to(ROOT / "funcmeta/_src")
        for node in _code_nodes(path):
            if isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if name in ("runtime_for", "PER_TASK"):
                    found.append(f"{where}:{node.lineno} names {name}")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                positional = [*args.posonlyargs, *args.args]
                with_defaults = [a.arg for a in positional][len(positional) - len(args.defaults) :]
                defaults = set(with_defaults) | {
                    a.arg
                    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                    if d is not None
                }
                if "runtime" in defaults:
                    found.append(f"{where}:{node.lineno} {node.name}(runtime=...) has a default")
            if isinstance(node, ast.ClassDef):
                for field in node.body:
                    if (
                        isinstance(field, ast.AnnAssign)
                        and isinstance(field.target, ast.Name)
                        and field.target.id == "runtime"
                        and field.value is not None
                    ):
                        found.append(f"{where}:{field.lineno} a runtime field with a default")
    assert found == []


#: What talks to other processes: torch.distributed's module, DTensor's gathers and
#: redistributions, the collectives.
_DISTRIBUTED_CALLS = (
    "full_tensor",
    "redistribute",
    "distribute_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "new_group",
)


def test_torch_distributed_and_dtensor_collectives_live_under_distributed_and_start_in_comm():
    """No module outside ``_src/distributed`` imports ``torch.distributed`` (or calls a
    gather or a collective); inside it, only ``comm.py`` starts a collective."""
    import ast

    found = []
    for path in sorted((ROOT / "funcmeta").rglob("*.py")):
        where = path.relative_to(ROOT / "funcmeta").as_posix()
        inside = where.startswith("_src/distributed/")
        for node in _code_nodes(path):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                if any(m.startswith("torch.distributed") for m in modules) and not inside:
                    found.append(f"{where}:{node.lineno} imports torch.distributed")
            called = None
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                through_comm = isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "comm"
                if through_comm:
                    called = None  # comm's own functions: the one place
            if called in _DISTRIBUTED_CALLS and where != "_src/distributed/comm.py":
                found.append(f"{where}:{node.lineno} calls {called}")
    assert found == [], found


def test_the_distributed_checks_see_a_call_and_a_collective_outside_their_place(tmp_path):
    """The check above is not blind: a gather in the inner loop is named."""
    import ast

    code = "def f(shard):\n    return shard.full_tensor()\n"
    calls = [
        n.func.attr
        for n in ast.walk(ast.parse(code))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]
    assert "full_tensor" in calls and "full_tensor" in _DISTRIBUTED_CALLS


def test_no_backup_or_merge_leftovers_are_tracked():
    """No ``*.orig``, ``*.rej``, ``*~``, ``*.bak`` or ``*.swp`` file is in the repository."""
    import subprocess

    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    leftovers = [f for f in tracked if f.endswith((".orig", ".rej", "~", ".bak", ".swp", ".swo"))]
    assert leftovers == []


def test_a_first_adapt_imports_no_dtensor_and_is_quick():
    """In a fresh process, the first ``fm.adapt`` of an unsharded 1x1 Linear imports no
    ``torch.distributed.tensor`` (nothing can be a DTensor before it is loaded) and takes at
    most 0.1 s (the best of three fresh processes, for a loaded machine)."""
    import subprocess

    code = (
        "import sys, time, torch, torch.nn.functional as F, funcmeta as fm\n"
        "fmodel = fm.functional_model(torch.nn.Linear(1, 1))\n"
        "x, y = torch.randn(4, 1), torch.randn(4, 1)\n"
        "t = time.perf_counter()\n"
        "fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1)\n"
        "print(time.perf_counter() - t, 'torch.distributed.tensor' in sys.modules)\n"
    )
    seconds = []
    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
        )
        took, loaded = run.stdout.split()
        assert loaded == "False", "the first fm.adapt imported torch.distributed.tensor"
        seconds.append(float(took))
    assert min(seconds) <= 0.1, seconds


def test_no_import_circle_among_the_private_modules():
    assert check_layers.import_cycles() == []


def test_the_circle_check_finds_type_only_and_function_level_circles(tmp_path):
    package = tmp_path / "funcmeta"
    (package / "_src/module").mkdir(parents=True)
    (package / "_src/core/fence").mkdir(parents=True)
    (package / "_src/module/functional.py").write_text(
        "from funcmeta._src.module.protocol import Executor\n"
    )
    (package / "_src/module/protocol.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from funcmeta._src.module.functional import FunctionalModel\nExecutor = 1\n"
    )
    (package / "_src/core/fence/__init__.py").write_text(
        "from funcmeta._src.core.fence.autograd import run\n"
    )
    (package / "_src/core/fence/autograd.py").write_text(
        "def run():\n    from funcmeta._src.core.fence import run\n"
    )
    circles = check_layers.import_cycles(package)
    assert sorted(circles) == [
        ["_src.core.fence", "_src.core.fence.autograd"],
        ["_src.module.functional", "_src.module.protocol"],
    ]
    assert any(
        "an import circle: funcmeta._src.core.fence" in v for v in check_layers.violations(package)
    )


def test_the_layering_check_catches_an_implementation_in_a_public_module(tmp_path):
    package = tmp_path / "funcmeta"
    (package / "_src/core").mkdir(parents=True)
    (package / "_src/core/tree.py").write_text("def leaves(t):\n    return t\n")
    (package / "tree.py").write_text(
        '"""Trees."""\n\nimport os\n\nfrom funcmeta._src.core.tree import leaves\n\n'
        '__all__ = ["leaves"]\n\n\ndef paths(t):\n    return os.sep\n'
    )
    (package / "models.py").write_text(
        '"""Models."""\n\nfrom funcmeta._src.core.tree import leaves\n\n__all__ = ["leaves"]\n'
    )
    found = check_layers.violations(package)
    assert any("tree.py:3: import os: a public module holds only" in v for v in found), found
    assert any("tree.py:10: def paths(t):" in v for v in found), found
    assert not any("models.py" in v for v in found), found


def test_every_private_access_exists_on_this_torch_or_its_capability_refuses():
    """A private access this torch lacks is one a capability needs, and that capability
    refuses here (funcmeta._src.core.capabilities): on torch 2.5 to 2.7, the query of the
    saved-tensor hooks in force, for checkpoint_steps. Any other missing access fails."""
    from funcmeta._src.core.capabilities import CAPABILITIES, missing

    needed = {a: name for name, c in CAPABILITIES.items() for a in c.accesses}
    unowned = [a for a in fence.missing_accesses() if a not in needed]
    assert not unowned, (
        f"torch {torch.__version__} lacks {unowned}, which funcmeta/_src/core/fence/ uses. "
        "Port that access to this release (one place), name the capability that needs it in "
        "funcmeta/_src/core/capabilities.py, or raise the claimed torch range in "
        "pyproject.toml and the README."
    )
    for access in fence.missing_accesses():
        assert missing(needed[access]) is not None, (access, needed[access])


def test_vmap_refusals_are_recognised_on_this_torch():
    def branches(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(RuntimeError) as info:
        torch.func.vmap(branches)(torch.randn(3, 2))
    assert fence.is_vmap_refusal(info.value), str(info.value)
    assert not fence.is_vmap_refusal(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not fence.is_vmap_refusal(ValueError("vmap: not a runtime error"))


@pytest.mark.parametrize(
    "name",
    [
        "funcmeta._src",
        "funcmeta._src.core",
        "funcmeta._src.optim",
        "funcmeta._src.module",
        "funcmeta._src.checkpoint",
        "funcmeta._src.batching",
        "funcmeta._src.inner",
        "funcmeta._src.compiled",
        "funcmeta._src.implicit",
        "funcmeta._src.learned",
        "funcmeta._src.models",
        "funcmeta._src.data",
        "funcmeta._src.snapshot",
        "funcmeta._src.distributed",
        "funcmeta._src.cpu_memory",
        "funcmeta._src.heads",
        "funcmeta._src.recipes",
        "funcmeta._src.evaluation",
        "funcmeta.checkpoint",
        "funcmeta.optim",
        "funcmeta.implicit",
        "funcmeta.learned",
        "funcmeta.recipes",
        "funcmeta.data",
    ],
)
def test_each_package_says_what_it_owns(name):
    doc = importlib.import_module(name).__doc__ or ""
    assert len(doc.split()) > 20, f"{name} has no docstring that says what it owns"


def test_the_fence_is_one_package_of_subsystems_with_one_registry():
    """Each torch subsystem's accesses in a module of their own, re-exported by the package;
    every probe in the one registry, whichever module registered it."""
    import importlib
    import pkgutil

    modules = [
        importlib.import_module(f"{fence.__name__}.{m.name}")
        for m in pkgutil.iter_modules(fence.__path__)
    ]
    exported: dict[str, object] = {}
    for module in modules:
        for name in module.__all__:
            assert name not in exported, f"{name} is exported by two fence modules"
            exported[name] = getattr(module, name)
    assert set(fence.__all__) == set(exported)
    assert all(getattr(fence, n) is v for n, v in exported.items())
    registries = {id(m.ACCESSES) for m in modules if hasattr(m, "ACCESSES")}
    assert registries == {id(fence.ACCESSES)} and len(fence.ACCESSES) >= 18
