"""Errors that name their place: a model's forward that fails on a batch says which batch
(support at which inner step, query, a batch given to task_losses or apply_tasks), per task
under task batching, the layer and the inputs' shapes, with torch's error chained; a loss
that is not a scalar names the fix at the call; task-axis mistakes in regression are said
(fm.TaskAxisWarning), and nothing is said for the shapes the suite and examples use."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

SGD = fm.optim.sgd(lr=0.1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _sin(tasks: int = 3, shots: int = 5) -> fm.data.Batch:
    return fm.data.Sinusoid().sample(
        tasks, shots, shots, generator=torch.Generator().manual_seed(0)
    )


def _raises_at(call, *, place: str, layer: str, inputs: str, torch_says: str) -> None:
    with pytest.raises(RuntimeError) as caught:
        call()
    text = str(caught.value)
    assert f"failed on {place}" in text, text
    assert layer in text, text
    assert inputs in text, text
    assert torch_says in text  # torch's own words stay first
    assert isinstance(caught.value.__cause__, RuntimeError)  # chained
    assert "funcmeta" not in str(caught.value.__cause__)


def test_adapt_names_the_support_batch_the_step_and_the_layer():
    f = fm.functional_model(_net())
    x, y = torch.randn(10, 2), torch.randn(10, 1)
    _raises_at(
        lambda: fm.adapt(f, f.params, F.mse_loss, (x, y), SGD, steps=2),
        place="the support batch at inner step 0",
        layer="in layer '0' (Linear)",
        inputs="argument 0 (10, 2) float32",
        torch_says="mat1 and mat2 shapes cannot be multiplied (10x2 and 1x8)",
    )


def test_adapt_tasks_names_it_per_task():
    f = fm.functional_model(_net())
    x, y = torch.randn(3, 10, 2), torch.randn(3, 10, 1)
    _raises_at(
        lambda: fm.adapt_tasks(f, f.params, F.mse_loss, (x, y), SGD, steps=1),
        place="the support batch at inner step 0 (shapes per task",
        layer="in layer '0' (Linear)",
        inputs="argument 0 (10, 2) float32",
        torch_says="",
    )


def test_a_nested_conv_layer_is_named_by_its_path():
    f = fm.functional_model(Encoder())
    x, y = torch.randn(3, 5, 2, 6, 6), torch.randint(0, 3, (3, 5))  # two channels, not one
    _raises_at(
        lambda: fm.adapt_tasks(f, f.params, F.cross_entropy, (x, y), SGD, steps=1),
        place="the support batch at inner step 0",
        layer="in layer 'body.0' (Conv2d)",
        inputs="argument 0 (5, 2, 6, 6)",
        torch_says="channels",
    )


def test_task_losses_apply_tasks_and_the_recipes_name_their_batch():
    f = fm.functional_model(_net())
    b = _sin()
    wrong = torch.randn(3, 5, 2)
    _raises_at(
        lambda: fm.task_losses(f, f.params, F.mse_loss, (wrong, b.y_query)),
        place="the batch given to fm.task_losses",
        layer="'0' (Linear)",
        inputs="(5, 2)",
        torch_says="",
    )
    _raises_at(
        lambda: fm.apply_tasks(f, f.params, wrong),
        place="the inputs given to fm.apply_tasks",
        layer="'0' (Linear)",
        inputs="(5, 2)",
        torch_says="",
    )
    _raises_at(
        lambda: fm.recipes.maml(
            f, f.params, F.mse_loss, b.support, (wrong, b.y_query), steps=1, lr=0.1
        ),
        place="the query batch",
        layer="'0' (Linear)",
        inputs="(5, 2)",
        torch_says="",
    )


def test_the_compiled_step_names_it_on_its_plain_path():
    f = fm.functional_model(_net())
    b = _sin()
    step = fm.compile_meta_step(f, F.mse_loss, SGD, steps=1, compile=False)
    _raises_at(
        lambda: step(b.support, (torch.randn(3, 5, 2), b.y_query)),
        place="the query batch",
        layer="'0' (Linear)",
        inputs="(5, 2)",
        torch_says="",
    )


def test_an_embedding_index_error_keeps_its_type():
    net = nn.Sequential(nn.Embedding(4, 3), nn.Flatten(), nn.Linear(6, 1))
    f = fm.functional_model(net)
    x, y = torch.tensor([[0, 9], [1, 2]]), torch.randn(2, 1)
    with pytest.raises(IndexError, match=r"(?s)index out of range.*in layer '0' \(Embedding\)"):
        fm.adapt(f, f.params, F.mse_loss, (x, y), SGD, steps=1)


def test_a_plain_call_of_the_model_is_not_changed():
    f = fm.functional_model(_net())
    with pytest.raises(RuntimeError) as caught:
        f(f.params, torch.randn(4, 2))
    assert "funcmeta" not in str(caught.value)


# --- a loss that is not a scalar -------------------------------------------------------------


@pytest.mark.parametrize("where", ["adapt", "adapt_tasks", "task_losses"])
def test_a_loss_that_is_not_a_scalar_names_the_fix_at_the_call(where):
    f = fm.functional_model(_net())
    b = _sin()
    per_example = lambda o, t: F.mse_loss(o, t, reduction="none")  # noqa: E731
    calls = {
        "adapt": lambda: fm.adapt(
            f, f.params, per_example, (b.x_support[0], b.y_support[0]), SGD, steps=1
        ),
        "adapt_tasks": lambda: fm.adapt_tasks(f, f.params, per_example, b.support, SGD, steps=1),
        "task_losses": lambda: fm.task_losses(f, f.params, per_example, b.query),
    }
    with pytest.raises(
        ValueError, match=r"got shape \(5, 1\).*reduction='mean'.*\.mean\(\)"
    ) as caught:
        calls[where]()
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert len(frames) <= 3, [f"{f.filename}:{f.lineno}" for f in frames]  # at the call
    assert frames[0].filename == __file__


# --- task-axis mistakes in regression -------------------------------------------------------


def test_adapt_given_a_batch_of_tasks_says_so():
    f = fm.functional_model(_net())
    b = _sin(4, 10)
    with pytest.warns(
        fm.TaskAxisWarning, match=r"\(4, 10, 1\).*ONE task of 4 x 10.*fm.adapt_tasks"
    ) as said:
        fm.adapt(f, f.params, F.mse_loss, b.support, SGD, steps=1)
    assert said[0].filename == __file__  # points at the user's call


@pytest.mark.parametrize("call", ["adapt_tasks", "maml"])
def test_one_task_given_as_a_batch_of_tasks_says_so(call):
    f = fm.functional_model(_net())
    b = _sin(1, 10)
    one = (b.x_support[0], b.y_support[0])  # (10, 1): ten "tasks" of one point each
    with pytest.warns(
        fm.TaskAxisWarning, match=r"\(10, 1\) make 10 tasks of one unbatched example.*fm.adapt"
    ) as said:
        if call == "maml":
            fm.recipes.maml(f, f.params, F.mse_loss, one, one, steps=1, lr=0.1)
        else:
            fm.adapt_tasks(f, f.params, F.mse_loss, one, SGD, steps=1)
    assert said[0].filename == __file__


def test_sequences_and_right_batches_say_nothing():
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.head = nn.GRU(2, 4, batch_first=True), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0])

    b = _sin(4, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fm.TaskAxisWarning)
        f = fm.functional_model(_net())
        fm.adapt(f, f.params, F.mse_loss, (b.x_support[0], b.y_support[0]), SGD, steps=1)
        fm.adapt_tasks(f, f.params, F.mse_loss, b.support, SGD, steps=1)
        seq = fm.functional_model(Reader())  # (batch, time, features): a sequence model
        fm.adapt(
            seq, seq.params, F.mse_loss, (torch.randn(3, 5, 2), torch.randn(3, 5, 1)), SGD, steps=1
        )


class _Attend(nn.Module):
    """One task of (N, L, D) sequences through self-attention: a real sequence model."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize(
    "layers",
    [
        "attention",
        "softmax over the sequence",
        "per-channel prelu",
    ],
)
def test_layers_that_read_a_leading_axis_say_nothing(layers):
    """Only layers that act on the last axis alone make the leading-task-axis warning: not
    nn.MultiheadAttention (it lives among torch's activations), not a softmax over another
    axis, not a PReLU with a weight per channel (axis 1)."""
    net = {
        "attention": _Attend,
        "softmax over the sequence": lambda: nn.Sequential(
            nn.Linear(4, 4), nn.Softmax(dim=1), nn.Linear(4, 1)
        ),
        "per-channel prelu": lambda: nn.Sequential(
            nn.Linear(4, 4), nn.PReLU(num_parameters=5), nn.Linear(4, 1)
        ),
    }[layers]()
    f = fm.functional_model(net)
    x, y = torch.randn(3, 5, 4), torch.randn(3, 5, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fm.TaskAxisWarning)
        fm.adapt(f, f.params, F.mse_loss, (x, y), SGD, steps=1)


@pytest.mark.parametrize(
    "layer",
    [nn.GELU(), nn.SiLU(), nn.Softmax(dim=-1), nn.PReLU(), nn.GLU(dim=-1)],
    ids=["gelu", "silu", "softmax-last", "prelu-one", "glu-last"],
)
def test_pointwise_layers_still_warn(layer):
    width = 8 if isinstance(layer, nn.GLU) else 4
    net = nn.Sequential(nn.Linear(4, width), layer, nn.Linear(4, 1))
    f = fm.functional_model(net)
    with pytest.warns(fm.TaskAxisWarning, match="ONE task of 3 x 5"):
        fm.adapt(
            f, f.params, F.mse_loss, (torch.randn(3, 5, 4), torch.randn(3, 5, 1)), SGD, steps=1
        )
