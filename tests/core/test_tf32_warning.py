"""TF32 never silently: a second-order meta-gradient formed in float32 on CUDA while TF32 is
on for an operator the model runs says so once per process (fm.TF32Warning), with the
measured effect and the switch. Tested on a CPU by setting torch's flags and letting the
parameters count as CUDA ones."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm
from funcmeta._src.core import precision

B: Any = torch.backends
ON_CUDA = precision._float32_on_cuda  # the real test, before any test replaces it


@pytest.fixture(autouse=True)
def _as_if_on_cuda(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(precision, "_WARNED", [False])
    monkeypatch.setattr(precision, "_float32_on_cuda", lambda tensors: True)
    with fm.exact_float32():  # every flag comes back after the test
        torch.set_float32_matmul_precision("highest")
        B.cudnn.allow_tf32 = True  # torch's defaults: TF32 for cuDNN, not for cuBLAS
        yield


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4, 2))


def _lstm() -> nn.Module:
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(3, 4, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][:, -1])

    return Reader()


INPUTS = {"mlp": (_mlp, (5, 3)), "conv": (_conv, (5, 1, 6)), "lstm": (_lstm, (5, 4, 3))}


def _adapt(name: str, tasks: bool = False, **options: Any) -> list[warnings.WarningMessage]:
    build, shape = INPUTS[name]
    torch.manual_seed(0)
    fmodel = fm.functional_model(build())
    x, y = torch.randn(*shape), torch.randn(shape[0], 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if tasks:
            x, y = x.expand(2, *x.shape), y.expand(2, *y.shape)
            call = fm.adapt_tasks
        else:
            call = fm.adapt
        call(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1, **options)
    return [w for w in caught if issubclass(w.category, fm.TF32Warning)]


@pytest.mark.parametrize("tasks", [False, True], ids=["adapt", "adapt_tasks"])
@pytest.mark.parametrize(("name", "said"), [("conv", "cuDNN convolutions"), ("lstm", "cuDNN RNNs")])
def test_torchs_default_tf32_is_named_once_for_the_layers_that_use_it(name, said, tasks):
    first = _adapt(name, tasks)
    assert len(first) == 1
    text = str(first[0].message)
    assert said in text and "36%" in text and "fm.exact_float32()" in text
    assert "matrix products" not in text  # cuBLAS TF32 is off by default
    assert first[0].filename == __file__  # points at the caller's line
    assert _adapt(name, tasks) == []  # once per process


def test_an_mlp_with_torchs_defaults_is_not_warned():
    assert _adapt("mlp") == []


def test_tf32_matrix_products_are_named():
    torch.set_float32_matmul_precision("high")
    (caught,) = _adapt("mlp")
    assert "matrix products" in str(caught.message)


@pytest.mark.parametrize("setting", ["new", "legacy"])
def test_the_flags_are_read_through_either_api(setting):
    if setting == "new" and not precision.PER_OPERATOR:
        pytest.skip("torch < 2.9 has no per-operator flags")
    if setting == "new":
        B.cuda.matmul.fp32_precision = "tf32"
    else:
        B.cuda.matmul.allow_tf32 = True
    assert "matmul" in precision.tf32_on()
    assert len(_adapt("mlp")) == 1


@pytest.mark.parametrize("how", ["exact_float32", "first_order", "no_grad", "autocast"])
def test_nothing_is_said_when_tf32_is_moot(how):
    context: Any = {
        "exact_float32": fm.exact_float32(),
        "no_grad": torch.no_grad(),
        "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
    }.get(how, contextlib.nullcontext())
    with context:
        assert _adapt("conv", first_order=how == "first_order") == []
    assert len(_adapt("conv")) == 1  # the one warning was not spent


def test_parameters_on_a_cpu_say_nothing(monkeypatch):
    monkeypatch.setattr(precision, "_float32_on_cuda", ON_CUDA)
    assert _adapt("conv") == []


def test_a_filter_silences_it():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=fm.TF32Warning)
        fmodel = fm.functional_model(_conv())
        x, y = torch.randn(5, 1, 6), torch.randn(5, 2)
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1)
    assert caught == []


def test_the_compiled_step_says_it_too():
    fmodel = fm.functional_model(_conv())
    step = fm.compile_meta_step(fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=1, compile=False)
    x, y = torch.randn(2, 5, 1, 6), torch.randn(2, 5, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step((x, y), (x, y))
    (said,) = [w for w in caught if issubclass(w.category, fm.TF32Warning)]
    assert "cuDNN convolutions" in str(said.message)
    assert said.filename == __file__  # points at the caller's line
