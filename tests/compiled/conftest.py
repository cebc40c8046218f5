"""Fixtures of the compiled step's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile with the aot_eager backend (the graph as dynamo and AOTAutograd trace
    it, activation checkpointing's recomputation included, without inductor's build)."""
    compile_ = torch.compile

    def compile_aot_eager(fn, **kwargs):  # type: ignore[no-untyped-def]
        return compile_(fn, fullgraph=True, dynamic=False, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_aot_eager)
