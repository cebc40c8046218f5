"""Meta-Curvature (Park and Oliva, 2019): learned per-layer preconditioners of the gradient.

Each parameter tensor's gradient ``G`` is multiplied, along each of its modes, by a learned
square matrix: ``M_out G M_in`` for a linear weight ``(out, in)``, ``M_out`` for a bias, and
for a convolution weight ``(out, in, *kernel)`` the three modes out, in and the flattened
kernel, as in the paper. The matrices start at the identity (plain gradient descent) and are
meta-learned with the initialisation. It is a Kronecker-factored preconditioner,
``(M_in^T (x) M_out) vec(G)``, that costs a few small matrix products per step.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fmodel = fm.functional_model(net)
    >>> mc = fm.learned.MetaCurvature(fmodel.params)
    >>> sorted(mc.modes)
    ['0.bias', '0.weight', '2.bias', '2.weight']
    >>> opt = fm.optim.chain(mc.transform(), fm.optim.sgd(lr=0.1))   # precondition, then step
    >>> b = fm.data.Sinusoid().sample(4, 10, 10)
    >>> out = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support, opt, steps=2)
    >>> F.mse_loss(fm.apply_tasks(fmodel, out.params, b.x_query)[0], b.y_query).backward()
    >>> mc.matrices["0-weight-0"].grad.shape                     # meta-gradient of M_out
    torch.Size([8, 8])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_int
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.optim.base import GradientTransformation

__all__ = ["MetaCurvature", "MetaCurvatureState"]


@exposed_in("funcmeta.learned")
class MetaCurvatureState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count


def _modes(shape: torch.Size) -> list[int]:
    """The mode sizes of a parameter: ``(out, in, prod(kernel))`` for rank >= 3."""
    if len(shape) >= 3:
        return [shape[0], shape[1], math.prod(shape[2:])]
    return list(shape)


def _key(path: str, mode: int) -> str:
    return f"{path.replace('.', '-')}-{mode}"


@exposed_in("funcmeta.learned")
class MetaCurvature(nn.Module):
    """Learnable per-mode preconditioning matrices for the parameters ``params``.

    ``params`` is the tree of parameters the inner loop adapts (``fmodel.params``), used for
    its paths and shapes. A mode larger than ``max_size`` gets no matrix (the identity), which
    keeps wide layers affordable (a matrix is ``size x size``). ``modes`` maps each path to the
    mode sizes that have a matrix (``None`` for those without); ``matrices`` holds them, as
    Parameters named ``"<path with dashes>-<mode>"``: hand ``mc.parameters()`` to the outer
    optimizer. :meth:`transform` is the preconditioner as a
    :class:`~funcmeta.optim.GradientTransformation`: chain it before an optimizer.

    Gradients with a leading task axis (:func:`funcmeta.adapt_tasks`) are preconditioned per
    task with the shared matrices; per-task matrices are not supported.
    """

    def __init__(self, params: Tree, *, max_size: int = 1024) -> None:
        super().__init__()
        check_int(max_size, "max_size", low=1, what="a positive int")
        leaves, spec = tree.flatten(params)
        if not leaves:
            raise ValueError("MetaCurvature needs a non-empty tree of parameters")
        self.shapes: dict[str, torch.Size] = {}
        self.modes: dict[str, list[int | None]] = {}
        self.matrices = nn.ParameterDict()
        for path, leaf in zip(tree.spec_paths(spec), leaves, strict=True):
            if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
                raise TypeError(f"parameter {path!r} is not a floating-point tensor")
            self.shapes[path] = leaf.shape
            sizes: list[int | None] = []
            for i, n in enumerate(_modes(leaf.shape)):
                if n > max_size:
                    sizes.append(None)
                    continue
                sizes.append(n)
                eye = torch.eye(n, dtype=leaf.dtype, device=leaf.device)
                self.matrices[_key(path, i)] = nn.Parameter(eye)
            self.modes[path] = sizes

    def precondition(self, path: str, g: Tensor) -> Tensor:
        """The preconditioned gradient of parameter ``path``: ``g`` with each mode multiplied
        by its matrix (``g`` may have one leading task axis)."""
        shape = self.shapes.get(path)
        if shape is None:
            raise KeyError(f"MetaCurvature has no matrices for parameter {path!r}")
        lead = g.dim() - len(shape)
        if lead not in (0, 1) or g.shape[lead:] != shape:
            raise ValueError(
                f"the gradient of {path!r} has shape {tuple(g.shape)}; MetaCurvature was built "
                f"for {tuple(shape)} (with at most one leading task axis)"
            )
        sizes = _modes(shape)
        x = g.reshape(*g.shape[:lead], *sizes)
        for i, n in enumerate(self.modes[path]):
            if n is None:
                continue
            m = self.matrices[_key(path, i)].to(x.dtype)
            x = torch.movedim(torch.movedim(x, lead + i, -1) @ m.T, -1, lead + i)
        return x.reshape(g.shape)

    def transform(self) -> GradientTransformation:
        """``updates = M(updates)`` leaf by leaf, differentiable in the matrices."""

        def init(params: Tree) -> MetaCurvatureState:
            for path, leaf in zip(tree.paths(params), tree.leaves(params), strict=True):
                want = self.shapes.get(path)
                if want is None or leaf.shape[leaf.dim() - len(want) :] != want:
                    raise ValueError(
                        f"parameter {path!r} of shape {tuple(leaf.shape)} is not one "
                        f"MetaCurvature was built for ({sorted(self.shapes)})"
                    )
            return MetaCurvatureState(0)

        def update(
            updates: Tree, state: MetaCurvatureState, params: Tree | None = None
        ) -> tuple[Tree, MetaCurvatureState]:
            g, spec = tree.flatten(updates)
            paths = tree.spec_paths(spec)
            out = [self.precondition(p, x) for p, x in zip(paths, g, strict=True)]
            return tree.unflatten(spec, out), MetaCurvatureState(state.count + 1)

        return GradientTransformation(init, update)

    def extra_repr(self) -> str:
        return f"{len(self.matrices)} matrices over {len(self.shapes)} parameters"
