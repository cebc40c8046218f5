"""Every reason compile_meta_step gives for running eagerly names what to change: the list of
known causes, each recognised in the words torch raises it with, and the models that meet
them on this torch (an LSTM, a transformer layer, a value read in Python, a model that
checkpoints itself), which also give the plain path's meta-gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import GRAPH_TORCH
from torch import nn

import funcmeta as fm
from funcmeta._src.compiled.eager_reasons import COMPILE_FALSE, RULES, explain

#: What each reason tells the user to do: each names a change or the plain call.
FIXES = ("use fm.adapt_tasks", "pass ", "compile=True", "keep the tasks", "turn it off")


def _names_a_fix(reason: str) -> bool:
    return any(fix in reason for fix in FIXES)


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_each_known_cause_is_recognised_and_names_a_fix(rule):
    chained = RuntimeError("RuntimeError when making fake tensor call")
    chained.__cause__ = RuntimeError(f"... {rule.words[0].upper()} ...")
    reason = explain(chained)
    assert reason.startswith(rule.says)
    assert _names_a_fix(reason), reason


def test_an_unknown_cause_keeps_torchs_words_and_names_the_plain_path():
    reason = explain(ValueError("something torch.compile has not met\nmore"))
    assert reason.startswith("ValueError: something torch.compile has not met.")
    assert _names_a_fix(reason) and "TORCH_LOGS=graph_breaks" in reason
    assert _names_a_fix(COMPILE_FALSE)


class Sequence(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body: nn.Module = (
            nn.LSTM(8, 8, batch_first=True)
            if kind == "lstm"
            else nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head((h[0] if self.kind == "lstm" else h)[:, -1])


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 0.5 if x.abs().max().item() > 100 else 1.0
        return self.layer(x).mean(1) * scale


class ChecksItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)
        return self.head(h).mean(1)


MODELS = {
    "lstm": (lambda: Sequence("lstm"), ("nn.LSTM", "the layers that stop it: 'body' (LSTM)")),
    "transformer": (
        lambda: Sequence("transformer"),
        ("first_order=True", "the layers that stop it: 'body.self_attn' (MultiheadAttention)"),
    ),
    "value read in Python": (ReadsAValue, (".item()",)),
    "own checkpoints": (ChecksItself, ("torch.utils.checkpoint",)),
}


@pytest.mark.parametrize("name", list(MODELS))
@GRAPH_TORCH
def test_models_that_cannot_be_one_graph_say_why_in_their_terms(name):
    """On the torch.func graph (the autograd graph compiles some of them:
    tests/compiled/test_compiled_autograd.py)."""
    build, said = MODELS[name]
    torch.manual_seed(0)
    net = build()
    fmodel = fm.functional_model(net)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 4, 5, 8, generator=g), torch.randint(0, 3, (2, 4)))
    step = fm.compile_meta_step(
        fmodel, F.cross_entropy, fm.optim.sgd(lr=0.1), steps=1, graph="torch.func"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(batch, batch)
    reason = step.eager_reason
    assert reason is not None and _names_a_fix(reason), reason
    assert all(words in reason for words in said), reason
    assert any(reason in str(w.message) for w in caught)


@GRAPH_TORCH
def test_rates_over_frozen_layers_compile():
    """Rates built over every parameter, with trainable= a subset: the rates of the layers
    held fixed are unused, as on the plain path, and the step compiles."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1)).double()
    fmodel = fm.functional_model(net)
    rates = fm.hyper.per_layer(fmodel.params, 0.1, parameterization="softplus").double()
    b = fm.data.Sinusoid().sample(
        3, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    grads = []
    for compile in (False, True):
        for t in [*net.parameters(), *rates.parameters()]:
            t.grad = None
        step = fm.compile_meta_step(
            fmodel,
            F.mse_loss,
            fm.optim.sgd(lr=rates),
            steps=2,
            hyper=[rates],
            trainable="2",
            compile=compile,
        )
        step(b.support, b.query)
        assert step.eager_reason == (None if compile else COMPILE_FALSE)
        grads.append(
            [t.grad.clone() for t in [*net.parameters(), *rates.parameters()] if t.grad is not None]
        )
    for a, b_ in zip(*grads, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-12)


def test_a_delayed_graph_break_names_the_recurrent_layer_that_delayed_it():
    """torch 2.15 turns an RNN into a delayed graph break whose error names no RNN
    ("cannot determine type of argument DelayGraphBreakVariable()"): the reason names the
    model's recurrent layers as on 2.13; in a model without one, it is no RNN's."""
    from funcmeta._src.compiled.eager_reasons import explain

    error = RuntimeError(
        "builtin isinstance() cannot determine type of argument DelayGraphBreakVariable()"
    )
    said = explain(error, Sequence("lstm"))
    assert "nn.LSTM" in said and "the layers that stop it: 'body' (LSTM)" in said, said
    assert "nn.LSTM" not in explain(error, nn.Linear(2, 2))
