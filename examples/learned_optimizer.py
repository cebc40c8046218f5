"""Meta-train a learned optimizer on sinusoid regression, and race it against tuned SGD.

The sinusoid MLP starts from one fixed random initialisation (not meta-learned), and every
task gets 5 inner steps on 10 support points. The optimizer is what is learned:
``fm.learned.LearnedOptimizer``, a per-coordinate MLP on gradient features. It is
meta-trained second order through ``fm.adapt_tasks`` on the query loss after the 5 steps.
Plain SGD gets the best learning rate of a sweep on validation tasks. Both are then scored on
held-out tasks. Meta-Curvature (``fm.learned.MetaCurvature``) chains the same way, in front
of an optimizer.

    python examples/learned_optimizer.py        # about 6 minutes on 2 CPU cores

That run took 358 s on 2 AMD EPYC cores that other work shared (measured 2026-11-26): the
process got less than half a core (150 s of CPU time), so an idle machine runs it faster. It
ended with a held-out query MSE of 3.685 for SGD at its best rate (0.00562) and 2.917 for the
learned optimizer (0.79x). ``--iterations`` (1000 meta-iterations) and ``--tasks`` (25 per
meta-batch) set its length.

``benchmarks/checks/learned_optimizer.py`` is the measured version (several seeds, Adam and
Meta-Curvature too); its figures are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _threads import add_threads_option, use_threads
from torch import nn

import funcmeta as fm

STEPS = 5


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="A learned optimizer against tuned SGD.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=1000,
        help="meta-training iterations of the learned optimizer, Adam at 1e-3",
    )
    p.add_argument("--tasks", type=int, default=25, help="tasks per meta-batch")
    p.add_argument(
        "--eval-tasks",
        type=int,
        default=500,
        help="tasks in each of the validation set (SGD's rate sweep) and the test set",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the fixed initialisation and the training tasks (the validation and "
        "test tasks are fixed)",
    )
    add_threads_option(
        p,
        1,
        "the sinusoid MLP and a per-coordinate MLP: tiny operations, which more threads only "
        "slow down",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parser().parse_args(argv)
    use_threads(args)

    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
    fmodel = fm.functional_model(net)
    theta = {k: v.detach() for k, v in fmodel.params.items()}  # the fixed initialisation
    tasks = fm.data.Sinusoid()
    val = tasks.sample(args.eval_tasks, 10, 10, generator=torch.Generator().manual_seed(1))
    test = tasks.sample(args.eval_tasks, 10, 10, generator=torch.Generator().manual_seed(2))

    def query_mse(
        opt: fm.optim.GradientTransformation, batch: fm.data.SinusoidBatch
    ) -> torch.Tensor:
        result = fm.adapt_tasks(fmodel, theta, F.mse_loss, batch.support, opt, steps=STEPS)
        pred, _ = fm.apply_tasks(fmodel, result.params, batch.x_query, task_chunk=result.chunk)
        return F.mse_loss(pred, batch.y_query)

    with torch.no_grad():  # SGD's learning rate: the best of a sweep on the validation tasks
        rates = [10 ** (k / 4) for k in range(-16, 5)]
        scores = {lr: float(query_mse(fm.optim.sgd(lr=lr), val)) for lr in rates}
        best = min((s, lr) for lr, s in scores.items() if s == s)[1]  # NaN: diverged
        sgd = float(query_mse(fm.optim.sgd(lr=best), test))

    lopt = fm.learned.LearnedOptimizer(hidden=32, lr=best)  # starts as SGD at that rate
    outer = torch.optim.Adam(lopt.parameters(), lr=1e-3)
    rng = torch.Generator().manual_seed(args.seed + 100)
    for it in range(args.iterations):
        loss = query_mse(lopt.transform(), tasks.sample(args.tasks, 10, 10, generator=rng))
        outer.zero_grad()
        loss.backward()
        # an inner loop can diverge on a task: skip a meta-batch with no finite meta-gradient
        if torch.isfinite(nn.utils.clip_grad_norm_(lopt.parameters(), 1.0)):
            outer.step()
        if it % 250 == 0:
            print(f"iteration {it}: meta-batch query MSE {loss.item():.3f}")
    with torch.no_grad():
        learned = float(query_mse(lopt.transform(), test))
    print(
        f"held-out query MSE after {STEPS} steps: SGD at its best rate ({best:.3g}) {sgd:.3f}, "
        f"learned optimizer {learned:.3f} ({learned / sgd:.2f}x)"
    )
    return {"sgd_lr": best, "sgd": sgd, "learned": learned}


if __name__ == "__main__":
    main()
