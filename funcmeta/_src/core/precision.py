"""Exact float32 on GPUs: :func:`exact_float32`, TF32 off for a block.

On NVIDIA GPUs since Ampere, torch may run float32 convolutions and recurrent layers on cuDNN
(and, if asked, float32 matrix products) in TF32, which keeps 10 bits of mantissa. cuDNN's
convolutions and RNNs do so by default. One forward and backward barely notice; a
second-order meta-gradient differentiates through every inner step's gradient and amplifies
the rounding: second-order MAML through conv4 with BatchNorm on an H200 was 36% (relative)
off float64 with TF32, and 2.3e-4 without (docs/memory.md, "TF32 and second order"). Inside
:func:`exact_float32` every float32 matrix product, convolution and recurrent layer runs in
full float32; the settings before it come back after it, exactly (also on error).

It coexists with torch's own switches. torch >= 2.9 keeps two sets of TF32 flags, the legacy
ones (``torch.backends.cudnn.allow_tf32``, ``torch.backends.cuda.matmul.allow_tf32``,
``torch.set_float32_matmul_precision``) and the per-operator ones
(``torch.backends.cudnn.conv.fp32_precision`` and its kin), and refuses to read a legacy
flag that disagrees with the new ones ("a mix of the legacy and new APIs"). Inside the block
both sets say the same (full float32), so every reader works, torch's
``torch.backends.cudnn.flags(...)`` included, and the block stays exact after such a nested
context ends; blocks nest. On torch < 2.9 only the legacy flags exist and it sets those.

Example:
    >>> import torch, funcmeta as fm
    >>> with fm.exact_float32():
    ...     y = torch.ones(2, 2) @ torch.ones(2, 2)   # in full float32 on a GPU too
    ...     torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    (False, False)
    >>> y.tolist()
    [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from funcmeta._src.core.exposed import exposed_in
from funcmeta._src.core.fence import autocast_enabled, user_stacklevel

__all__ = [
    "CONVOLUTIONS",
    "TF32Warning",
    "exact_float32",
    "tf32_on",
    "tf32_state",
    "warn_tf32_second_order",
]

_backends: Any = cast(Any, torch.backends)  # cudnn.conv and kin live on a swapped-in module

#: Whether this torch has the per-operator precision flags (torch >= 2.9).
PER_OPERATOR = hasattr(getattr(_backends.cudnn, "conv", None), "fp32_precision")


def _owners() -> list[tuple[str, Any]]:
    """The per-operator flags, parents before children: setting a parent overwrites its
    children, so restoring in this order gives every flag back its value."""
    b = _backends
    return [
        ("generic", b),
        ("cuda", b.cudnn),  # torch's ("cuda", "all"): cuBLAS and cuDNN together
        ("mkldnn", b.mkldnn),
        ("cuda.matmul", b.cuda.matmul),
        ("cuda.conv", b.cudnn.conv),
        ("cuda.rnn", b.cudnn.rnn),
        ("mkldnn.matmul", b.mkldnn.matmul),
        ("mkldnn.conv", b.mkldnn.conv),
        ("mkldnn.rnn", b.mkldnn.rnn),
    ]


def _read(reader: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        with warnings.catch_warnings():
            # torch 2.9 warns on each read of a legacy flag that the legacy API is deprecated
            warnings.filterwarnings(
                "ignore", message="Please use the new API", category=UserWarning
            )
            return True, reader()
    except RuntimeError:  # torch refuses to read a legacy flag the new ones contradict
        return False, None


def _probed(reader: Callable[[], Any], owners: list[Any], tries: list[str]) -> Any:
    """A legacy flag's own value when torch refuses to read it (the new flags of ``owners``
    contradict it): set those to each value of ``tries`` until the read succeeds, then put
    them back."""
    ok, value = _read(reader)
    if ok:
        return value
    saved = [o.fp32_precision for o in owners]
    try:
        for precision in tries:
            for o in owners:
                o.fp32_precision = precision
            ok, value = _read(reader)
            if ok:
                return value
    finally:
        for o, precision in zip(owners, saved, strict=True):
            o.fp32_precision = precision
    raise RuntimeError("exact_float32 could not read torch's legacy TF32 flags")  # unreachable


def tf32_state() -> dict[str, Any]:
    """Every TF32 setting torch holds, read without tripping torch's mixed-API check: the
    legacy ``matmul`` precision (``torch.get_float32_matmul_precision``) and cuDNN's
    ``allow_tf32``, and on torch >= 2.9 each per-operator ``fp32_precision``."""
    b = _backends
    if not PER_OPERATOR:
        return {
            "matmul": torch.get_float32_matmul_precision(),
            "cudnn.allow_tf32": bool(b.cudnn.allow_tf32),
        }
    state: dict[str, Any] = {
        "matmul": _probed(
            torch.get_float32_matmul_precision,
            [b.cuda.matmul, b.mkldnn.matmul],
            ["ieee", "tf32"],
        ),
        "cudnn.allow_tf32": _probed(
            lambda: bool(b.cudnn.allow_tf32), [b.cudnn.conv, b.cudnn.rnn], ["ieee", "tf32"]
        ),
    }
    state.update({name: owner.fp32_precision for name, owner in _owners()})
    return state


def _restore(state: dict[str, Any]) -> None:
    """Put back what :func:`tf32_state` read: the legacy flags first (their setters also set
    per-operator flags), then the per-operator flags, parents first."""
    torch.set_float32_matmul_precision(state["matmul"])
    _backends.cudnn.allow_tf32 = state["cudnn.allow_tf32"]
    if PER_OPERATOR:
        for name, owner in _owners():
            owner.fp32_precision = state[name]


def _exact() -> None:
    """Full float32 everywhere, the legacy and per-operator flags in agreement."""
    torch.set_float32_matmul_precision("highest")
    _backends.cudnn.allow_tf32 = False
    if PER_OPERATOR:
        b = _backends
        # the parent too: a nested torch.backends.cudnn.flags(...) resets the operators to
        # "none" on exit, which then reads the parent's "ieee"
        for owner in (b.cudnn, b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn):
            owner.fp32_precision = "ieee"


@exposed_in("funcmeta")
@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off for the block: float32 matrix products, cuDNN convolutions and cuDNN
    recurrent layers in full float32, for float32 meta-gradients that a second-order
    derivative does not amplify TF32's rounding into. Every TF32 setting made before it,
    through torch's legacy or per-operator flags, comes back after it. Usable as a decorator
    too.

    Example:
        >>> import torch, funcmeta as fm
        >>> torch.backends.cudnn.allow_tf32     # torch's default
        True
        >>> with fm.exact_float32():
        ...     torch.backends.cudnn.allow_tf32
        False
        >>> torch.backends.cudnn.allow_tf32
        True
    """
    saved = tf32_state()
    try:
        _exact()
        yield
    finally:
        _restore(saved)


# --- TF32 never silently ------------------------------------------------------------------


@exposed_in("funcmeta")
class TF32Warning(UserWarning):
    """A second-order meta-gradient is formed on CUDA while TF32 is on for an operator the
    model uses (said once per process). Silence it, keeping TF32, with
    ``warnings.filterwarnings("ignore", category=fm.TF32Warning)``."""


def tf32_on() -> list[str]:
    """The operators that run float32 in TF32 on CUDA now: ``"matmul"`` (cuBLAS),
    ``"conv"`` and ``"rnn"`` (cuDNN), read without tripping torch's mixed-API check."""
    b = _backends
    if PER_OPERATOR:
        flags = {
            "matmul": b.cuda.matmul.fp32_precision,
            "conv": b.cudnn.conv.fp32_precision,
            "rnn": b.cudnn.rnn.fp32_precision,
        }
        return [op for op, precision in flags.items() if precision == "tf32"]
    on = ["matmul"] if b.cuda.matmul.allow_tf32 else []
    return on + (["conv", "rnn"] if b.cudnn.allow_tf32 else [])


#: The convolution layers: what runs on cuDNN, and what makes a compiled step one task per graph.
CONVOLUTIONS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_RECURRENT = (nn.RNNBase,)
_WARNED = [False]

TF32_MESSAGE = (
    "a second-order meta-gradient on CUDA with TF32 on for {ops}: second order amplifies "
    "TF32's rounding (on conv4 with BatchNorm, an NVIDIA H200 gave meta-gradients 36% off "
    "float64 with torch's default TF32 convolutions, and 2.3e-4 off inside "
    "fm.exact_float32()). Run the meta-iteration, its outer backward included, inside "
    "`with fm.exact_float32():` (docs/memory.md, 'TF32 and second order'); to keep TF32, "
    "silence this with warnings.filterwarnings('ignore', category=fm.TF32Warning). Said once "
    "per process."
)


def _operators(module: nn.Module) -> set[str]:
    """The TF32-capable operators ``module``'s layers run: matrix products always, cuDNN
    convolutions and RNNs where it has such layers."""
    used = {"matmul"}
    for m in module.modules():
        if isinstance(m, CONVOLUTIONS):
            used.add("conv")
        elif isinstance(m, _RECURRENT):
            used.add("rnn")
    return used


def _float32_on_cuda(tensors: Iterable[Tensor]) -> bool:
    return any(t.is_cuda and t.dtype == torch.float32 for t in tensors)


def warn_tf32_second_order(module: nn.Module, tensors: Iterable[Tensor], first_order: bool) -> None:
    """Warn once per process (:class:`TF32Warning`) when a second-order meta-gradient is
    about to be formed in float32 on CUDA (``tensors``: the parameters) while TF32 is on
    for an operator ``module`` runs; autocast to a half type and first order say nothing."""
    if _WARNED[0] or first_order or not torch.is_grad_enabled():
        return
    if not _float32_on_cuda(tensors):
        return
    if autocast_enabled():  # float32 layers then run in a half type, where TF32 is moot
        return
    ops = [op for op in tf32_on() if op in _operators(module)]
    if not ops:
        return
    _WARNED[0] = True
    names = {"matmul": "matrix products", "conv": "cuDNN convolutions", "rnn": "cuDNN RNNs"}
    warnings.warn(
        TF32_MESSAGE.format(ops=", ".join(names[op] for op in ops)),
        TF32Warning,
        stacklevel=user_stacklevel(),
    )
