"""Public names that were renamed or removed, and the errors that point to what replaced them.

:data:`GONE` is the one table of them (``CHANGELOG.md`` lists the same names, with their
commits). :func:`install` turns it into errors that name the replacement: an
``AttributeError`` from the owning module (a module ``__getattr__``, PEP 562) or class
(``FunctionalModel.__getattr__``, on instances; setting such an attribute raises the same),
and an import error for ``import funcmeta.remat`` and for a package's from-imports (``from funcmeta import remat``,
``from funcmeta.optim import trace``), from a finder at the end of ``sys.meta_path`` that
answers only for the old names, after every other finder has found nothing. A from-import of
an old name from a plain module (``from funcmeta.tree import map``) says only "cannot import
name": Python drops the module's ``AttributeError`` there. The old names stay gone: nothing is
aliased, ``hasattr`` is False and neither ``dir`` nor ``__all__`` lists them. The facade calls
:func:`install` once.

Adding an entry: when a public name is renamed or removed, add it here and a line to
``CHANGELOG.md`` in the same commit; ``tests/core/test_renames.py`` checks that the two agree,
that each old name fails with its pointer and that each replacement exists.

Example:
    >>> import funcmeta as fm
    >>> fm.remat
    Traceback (most recent call last):
      ...
    AttributeError: fm.remat was renamed fm.checkpoint in b4c24ac (see CHANGELOG.md)
    >>> hasattr(fm.optim, "trace")
    False
    >>> import funcmeta.tasks
    Traceback (most recent call last):
      ...
    ModuleNotFoundError: No module named 'funcmeta.tasks': fm.tasks was removed in 30d191b; use fm.adapt_tasks, fm.apply_tasks and fm.task_losses (see CHANGELOG.md)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, NoReturn

__all__ = ["GONE", "Gone", "install", "short"]


@dataclass(frozen=True)
class Gone:
    """A public name that is no longer there.

    ``old`` is its full dotted path (``"funcmeta.remat"``, ``"funcmeta.FunctionalModel.apply"``
    for an attribute of a class); ``commits`` the commit(s) that renamed or removed it; ``new``
    the full dotted paths of what to use now, each of which exists; ``renamed`` whether it is a
    plain rename (one ``new``); ``module`` whether ``old`` was a module one could import;
    ``how`` what else to know.
    """

    old: str
    commits: str
    new: tuple[str, ...] = ()
    renamed: bool = False
    module: bool = False
    how: str = ""

    @property
    def owner(self) -> str:
        """The dotted path of the module or class the old name was an attribute of."""
        return self.old.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.old.rpartition(".")[2]

    @property
    def message(self) -> str:
        """The error's text: the old name, what happened, the commit, what to use instead."""
        new = _listed([short(n) for n in self.new])
        if self.renamed:
            text = f"{short(self.old)} was renamed {new} in {self.commits}"
        else:
            text = f"{short(self.old)} was removed in {self.commits}"
            if new:
                text += f"; use {new}"
        if self.how:
            text += f"; {self.how}"
        return f"{text} (see CHANGELOG.md)"


def short(path: str) -> str:
    """A dotted path as the docs write it: ``fm.`` for ``funcmeta.``, and a class's attribute
    under the class's own name (``FunctionalModel.run``)."""
    parts = path.split(".")
    if parts[0] != "funcmeta":
        return path
    if len(parts) > 2 and parts[1][:1].isupper():
        return ".".join(parts[1:])
    return ".".join(["fm", *parts[1:]])


def _listed(names: Sequence[str]) -> str:
    if len(names) < 2:
        return "".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"


_INTERNAL = "it is internal now"
_CHECKED = (
    "it is internal now: fm.adapt, fm.adapt_tasks, fm.task_losses and fm.apply_tasks check "
    "their calls"
)
_PACKAGE_MODULES = {
    "data": ("episodes", "omniglot", "sinusoid"),
    "implicit": ("ift", "solvers"),
    "learned": ("curvature", "mlp"),
    "recipes": ("anil", "imaml", "maml", "mamlpp", "metasgd", "protonet", "r2d2", "reptile"),
}
_OPTIM_MODULES = ("adagrad", "adam", "base", "clip", "from_torch", "primitives", "rmsprop", "sgd")

GONE: tuple[Gone, ...] = (
    # 93801d2, 2026-11-22: one calling convention
    Gone(
        "funcmeta.functionalize",
        "93801d2",
        ("funcmeta.functional_model",),
        renamed=True,
        how="its checkpoint= keyword is checkpoint_layers=",
    ),
    Gone(
        "funcmeta.resume",
        "93801d2",
        ("funcmeta.snapshot",),
        renamed=True,
        module=True,
        how="save_state is save, load_state is load, Resumed is Snapshot",
    ),
    Gone(
        "funcmeta.tree.map_with_path",
        "93801d2",
        ("funcmeta.tree.flatten_with_paths",),
        how="map over its paths and leaves and rebuild with fm.tree.unflatten",
    ),
    # 833d885, 2026-11-21: task batching speed
    Gone(
        "funcmeta.checkpoint.shadow",
        "833d885",
        ("funcmeta.functional_model",),
        how=f"{_INTERNAL}; functional_model(..., checkpoint_layers=...) builds the shadow",
    ),
    Gone(
        "funcmeta.checkpoint.sync_training",
        "833d885",
        ("funcmeta.functional_model",),
        how=f"{_INTERNAL}; functional_model(..., checkpoint_layers=...) keeps the shadow in step",
    ),
    # 99e0883, 2026-11-23: colliding names renamed (deprecated aliases until 30d191b)
    Gone(
        "funcmeta.FunctionalModel.apply",
        "99e0883",
        ("funcmeta.FunctionalModel.run",),
        renamed=True,
        how="nn.Module.apply(fn) means something else",
    ),
    Gone(
        "funcmeta.FunctionalModel.apply_checked",
        "99e0883",
        ("funcmeta.FunctionalModel.run_checked",),
        renamed=True,
    ),
    Gone("funcmeta.optim.trace", "99e0883", ("funcmeta.optim.momentum_trace",), renamed=True),
    Gone("funcmeta.tree.map", "99e0883", ("funcmeta.tree.tree_map",), renamed=True),
    Gone(
        "funcmeta.checkpoint.POLICIES",
        "99e0883",
        ("funcmeta.checkpoint.PRESETS",),
        renamed=True,
    ),
    Gone(
        "funcmeta.kernels",
        "99e0883, b4c24ac",
        ("funcmeta.checkpoint.kernels",),
        renamed=True,
        module=True,
    ),
    Gone(
        "funcmeta.replay",
        "30d191b",
        ("funcmeta.recomputing",),
        module=True,
        how="it was moved to fm.remat.replay in 99e0883",
    ),
    Gone(
        "funcmeta.optim.hparams",
        "30d191b",
        ("funcmeta.optim.Hyperparameter",),
        module=True,
        how="it was renamed fm.optim.values in 99e0883; its value checks are internal now",
    ),
    # 6816053: typed options
    Gone(
        "funcmeta.takes_options",
        "6816053",
        ("funcmeta.AdaptKeywords",),
        how="type a function's **options as Unpack[fm.AdaptKeywords]",
    ),
    # eff52ee: fm.optim exports no internals
    Gone(
        "funcmeta.optim.step",
        "eff52ee",
        ("funcmeta.apply_updates",),
        how="after opt.update; the inner loop's step is internal",
    ),
    Gone(
        "funcmeta.optim.with_descend",
        "eff52ee",
        ("funcmeta.optim.GradientTransformation",),
        how="its descend= field",
    ),
    Gone("funcmeta.optim.safe_sqrt", "eff52ee", how="internal to Adam, RMSprop and Adagrad"),
    Gone(
        "funcmeta.optim.clip_grads_by_global_norm",
        "eff52ee",
        ("funcmeta.optim.clip_by_global_norm",),
        how="clip.update(grads, clip.init(grads)) clips a gradient tree once",
    ),
    # 30d191b, 2026-11-26: the engine in funcmeta/_src, no shims
    Gone(
        "funcmeta.tune",
        "30d191b",
        ("funcmeta.tune_task_chunk",),
        module=True,
        how="it was moved to fm.batching.tune in 4de4f8d",
    ),
    Gone(
        "funcmeta.batching",
        "30d191b",
        ("funcmeta.adapt_tasks", "funcmeta.apply_tasks", "funcmeta.tune_task_chunk"),
        module=True,
        how="task batching is internal now; functional_model(..., task_chunk=...) sets the chunk",
    ),
    Gone(
        "funcmeta.forward",
        "30d191b",
        ("funcmeta.task_losses",),
        module=True,
        how=f"{_INTERNAL}; task_losses(..., return_outputs=True) gives the outputs",
    ),
    Gone(
        "funcmeta.functional",
        "30d191b",
        ("funcmeta.FunctionalModel", "funcmeta.functional_model"),
        module=True,
    ),
    Gone(
        "funcmeta.inner",
        "30d191b",
        ("funcmeta.adapt", "funcmeta.AdaptResult", "funcmeta.LossFn", "funcmeta.NonFiniteError"),
        module=True,
    ),
    Gone(
        "funcmeta.options",
        "30d191b",
        ("funcmeta.AdaptOptions", "funcmeta.AdaptKeywords"),
        module=True,
    ),
    Gone("funcmeta.precision", "30d191b", ("funcmeta.exact_float32",), module=True),
    Gone(
        "funcmeta.tasks",
        "30d191b",
        ("funcmeta.adapt_tasks", "funcmeta.apply_tasks", "funcmeta.task_losses"),
        module=True,
    ),
    Gone(
        "funcmeta.types",
        "30d191b",
        ("funcmeta.AdaptResult", "funcmeta.LossFn", "funcmeta.NonFiniteError"),
        module=True,
    ),
    *(
        Gone(f"funcmeta.optim.{name}", "30d191b", ("funcmeta.optim",), module=True)
        for name in _OPTIM_MODULES
    ),
    Gone(
        "funcmeta.optim.values",
        "30d191b",
        ("funcmeta.optim.Hyperparameter",),
        module=True,
        how="its value checks are internal now",
    ),
    Gone(
        "funcmeta.checkpoint.checkpointed_runner",
        "30d191b",
        ("funcmeta.functional_model",),
        how=f"{_INTERNAL}; functional_model(..., checkpoint_layers=...) builds the runner",
    ),
    *(
        Gone(
            f"funcmeta.optim.{name}",
            "30d191b",
            ("funcmeta.optim.GradientTransformation",),
            how=(
                "a transformation that reduces over the whole tree gives an update_tasks "
                "function for updates with a task axis"
            ),
        )
        for name in ("task_axis", "has_task_axis")
    ),
    *(
        Gone(f"funcmeta.tree.{name}", "30d191b", how=_INTERNAL)
        for name in ("flatten_registered", "leaves_registered", "unflatten_registered")
    ),
    *(
        Gone(f"funcmeta.inputs.{name}", "30d191b", how=_CHECKED)
        for name in (
            "CallInputs",
            "CheckedCall",
            "check_adapt_call",
            "check_batch",
            "check_batch_call",
            "check_call",
            "check_model",
            "leftover_task_axis",
            "task_count",
        )
    ),
    # b4c24ac, 2026-11-26: one name for checkpointing
    Gone(
        "funcmeta.remat",
        "b4c24ac",
        ("funcmeta.checkpoint",),
        renamed=True,
        module=True,
    ),
    # 5c2e4a4, 2026-11-26: one name per concept
    Gone(
        "funcmeta.FunctionalModel.task_loop",
        "5c2e4a4",
        ("funcmeta.FunctionalModel.per_task",),
        renamed=True,
    ),
    Gone(
        "funcmeta.FunctionalModel.task_loop_layers",
        "5c2e4a4",
        ("funcmeta.FunctionalModel.per_task_layers",),
        renamed=True,
    ),
    # 57c9d66, 2026-11-28: the chunk of tasks is an argument of each call
    Gone(
        "funcmeta.FunctionalModel.task_chunk",
        "57c9d66",
        how="pass task_chunk= to each task-batched call (fm.adapt_tasks, fm.task_losses, "
        "fm.apply_tasks, the recipes, fm.evaluate)",
    ),
    Gone(
        "funcmeta.FunctionalModel.chunk_now",
        "57c9d66",
        ("funcmeta.AdaptResult.chunk",),
        how="the chunk an inner loop took; pass it on as task_chunk=result.chunk",
    ),
    # 5b32348: every implementation in funcmeta/_src; the public packages re-export it
    *(
        Gone(f"funcmeta.{package}.{name}", "5b32348", (f"funcmeta.{package}",), module=True)
        for package, names in _PACKAGE_MODULES.items()
        for name in names
    ),
)
"""Every renamed or removed public name, oldest change first."""


def _by_owner() -> dict[str, dict[str, Gone]]:
    owners: dict[str, dict[str, Gone]] = {}
    for entry in GONE:
        owners.setdefault(entry.owner, {})[entry.name] = entry
    return owners


def _module_getattr(module: ModuleType, gone: dict[str, Gone]) -> Callable[[str], NoReturn]:
    def __getattr__(name: str) -> NoReturn:
        entry = gone.get(name)
        if entry is None:
            raise AttributeError(
                f"module {module.__name__!r} has no attribute {name!r}", name=name, obj=module
            )
        raise AttributeError(entry.message, name=name)

    return __getattr__


def _class_getattr(gone: dict[str, Gone]) -> Callable[[Any, str], NoReturn]:
    def __getattr__(self: Any, name: str) -> NoReturn:
        entry = gone.get(name)
        if entry is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
            )
        raise AttributeError(entry.message, name=name)

    return __getattr__


def _class_setattr(
    gone: dict[str, Gone], base: Callable[[Any, str, Any], None]
) -> Callable[[Any, str, Any], None]:
    """Setting an old name of the class raises its pointer too: it would otherwise make a
    plain attribute that nothing reads (``fmodel.task_chunk = 4``)."""

    def __setattr__(self: Any, name: str, value: Any) -> None:
        entry = gone.get(name)
        if entry is not None:
            raise AttributeError(entry.message, name=name)
        base(self, name, value)

    return __setattr__


class _OldImports:
    """A meta path finder, last on ``sys.meta_path``, asked only after every other finder has
    found nothing: ``import funcmeta.remat`` fails with a ``ModuleNotFoundError`` that has the
    pointer, and so does ``from funcmeta import remat``. ``from funcmeta import functionalize``
    asks for a submodule ``funcmeta.functionalize`` too (a package's from-import does), which
    fails with an ``ImportError`` that has the pointer. The errors' ``name`` is left unset:
    a from-import ignores a ``ModuleNotFoundError`` for the very name it asked for, and says
    only "cannot import name"."""

    funcmeta_renames = True

    def __init__(self, gone: dict[str, Gone]) -> None:
        self.gone = gone

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        entry = self.gone.get(fullname)
        if entry is None:
            return None
        if entry.module:
            raise ModuleNotFoundError(f"No module named {fullname!r}: {entry.message}")
        raise ImportError(
            f"cannot import name {entry.name!r} from {entry.owner!r}: {entry.message}"
        )


def _resolve(path: str) -> Any:
    """The module or class at ``path``: the longest imported module on it, then attributes
    (``funcmeta.recipes.imaml`` is the module, though the package's ``imaml`` is the recipe)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        found = sys.modules.get(".".join(parts[:i]))
        if found is not None:
            for part in parts[i:]:
                found = getattr(found, part)
            return found
    raise LookupError(f"{path} is not imported")


def install() -> None:
    """Give every owner of an old name its pointer (a ``__getattr__``), and put the finder
    of old imports last on ``sys.meta_path``. The owners must be imported already; the
    facade calls this after its imports. Calling it again changes nothing."""
    for owner_path, gone in _by_owner().items():
        owner = _resolve(owner_path)
        if isinstance(owner, ModuleType):
            getattr_fn: Any = _module_getattr(owner, gone)
        elif isinstance(owner, type):
            getattr_fn = _class_getattr(gone)
            if not getattr(vars(owner).get("__setattr__"), "funcmeta_renames", False):
                base: Any = owner.__setattr__
                setattr_fn: Any = _class_setattr(gone, base)
                setattr_fn.funcmeta_renames = True
                setattr(owner, "__setattr__", setattr_fn)  # noqa: B010
        else:
            raise TypeError(f"{owner_path} is neither a module nor a class")
        current = vars(owner).get("__getattr__")
        if current is not None and not getattr(current, "funcmeta_renames", False):
            raise TypeError(f"{owner_path} has a __getattr__ of its own")
        getattr_fn.funcmeta_renames = True
        owner.__getattr__ = getattr_fn
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "funcmeta_renames", False)]
    sys.meta_path.append(_OldImports({e.old: e for e in GONE}))
