"""The peers' second-order MAML and Meta-SGD meta-iterations, as their users write them: a
support module of the peer benchmarks (``peers.py``, ``omniglot_peers.py``), not a benchmark.

:data:`PEERS` holds the peer packages that import here (higher, TorchOpt, learn2learn; each is
optional: one that does not import is reported and left out). :data:`IMPLEMENTATIONS` maps
each peer's name to its meta-iteration ``f(net, rates, support, query, loss_fn, steps, lr=LR)``,
a loop over the tasks returning the mean query loss (``rates``: Meta-SGD's per-tensor rates,
or ``None`` for MAML's ``lr``). learn2learn imports torchvision and gym at import time, which
its MAML code does not use: ``_learn2learn_shim.py`` stands in for them where absent.
"""

from __future__ import annotations

import torch
from _learn2learn_shim import install as _shim
from torch import nn

LR = 0.01
PEERS: dict = {}
try:
    import higher

    PEERS["higher"] = higher
except ImportError as e:  # pragma: no cover - optional
    print(f"higher is not available: {e}")
try:
    import torchopt

    PEERS["torchopt"] = torchopt
except ImportError as e:  # pragma: no cover - optional
    print(f"torchopt is not available: {e}")
try:
    # learn2learn imports torchvision and gym at import time; the MAML code needs neither
    _shimmed = _shim(["torchvision", "gym"])
    import learn2learn

    PEERS["learn2learn"] = learn2learn
    if _shimmed:
        print(f"learn2learn: stand-ins for {', '.join(_shimmed)} (not installed, not used)")
except ImportError as e:  # pragma: no cover - optional
    print(f"learn2learn is not available: {e} (bash benchmarks/peers/build_learn2learn.sh)")


def with_higher(net, rates, support, query, loss_fn, steps, lr=LR):
    # one parameter group per tensor, so that a per-element rate can be given to each
    opt = torch.optim.SGD([{"params": [p]} for p in net.parameters()], lr=lr)
    losses = []
    for t in range(support[0].shape[0]):
        with higher.innerloop_ctx(net, opt, copy_initial_weights=False) as (fnet, diffopt):
            override = None
            if rates is not None:
                override = {"lr": [rates[k] for k, _ in net.named_parameters()]}
            for _ in range(steps):
                diffopt.step(loss_fn(fnet(support[0][t]), support[1][t]), override=override)
            losses.append(loss_fn(fnet(query[0][t]), query[1][t]))
    return torch.stack(losses).mean()


def with_torchopt(net, rates, support, query, loss_fn, steps, lr=LR):
    state = torchopt.extract_state_dict(net)
    losses = []
    for t in range(support[0].shape[0]):
        inner = torchopt.MetaSGD(net, lr=lr)
        for _ in range(steps):
            inner.step(loss_fn(net(support[0][t]), support[1][t]))
        losses.append(loss_fn(net(query[0][t]), query[1][t]))
        torchopt.recover_state_dict(net, state)
    return torch.stack(losses).mean()


def with_learn2learn(net, rates, support, query, loss_fn, steps, lr=LR):
    l2l = learn2learn.algorithms
    if rates is None:
        meta = l2l.MAML(net, lr=lr, first_order=False)
    else:
        meta = l2l.MetaSGD(net, lr=lr, first_order=False)
        meta.lrs = nn.ParameterList([rates[k] for k, _ in net.named_parameters()])
    losses = []
    for t in range(support[0].shape[0]):
        learner = meta.clone()
        for _ in range(steps):
            learner.adapt(loss_fn(learner(support[0][t]), support[1][t]))
        losses.append(loss_fn(learner(query[0][t]), query[1][t]))
    return torch.stack(losses).mean()


IMPLEMENTATIONS = {
    "higher": with_higher,
    "torchopt": with_torchopt,
    "learn2learn": with_learn2learn,
}


# Meta-SGD needs per-element learning rates: torchopt's MetaSGD takes one scalar rate.
NO_PER_ELEMENT_RATES = {"torchopt"}
