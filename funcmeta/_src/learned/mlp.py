"""A learned optimizer: a small MLP applied to every coordinate's gradient features.

In the style of the learned-optimisation literature (Andrychowicz et al., 2016; Metz et al.,
2019), one small network, shared by every coordinate of every parameter, maps features of a
coordinate's optimisation history to its update. The features, all per coordinate (so tasks
batch exactly), are:

- the gradient and its momenta at several decays, each divided by the root of a running
  second moment plus ``eps`` (bias-corrected, as in Adam),
- the log of that root plus ``eps`` (the gradient's scale),
- the parameter's value,
- the step, as ``tanh((t + 1) / s)`` for a few time scales ``s``.

The MLP outputs a direction ``d`` and a log-magnitude ``m`` per coordinate, and the update is

    update = -(lr * g + scale * tanh(d) * exp(b * tanh(m / b))),    b = log(max_gain),

with a learnable base rate ``lr``. The learned part of a step is bounded by
``scale * max_gain`` per coordinate, so no setting of the network can make it diverge on its
own: unbounded, meta-training drifted into steps that diverged on the largest tasks and gave
non-finite meta-gradients from then on. The last layer starts at zero, so an untrained
optimizer is exactly SGD with ``lr``; meta-training (second order, through
:func:`funcmeta.adapt`) learns the rest.

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> fmodel = fm.functional_model(net)
    >>> lopt = fm.learned.LearnedOptimizer(hidden=16, lr=0.05)
    >>> outer = torch.optim.Adam(lopt.parameters(), lr=1e-3)          # train the optimizer
    >>> b = fm.data.Sinusoid().sample(4, 10, 10)
    >>> out = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support, lopt.transform(), steps=5)
    >>> F.mse_loss(fm.apply_tasks(fmodel, out.params, b.x_query)[0], b.y_query).backward()
    >>> outer.step()
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcmeta._src.core import tree
from funcmeta._src.core.checks import check_int, check_real
from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.tree import Tree
from funcmeta._src.optim.base import GradientTransformation, safe_sqrt

__all__ = ["LearnedOptimizer", "LearnedOptimizerState"]


@exposed_in("funcmeta.learned")
class LearnedOptimizerState(NamedTuple):
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count
    momenta: tuple[Tree, ...]
    nu: Tree


def _check_decay(value: float, name: str) -> float:
    return check_real(value, name, low=0.0, high=1.0, high_open=True)


@exposed_in("funcmeta.learned")
class LearnedOptimizer(nn.Module):
    """A per-coordinate MLP optimizer; :meth:`transform` is it as a
    :class:`~funcmeta.optim.GradientTransformation` (a whole optimizer: its updates are the
    steps; chain clipping or :class:`~funcmeta.learned.MetaCurvature` before it).

    Args:
        hidden: width of the hidden layers.
        layers: number of hidden layers (ReLU).
        decays: the momenta's decays (one feature each).
        beta2: the second moment's decay.
        time_scales: the step features' scales.
        lr: the initial base learning rate (a learnable Parameter).
        scale: the learned part of a step at ``m = 0``: ``scale * tanh(d)``.
        max_gain: the most ``exp(m)`` can multiply it by (a soft bound).
        eps: added to the root of the second moment. It bounds how sharply the normalised
            features respond to a small gradient (``1 / eps``), which keeps the second-order
            meta-gradient through several steps finite; far smaller values overflow.

    All Parameters (the MLP's and ``lr``) are the meta-learnable ones: hand ``parameters()``
    to the outer optimizer. Move the module to the parameters' dtype and device (``.double()``).
    """

    def __init__(
        self,
        hidden: int = 32,
        *,
        layers: int = 2,
        decays: Sequence[float] = (0.5, 0.9, 0.99),
        beta2: float = 0.999,
        time_scales: Sequence[float] = (1.0, 3.0, 10.0),
        lr: float = 0.01,
        scale: float = 0.01,
        max_gain: float = 20.0,
        eps: float = 1e-3,
    ) -> None:
        super().__init__()
        for name, v in (("hidden", hidden), ("layers", layers)):
            check_int(v, name, low=1, what="a positive int")
        self.decays = tuple(_check_decay(v, f"decays[{i}]") for i, v in enumerate(decays))
        self.beta2 = _check_decay(beta2, "beta2")
        self.time_scales = tuple(
            check_real(s, f"time_scales[{i}]", low=0.0, low_open=True)
            for i, s in enumerate(time_scales)
        )
        self.scale = check_real(scale, "scale", low=0.0, low_open=True)
        self.eps = check_real(eps, "eps", low=0.0, low_open=True)
        self.log_gain = math.log(check_real(max_gain, "max_gain", low=1.0, low_open=True))
        lr = check_real(lr, "lr")
        features = 1 + len(self.decays) + 1 + 1 + len(self.time_scales)
        widths = [features] + [hidden] * layers
        self.net = nn.Sequential()
        for a, b in itertools.pairwise(widths):
            self.net.append(nn.Linear(a, b))
            self.net.append(nn.ReLU())
        last = nn.Linear(widths[-1], 2)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.net.append(last)
        self.lr = nn.Parameter(torch.tensor(lr))

    @property
    def num_features(self) -> int:
        return cast(nn.Linear, self.net[0]).in_features  # the first layer is a Linear

    def features(
        self, g: Tensor, p: Tensor, momenta: list[Tensor], nu: Tensor, count: int
    ) -> Tensor:
        """The per-coordinate features ``(*g.shape, num_features)`` at step ``count``
        (0-based), from the updated momenta and second moment."""
        t = count + 1
        rms = safe_sqrt(nu / (1 - self.beta2**t)) + self.eps
        inv = 1 / rms
        cols = [g * inv]
        cols += [m / (1 - b**t) * inv for m, b in zip(momenta, self.decays, strict=True)]
        cols.append(torch.log(rms))
        cols.append(p)
        cols += [torch.full_like(g, math.tanh(t / s)) for s in self.time_scales]
        return torch.stack(cols, -1)

    def step(self, features: Tensor, g: Tensor) -> Tensor:
        """The update from the features:
        ``-(lr * g + scale * tanh(d) * exp(b * tanh(m / b)))`` with ``b = log(max_gain)``."""
        out = features
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                out = F.linear(out, layer.weight.to(out.dtype), layer.bias.to(out.dtype))
            else:
                out = layer(out)
        d, m = out.unbind(-1)
        b = self.log_gain
        learned = self.scale * torch.tanh(d) * torch.exp(b * torch.tanh(m / b))
        return -(self.lr.to(g.dtype) * g + learned)

    def transform(self) -> GradientTransformation:
        """The learned optimizer as a ``GradientTransformation`` (state: the step count, the
        momenta and the second moment); ``update`` needs the parameters."""

        def init(params: Tree) -> LearnedOptimizerState:
            zeros = tree.tree_map(torch.zeros_like, params)
            return LearnedOptimizerState(0, tuple(zeros for _ in self.decays), zeros)

        def update(
            updates: Tree, state: LearnedOptimizerState, params: Tree | None = None
        ) -> tuple[Tree, LearnedOptimizerState]:
            if params is None:
                raise ValueError(
                    "the learned optimizer reads the parameters: call update(grads, state, params)"
                )
            g, spec = tree.flatten(updates)
            p = cast(list[Tensor], spec.flatten_up_to(params))
            nus = cast(list[Tensor], spec.flatten_up_to(state.nu))
            moms = [cast(list[Tensor], spec.flatten_up_to(m)) for m in state.momenta]
            new_nu = [
                self.beta2 * v + (1 - self.beta2) * x * x for v, x in zip(nus, g, strict=True)
            ]
            new_moms = [
                [b * m + (1 - b) * x for m, x in zip(ms, g, strict=True)]
                for ms, b in zip(moms, self.decays, strict=True)
            ]
            out = []
            for i, (x, w) in enumerate(zip(g, p, strict=True)):
                feats = self.features(x, w, [ms[i] for ms in new_moms], new_nu[i], state.count)
                out.append(self.step(feats, x))
            new_state = LearnedOptimizerState(
                state.count + 1,
                tuple(tree.unflatten(spec, ms) for ms in new_moms),
                tree.unflatten(spec, new_nu),
            )
            return tree.unflatten(spec, out), new_state

        return GradientTransformation(init, update)
