"""The import-layering check of ``make lint``: funcmeta's modules import only from lower layers,
and only the fence module touches torch's private internals.

The layers, bottom up, are :data:`LAYERS` (docs/design.md draws them). A module may import a
module of its own layer or of a lower one; modules of one layer must not import each other in
a cycle (Python would fail on that anyway). A package's ``__init__`` belongs to the layer of
its highest module: it only re-exports.

    python scripts/check_layers.py            # exit 1 and a list of violations, if any
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "funcmeta"

LAYERS: list[list[str]] = [
    # 0: no funcmeta imports
    [
        "_check",
        "_deprecated",
        "_tempfiles",
        "_records",
        "_rng_state",
        "cpu_memory",
        "precision",
        "_torch_private",
        "tree",
        "remat.replay",
        "models",
        "types",
        "data.*",
    ],
    # 1: kernels, optimizers, hyperparameters, the module shadow
    ["remat.kernels", "remat.scope", "optim.*", "hyper", "remat.shadow", "distributed", "snapshot"],
    # 2: the vmap glue and what runs on it
    [
        "batching.vmap",
        "batching.auto",
        "batching.fallback",
        "batching.intercept",
        "batching.packed",
        "batching.recurrent",
        "batching.layer_norm",
        "batching.cells",
        "batching.attention",
        "batching.layers",
        "remat.engine",
        "implicit.*",
        "learned.*",
        "heads",
    ],
    # 3: per-layer checkpointing (a checkpointed layer under vmap leaves the vmap level)
    ["remat.layers", "remat.takeover", "remat", "checkpoint", "kernels", "replay"],
    # 4: the public core
    ["functional", "options", "inputs", "forward"],
    ["_loop"],
    ["inner", "tasks"],
    # 5: what is built on the inner loop
    ["batching.tune", "batching", "tune", "recipes.*", "evaluation"],
    ["__init__"],
]

FENCE = "_torch_private"
PRIVATE = re.compile(
    r"torch\._C\b|torch\.utils\._|\._parameters\b|\._buffers\b|\._modules\b|"
    r"_(?:forward|backward)(?:_pre)?_hooks\b|_conv_forward\b|_reversed_padding_repeated_twice|"
    r"cudnn\.enabled\b|_is_fastpath_enabled|__dict__\[\"_(?:parameters|buffers|modules)\"\]"
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        for pattern in layer:
            if name == pattern or (pattern.endswith(".*") and name.startswith(pattern[:-1])):
                return i
            if pattern.endswith(".*") and name == pattern[:-2]:
                return i
    raise KeyError(name)


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """The funcmeta modules ``path`` imports (``from funcmeta import tree`` is ``tree``,
    ``from funcmeta.remat import kernels`` is ``remat.kernels`` where that module exists)."""
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


def violations(root: Path = ROOT) -> list[str]:
    """Every upward import and every private access outside the fence, in the package at
    ``root``."""
    out = []
    files = sorted(root.rglob("*.py"))
    known = {module_name(p, root) for p in files}
    for path in files:
        name = module_name(path, root)
        try:
            mine = layer_of(name)
        except KeyError:
            out.append(f"funcmeta.{name}: in no layer of scripts/check_layers.py")
            continue
        for dep in sorted(imports(path, root)):
            if dep not in known:
                continue  # a name from a package (from funcmeta.optim import sgd), checked there
            if layer_of(dep) > mine:
                out.append(
                    f"funcmeta.{name} (layer {mine}) imports funcmeta.{dep} (layer "
                    f"{layer_of(dep)}): an upward import"
                )
        if name != FENCE:
            for lineno, line in enumerate(path.read_text().splitlines(), start=1):
                code = line.split("#", 1)[0]
                if PRIVATE.search(code) and "``" not in code:
                    out.append(
                        f"funcmeta/{path.relative_to(root)}:{lineno}: touches torch's private "
                        f"internals outside funcmeta/_torch_private.py: {line.strip()}"
                    )
    return out


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    print(f"layering: {len(found)} violation(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
