"""The floor plan of funcmeta, checked: the package rule and the fence.

Packages, lowest first; a module imports from its own package or from lower rows only, and
two packages of one row never import each other::

    0  _src.core                       tree, checks, types, the torch fence, kernels, replay
    1  _src.optim                      the optimizers as pure (init, update) pairs
    2  _src.module                     FunctionalModel, the shadow base, the executor protocol
    3  _src.checkpoint | _src.batching  checkpointing | the task executor
    4  _src.inner                      the batch, forward, the loop, adapt and adapt_tasks
    5  _src.compiled | _src.implicit | _src.learned | _src.models | _src.data | _src.snapshot | _src.distributed
       | _src.cpu_memory               the features that need only the engine, never each other
    6  _src.heads                      closed-form heads (on _src.implicit)
    7  _src.recipes                    the meta-learning methods (on _src.heads, _src.implicit)
    8  _src.evaluation                 the evaluation protocol (on _src.data, _src.recipes)
    9  the public modules and packages (everything outside _src): imports and __all__ only
    10 the facade (funcmeta/__init__.py)

A public module (row 9) holds a docstring, imports from funcmeta and ``__all__``, nothing else:
every implementation is in ``_src``.

Only the ``_src/core/fence`` package touches torch's (and Python's) private internals; the check reads
code only (strings and comments are skipped), with no exceptions.

    python scripts/check_layers.py
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "funcmeta"

ROWS: list[list[str]] = [
    ["_src.core"],
    ["_src.optim"],
    ["_src.module"],
    ["_src.checkpoint", "_src.batching"],
    ["_src.runtime"],
    ["_src.inner"],
    [
        "_src.compiled",
        "_src.implicit",
        "_src.learned",
        "_src.models",
        "_src.data",
        "_src.snapshot",
        "_src.distributed",
        "_src.cpu_memory",
    ],
    ["_src.heads"],
    ["_src.recipes"],
    ["_src.evaluation"],
    ["public"],
    ["__init__"],
]

FENCE = "_src.core.fence"
PRIVATE = re.compile(
    r"torch\._C\b|torch\.utils\._|torch\._functorch|torch\._inductor|torch\._dynamo|\._parameters\b|\._buffers\b|\._modules\b|"
    r"_(?:forward|backward)(?:_pre)?_hooks\b|_conv_forward\b|_reversed_padding_repeated_twice|"
    r"cudnn\.enabled\b|_is_fastpath_enabled|_qkv_same_embed_dim|sys\._getframe|"
    r"\.__code__\b|\.f_locals\b|\.f_back\b|\.co_\w+|__dict__\[\"_(?:parameters|buffers|modules)\"\]"
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def package_of(name: str) -> str:
    """The package of the module ``name``: ``_src.<part>``, ``public`` or ``__init__``."""
    if name == "__init__":
        return "__init__"
    if name == "_src":
        return "_src.core"
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "_src" else "public"


def row_of(package: str) -> int:
    for i, row in enumerate(ROWS):
        if package in row:
            return i
    raise KeyError(package)


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """The funcmeta modules ``path`` imports (``from funcmeta._src.core import tree`` is
    ``_src.core.tree``; a name from a package is the package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "funcmeta" and not node.module.startswith("funcmeta."):
                continue
            package = node.module[len("funcmeta.") :]
            folder = root.joinpath(*package.split(".")) if package else root
            for a in node.names:
                submodule = (folder / f"{a.name}.py").exists() or (folder / a.name).is_dir()
                if submodule:
                    found.add(f"{package}.{a.name}" if package else a.name)
                elif package:
                    found.add(package)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("funcmeta."):
                    found.add(a.name[len("funcmeta.") :])
    return found


def public_statements(path: Path) -> list[str]:
    """The top-level statements of the public module at ``path`` that are not its docstring,
    an import from funcmeta (or ``from __future__``) or its ``__all__``, as ``line: code``."""
    tree = ast.parse(path.read_text())
    out = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and (node.module in ("funcmeta", "__future__") or node.module.startswith("funcmeta."))
        ):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__all__"
        ]:
            continue
        out.append(f"{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return out


def code_lines(text: str) -> dict[int, str]:
    """Each line's code with strings and comments taken out, by line number."""
    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type >= tokenize.N_TOKENS:
            continue
        if sys.version_info >= (3, 12) and tok.type in (
            tokenize.FSTRING_START,
            tokenize.FSTRING_MIDDLE,
            tokenize.FSTRING_END,
        ):
            continue
        lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: " ".join(parts) for n, parts in lines.items()}


def violations(root: Path = ROOT) -> list[str]:
    """Every import against the package rule and every private access outside the fence, in
    the package at ``root``."""
    out = []
    files = sorted(root.rglob("*.py"))
    known = {module_name(p, root) for p in files}
    for path in files:
        name = module_name(path, root)
        mine = package_of(name)
        for dep in sorted(imports(path, root)):
            if dep not in known:
                continue
            theirs = package_of(dep)
            if theirs == mine:
                continue
            if row_of(theirs) >= row_of(mine):
                kind = "a sideways" if row_of(theirs) == row_of(mine) else "an upward"
                out.append(
                    f"funcmeta.{name} ({mine}, row {row_of(mine)}) imports funcmeta.{dep} "
                    f"({theirs}, row {row_of(theirs)}): {kind} import"
                )
        if mine == "public":
            for statement in public_statements(path):
                out.append(
                    f"funcmeta/{path.relative_to(root)}:{statement}: a public module holds only "
                    "a docstring, imports from funcmeta and __all__ (move it into funcmeta/_src/)"
                )
        if name != FENCE and not name.startswith(FENCE + "."):
            text = path.read_text()
            source = text.splitlines()
            for lineno, code in sorted(code_lines(text).items()):
                if PRIVATE.search(code.replace(" . ", ".").replace(" .", ".").replace(". ", ".")):
                    out.append(
                        f"funcmeta/{path.relative_to(root)}:{lineno}: touches private "
                        f"internals outside funcmeta/_src/core/fence/: {source[lineno - 1].strip()}"
                    )
    for circle in import_cycles(root):
        names = ", ".join(f"funcmeta.{m}" for m in circle)
        out.append(f"an import circle: {names} import each other (type-only imports count)")
    return out


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """The circles of imports among the modules of ``funcmeta/_src`` (type-only and
    function-level imports included): each a list of modules that import each other, round."""
    files = sorted((root / "_src").rglob("*.py"))
    known = {module_name(p, root) for p in files}
    graph = {module_name(p, root): sorted(imports(p, root) & known) for p in files}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        order[node] = low[node] = len(order)
        stack.append(node)
        for dep in graph[node]:
            if dep not in order:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], order[dep])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in order:
            visit(node)
    return circles


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    print(f"layering: {len(found)} violation(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
