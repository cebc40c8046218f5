"""What the task batches of :mod:`funcmeta.data` share: their ``support`` and ``query`` pairs."""

from __future__ import annotations

__all__ = ["query_pair", "support_pair"]

support_pair = property(
    lambda self: (self.x_support, self.y_support),
    doc="``(x_support, y_support)``: the support batch, as the recipes and "
    ":func:`funcmeta.adapt_tasks` take it.",
)
query_pair = property(
    lambda self: (self.x_query, self.y_query),
    doc="``(x_query, y_query)``: the query batch.",
)
