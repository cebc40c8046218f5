"""funcmeta: functional meta-learning for PyTorch, built on ``torch.func``.

Models become pure functions (:func:`functional_model`), inner-loop updates are explicit,
differentiable optimizer steps (:mod:`funcmeta.optim`) whose hyperparameters can be learned
(:mod:`funcmeta.hyper`), and :func:`adapt` runs K of them with exact second-order (or
first-order) meta-gradients.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> lrs = fm.hyper.per_layer(fmodel.params, 0.01, parameterization="softplus")
    >>> outer = torch.optim.Adam([*net.parameters(), *lrs.parameters()], lr=1e-3)
    >>> xs, ys, xq, yq = torch.randn(4, 10, 1).unbind(0)
    >>> result = fm.adapt(fmodel, fmodel.params, F.mse_loss, (xs, ys), fm.optim.sgd(lr=lrs), steps=2)
    >>> F.mse_loss(fmodel(result.params, xq), yq).backward()
    >>> outer.step()
"""

from funcmeta import (
    batching,
    data,
    distributed,
    heads,
    hyper,
    implicit,
    inputs,
    learned,
    models,
    optim,
    options,
    recipes,
    remat,
    snapshot,
    tasks,
    tree,
    types,
)
from funcmeta.batching.tune import tune_task_chunk
from funcmeta.cpu_memory import keep_freed_memory
from funcmeta.evaluation import Evaluation, evaluate
from funcmeta.functional import FunctionalModel, functional_model
from funcmeta.inner import adapt
from funcmeta.inputs import Args
from funcmeta.optim.base import apply_updates
from funcmeta.options import AdaptOptions
from funcmeta.precision import exact_float32
from funcmeta.remat.replay import recomputing
from funcmeta.tasks import adapt_tasks, apply_tasks, task_losses
from funcmeta.types import AdaptResult, LossFn, NonFiniteError

__version__ = "0.1.0"

__all__ = [
    "AdaptOptions",
    "AdaptResult",
    "Args",
    "Evaluation",
    "FunctionalModel",
    "LossFn",
    "NonFiniteError",
    "__version__",
    "adapt",
    "adapt_tasks",
    "apply_tasks",
    "apply_updates",
    "batching",
    "data",
    "distributed",
    "evaluate",
    "exact_float32",
    "functional_model",
    "heads",
    "hyper",
    "implicit",
    "inputs",
    "keep_freed_memory",
    "learned",
    "models",
    "options",
    "optim",
    "recipes",
    "recomputing",
    "remat",
    "snapshot",
    "task_losses",
    "tasks",
    "tree",
    "tune_task_chunk",
    "types",
]


def __getattr__(name: str) -> object:
    """The deprecated module aliases, imported (and warning) only when used."""
    if name in ("checkpoint", "kernels", "replay", "tune"):
        import importlib

        return importlib.import_module(f"funcmeta.{name}")
    raise AttributeError(f"module 'funcmeta' has no attribute {name!r}")
