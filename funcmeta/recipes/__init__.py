"""Meta-learning methods as short functions over a batch of tasks.

Every recipe has the calling convention of :func:`funcmeta.adapt_tasks`: ``recipe(fmodel,
params, loss_fn, support, query, *, steps, ...)``, where ``support`` and ``query`` are
``(inputs, targets)`` with a leading task axis, then its own keywords (``lr`` or ``opt`` for
the inner optimizer) and the inner-loop options of :class:`funcmeta.AdaptOptions`
(Prototypical Networks, which have no inner loop, take neither ``steps`` nor options). Every
recipe returns a :class:`RecipeResult` (MAML++ and iMAML a subclass with their own
diagnostics: :class:`MamlppResult`, :class:`ImamlResult`): call ``.backward()`` on
``result.loss``. For Reptile
and iMAML, which are not loss-based, ``loss`` is a surrogate whose gradient is the method's
meta-gradient. The meta-gradients reach the module's ``.grad`` (and any learnable
hyperparameters), ready for a ``torch.optim`` outer optimizer.

| recipe | method |
| --- | --- |
| :func:`maml`, :func:`fomaml` | MAML, second and first order (Finn et al., 2017) |
| :func:`metasgd` | per-element learned rates (Li et al., 2017) |
| :func:`anil` | adapt only the head (Raghu et al., 2020) |
| :func:`reptile` | average displacement (Nichol et al., 2018) |
| :func:`mamlpp` | MAML++: LSLR, multi-step loss, derivative-order annealing, per-step BN statistics (Antoniou et al., 2019) |
| :func:`imaml` | implicit gradients by conjugate gradient (Rajeswaran et al., 2019) |
| :func:`r2d2` | a closed-form ridge-regression head on a learned embedding (Bertinetto et al., 2019) |
| :func:`protonet` | Prototypical Networks: nearest class mean in an embedding (Snell et al., 2017) |

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functional_model(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> out = fm.recipes.fomaml(fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=3, lr=0.01)
    >>> out.loss.backward()
    >>> out.query_loss.shape, out.adapted.losses.shape   # logged: query loss, inner losses
    (torch.Size([]), torch.Size([3, 8]))
"""

from funcmeta._src.recipes.anil import anil
from funcmeta._src.recipes.imaml import ConvergenceWarning, imaml
from funcmeta._src.recipes.maml import fomaml, maml
from funcmeta._src.recipes.mamlpp import mamlpp, mamlpp_step_weights
from funcmeta._src.recipes.metasgd import metasgd, metasgd_rates
from funcmeta._src.recipes.protonet import protonet, prototype_logits
from funcmeta._src.recipes.r2d2 import r2d2
from funcmeta._src.recipes.reptile import reptile
from funcmeta._src.recipes.results import ImamlResult, MamlppResult, RecipeResult

__all__ = [
    "ConvergenceWarning",
    "ImamlResult",
    "MamlppResult",
    "RecipeResult",
    "anil",
    "fomaml",
    "imaml",
    "maml",
    "mamlpp",
    "mamlpp_step_weights",
    "metasgd",
    "metasgd_rates",
    "prototype_logits",
    "protonet",
    "r2d2",
    "reptile",
]
