"""``loss_scale=torch.amp.GradScaler``: the scaler's scale for the inner loop, and an inner
overflow made a skipped step for the scaler (no exception, no partial update, the scale
backed off), as torch's AMP does for an overflow in the outer backward."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, mlp
from torch import nn

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def data(seed=0, n=16, width=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g, dtype=dtype), torch.randn(
        n, 2, generator=g, dtype=dtype
    )


def test_a_scaler_scales_the_inner_loss_like_its_scale_as_a_number():
    net = mlp()
    fmodel = fm.functional_model(net)
    (x, y), opt = data(dtype=DTYPE), fm.optim.sgd(lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    results = [
        fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2, loss_scale=s)
        for s in (scaler, 1024.0, None)
    ]
    for r in results[1:]:
        for k, v in results[0].params.items():
            torch.testing.assert_close(v, r.params[k], rtol=1e-12, atol=0)
    assert not results[0].overflowed and results[0].skipped == ()


def overflowing(scale: float = 2.0**40) -> tuple[fm.FunctionalModel, torch.amp.GradScaler]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    return fm.functional_model(net), torch.amp.GradScaler("cpu", init_scale=scale)


@pytest.mark.parametrize("batched", [False, True], ids=["adapt", "adapt_tasks"])
def test_an_inner_overflow_is_a_skipped_step_for_the_scaler(batched):
    """fp16 inner gradients times 2**40 overflow: no exception; the result says so; the
    scaler's step leaves every parameter (and the rates) as they were; its update halves
    the scale."""
    fmodel, scaler = overflowing()
    net = fmodel.module
    rates = fm.hyper.per_layer(fmodel.params, 0.1, parameterization="softplus")
    outer = torch.optim.SGD([*net.parameters(), *rates.parameters()], lr=0.1)
    before = [p.detach().clone() for p in [*net.parameters(), *rates.parameters()]]
    x, y = data()
    if batched:
        x, y = x.view(4, 4, 3), y.view(4, 4, 2)
    with torch.autocast("cpu", dtype=torch.float16):
        call = fm.adapt_tasks if batched else fm.adapt
        r = call(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (x, y),
            fm.optim.sgd(lr=rates),
            steps=3,
            loss_scale=scaler,
        )
        out = fm.apply_tasks(fmodel, r.params, x)[0] if batched else fmodel(r.params, x)
        query = F.mse_loss(out.float(), y)
    assert r.overflowed and r.skipped == (0, 1, 2)
    assert r.losses.shape[0] == 3 and math.isnan(float(r.losses[-1].float().flatten()[0]))
    assert torch.isfinite(query)  # the query pass runs on the last finite parameters
    outer.zero_grad()
    scaler.scale(query).backward()
    scaler.step(outer)
    scaler.update()
    after = [p.detach() for p in [*net.parameters(), *rates.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert scaler.get_scale() == 2.0**39


def test_explicit_on_nonfinite_and_a_number_keep_their_meaning():
    fmodel, scaler = overflowing()
    x, y = data()
    opt = fm.optim.sgd(lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(fm.NonFiniteError, match="inner step 0"):
            fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2, loss_scale=2.0**40)
        with pytest.raises(fm.NonFiniteError, match="inner step 0"):
            fm.adapt(
                fmodel,
                fmodel.params,
                F.mse_loss,
                (x, y),
                opt,
                steps=2,
                loss_scale=scaler,
                on_nonfinite="raise",
            )
        r = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (x, y),
            opt,
            steps=2,
            loss_scale=scaler,
            on_nonfinite="skip",
        )
    assert r.skipped == (0, 1) and not r.overflowed


def test_a_disabled_scaler_scales_nothing():
    fmodel, _ = overflowing()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = data()
    opt = fm.optim.sgd(lr=0.1)
    r = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2, loss_scale=scaler)
    plain = fm.adapt(fmodel, fmodel.params, F.mse_loss, (x, y), opt, steps=2)
    for k, v in r.params.items():
        assert torch.equal(v, plain.params[k])


def test_a_bad_loss_scale_names_the_choices():
    fmodel, _ = overflowing()
    with pytest.raises(ValueError, match=r"finite positive number or a torch\.amp\.GradScaler"):
        fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            data(),
            fm.optim.sgd(lr=0.1),
            steps=1,
            loss_scale="65536",
        )


def test_the_motivating_gradscaler_loop_trains_from_too_high_a_scale():
    """The example's fp16 loop on CPU with GradScaler("cpu") from an initial scale of 2**24
    (at the default 65536 its normalised head does not overflow): 30+ meta-iterations without
    an exception, the scale backing off on inner overflows, and the query loss falling."""
    import checkpointed_maml as example

    args = example.parser().parse_args(
        [
            "--device",
            "cpu",
            "--precision",
            "fp16",
            "--init-scale",
            str(2.0**24),
            "--width",
            "32",
            "--modules",
            "8",
            "--adapt",
            "4",
            "--rows",
            "32",
            "--tasks",
            "2",
            "--steps",
            "3",
            "--iterations",
            "36",
            "--inner-lr",
            "0.3",
            "--outer-lr",
            "3e-3",
            "--no-measure",
        ]
    )
    history = example.train(args)
    assert len(history["loss"]) == 36
    assert history["scale"][-1] < 2.0**24
    assert any(history["skipped"])
    kept = [
        loss
        for loss, skipped in zip(history["loss"], history["skipped"], strict=True)
        if not skipped
    ]
    assert sum(kept[-5:]) / 5 < 0.8 * sum(kept[:5]) / 5
