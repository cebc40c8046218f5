"""The compiled meta-step's CPU choices: the graph rewrite (``_src/compiled/passes.py``), which
products it turns, and that the rewritten graph computes what the original does; max
pooling's backward as aten's kernel, with the same values (float64)."""

from __future__ import annotations

import pytest
import torch
from helpers import GRAPH_TORCH
from torch.fx.experimental.proxy_tensor import make_fx

from funcmeta._src.compiled.passes import cpu_passes, orient_bmm


def products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    tall = torch.bmm(a, b)  # (B, 40, 10): turned
    wide = torch.bmm(tall.transpose(1, 2), a)  # (B, 10, 40): kept
    square = torch.bmm(a.transpose(1, 2), c)  # (B, 40, 40): kept
    both_t = torch.bmm(square.transpose(1, 2), tall)  # transposed operands, (B, 40, 10): turned
    return (wide.sum() + both_t.sum()) * tall


def inputs(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = ((4, 40, 40), (4, 40, 10), (4, 40, 40))
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(device) for s in shapes)


def test_turns_the_tall_products_and_keeps_the_value():
    args = inputs()
    gm = make_fx(products, tracing_mode="fake")(*args)
    assert orient_bmm(gm.graph) == 2
    gm.recompile()
    bmms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.bmm.default]
    assert len(bmms) == 4
    torch.testing.assert_close(gm(*args), products(*args), rtol=1e-12, atol=0)


def test_double_backward_graph_rewritten_equals_the_original():
    """A second-order meta-gradient through two layers with a task axis (the weights shared
    by the layers, as a tied MLP), traced as inductor's post-grad graph holds it: its double
    backward makes a tall product, and the rewritten graph gives the same meta-gradient."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 40, 40, generator=g, dtype=torch.float64)
    x = torch.randn(8, 10, 40, generator=g, dtype=torch.float64)

    def inner(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.bmm(x, w.transpose(1, 2)))
        return torch.tanh(torch.bmm(h, w.transpose(1, 2))).pow(2).sum()

    def meta(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return inner(w - 0.1 * torch.func.grad(inner)(w, x), x)

    meta_grad = torch.func.grad(meta)
    gm = make_fx(meta_grad, tracing_mode="fake")(w, x)
    assert orient_bmm(gm.graph) >= 1
    gm.recompile()
    torch.testing.assert_close(gm(w, x), meta_grad(w, x), rtol=1e-12, atol=1e-12)


def test_leaves_values_off_the_cpu_alone():
    args = inputs("meta")
    gm = make_fx(products, tracing_mode="fake")(*args)
    assert orient_bmm(gm.graph) == 0


def test_the_inductor_option_is_keyed_by_the_code():
    options = cpu_passes()
    if not options:
        pytest.skip("this torch has no custom graph passes")
    graph_pass = options["post_grad_custom_post_pass"]
    assert graph_pass.uuid() == cpu_passes()["post_grad_custom_post_pass"].uuid()
    assert graph_pass.uuid().startswith("funcmeta.orient_bmm.")


@GRAPH_TORCH
def test_max_pool_backward_compiles_as_atens_kernel_with_the_same_values():
    """Inside ``fence.inductor_aten_max_pool_backward`` a compiled second-order gradient
    through max pooling (windows apart and overlapping) calls aten's backward kernel and
    gives the eager values (float64); after it, inductor's own lowering is back."""
    import torch._inductor.config
    import torch.nn.functional as F
    from torch._inductor import decomposition, lowering

    from funcmeta._src.core.fence import inductor_aten_max_pool_backward

    op = torch.ops.aten.max_pool2d_with_indices_backward.default
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 9, 9, generator=g, dtype=torch.float64)
    w = torch.randn(3, 1, 1, generator=g, dtype=torch.float64)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(torch.tanh(x * w), 2)
        return F.max_pool2d(h, 3, stride=1).pow(2).sum()

    def meta(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return loss(w - 0.1 * torch.func.grad(loss)(w, x), x)

    meta_grad = torch.func.grad(meta)
    compiled = torch.compile(meta_grad, fullgraph=True, dynamic=False)
    with (
        torch._inductor.config.patch(force_disable_caches=True),
        inductor_aten_max_pool_backward() as applied,
    ):
        compiled(w, x)  # compiles
    if not applied:
        pytest.skip("this torch lacks inductor's max pooling fallback")
    with torch.profiler.profile() as profile:
        got = compiled(w, x)
    assert "aten::max_pool2d_with_indices_backward" in {e.key for e in profile.key_averages()}
    torch.testing.assert_close(got, meta_grad(w, x), rtol=1e-12, atol=1e-12)
    # a NaN and an infinity in a window: the kept index, so the gradient, is eager's
    bad = x.clone()
    bad[0, 0, 0, 0], bad[1, 2, 4, 5] = float("nan"), float("inf")
    want = meta_grad(w, bad)
    assert want.isnan().any()  # the NaN reaches the meta-gradient, not silently finite
    torch.testing.assert_close(compiled(w, bad), want, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert op in decomposition.select_decomp_table()
    assert lowering.lowerings[op] is not lowering.fallback_max_pool2d_with_indices_backward

    with pytest.raises(RuntimeError, match="inside"), inductor_aten_max_pool_backward():
        raise RuntimeError("inside")
    assert op in decomposition.select_decomp_table()
