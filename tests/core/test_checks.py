"""The shared argument checks (``funcmeta._src.core.checks``) and the public arguments that go
through them: a bad value raises an error naming the argument and the value it got."""

from __future__ import annotations

import math

import pytest
import torch

import funcmeta as fm
from funcmeta._src.core.checks import check_choice


def test_check_choice_returns_a_choice():
    assert check_choice("warn", "on_unsolved", ("raise", "warn", "ignore")) == "warn"
    assert check_choice(None, "on_nonfinite", (None, "raise", "skip")) is None
    assert check_choice(1, "batch_dims", (0, 1)) == 1


@pytest.mark.parametrize(
    ("value", "choices", "message"),
    [
        (
            "x",
            ("raise", "warn", "ignore"),
            "on_unsolved must be 'raise', 'warn' or 'ignore', got 'x'",
        ),
        ("x", (None, "raise", "skip"), "on_unsolved must be None, 'raise' or 'skip', got 'x'"),
        (2, (0, 1), "on_unsolved must be 0 or 1, got 2"),
        ("b", ("a",), "on_unsolved must be 'a', got 'b'"),
        ([1], frozenset("a"), r"on_unsolved must be 'a', got \[1\]"),  # unhashable
        (torch.ones(2), (0, 1), r"on_unsolved must be 0 or 1, got tensor\(\[1\., 1\.\]\)"),
    ],
)
def test_check_choice_names_the_argument_the_choices_and_the_value(value, choices, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_choice(value, "on_unsolved", choices)


@pytest.mark.parametrize("damping", [-1.0, math.nan, math.inf])
@pytest.mark.parametrize("solver", [fm.implicit.CG, fm.implicit.NormalCG, fm.implicit.Neumann])
def test_a_solver_refuses_a_bad_damping(solver, damping):
    message = "finite number" if not math.isfinite(damping) else r">= 0\.0"
    with pytest.raises(ValueError, match=f"damping must be (a )?{message}, got {damping}"):
        solver(damping=damping)


def test_solver_settings_are_checked():
    with pytest.raises(ValueError, match=r"tol must be >= 0\.0, got -1e-06"):
        fm.implicit.CG(tol=-1e-6)
    with pytest.raises(ValueError, match="tol must be a finite number, got nan"):
        fm.implicit.NormalCG(tol=math.nan)
    with pytest.raises(ValueError, match=r"alpha must be > 0\.0, got -0\.5"):
        fm.implicit.Neumann(alpha=-0.5)
    with pytest.raises(TypeError, match="damping must be a number, got str '1'"):
        fm.implicit.CG(damping="1")


def test_root_checks_its_options():
    t = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)

    def root(**kw):
        return fm.implicit.root(lambda x, t: x - t, t.detach(), t, **kw)

    with pytest.raises(
        ValueError, match="on_unsolved must be 'raise', 'warn' or 'ignore', got 'maybe'"
    ):
        root(on_unsolved="maybe")
    with pytest.raises(ValueError, match=r"max_residual must be > 0\.0, got 0"):
        root(max_residual=0)
    with pytest.raises(ValueError, match="max_residual must be a finite number, got nan"):
        root(max_residual=math.nan)
    with pytest.raises(ValueError, match="batch_dims must be 0 or 1, got 2"):
        root(batch_dims=2)
    # None and infinity both mean no limit on the residual
    for limit in (None, math.inf):
        torch.testing.assert_close(root(max_residual=limit), t)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"decays": (1.5,)}, ValueError, r"decays\[0\] must be >= 0\.0 and < 1\.0, got 1\.5"),
        ({"decays": (0.5, -0.1)}, ValueError, r"decays\[1\] must be >= 0\.0 and < 1\.0, got -0\.1"),
        ({"beta2": math.nan}, ValueError, "beta2 must be a finite number, got nan"),
        ({"time_scales": (1.0, 0.0)}, ValueError, r"time_scales\[1\] must be > 0\.0, got 0\.0"),
        ({"scale": -1.0}, ValueError, r"scale must be > 0\.0, got -1\.0"),
        ({"eps": 0}, ValueError, r"eps must be > 0\.0, got 0"),
        ({"max_gain": 1.0}, ValueError, r"max_gain must be > 1\.0, got 1\.0"),
        ({"lr": math.inf}, ValueError, "lr must be a finite number, got inf"),
        ({"lr": "0.1"}, TypeError, "lr must be a number, got str '0.1'"),
    ],
)
def test_learned_optimizer_names_a_bad_setting(kwargs, error, message):
    with pytest.raises(error, match=message):
        fm.learned.LearnedOptimizer(**kwargs)


def test_ridge_checks_lam_and_method():
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    y = torch.randn(4, 5, 2, dtype=torch.float64)
    for lam in (math.nan, math.inf):
        with pytest.raises(ValueError, match=f"lam must be a finite number, got {lam}"):
            fm.heads.ridge(x, y, lam)
        with pytest.raises(ValueError, match=f"lam must be a finite number, got {lam}"):
            fm.heads.RidgeHead(lam=lam)
    with pytest.raises(TypeError, match="lam must be a number, got bool True"):
        fm.heads.ridge(x, y, True)
    with pytest.raises(ValueError, match="method must be 'exact' or 'implicit', got 'cg'"):
        fm.heads.RidgeHead(method="cg")
    # a tensor lam (one per task) is still taken as it is
    w = fm.heads.ridge(x, y, torch.full((4,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(w, fm.heads.ridge(x, y, 0.5))


def test_sinusoid_ranges_are_checked():
    with pytest.raises(
        ValueError, match=r"amplitude\[0\] \(low\) must be a finite number, got nan"
    ):
        fm.data.Sinusoid(amplitude=(math.nan, 1.0))
    with pytest.raises(ValueError, match=r"x_range\[1\] \(high\) must be a finite number, got inf"):
        fm.data.Sinusoid(x_range=(-5.0, math.inf))
    with pytest.raises(TypeError, match="phase\\[0\\] \\(low\\) must be a number, got str '0'"):
        fm.data.Sinusoid(phase=("0", 1.0))
    with pytest.raises(
        ValueError, match=r"phase must be \(low, high\) with low <= high, got \(3\.0, 1\.0\)"
    ):
        fm.data.Sinusoid(phase=(3.0, 1.0))
    assert fm.data.Sinusoid(amplitude=(1, 1)).amplitude == (1.0, 1.0)


def test_adapt_options_go_through_the_shared_checks():
    with pytest.raises(ValueError, match="on_nonfinite must be None, 'raise' or 'skip', got 'x'"):
        fm.AdaptOptions(on_nonfinite="x")
    for scale in (0.0, -1.0, math.nan, "2"):
        with pytest.raises(
            ValueError, match=r"loss_scale must be a finite positive number or a torch\.amp"
        ):
            fm.AdaptOptions(loss_scale=scale)
    assert fm.AdaptOptions(loss_scale=1024).loss_scale == 1024
    with pytest.raises(ValueError, match=r"truncate must be an int in \[0, steps=2\], got 3"):
        fm.AdaptOptions(truncate=3).check_steps(2)


def test_mamlpp_step_weights_name_the_bad_argument():
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        fm.recipes.mamlpp_step_weights(0, epoch=0, msl_epochs=10)
    with pytest.raises(ValueError, match="msl_epochs must be an int >= 1, got 0"):
        fm.recipes.mamlpp_step_weights(5, epoch=0, msl_epochs=0)
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        fm.recipes.mamlpp_step_weights(5, epoch=-1, msl_epochs=10)


def test_a_hyperparameter_names_a_bad_parameterization():
    with pytest.raises(
        ValueError, match="parameterization must be 'raw', 'softplus' or 'exp', got 'log'"
    ):
        fm.hyper.scalar(0.1, parameterization="log")
