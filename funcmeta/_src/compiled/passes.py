"""Rewrites of a compiled meta-step's graph, made before inductor lowers it.

:func:`orient_bmm`: on a CPU, torch's batched matrix product (``aten.bmm``) is several times
slower when the short side of the result is its last dimension, and a meta-gradient's
double backward makes such products (``(T, 40, 40) @ (T, 40, 10)`` in the sinusoid MLP,
both operands transposed views; ``benchmarks/RESULTS.md``, "The compiled meta-step"). The
pass computes each of them transposed, ``(b^T @ a^T)^T``: the same products and sums, in
the orientation the kernel runs fast, so the result differs by rounding only.

Example:
    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> from funcmeta._src.compiled.passes import orient_bmm
    >>> a, b = torch.randn(3, 8, 5, dtype=torch.float64), torch.randn(3, 5, 2, dtype=torch.float64)
    >>> g = make_fx(torch.bmm, tracing_mode="fake")(a, b)
    >>> orient_bmm(g.graph)
    1
    >>> _ = g.recompile()
    >>> torch.allclose(g(a, b), torch.bmm(a, b))
    True
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import fx

from funcmeta._src.core.fence import inductor_graph_pass

__all__ = ["cpu_passes", "orient_bmm"]

_BMM = torch.ops.aten.bmm.default
_PERMUTE = torch.ops.aten.permute.default


def orient_bmm(graph: fx.Graph) -> int:
    """Rewrite, in place, every CPU ``bmm`` whose result ``(B, m, n)`` has ``n < m`` as
    ``permute(bmm(permute(b), permute(a)))``; returns how many were rewritten. Nodes without
    a recorded value (no shape to read) are left as they are."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _BMM:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or out.dim() != 3:
            continue
        if out.shape[2] >= out.shape[1]:
            continue
        a, b = node.args
        with graph.inserting_before(node):
            bt = graph.call_function(_PERMUTE, (b, [0, 2, 1]))
            at = graph.call_function(_PERMUTE, (a, [0, 2, 1]))
            product = graph.call_function(_BMM, (bt, at))
            back = graph.call_function(_PERMUTE, (product, [0, 2, 1]))
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        done += 1
    graph.lint()
    return done


@functools.cache
def cpu_passes() -> dict[str, Any]:
    """Inductor options that install :func:`orient_bmm` (empty where this torch has no
    custom graph passes); keyed for inductor's cache by the hash of this module and by the
    lowering the compiled step compiles in (aten's max pooling backward), so that a graph
    compiled otherwise is not taken from the cache."""
    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    graph_pass = inductor_graph_pass(
        orient_bmm, f"funcmeta.orient_bmm.{key}.aten-max-pool-backward"
    )
    return {} if graph_pass is None else {"post_grad_custom_post_pass": graph_pass}
