"""Meta-learning methods as short functions over a batch of tasks.

Each recipe takes the functional model, the support and query batches (``(inputs,
targets)`` with a leading task axis) and the loss. It returns the outer loss to call
``.backward()`` on. Reptile and iMAML, which are not loss-based, return a surrogate whose
gradient is the method's meta-gradient. The meta-gradients reach the module's ``.grad`` (and
any learnable hyperparameters), ready for a ``torch.optim`` outer optimizer.

| recipe | method |
| --- | --- |
| :func:`maml`, :func:`fomaml` | MAML, second and first order (Finn et al., 2017) |
| :func:`metasgd` | per-element learned rates (Li et al., 2017) |
| :func:`anil` | adapt only the head (Raghu et al., 2020) |
| :func:`reptile` | average displacement (Nichol et al., 2018) |
| :func:`mamlpp` | MAML++: LSLR, multi-step loss, derivative-order annealing, per-step BN statistics (Antoniou et al., 2019) |
| :func:`imaml` | implicit gradients by conjugate gradient (Rajeswaran et al., 2019) |

Example:
    >>> import torch, torch.nn.functional as F, funcmeta as fm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 40), torch.nn.ReLU(), torch.nn.Linear(40, 1))
    >>> fmodel = fm.functionalize(net)
    >>> b = fm.data.Sinusoid().sample(8, 10, 10)
    >>> fm.recipes.fomaml(fmodel, (b.x_support, b.y_support), (b.x_query, b.y_query), F.mse_loss, steps=3).backward()
"""

from funcmeta.recipes.anil import anil
from funcmeta.recipes.imaml import ImamlResult, imaml
from funcmeta.recipes.maml import fomaml, maml
from funcmeta.recipes.mamlpp import MamlppResult, mamlpp, mamlpp_step_weights
from funcmeta.recipes.metasgd import metasgd, metasgd_rates
from funcmeta.recipes.reptile import reptile

__all__ = [
    "ImamlResult",
    "MamlppResult",
    "anil",
    "fomaml",
    "imaml",
    "maml",
    "mamlpp",
    "mamlpp_step_weights",
    "metasgd",
    "metasgd_rates",
    "reptile",
]
