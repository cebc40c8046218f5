"""The autocast precision a device computes fast: :func:`choose_autocast`.

Mixed precision pays only where the hardware computes the half type. On CUDA that is fp16
(with a ``GradScaler``). On a CPU, bf16 matrix products are fast only where the processor has
bf16 instructions (x86: AVX-512 BF16 or AMX; Arm: the BF16 extension); elsewhere torch emulates
them, and a 768-wide bf16 product ran 50 to 110 times slower than float32. So ``"auto"`` means
bf16 on a CPU only where :func:`cpu_has_native_bf16` says the processor computes it, and
float32 (no autocast) elsewhere. The reason is part of the answer, for a program to print once.

Example:
    >>> import torch, funcmeta as fm
    >>> choice = fm.choose_autocast("cpu")
    >>> choice.name in ("bf16", "fp32"), choice.dtype in (torch.bfloat16, None)
    (True, True)
    >>> with choice.autocast("cpu"):   # torch.autocast, or a no-op for fp32
    ...     y = torch.ones(2, 2) @ torch.ones(2, 2)
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from funcmeta._src.core.exposed import exposed_in

__all__ = ["AutocastChoice", "choose_autocast", "cpu_has_native_bf16"]

# ISA caps below which oneDNN and ATen emulate bf16 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY)
_ONEDNN_CAPS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}
_ATEN_CAPS_WITHOUT_BF16 = {"DEFAULT", "AVX2"}
_DTYPES: dict[str, torch.dtype | None] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": None,
}


def _torch_probe(name: str) -> bool | None:
    """``torch.cpu._is_<name>_supported()``, or None where this torch lacks it."""
    probe = getattr(torch.cpu, f"_is_{name}_supported", None)
    if probe is None:
        return None
    try:
        return bool(probe())
    except RuntimeError:
        return None


def _cpuinfo_flags() -> set[str]:
    """The processor's feature flags from ``/proc/cpuinfo`` (Linux), lower case; empty
    elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.lower().split())
    return flags


def _probe() -> tuple[bool, str]:
    """Whether this processor computes bf16 in hardware, and the evidence."""
    for variable, caps in (
        ("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAPS_WITHOUT_BF16),
        ("DNNL_MAX_CPU_ISA", _ONEDNN_CAPS_WITHOUT_BF16),
        ("ATEN_CPU_CAPABILITY", _ATEN_CAPS_WITHOUT_BF16),
    ):
        value = os.environ.get(variable, "").strip().upper()
        if value in caps:
            return False, f"{variable}={value} caps the instructions torch uses below bf16's"
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686", "x86"):
        avx512_bf16 = _torch_probe("avx512_bf16")
        amx = _torch_probe("amx_tile")
        if avx512_bf16 is None or amx is None:  # an older torch: read the flags
            flags = _cpuinfo_flags()
            avx512_bf16 = avx512_bf16 or "avx512_bf16" in flags
            amx = amx or "amx_bf16" in flags
        if avx512_bf16 or amx:
            found = " and ".join(n for n, ok in (("AVX-512 BF16", avx512_bf16), ("AMX", amx)) if ok)
            return True, f"the processor has {found}"
        return False, "the processor has neither AVX-512 BF16 nor AMX"
    if machine in ("aarch64", "arm64"):
        if platform.system() == "Darwin":  # Apple M2 and later; the flags are not readable
            return False, "bf16 support is not detectable on this Arm Mac"
        if "bf16" in _cpuinfo_flags():
            return True, "the processor has the Arm BF16 extension"
        return False, "the processor lacks the Arm BF16 extension"
    return False, f"no bf16 instructions are known for a {machine or 'unknown'} processor"


@exposed_in("funcmeta")
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (x86: AVX-512 BF16 or AMX; Arm: the BF16
    extension), and torch is not capped below those instructions (``ONEDNN_MAX_CPU_ISA``,
    ``ATEN_CPU_CAPABILITY``). Where it is False, CPU bf16 autocast is emulated and slow.

    Example:
        >>> import funcmeta as fm
        >>> isinstance(fm.cpu_has_native_bf16(), bool)
        True
    """
    return _probe()[0]


@exposed_in("funcmeta")
@dataclass(frozen=True)
class AutocastChoice:
    """The autocast precision :func:`choose_autocast` picked, and why.

    ``name`` is ``"fp16"``, ``"bf16"`` or ``"fp32"``; ``dtype`` the autocast dtype (None for
    fp32: no autocast); ``scaler`` whether it wants a ``torch.amp.GradScaler`` (fp16);
    ``reason`` one line to print.

    Example:
        >>> import funcmeta as fm
        >>> fm.choose_autocast("cpu", "fp32")
        AutocastChoice(name='fp32', dtype=None, reason='fp32 was asked for')
    """

    name: str
    dtype: torch.dtype | None
    reason: str

    @property
    def scaler(self) -> bool:
        """Whether this precision wants loss scaling (fp16)."""
        return self.name == "fp16"

    def autocast(self, device: str | torch.device) -> Any:
        """``torch.autocast(device.type, dtype)`` for a half type; a no-op context for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.dtype)


@exposed_in("funcmeta")
def choose_autocast(device: str | torch.device, precision: str = "auto") -> AutocastChoice:
    """The autocast precision for ``device``: ``precision`` as given (``"fp16"``, ``"bf16"``,
    ``"fp32"``), or for ``"auto"`` fp16 on CUDA, bf16 on a CPU that computes it in hardware
    (:func:`cpu_has_native_bf16`), float32 on any other CPU, where bf16 is emulated and many
    times slower than float32.

    Example:
        >>> import funcmeta as fm
        >>> fm.choose_autocast("cuda").name
        'fp16'
        >>> fm.choose_autocast("cpu", "bf16").reason
        'bf16 was asked for'
    """
    if precision not in ("auto", *_DTYPES):
        raise ValueError(f"precision={precision!r} is not one of 'auto', 'fp16', 'bf16', 'fp32'")
    if precision != "auto":
        return AutocastChoice(precision, _DTYPES[precision], f"{precision} was asked for")
    kind = torch.device(device).type
    if kind == "cuda":
        return AutocastChoice("fp16", torch.float16, "CUDA computes fp16 (with a GradScaler)")
    if kind != "cpu":
        return AutocastChoice("fp32", None, f"no half type is chosen for {kind} by itself")
    native, why = _probe()
    if native:
        return AutocastChoice("bf16", torch.bfloat16, f"{why}: bf16 runs natively on this CPU")
    return AutocastChoice(
        "fp32", None, f"{why}: bf16 would be emulated and many times slower than float32"
    )
