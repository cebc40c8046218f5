"""One calling convention: the core calls and every recipe take the model, the parameters,
the loss and the data in that order, ``steps`` as a required keyword, and the inner-loop
options of fm.AdaptOptions, checked before any computation."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm

OPTIONS = [f.name for f in dataclasses.fields(fm.AdaptOptions)]
RECIPES = ["maml", "fomaml", "metasgd", "anil", "reptile", "mamlpp", "imaml"]
KW = inspect.Parameter.KEYWORD_ONLY


def signature(fn):
    return inspect.signature(fn).parameters


@pytest.mark.parametrize(
    "fn", [fm.adapt, fm.adapt_tasks, *(getattr(fm.recipes, r) for r in RECIPES)]
)
def test_order_steps_and_options(fn):
    params = signature(fn)
    names = list(params)
    data = ["batch"] if fn in (fm.adapt, fm.adapt_tasks) else ["support", "query"]
    assert names[: 3 + len(data)] == ["fmodel", "params", "loss_fn", *data]
    assert params["steps"].kind is KW and params["steps"].default is inspect.Parameter.empty
    shown = [n for n in OPTIONS if n in params]
    expected = [n for n in OPTIONS if not (fn is fm.recipes.fomaml and n == "first_order")]
    assert shown == expected  # the options, listed in the signature, from one definition
    assert all(params[n].kind is KW for n in shown)


def test_task_calls_take_buffers_as_a_keyword():
    for fn in (fm.task_losses, fm.apply_tasks, fm.adapt, fm.adapt_tasks):
        params = signature(fn)
        assert list(params)[:2] == ["fmodel", "params"]
        assert params["buffers"].kind is KW and params["buffers"].default is None
    assert list(signature(fm.task_losses))[2:4] == ["loss_fn", "batch"]
    assert list(signature(fm.apply_tasks))[2] == "inputs"


class Counting(nn.Module):
    """A linear model that counts its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def tasks():
    b = fm.data.Sinusoid().sample(3, 4, 4, generator=torch.Generator().manual_seed(0))
    return b.support, b.query


@pytest.mark.parametrize("call", ["adapt", "adapt_tasks", "maml", "reptile"])
def test_unknown_or_bad_option_raises_before_any_forward(call):
    net = Counting()
    fmodel = fm.functional_model(net)
    support, query = tasks()
    opt = fm.optim.sgd(lr=0.1)

    def run(**options):
        if call == "adapt":
            single = (support[0][0], support[1][0])
            return fm.adapt(fmodel, fmodel.params, F.mse_loss, single, opt, steps=1, **options)
        if call == "adapt_tasks":
            return fm.adapt_tasks(
                fmodel, fmodel.params, F.mse_loss, support, opt, steps=1, **options
            )
        recipe = getattr(fm.recipes, call)
        return recipe(fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=0.1, **options)

    with pytest.raises(
        TypeError, match=r"unknown option 'frist_order'; the options are first_order"
    ):
        run(frist_order=True)
    with pytest.raises(ValueError, match=r"truncate must be an int in \[0, steps=1\], got 2"):
        run(truncate=2)
    with pytest.raises(TypeError, match="checkpoint_steps must be a bool"):
        run(checkpoint_steps="yes")
    with pytest.raises(ValueError, match="on_nonfinite must be None, 'raise' or 'skip'"):
        run(on_nonfinite="ignore")
    assert net.calls == 0


def test_recipe_inner_optimizer_is_lr_or_opt_never_both():
    fmodel = fm.functional_model(nn.Linear(1, 1))
    support, query = tasks()
    opt = fm.optim.sgd(lr=0.1)
    with pytest.raises(TypeError, match="as opt= or its learning rate as lr=, not both"):
        fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=0.1, opt=opt)
    for recipe in (fm.recipes.maml, fm.recipes.fomaml, fm.recipes.reptile):
        with pytest.raises(TypeError, match=r"no inner learning rate: pass lr=.*or opt="):
            recipe(fmodel, fmodel.params, F.mse_loss, support, query, steps=1)
    with pytest.raises(TypeError, match="no inner learning rate"):
        fm.recipes.anil(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=1, trainable="bias"
        )
    a = fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=0.1)
    b = fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, support, query, steps=1, opt=opt)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    with pytest.raises(TypeError, match="fomaml is first order by definition"):
        fm.recipes.fomaml(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=1, first_order=False
        )
    with pytest.raises(TypeError, match="imaml adapts every parameter"):
        fm.recipes.imaml(
            fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lam=1.0, trainable="lin"
        )
    with pytest.raises(
        TypeError,
        match=r"Meta-SGD rates lr= must be tensors.*fm\.hyper\.per_element\(params, 0\.1\)",
    ):
        fm.recipes.metasgd(fmodel, fmodel.params, F.mse_loss, support, query, steps=1, lr=0.1)
    with pytest.raises(TypeError, match="MAML\\+\\+ needs per-step rates"):
        fm.recipes.mamlpp(
            fmodel,
            fmodel.params,
            F.mse_loss,
            support,
            query,
            steps=1,
            lr=0.1,
            step_weights=torch.ones(1),
        )


def test_every_recipe_returns_a_recipe_result_and_only_its_own_extras():
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    fmodel = fm.functional_model(net)
    support, query = tasks()
    own = {
        "maml": {"lr": 0.01},
        "fomaml": {"lr": 0.01},
        "metasgd": {"lr": fm.recipes.metasgd_rates(fmodel.params)},
        "anil": {"trainable": "2", "lr": 0.01},
        "reptile": {"lr": 0.01},
        "mamlpp": {
            "lr": fm.hyper.per_layer(fmodel.params, 0.01, steps=2),
            "step_weights": fm.recipes.mamlpp_step_weights(2, 0, 1),
        },
        "imaml": {"lam": 1.0, "lr": 0.01},
    }
    for name in RECIPES:
        recipe = getattr(fm.recipes, name)
        out = recipe(fmodel, fmodel.params, F.mse_loss, support, query, steps=2, **own[name])
        assert isinstance(out, fm.recipes.RecipeResult), name
        assert out.loss.dim() == 0 and out.loss.requires_grad, name
        assert out.query_loss.dim() == 0 and not out.query_loss.requires_grad, name
        assert isinstance(out.adapted, fm.AdaptResult), name
        assert out.adapted.params["2.weight"].shape == (3, 1, 8), name  # the task axis
        own_type = {"mamlpp": fm.recipes.MamlppResult, "imaml": fm.recipes.ImamlResult}
        assert type(out) is own_type.get(name, fm.recipes.RecipeResult), name
        extras = {"step_buffers", "residual", "curvature_stop"}
        has = {field for field in extras if hasattr(out, field)}
        mine = {"mamlpp": {"step_buffers"}, "imaml": {"residual", "curvature_stop"}}
        assert has == mine.get(name, set()), name  # extras only where the recipe has them
        if name == "imaml":
            assert out.residual.shape == (3,) and out.curvature_stop.shape == (3,)
        if name == "mamlpp":
            assert len(out.step_buffers) == 2
    none = fm.recipes.reptile(fmodel, fmodel.params, F.mse_loss, support, steps=1, lr=0.01)
    assert none.query_loss is None


def test_predicates_take_name_and_value():
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    seen_layers, seen_params = [], []

    def layers(name, module):
        seen_layers.append((name, type(module).__name__))
        return name == "2"

    def params(name, tensor):
        seen_params.append((name, tuple(tensor.shape)))
        return name.startswith("2.")

    fmodel = fm.functional_model(net, checkpoint_layers=layers)
    assert fmodel.checkpointed == ["2"] and ("2", "Linear") in seen_layers
    x, y = torch.randn(5, 1), torch.randn(5, 1)
    result = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=1, trainable=params
    )
    assert ("2.weight", (1, 4)) in seen_params
    assert result.params["0.weight"] is fmodel.params["0.weight"]  # held fixed


def test_the_typed_options_are_the_options():
    """``fm.AdaptKeywords`` (the type of every ``**options``) names each field of
    ``fm.AdaptOptions`` with its type; the recipes that set an option themselves take the
    rest."""
    import dataclasses
    import typing

    from funcmeta._src.inner import options

    fields = {f.name: f.type for f in dataclasses.fields(fm.AdaptOptions)}
    keys = typing.get_type_hints(fm.AdaptKeywords)
    assert set(keys) == set(fields)
    assert fm.AdaptKeywords.__optional_keys__ == frozenset(fields)
    assert set(typing.get_type_hints(options.FirstOrderKeywords)) == set(fields) - {"first_order"}
    assert set(typing.get_type_hints(options.HeadKeywords)) == set(fields) - {"trainable"}
    hints = typing.get_type_hints(fm.adapt, include_extras=True)
    assert "Unpack" in str(hints["options"]) and "AdaptKeywords" in str(hints["options"])
