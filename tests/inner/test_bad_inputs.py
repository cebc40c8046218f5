"""Bad input, as a careless user or an adversary gives it: every case raises a named exception
whose message names the argument and says what to do, before any wrong number is computed.

Each case is ``(callable, exception type, pattern)``; the pattern must match the message. The
cases cover adapt, adapt_tasks, task_losses, apply_tasks, the recipes, the optimizers, the
hyperparameters, evaluate, snapshots, data and distributed.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict, namedtuple
from enum import IntEnum

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

D = torch.float64


class _Color(IntEnum):
    RED = 1


class _Tag(str):
    pass


def _world():
    """The objects the cases call with: a 5-way linear classifier and 4 tasks of 6 examples."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5)).to(D)
    fmodel = fm.functional_model(net)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 3, generator=g, dtype=D)
    y = torch.randint(0, 5, (4, 6), generator=g)
    return net, fmodel, x, y


NET, FMODEL, X, Y = _world()
SGD = fm.optim.sgd(lr=0.1)
P = FMODEL.params
SUPPORT, QUERY = (X, Y), (X[:3], Y[:3])
ONE = (X[0], Y[0])


def adapt(**kw):
    args = {"steps": 1, **kw}
    return fm.adapt(FMODEL, args.pop("params", P), F.cross_entropy, ONE, SGD, **args)


def adapt_tasks(**kw):
    return fm.adapt_tasks(FMODEL, P, F.cross_entropy, SUPPORT, SGD, **{"steps": 1, **kw})


def _bn_model():
    return fm.functional_model(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))


def _narrow_head():
    return fm.functional_model(nn.Sequential(nn.Linear(3, 3)).to(D))


def _episodes():
    return fm.data.Episodes(
        torch.randn(50, 3, dtype=D), torch.arange(10).repeat_interleave(5), ways=5, shots=1, query=2
    )


def _cycle():
    items: list = [1]
    items.append(items)
    return items


def _loss_without_graph(out, targets):
    return out.detach().sum() * 0 + 1.0


CASES = {
    # adapt
    "adapt opt None": (
        lambda: fm.adapt(FMODEL, P, F.cross_entropy, ONE, None, steps=1),
        TypeError,
        "opt is required.*fm.optim.sgd",
    ),
    "adapt opt torch.optim": (
        lambda: fm.adapt(
            FMODEL, P, F.cross_entropy, ONE, torch.optim.SGD(NET.parameters(), lr=0.1), steps=1
        ),
        TypeError,
        "torch.optim.SGD.*funcmeta counterpart",
    ),
    "adapt module not fmodel": (
        lambda: fm.adapt(NET, P, F.cross_entropy, ONE, SGD, steps=1),
        TypeError,
        "fmodel must be a FunctionalModel.*functional_model",
    ),
    "adapt params list": (
        lambda: adapt(params=list(P.values())),
        TypeError,
        "params must be a dict",
    ),
    "adapt params missing key": (
        lambda: adapt(params={"0.weight": P["0.weight"]}),
        ValueError,
        r"params do not match.*missing keys \['0.bias'\]",
    ),
    "adapt params wrong shape": (
        lambda: adapt(params={**P, "0.bias": torch.zeros(4, dtype=D)}),
        ValueError,
        r"params\['0.bias'\] has shape \(4,\); the module expects \(5,\)",
    ),
    "adapt steps float": (
        lambda: adapt(steps=1.0),
        ValueError,
        "steps must be a non-negative int, got 1.0",
    ),
    "adapt steps negative": (
        lambda: adapt(steps=-1),
        ValueError,
        "steps must be a non-negative int",
    ),
    "adapt steps missing": (
        lambda: fm.adapt(FMODEL, P, F.cross_entropy, ONE, SGD),
        TypeError,
        "steps",
    ),
    "adapt truncate > steps": (
        lambda: adapt(truncate=2),
        ValueError,
        r"truncate must be an int in \[0, steps=1\]",
    ),
    "adapt unknown option": (
        lambda: adapt(first_ordr=True),
        TypeError,
        "unknown option 'first_ordr'; the options are",
    ),
    "adapt clip nan": (
        lambda: adapt(clip_grad_norm=math.nan),
        ValueError,
        "clip_grad_norm: nan .*finite.*None means no clipping",
    ),
    "adapt clip inf": (
        lambda: adapt(clip_grad_norm=math.inf),
        ValueError,
        "clip_grad_norm: inf .*finite",
    ),
    "adapt clip bool": (
        lambda: adapt(clip_grad_norm=True),
        TypeError,
        "clip_grad_norm must be a number or a 0-d tensor",
    ),
    "adapt loss_scale nan": (
        lambda: adapt(loss_scale=math.nan),
        ValueError,
        "loss_scale must be a finite positive number",
    ),
    "adapt on_nonfinite typo": (
        lambda: adapt(on_nonfinite="rise"),
        ValueError,
        "on_nonfinite must be None, 'raise' or 'skip'",
    ),
    "adapt trainable matches nothing": (
        lambda: adapt(trainable="head"),
        ValueError,
        r"filter names match no parameter: \['head'\]",
    ),
    "adapt batch not a pair": (
        lambda: fm.adapt(FMODEL, P, F.cross_entropy, X[0], SGD, steps=1),
        TypeError,
        r"batch must be a pair \(inputs, targets\)",
    ),
    "adapt input dtype": (
        lambda: fm.adapt(FMODEL, P, F.cross_entropy, (X[0].float(), Y[0]), SGD, steps=1),
        TypeError,
        r"inputs\[0\] is torch.float32.*cast the data",
    ),
    "adapt empty batch": (
        lambda: fm.adapt(FMODEL, P, F.cross_entropy, (X[0][:0], Y[0][:0]), SGD, steps=1),
        ValueError,
        "are empty",
    ),
    "adapt loss not scalar": (
        lambda: fm.adapt(FMODEL, P, lambda o, t: o.sum(0), ONE, SGD, steps=1),
        ValueError,
        r"loss_fn must return a scalar tensor \(one number per task\), got shape \(5,\).*\.mean\(\)",
    ),
    "adapt loss ignores params": (
        lambda: fm.adapt(FMODEL, P, _loss_without_graph, ONE, SGD, steps=1),
        ValueError,
        "does not depend on the adapted parameters.*from the model's output",
    ),
    "adapt state of another optimizer": (
        lambda: adapt(state=fm.optim.sgd(lr=0.1, momentum=0.9).init(P)),
        ValueError,
        "state does not match the optimizer.*None to start afresh",
    ),
    "adapt params and buffers dtypes": (
        lambda: fm.adapt(
            _bn_model(),
            {k: v.double() for k, v in _bn_model().params.items()},
            F.mse_loss,
            (X[0], torch.randn(6, 4, dtype=D)),
            SGD,
            steps=1,
        ),
        TypeError,
        r"parameters are torch.float64 but the buffers \['1.running_mean'.*module.to\(torch.float64\)",
    ),
    "adapt class index out of range": (
        lambda: fm.adapt(_narrow_head(), _narrow_head().params, F.cross_entropy, ONE, SGD, steps=1),
        IndexError,
        r"targets \(a int64 tensor of shape \(6,\)\).*must lie in \[0, 3\)",
    ),
    "adapt skip with tasks": (
        lambda: adapt_tasks(on_nonfinite="skip"),
        ValueError,
        "on_nonfinite='skip' is not available with task batching",
    ),
    # adapt_tasks, task_losses, apply_tasks
    "adapt_tasks task axes differ": (
        lambda: fm.adapt_tasks(FMODEL, P, F.cross_entropy, (X, Y[:3]), SGD, steps=1),
        ValueError,
        r"same leading task axis \(expected 4 tasks",
    ),
    "adapt_tasks params wrong task axis": (
        lambda: fm.adapt_tasks(
            FMODEL,
            {k: v.expand(7, *v.shape) for k, v in P.items()},
            F.cross_entropy,
            SUPPORT,
            SGD,
            steps=1,
        ),
        ValueError,
        r"params\['0.weight'\] has shape \(7, 5, 3\); expected \(5, 3\) \(shared by all tasks\) or \(4, 5, 3\)",
    ),
    "adapt_tasks scalar batch tensor": (
        lambda: fm.adapt_tasks(FMODEL, P, F.cross_entropy, (X, torch.tensor(1)), SGD, steps=1),
        ValueError,
        r"batch tensors \['1'\] are scalars; every one needs a leading task axis",
    ),
    "adapt_tasks zero tasks": (
        lambda: fm.adapt_tasks(FMODEL, P, F.cross_entropy, (X[:0], Y[:0]), SGD, steps=1),
        ValueError,
        "zero tasks",
    ),
    "adapt_tasks labels out of range": (
        lambda: fm.adapt_tasks(FMODEL, P, F.cross_entropy, (X, Y + 10), SGD, steps=1),
        RuntimeError,
        r"Class-index targets must lie in \[0, 5\).*labels not numbered 0..ways-1",
    ),
    "adapt_tasks buffers not a dict": (
        lambda: adapt_tasks(buffers=[1]),
        TypeError,
        "buffers must be a dict",
    ),
    "task_losses params list": (
        lambda: fm.task_losses(FMODEL, list(P.values()), F.cross_entropy, SUPPORT),
        TypeError,
        "params must be a dict",
    ),
    "task_losses wrong task axis": (
        lambda: fm.task_losses(
            FMODEL, {k: v.expand(2, *v.shape) for k, v in P.items()}, F.cross_entropy, SUPPORT
        ),
        ValueError,
        r"or \(4, 5, 3\) \(one per task, task axis first\)",
    ),
    "apply_tasks inputs differ in tasks": (
        lambda: fm.apply_tasks(FMODEL, P, (X, X[:3])),
        ValueError,
        "same leading task axis",
    ),
    "apply_tasks no tensors": (
        lambda: fm.apply_tasks(FMODEL, P, (1.0,)),
        ValueError,
        "holds no tensors: nothing gives the task axis",
    ),
    "functional_model task_chunk moved": (
        lambda: fm.functional_model(NET, task_chunk=0),
        TypeError,
        r"takes no task_chunk.*fm\.adapt_tasks\(\.\.\., task_chunk=0\)",
    ),
    "adapt_tasks task_chunk 0": (
        lambda: adapt_tasks(task_chunk=0),
        ValueError,
        'fm.adapt_tasks: task_chunk must be "auto", "tune", None or a positive int, got 0',
    ),
    "task_losses task_chunk tune": (
        lambda: fm.task_losses(FMODEL, P, F.cross_entropy, SUPPORT, task_chunk="tune"),
        ValueError,
        r'fm\.task_losses takes no task_chunk="tune".*task_chunk=result\.chunk',
    ),
    "functional_model checkpoint name": (
        lambda: fm.functional_model(NET, checkpoint_layers=["x"]),
        ValueError,
        r"checkpoint names \['x'\] are not submodules; submodules are \['0'\]",
    ),
    "functional_model embedding max_norm": (
        lambda: fm.functional_model(nn.Embedding(5, 2, max_norm=1.0)),
        ValueError,
        "max_norm=1.0: its forward renormalises the weight in place",
    ),
    # recipes
    "maml support and query tasks": (
        lambda: fm.recipes.maml(FMODEL, P, F.cross_entropy, SUPPORT, QUERY, steps=1, lr=0.1),
        ValueError,
        "support has 4 tasks but query has 3",
    ),
    "maml opt and lr": (
        lambda: fm.recipes.maml(
            FMODEL, P, F.cross_entropy, SUPPORT, SUPPORT, steps=1, lr=0.1, opt=SGD
        ),
        TypeError,
        "opt= or its learning rate as lr=, not both",
    ),
    "mamlpp support and query tasks": (
        lambda: fm.recipes.mamlpp(
            FMODEL, P, F.cross_entropy, SUPPORT, QUERY, steps=1, lr=0.1, step_weights=[1.0]
        ),
        ValueError,
        "support has 4 tasks but query has 3",
    ),
    "reptile support and query tasks": (
        lambda: fm.recipes.reptile(FMODEL, P, F.cross_entropy, SUPPORT, QUERY, steps=1, lr=0.1),
        ValueError,
        "support has 4 tasks but query has 3",
    ),
    "protonet support and query tasks": (
        lambda: fm.recipes.protonet(FMODEL, P, F.cross_entropy, SUPPORT, QUERY),
        ValueError,
        "support has 4 tasks but query has 3",
    ),
    "imaml cg_steps float": (
        lambda: fm.recipes.imaml(
            FMODEL, P, F.cross_entropy, SUPPORT, SUPPORT, steps=1, lam=1.0, lr=0.1, cg_steps=2.5
        ),
        TypeError,
        "cg_steps must be an int >= 1, got 2.5",
    ),
    "imaml lam string": (
        lambda: fm.recipes.imaml(
            FMODEL, P, F.cross_entropy, SUPPORT, SUPPORT, steps=1, lam="1", lr=0.1
        ),
        TypeError,
        r"lam \(the proximal strength\) must be a number, got str '1'",
    ),
    "imaml lam nan": (
        lambda: fm.recipes.imaml(
            FMODEL, P, F.cross_entropy, SUPPORT, SUPPORT, steps=1, lam=math.nan, lr=0.1
        ),
        ValueError,
        r"lam \(the proximal strength\) must be a finite number, got nan",
    ),
    "imaml lam zero": (
        lambda: fm.recipes.imaml(
            FMODEL, P, F.cross_entropy, SUPPORT, SUPPORT, steps=1, lam=0.0, lr=0.1
        ),
        ValueError,
        r"lam \(the proximal strength\) must be > 0.0",
    ),
    "imaml damping inf": (
        lambda: fm.recipes.imaml(
            FMODEL, P, F.cross_entropy, SUPPORT, SUPPORT, steps=1, lam=1.0, lr=0.1, damping=math.inf
        ),
        ValueError,
        "damping must be a finite number",
    ),
    # optimizers
    "sgd lr nan": (lambda: fm.optim.sgd(lr=math.nan), ValueError, "learning rate: nan .*finite"),
    "sgd lr inf": (lambda: fm.optim.sgd(lr=math.inf), ValueError, "learning rate: inf .*finite"),
    "sgd lr None": (
        lambda: fm.optim.sgd(lr=None),
        TypeError,
        "learning rate must be a number, a tensor, a tree of tensors or a schedule, got None",
    ),
    "sgd lr string": (
        lambda: fm.optim.sgd(lr="0.1"),
        TypeError,
        "learning rate must be a number.*got '0.1'",
    ),
    "sgd lr negative": (
        lambda: fm.optim.sgd(lr=-0.1),
        ValueError,
        r"invalid learning rate: -0.1 \(must be >= 0.0\)",
    ),
    "sgd nesterov without momentum": (
        lambda: fm.optim.sgd(lr=0.1, nesterov=True),
        ValueError,
        "Nesterov momentum requires a momentum",
    ),
    "adam beta1 nan": (
        lambda: fm.optim.adam(lr=0.1, betas=(math.nan, 0.999)),
        ValueError,
        "beta1: nan",
    ),
    "adam beta2 one": (lambda: fm.optim.adam(lr=0.1, betas=(0.9, 1.0)), ValueError, "beta2: 1.0"),
    "adam eps negative": (
        lambda: fm.optim.adam(lr=0.1, eps=-1),
        ValueError,
        r"eps: -1 \(must be >= 0.0\)",
    ),
    "adamw weight_decay nan": (
        lambda: fm.optim.adamw(lr=0.1, weight_decay=math.nan),
        ValueError,
        "weight_decay: nan",
    ),
    "rmsprop alpha nan": (
        lambda: fm.optim.rmsprop(lr=0.1, alpha=math.nan),
        ValueError,
        "alpha: nan",
    ),
    "adagrad lr inf": (lambda: fm.optim.adagrad(lr=math.inf), ValueError, "learning rate: inf"),
    "clip_by_global_norm nan": (
        lambda: fm.optim.clip_by_global_norm(math.nan),
        ValueError,
        "max_norm: nan",
    ),
    # hyperparameters
    "hyper scalar inf": (
        lambda: fm.hyper.scalar(math.inf),
        ValueError,
        "init must be a finite number, got inf",
    ),
    "hyper per_layer nan": (
        lambda: fm.hyper.per_layer(P, math.nan),
        ValueError,
        "init must be a finite number, got nan",
    ),
    "hyper per_element string": (
        lambda: fm.hyper.per_element(P, "0.1"),
        TypeError,
        "init must be a number, got str",
    ),
    "hyper softplus negative": (
        lambda: fm.hyper.scalar(-0.1, parameterization="softplus"),
        ValueError,
        "softplus hyperparameter needs a positive init",
    ),
    "hyper steps zero": (
        lambda: fm.hyper.scalar(0.1, steps=0),
        ValueError,
        r"steps \(None, or the number of per-step values\) must be an int >= 1, got 0",
    ),
    # evaluate
    "evaluate steps missing": (
        lambda: fm.evaluate(FMODEL, P, F.cross_entropy, _episodes(), SGD, num_episodes=2),
        TypeError,
        "method='adapt' needs steps=.*steps=0 scores the unadapted model",
    ),
    "evaluate opt missing": (
        lambda: fm.evaluate(FMODEL, P, F.cross_entropy, _episodes(), steps=1, num_episodes=2),
        TypeError,
        "method='adapt' needs the inner optimizer opt",
    ),
    "evaluate steps for prototypes": (
        lambda: fm.evaluate(FMODEL, P, F.cross_entropy, _episodes(), method="prototypes", steps=1),
        TypeError,
        "adapts nothing: it takes no opt, steps or options",
    ),
    "evaluate nan logits": (
        lambda: fm.evaluate(
            FMODEL,
            {k: torch.full_like(v, math.nan) for k, v in P.items()},
            F.cross_entropy,
            _episodes(),
            SGD,
            steps=0,
            num_episodes=4,
        ),
        fm.NonFiniteError,
        "query logits of 4 of 4 episodes .*NaN or infinite",
    ),
    "evaluate num_episodes zero": (
        lambda: fm.evaluate(FMODEL, P, F.cross_entropy, _episodes(), SGD, steps=1, num_episodes=0),
        ValueError,
        "num_episodes must be an int >= 1",
    ),
    # snapshots
    "snapshot extra numpy float": (
        lambda: fm.snapshot.save(
            "unused.pt", step=0, extra={"x": pytest.importorskip("numpy").float64(1.0)}
        ),
        TypeError,
        r"extra\['x'\] is a numpy.float64.*float\(x\)",
    ),
    "snapshot extra IntEnum": (
        lambda: fm.snapshot.save("unused.pt", step=0, extra={"c": _Color.RED}),
        TypeError,
        r"extra\['c'\] is a .*_Color.*int\(x\)",
    ),
    "snapshot extra namedtuple": (
        lambda: fm.snapshot.save("unused.pt", step=0, extra={"p": namedtuple("P", "a")(1)}),
        TypeError,
        r"extra\['p'\] is a .*P.*tuple\(x\)",
    ),
    "snapshot extra defaultdict": (
        lambda: fm.snapshot.save("unused.pt", step=0, extra={"d": defaultdict(int)}),
        TypeError,
        r"extra\['d'\] is a collections.defaultdict.*dict\(x\)",
    ),
    "snapshot extra str subclass": (
        lambda: fm.snapshot.save("unused.pt", step=0, extra={"s": _Tag("a")}),
        TypeError,
        r"extra\['s'\] is a .*_Tag.*str\(x\)",
    ),
    "snapshot extra tensor subclass": (
        lambda: fm.snapshot.save(
            "unused.pt", step=0, extra={"t": torch.ones(1).as_subclass(_TensorSub)}
        ),
        TypeError,
        r"as_subclass\(torch.Tensor\)",
    ),
    "snapshot extra cycle": (
        lambda: fm.snapshot.save("unused.pt", step=0, extra={"l": _cycle()}),
        ValueError,
        r"extra\['l'\]\[1\] contains itself",
    ),
    "snapshot step negative": (
        lambda: fm.snapshot.save("unused.pt", step=-1),
        ValueError,
        "step must be a non-negative int",
    ),
    # data
    "episodes more ways than classes": (
        lambda: fm.data.Episodes(
            torch.randn(50, 3), torch.arange(10).repeat_interleave(5), ways=20, shots=1, query=2
        ),
        ValueError,
        "20-way episodes need at least 20 classes; there are 10",
    ),
    "download timeout zero": (
        lambda: fm.data.download_omniglot(
            "unused", ["all_runs.zip"], url="http://127.0.0.1:9/", timeout=0
        ),
        ValueError,
        r"timeout \(seconds per network operation\) must be > 0.0, got 0",
    ),
    "download deadline nan": (
        lambda: fm.data.download_omniglot(
            "unused", ["all_runs.zip"], url="http://127.0.0.1:9/", deadline=math.nan
        ),
        ValueError,
        r"deadline \(seconds per file\) must be a finite number",
    ),
    "download unknown file": (
        lambda: fm.data.download_omniglot("unused", ["images_evaluation.zip"]),
        ValueError,
        "no known download with a checksum",
    ),
    # distributed
    "average_gradients count negative": (
        lambda: fm.distributed.average_gradients(dict(NET.named_parameters()), -1),
        ValueError,
        r"count \(the number of tasks.*\) must be >= 0.0, got -1",
    ),
    "average_gradients count nan": (
        lambda: fm.distributed.average_gradients(dict(NET.named_parameters()), math.nan),
        ValueError,
        "count .* must be a finite number, got nan",
    ),
    "average_gradients count bool": (
        lambda: fm.distributed.average_gradients(dict(NET.named_parameters()), True),
        TypeError,
        "count .* must be a number, got bool",
    ),
    "average_gradients timeout zero": (
        lambda: fm.distributed.average_gradients(dict(NET.named_parameters()), 1, timeout=0),
        ValueError,
        r"timeout \(seconds\) must be > 0.0",
    ),
    "shard no tensors": (
        lambda: fm.distributed.shard((1, 2)),
        ValueError,
        "the batch holds no tensors to shard",
    ),
}


class _TensorSub(torch.Tensor):
    pass


def test_there_are_at_least_sixty_cases():
    assert len(CASES) >= 60


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_a_named_error(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snapshot and download cases write nothing elsewhere
    call, kind, pattern = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(kind, match=pattern):
            call()
    assert not (tmp_path / "unused.pt").exists()


def test_one_tasks_batch_without_a_task_axis_warns():
    with pytest.warns(UserWarning, match=r"make 6 tasks of one example each.*call fm.adapt"):
        fm.adapt_tasks(FMODEL, P, F.cross_entropy, ONE, SGD, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fm.adapt_tasks(FMODEL, P, F.cross_entropy, SUPPORT, SGD, steps=1)


# --- a batch with its task axis left in, given to fm.adapt ------------------------------------


def test_a_leftover_task_axis_that_cross_entropy_would_read_as_classes_is_refused():
    """(4, 5, 8) inputs and (4, 5) labels to fm.adapt: 4 tasks of 5 examples. A 5-way head
    gives (4, 5, 5), which cross-entropy reads as 4 examples with the 5 examples as classes,
    and runs: refused, with the fix."""
    torch.manual_seed(0)
    fmodel = fm.functional_model(nn.Linear(8, 5))
    x, y = torch.randn(4, 5, 8), torch.randint(0, 5, (4, 5))
    with pytest.raises(fm.inputs.TaskAxisError, match=r"4 tasks of 5 examples.*fm\.adapt_tasks"):
        fm.adapt(fmodel, fmodel.params, F.cross_entropy, (x, y), fm.optim.sgd(lr=0.1), steps=1)
    # the fix: one task, or all of them as tasks
    fm.adapt(fmodel, fmodel.params, F.cross_entropy, (x[0], y[0]), fm.optim.sgd(lr=0.1), steps=1)
    fm.adapt_tasks(fmodel, fmodel.params, F.cross_entropy, (x, y), fm.optim.sgd(lr=0.1), steps=1)


def test_a_leftover_task_axis_that_breaks_the_model_gets_the_hint():
    fmodel = fm.functional_model(nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.Linear(16, 5)))
    x, y = torch.randn(4, 5, 1, 28, 28), torch.randint(0, 5, (4, 5))
    with pytest.raises(RuntimeError, match=r"(?s)mat1 and mat2.*4 tasks of 5 examples"):
        fm.adapt(fmodel, fmodel.params, F.cross_entropy, (x, y), fm.optim.sgd(lr=0.1), steps=1)


def test_per_token_targets_of_a_sequence_model_are_not_suspected():
    """(N, L, D) sequences with (N, L) labels and a loss that flattens them: legitimate, also
    with as many classes as tokens."""
    fmodel = fm.functional_model(nn.Linear(8, 5))
    x, y = torch.randn(4, 5, 8), torch.randint(0, 5, (4, 5))

    def token_loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    r = fm.adapt(fmodel, fmodel.params, token_loss, (x, y), fm.optim.sgd(lr=0.1), steps=2)
    assert r.losses.shape == (2,)


def test_an_elementwise_loss_of_shapes_that_would_broadcast_is_refused():
    """MSE of an output (10, 1) and targets (10,) compares every output with every target
    (torch only warns): refused, in fm.adapt and under task batching, with the fix."""
    fmodel = fm.functional_model(nn.Linear(3, 1))
    x, y = torch.randn(10, 3), torch.randn(10)
    opt = fm.optim.sgd(lr=0.1)
    with pytest.raises(ValueError, match=r"output \(10, 1\) and targets \(10,\).*\(10, 10\)"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=1)
    with pytest.raises(ValueError, match=r"y\.unsqueeze\(-1\)"):
        fm.adapt_tasks(fmodel, fmodel.params, F.l1_loss, (x[None], y[None]), opt, steps=1)
    fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y.unsqueeze(-1)), opt, steps=1)


def test_adam_with_eps_zero_is_refused():
    with pytest.raises(ValueError, match=r"invalid eps: 0 \(must be > 0\).*0 / 0"):
        fm.optim.adam(lr=0.1, eps=0)
    with pytest.raises(ValueError, match="invalid eps: 0"):
        fm.optim.adamw(lr=0.1, eps=0.0)


def test_dtype_mismatches_inside_the_model_name_the_dtypes_and_the_fix():
    fmodel = fm.functional_model(nn.Linear(3, 1))
    ints = torch.randint(0, 3, (10, 3))
    opt = fm.optim.sgd(lr=0.1)
    with pytest.raises(RuntimeError, match=r"(?s)inputs are \{'argument 0': 'int64'\}.*x\.to"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (ints, torch.randn(10, 1)), opt, steps=1)
    with pytest.raises(RuntimeError, match=r"(?s)parameters are float32.*int64"):
        fm.apply_tasks(fmodel, fmodel.params, ints[None])
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    net[1].double()
    mixed = fm.functional_model(net)
    with pytest.raises(RuntimeError, match=r"(?s)except \{'1\.weight': 'float64'.*module\.to"):
        fm.adapt(
            mixed, mixed.params, F.mse_loss, (torch.randn(10, 3), torch.randn(10, 1)), opt, steps=1
        )


def test_a_hyperparameter_of_an_integer_dtype_is_named():
    with pytest.raises(
        TypeError, match=r"dtype must be a floating-point torch\.dtype.*torch\.int64"
    ):
        fm.hyper.scalar(0.1, dtype=torch.long)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda ys, yq: (ys, yq + 4), r"query labels must lie in \[0, 5\).*from 4 to 8"),
        (lambda ys, yq: (ys - 1, yq), r"support labels must lie in \[0, 4\).*from -1"),
        (lambda ys, yq: (ys[:, :3], yq), r"support labels have shape \(2, 3\) but its inputs"),
        (lambda ys, yq: (ys, yq[:, :2]), r"query labels have shape \(2, 2\)"),
    ],
    ids=["query-beyond", "negative", "support-shape", "query-shape"],
)
@pytest.mark.parametrize("recipe", ["protonet", "r2d2"])
def test_closed_form_recipes_name_label_errors(change, match, recipe):
    fmodel = fm.functional_model(nn.Linear(4, 3))
    ys = torch.arange(5).repeat(2, 1)
    x = torch.randn(2, 5, 4)
    y_s, y_q = change(ys, ys.clone())
    own = {"head": fm.heads.RidgeHead(lam=1.0)} if recipe == "r2d2" else {}
    with pytest.raises(ValueError, match=match):
        getattr(fm.recipes, recipe)(
            fmodel, fmodel.params, F.cross_entropy, (x, y_s), (x, y_q), **own
        )


def test_protonet_ways_smaller_than_the_labels_is_named():
    fmodel = fm.functional_model(nn.Linear(4, 3))
    ys, x = torch.arange(5).repeat(2, 1), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"lie in \[0, 3\) \(ways=3\)"):
        fm.recipes.protonet(fmodel, fmodel.params, F.cross_entropy, (x, ys), (x, ys), ways=3)
    with pytest.raises(ValueError, match="ways must be"):
        fm.recipes.protonet(fmodel, fmodel.params, F.cross_entropy, (x, ys), (x, ys), ways=0)
