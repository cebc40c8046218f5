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
    checkpoint,
    cpu_memory,
    data,
    distributed,
    evaluation,
    heads,
    hyper,
    implicit,
    inputs,
    learned,
    models,
    optim,
    recipes,
    snapshot,
    tree,
)
from funcmeta._src.compiled.plan import CompilePlan as CompilePlan
from funcmeta._src.compiled.step import MetaStep as MetaStep
from funcmeta._src.compiled.step import compile_meta_step as compile_meta_step
from funcmeta._src.core.autocast_choice import AutocastChoice as AutocastChoice
from funcmeta._src.core.autocast_choice import choose_autocast as choose_autocast
from funcmeta._src.core.autocast_choice import cpu_has_native_bf16 as cpu_has_native_bf16
from funcmeta._src.core.capabilities import UnsupportedTorchError as UnsupportedTorchError
from funcmeta._src.core.capabilities import torch_capabilities as torch_capabilities
from funcmeta._src.core.precision import TF32Warning as TF32Warning
from funcmeta._src.core.precision import exact_float32 as exact_float32
from funcmeta._src.core.renames import install as _point_old_names
from funcmeta._src.core.replay import recomputing as recomputing
from funcmeta._src.core.types import AdaptResult as AdaptResult
from funcmeta._src.core.types import LossFn as LossFn
from funcmeta._src.core.types import NonFiniteError as NonFiniteError
from funcmeta._src.core.types import TaskChunk as TaskChunk
from funcmeta._src.core.types import TaskLosses as TaskLosses
from funcmeta._src.inner.adapt import adapt as adapt
from funcmeta._src.inner.inputs import Args as Args
from funcmeta._src.inner.inputs import TaskAxisWarning as TaskAxisWarning
from funcmeta._src.inner.model import functional_model as functional_model
from funcmeta._src.inner.options import AdaptKeywords as AdaptKeywords
from funcmeta._src.inner.options import AdaptOptions as AdaptOptions
from funcmeta._src.inner.tasks import adapt_tasks as adapt_tasks
from funcmeta._src.inner.tasks import apply_tasks as apply_tasks
from funcmeta._src.inner.tasks import task_losses as task_losses
from funcmeta._src.inner.tune import tune_task_chunk as tune_task_chunk
from funcmeta._src.module.functional import FunctionalModel as FunctionalModel
from funcmeta._src.module.guard import ConcurrentUseError as ConcurrentUseError
from funcmeta._src.optim.base import apply_updates as apply_updates
from funcmeta.cpu_memory import keep_freed_memory as keep_freed_memory
from funcmeta.evaluation import Evaluation as Evaluation
from funcmeta.evaluation import evaluate as evaluate

__version__ = "0.1.0"

__all__ = [
    "AdaptKeywords",
    "AdaptOptions",
    "AdaptResult",
    "Args",
    "AutocastChoice",
    "Evaluation",
    "FunctionalModel",
    "LossFn",
    "CompilePlan",
    "ConcurrentUseError",
    "MetaStep",
    "NonFiniteError",
    "TF32Warning",
    "TaskAxisWarning",
    "TaskChunk",
    "TaskLosses",
    "UnsupportedTorchError",
    "__version__",
    "adapt",
    "adapt_tasks",
    "apply_tasks",
    "apply_updates",
    "choose_autocast",
    "compile_meta_step",
    "cpu_has_native_bf16",
    "cpu_memory",
    "data",
    "distributed",
    "evaluate",
    "evaluation",
    "exact_float32",
    "functional_model",
    "heads",
    "hyper",
    "implicit",
    "inputs",
    "keep_freed_memory",
    "learned",
    "models",
    "optim",
    "recipes",
    "recomputing",
    "checkpoint",
    "snapshot",
    "task_losses",
    "torch_capabilities",
    "tree",
    "tune_task_chunk",
]

_point_old_names()  # old names fail with a pointer to the new ones (CHANGELOG.md)
del _point_old_names
