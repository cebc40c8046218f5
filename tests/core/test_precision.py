"""fm.exact_float32 coexists with torch's TF32 switches, on any machine (the flags are set
and read without a GPU): inside the block every reader torch has works and says "full
float32", torch's own ``torch.backends.cudnn.flags(...)`` works inside it and leaves it
exact, blocks nest, and every setting made before it, through the legacy or the
per-operator flags, comes back after it (also after an error)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import funcmeta as fm
from funcmeta._src.core import precision

B: Any = torch.backends
NEW = hasattr(getattr(B.cudnn, "conv", None), "fp32_precision")


def _reader(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as error:
        return f"refused: {str(error)[:40]}"


READERS: dict[str, Callable[[], Any]] = {
    "cudnn.allow_tf32": lambda: B.cudnn.allow_tf32,
    "matmul.allow_tf32": lambda: B.cuda.matmul.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
}
if NEW:
    READERS.update(
        {
            "generic": lambda: B.fp32_precision,
            "cudnn": lambda: B.cudnn.fp32_precision,
            "cuda.matmul": lambda: B.cuda.matmul.fp32_precision,
            "cudnn.conv": lambda: B.cudnn.conv.fp32_precision,
            "cudnn.rnn": lambda: B.cudnn.rnn.fp32_precision,
            "mkldnn.matmul": lambda: B.mkldnn.matmul.fp32_precision,
        }
    )


def observed() -> dict[str, Any]:
    """What a user sees through torch's own readers (a refusal is what it says)."""
    return {name: _reader(fn) for name, fn in READERS.items()}


def assert_exact_inside() -> None:
    seen = observed()
    assert seen["cudnn.allow_tf32"] is False, seen
    assert seen["matmul.allow_tf32"] is False, seen
    assert seen["float32_matmul_precision"] == "highest", seen
    if NEW:
        for name in ("cuda.matmul", "cudnn.conv", "cudnn.rnn"):
            assert seen[name] == "ieee", seen


def _defaults() -> None:
    """torch's defaults at start-up."""
    if NEW:  # a parent set to "none" leaves its children as they are: each one by name
        for owner in (B, B.cudnn, B.mkldnn, B.mkldnn.conv, B.mkldnn.rnn):
            owner.fp32_precision = "none"
    torch.set_float32_matmul_precision("highest")
    B.cudnn.allow_tf32 = True
    if NEW:
        B.cuda.matmul.fp32_precision = "none"
        B.mkldnn.matmul.fp32_precision = "none"


START = observed()


@pytest.fixture(autouse=True)
def _torch_defaults() -> Iterator[None]:
    _defaults()
    assert observed() == START
    yield
    _defaults()


def _user_settings() -> dict[str, Callable[[], None]]:
    settings: dict[str, Callable[[], None]] = {
        "defaults": lambda: None,
        "legacy cudnn off": lambda: setattr(B.cudnn, "allow_tf32", False),
        "legacy matmul on": lambda: setattr(B.cuda.matmul, "allow_tf32", True),
        "matmul precision high": lambda: torch.set_float32_matmul_precision("high"),
        "matmul precision medium": lambda: torch.set_float32_matmul_precision("medium"),
    }
    if NEW:
        settings.update(
            {
                # a mix torch itself refuses to read back through allow_tf32
                "new conv ieee only": lambda: setattr(B.cudnn.conv, "fp32_precision", "ieee"),
                "new matmul tf32": lambda: setattr(B.cuda.matmul, "fp32_precision", "tf32"),
                "new generic tf32": lambda: setattr(B, "fp32_precision", "tf32"),
                "new cudnn ieee": lambda: setattr(B.cudnn, "fp32_precision", "ieee"),
            }
        )
    return settings


SETTINGS = _user_settings()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_settings_come_back_and_readers_work_inside(setting):
    SETTINGS[setting]()
    before = observed()
    with fm.exact_float32():
        assert_exact_inside()
    assert observed() == before


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_torchs_cudnn_flags_inside_the_block(setting):
    """The reproduction of the GPU run's 56 failures, on a CPU: torch's own context manager
    inside the block, and the block still exact after it."""
    SETTINGS[setting]()
    before = observed()
    with fm.exact_float32():
        with torch.backends.cudnn.flags(enabled=False):
            assert B.cudnn.enabled is False
            assert isinstance(B.cudnn.allow_tf32, bool)
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            pass
        assert_exact_inside()
    assert observed() == before


def test_torchs_cudnn_flags_around_the_block():
    with torch.backends.cudnn.flags(enabled=False, allow_tf32=True):
        inside = observed()
        with fm.exact_float32():
            assert_exact_inside()
        assert observed() == inside
    assert observed() == START


def test_blocks_nest_and_restore_after_an_error():
    torch.set_float32_matmul_precision("high")
    before = observed()
    with pytest.raises(KeyError), fm.exact_float32():
        with fm.exact_float32():
            assert_exact_inside()
        assert_exact_inside()
        raise KeyError("inside")
    assert observed() == before


def test_as_a_decorator():
    @fm.exact_float32()
    def read() -> dict[str, Any]:
        return observed()

    assert read()["cudnn.allow_tf32"] is False
    assert observed() == START


def test_settings_made_inside_do_not_leak_out():
    with fm.exact_float32():
        B.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("medium")
    assert observed() == START


@pytest.mark.skipif(not NEW, reason="torch < 2.9 has no per-operator flags")
def test_the_state_reads_a_mix_torch_refuses_to_read():
    B.cudnn.conv.fp32_precision = "ieee"  # conv and rnn now disagree with allow_tf32
    with pytest.raises(RuntimeError, match="legacy and new"):
        _ = B.cudnn.allow_tf32
    state = precision.tf32_state()
    assert state["cudnn.allow_tf32"] is True  # the legacy flag itself was never changed
    assert state["cuda.conv"] == "ieee" and state["cuda.rnn"] == "tf32"
    assert precision.tf32_state() == state  # reading changed nothing
