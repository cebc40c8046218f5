"""Models that checkpoint themselves (``torch.utils.checkpoint`` in ``forward``,
``checkpoint_sequential``, HuggingFace's gradient checkpointing): exact meta-gradients against
the same model without checkpointing (float64), funcmeta's memory saving, refusals that name
the fix, and torch's ``checkpoint`` left as it was after every run, in every thread."""

from __future__ import annotations

import functools
import inspect
import threading
import warnings

import pytest
import test_engine
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
import zoo
from helpers import DEVICES, DTYPE
from test_engine import Residual
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import funcmeta as fm
from funcmeta._src.checkpoint.engine import OpenFunctionError

T, N, W = 3, 10, 6  # tasks, examples per task, width


class Block(nn.Module):
    def __init__(self, p: float = 0.0, batchnorm: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.norm = nn.BatchNorm1d(W) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(p)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(torch.tanh(self.norm(self.lin(x)))) * scale


class SelfCheckpointed(nn.Module):
    """Blocks and a head; ``how`` is how its forward checkpoints the blocks (``"none"``: it
    does not, the reference)."""

    def __init__(self, how: str, p: float = 0.0, batchnorm: bool = False, blocks: int = 4):
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList([Block(p, batchnorm) for _ in range(blocks)])
        self.head = nn.Linear(W, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        how = self.how
        if how == "sequential":
            x = checkpoint_sequential(nn.Sequential(*self.blocks), 2, x, use_reentrant=False)
        for b in self.blocks if how != "sequential" else ():
            if how == "none":
                x = b(x)
            elif how == "non-reentrant":
                x = checkpoint(b, x, use_reentrant=False)
            elif how == "reentrant":
                x = tuc.checkpoint(b, x, use_reentrant=True)
            elif how == "keyword":  # a keyword argument for the block
                x = checkpoint(b, x, scale=torch.tensor(1.0, dtype=x.dtype), use_reentrant=False)
            elif how == "default":  # use_reentrant left out (torch's reentrant default)
                x = tuc.checkpoint(b, x)
            elif how == "closure":
                x = checkpoint(lambda t, b=b: b(t), x, use_reentrant=False)
            elif how == "partial":
                x = checkpoint(functools.partial(b.forward, scale=1.0), x, use_reentrant=False)
            elif how == "root-method":
                x = checkpoint(self.run_block, b, x, use_reentrant=False)
        return self.head(x)

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)


HOWS = [
    "non-reentrant",
    "reentrant",
    "default",
    "sequential",
    "keyword",
    "closure",
    "partial",
    "root-method",
]


def task_data(seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, N, W, generator=g, dtype=DTYPE)
    y = torch.randint(0, 3, (T, N), generator=g)
    xq = torch.randn(T, N, W, generator=g, dtype=DTYPE)
    yq = torch.randint(0, 3, (T, N), generator=g)
    return x, y, xq, yq


def meta_gradients(
    net: nn.Module,
    batched: bool,
    first_order: bool,
    checkpoint_layers=None,
    loss=F.cross_entropy,
    seed: int = 5,
) -> list[torch.Tensor]:
    """Two SGD steps on each task and the mean query loss's gradient in every parameter:
    ``fm.adapt`` per task, or ``fm.adapt_tasks`` and ``fm.task_losses``."""
    fmodel = fm.functional_model(net, checkpoint_layers=checkpoint_layers)
    x, y, xq, yq = task_data()
    params, opt = fmodel.params, fm.optim.sgd(lr=0.5)
    torch.manual_seed(seed)  # the dropout masks
    if batched:
        r = fm.adapt_tasks(
            fmodel, params, loss, (x, y), opt, steps=2, first_order=first_order, task_chunk=None
        )
        query = fm.task_losses(fmodel, r.params, loss, (xq, yq), task_chunk=None)[0].mean()
    else:
        query = 0
        for t in range(T):
            r = fm.adapt(fmodel, params, loss, (x[t], y[t]), opt, steps=2, first_order=first_order)
            query = query + loss(fmodel(r.params, xq[t]), yq[t]) / T
    return list(torch.autograd.grad(query, list(params.values())))


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    flat_a, flat_b = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def build(how: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return SelfCheckpointed(how, **kwargs).to(DTYPE)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("batched", [False, True], ids=["adapt", "adapt_tasks"])
@pytest.mark.parametrize("first_order", [False, True], ids=["second", "first"])
def test_self_checkpointed_model_gives_the_unchecked_meta_gradients(how, batched, first_order):
    reference = meta_gradients(build("none"), batched, first_order)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and says nothing (torch's reentrant warnings included)
        ours = meta_gradients(build(how), batched, first_order)
    assert relative(ours, reference) < 1e-10


@pytest.mark.parametrize("batched", [False, True], ids=["adapt", "adapt_tasks"])
def test_dropout_in_training_mode_recomputes_the_same_masks(batched):
    reference = meta_gradients(build("none", p=0.3), batched, first_order=False)
    ours = meta_gradients(build("non-reentrant", p=0.3), batched, first_order=False)
    assert relative(ours, reference) < 1e-10
    # the masks matter: another draw gives other meta-gradients
    other = meta_gradients(build("none", p=0.3), batched, first_order=False, seed=99)
    assert relative(other, reference) > 1e-3


@pytest.mark.parametrize("batched", [False, True], ids=["adapt", "adapt_tasks"])
def test_batchnorm_inside_a_self_checkpointed_block(batched):
    nets = [build(how, batchnorm=True) for how in ("none", "non-reentrant")]
    reference, ours = (meta_gradients(net, batched, first_order=False) for net in nets)
    assert relative(ours, reference) < 1e-10
    # the running statistics are the module's own, untouched (functional runs)
    assert torch.equal(nets[1].blocks[0].norm.running_mean, torch.zeros(W, dtype=DTYPE))


def test_with_checkpoint_layers_too_each_block_is_checkpointed_once():
    """``checkpoint_layers`` on blocks the model checkpoints itself: the model's call runs the
    funcmeta-checkpointed layer as it is (recomputed as often as without the model's own
    checkpoint), with the unchecked meta-gradients."""
    reference = meta_gradients(build("none"), batched=False, first_order=False)
    counts = []
    for how in ("none", "non-reentrant"):
        net = build(how)
        ours = meta_gradients(net, False, False, checkpoint_layers="sequential")
        assert relative(ours, reference) < 1e-10
        counts.append([b.calls for b in net.blocks])
    assert counts[0] == counts[1]


def test_recomputed_as_often_as_funcmeta_checkpointed_layers():
    """The model's own checkpoints are funcmeta's checkpointing (torch's checkpoint would
    recompute each block once in the inner backward and keep it)."""
    counts = []
    for how, layers in (("none", "sequential"), ("non-reentrant", None)):
        net = build(how)
        meta_gradients(net, batched=False, first_order=False, checkpoint_layers=layers)
        counts.append([b.calls for b in net.blocks])
    assert counts[0] == counts[1]


class ResidualNet(nn.Module):
    def __init__(self, self_checkpoint: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual(16) for _ in range(4)])
        self.head = nn.Linear(16, 1)
        self.self_checkpoint = self_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.self_checkpoint else b(x)
        return self.head(x)


def test_second_order_memory_as_funcmeta_checkpoint_layers(monkeypatch):
    """What the graph keeps between the inner loop and the outer backward (the measurement of
    ``test_engine``): the self-checkpointed model at most 1.1x the same model under
    ``checkpoint_layers``, with the same meta-gradients."""

    def net_with(self_checkpoint):
        def make(*layers):
            torch.manual_seed(0)
            return ResidualNet(self_checkpoint).to(DTYPE)

        return make

    results = {}
    for name, self_ck, layers in (
        ("plain", False, None),
        ("layers", False, ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
        ("self", True, None),
    ):
        monkeypatch.setattr(test_engine.nn, "Sequential", net_with(self_ck))
        results[name] = test_engine.kept_bytes(layers)
    (plain, reference), (layers, _), (ours, grads) = (
        results["plain"],
        results["layers"],
        results["self"],
    )
    assert relative(grads, reference) < 1e-10
    assert ours <= 1.1 * layers, (ours, layers)
    assert ours < 0.5 * plain, (ours, plain)


# --- HuggingFace gradient checkpointing ------------------------------------------------------


def _hf(kind: str) -> nn.Module:
    """The zoo's BERT and GPT-2 (width 8, two layers, no dropout), or a Llama like them."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[dev]'"
    )
    torch.manual_seed(0)
    if kind == "bert":
        model = zoo._bert()
    elif kind == "gpt2":
        model = zoo._gpt2()
    else:
        config = transformers.LlamaConfig(
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            use_cache=False,
            vocab_size=13,
            max_position_embeddings=16,
        )
        model = transformers.LlamaModel(config)
    return model.to(DTYPE).train()


def _hf_data(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 13, (T, 6, 5), generator=g)
    mask = torch.ones(T, 6, 5, dtype=torch.long)
    mask[:, :, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}, torch.randn(T, 6, 5, 8, generator=g)


def _hf_loss(out, y):
    return F.mse_loss(out.last_hidden_state, y.to(out.last_hidden_state.dtype))


def hf_meta_gradients(model: nn.Module, batched: bool, first_order: bool = False) -> list:
    fmodel = fm.functional_model(model)
    (x, y), (xq, yq) = _hf_data(1), _hf_data(2)
    params, opt = fmodel.params, fm.optim.sgd(lr=0.3)
    if batched:
        r = fm.adapt_tasks(
            fmodel, params, _hf_loss, (x, y), opt, steps=2, first_order=first_order, task_chunk=None
        )
        query = fm.task_losses(fmodel, r.params, _hf_loss, (xq, yq), task_chunk=None)[0].mean()
    else:
        query = 0
        for t in range(T):
            task = {k: v[t] for k, v in x.items()}
            r = fm.adapt(
                fmodel, params, _hf_loss, (task, y[t]), opt, steps=2, first_order=first_order
            )
            query_x = {k: v[t] for k, v in xq.items()}
            query = query + _hf_loss(fmodel(r.params, **query_x), yq[t]) / T
    return list(torch.autograd.grad(query, list(params.values()), allow_unused=True))


def _present(grads: list) -> list[torch.Tensor]:
    return [g for g in grads if g is not None]


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("batched", [False, True], ids=["adapt", "adapt_tasks"])
@pytest.mark.parametrize("first_order", [False, True], ids=["second", "first"])
def test_huggingface_gradient_checkpointing(kind, reentrant, batched, first_order):
    """``gradient_checkpointing_enable()`` with either setting: the meta-gradients of the same
    model without it. Llama's RMS norm computes in float32 inside the float64 model, so its
    second-order meta-gradients agree to float32 round-off
    (``docs/decisions/huggingface-models.md``)."""
    reference = _present(hf_meta_gradients(_hf(kind), batched, first_order))
    model = _hf(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF: gradient_checkpointing_enable is deprecated
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    ours = _present(hf_meta_gradients(model, batched, first_order))
    exact = kind != "llama" or first_order
    assert relative(ours, reference) < (1e-10 if exact else 1e-6)


def test_embedding_with_padding_and_a_hook_under_task_batching():
    """An ``nn.Embedding`` with ``padding_idx`` and a forward hook (HuggingFace puts one there
    for gradient checkpointing): no gradient reaches the padding row under task batching,
    as in the per-task loop, and the hook runs."""
    torch.manual_seed(0)
    seen = []

    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Embedding(7, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 2))
        net[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
        return net.to(DTYPE)

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 7, (T, 5, 3), generator=g)
    y = torch.randn(T, 5, 2, generator=g, dtype=DTYPE)
    grads = []
    for batched in (False, True):
        fmodel = fm.functional_model(make())
        params = fmodel.params
        if batched:
            opt = fm.optim.sgd(lr=0.5)
            r = fm.adapt_tasks(fmodel, params, F.mse_loss, (x, y), opt, steps=1, task_chunk=None)
            loss = fm.task_losses(fmodel, r.params, F.mse_loss, (x, y), task_chunk=None)[0].sum()
        else:
            loss = 0
            for t in range(T):
                r = fm.adapt(
                    fmodel, params, F.mse_loss, (x[t], y[t]), fm.optim.sgd(lr=0.5), steps=1
                )
                loss = loss + F.mse_loss(fmodel(r.params, x[t]), y[t])
        grads.append(torch.autograd.grad(loss, list(params.values())))
    assert relative(list(grads[1]), list(grads[0])) < 1e-12
    assert grads[1][0][0].abs().max() == 0  # the padding row
    assert seen


# --- recipes and the other task-batched calls -------------------------------------------------


def test_maml_recipe_and_apply_tasks_on_a_self_checkpointed_model():
    x, y, xq, yq = task_data()
    out = []
    for how in ("none", "non-reentrant"):
        net = build(how)
        fmodel = fm.functional_model(net)
        r = fm.recipes.maml(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            (x, y),
            (xq, yq),
            steps=2,
            lr=0.5,
            task_chunk=None,
        )
        grads = torch.autograd.grad(r.loss, list(fmodel.params.values()))
        logits, _ = fm.apply_tasks(fmodel, fmodel.params, xq, task_chunk=None)
        (g_apply,) = torch.autograd.grad(logits.square().sum(), [net.blocks[0].lin.weight])
        out.append([*grads, g_apply])
    assert relative(out[1], out[0]) < 1e-10


# --- refusals ------------------------------------------------------------------------------


class Closure(nn.Module):
    """Checkpoints a function that reads a tensor requiring grad from a closure."""

    def __init__(self, outside: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.outside = [outside]  # not a parameter

    def forward(self, x):
        outside = self.outside[0]
        return checkpoint(lambda t: self.lin(t) * outside, x, use_reentrant=False)


def test_a_tensor_requiring_grad_outside_the_arguments_is_refused():
    outside = torch.ones(W, dtype=DTYPE, requires_grad=True)
    net = Closure(outside * 2).to(DTYPE)  # a tensor computed before the call
    fmodel = fm.functional_model(net)
    x, y = torch.randn(4, W, dtype=DTYPE), torch.randn(4, W, dtype=DTYPE)
    with pytest.raises(OpenFunctionError, match=r"computed before the call.*Pass that tensor"):
        fmodel(fmodel.params, x)
    net.outside = [outside]  # a leaf
    with pytest.raises(OpenFunctionError, match=r"leaf tensor of shape \(6,\)"):
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1)
    # without a graph (evaluation) nothing is refused
    with torch.no_grad():
        fmodel(fmodel.params, x)


class WithContext(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.options = options

    def forward(self, x):
        return checkpoint(self.lin, x, **self.options)


@pytest.mark.parametrize(
    "options, error, match",
    [
        (
            {"use_reentrant": False, "context_fn": lambda: (torch.no_grad(), torch.no_grad())},
            ValueError,
            r"checkpoint\(Linear, \.\.\., context_fn=\.\.\.\).*Drop context_fn",
        ),
        ({"use_reentrant": True, "extra": 1}, ValueError, "Unexpected keyword arguments: extra"),
        ({"use_reentrant": True, "debug": True}, ValueError, "only supported when"),
    ],
)
def test_checkpoint_options_funcmeta_cannot_honour_are_refused(options, error, match):
    fmodel = fm.functional_model(WithContext(**options).to(DTYPE))
    with pytest.raises(error, match=match):
        fmodel(fmodel.params, torch.randn(2, W, dtype=DTYPE))


# --- torch's checkpoint as it was ------------------------------------------------------------


def _code():
    return inspect.unwrap(tuc.checkpoint).__code__


def test_torch_checkpoint_is_restored_after_runs_and_errors():
    before = _code()
    fmodel = fm.functional_model(build("non-reentrant"))
    fmodel(fmodel.params, torch.randn(2, W, dtype=DTYPE))
    assert _code() is before
    with pytest.raises(RuntimeError):
        fmodel(fmodel.params, torch.randn(2, W + 1, dtype=DTYPE))  # a shape error inside
    assert _code() is before


def test_other_threads_get_torchs_own_checkpoint_during_a_run():
    """While one thread is inside a functional model's forward, another calls torch's
    checkpoint on a function closing over a tensor that requires grad: torch's own
    checkpoint runs there (funcmeta's would refuse the closure), with its gradient."""
    inside, done = threading.Event(), threading.Event()

    class Waiting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(W, W)

        def forward(self, x):
            inside.set()
            assert done.wait(30)
            return checkpoint(self.lin, x, use_reentrant=False)

    fmodel = fm.functional_model(Waiting().to(DTYPE))
    worker = threading.Thread(target=lambda: fmodel(fmodel.params, torch.randn(2, W, dtype=DTYPE)))
    worker.start()
    try:
        assert inside.wait(30)
        w = torch.randn(W, dtype=DTYPE, requires_grad=True)
        out = checkpoint(lambda t: t * w, torch.ones(W, dtype=DTYPE), use_reentrant=False)
        (g,) = torch.autograd.grad(out.sum(), w)
        assert torch.equal(g, torch.ones(W, dtype=DTYPE))
    finally:
        done.set()
        worker.join()
    assert _code() is inspect.unwrap(tuc.checkpoint).__code__


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batched", [False, True], ids=["adapt", "adapt_tasks"])
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "sequential"])
def test_self_checkpointed_model_on_the_device_gives_the_unchecked_meta_gradients(
    how, batched, device, monkeypatch
):
    """float64 on the device: the model's own checkpoints, checkpointed by funcmeta, give the
    unchecked model's meta-gradients (the CUDA backward runs recomputations on autograd's
    device threads)."""
    cpu_data = task_data
    monkeypatch.setitem(
        globals(), "task_data", lambda seed=1: tuple(t.to(device) for t in cpu_data(seed))
    )
    reference = meta_gradients(build("none").to(device), batched, first_order=False)
    ours = meta_gradients(build(how).to(device), batched, first_order=False)
    assert relative(ours, reference) < 1e-10
