"""``fm.choose_autocast``: bf16 on a CPU only where the processor computes it, fp32 elsewhere
(a CPU without bf16 instructions emulates it many times slower than float32), fp16 on CUDA;
and the examples that pick a precision by themselves follow it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import funcmeta as fm
from funcmeta._src.core import autocast_choice

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def no_caps(monkeypatch):
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(variable, raising=False)


def _x86(monkeypatch, avx512_bf16, amx):
    monkeypatch.setattr(autocast_choice.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.mark.parametrize(("avx512_bf16", "amx"), [(True, False), (False, True), (True, True)])
def test_a_cpu_with_bf16_instructions_autocasts_to_bf16(monkeypatch, no_caps, avx512_bf16, amx):
    _x86(monkeypatch, avx512_bf16, amx)
    choice = fm.choose_autocast("cpu")
    assert choice.name == "bf16" and choice.dtype is torch.bfloat16 and not choice.scaler
    assert fm.cpu_has_native_bf16()
    assert "bf16 runs natively" in choice.reason
    assert ("AMX" in choice.reason) == amx and ("AVX-512 BF16" in choice.reason) == avx512_bf16


def test_an_avx2_cpu_runs_float32(monkeypatch, no_caps):
    """The reported trap: AVX2 without AVX-512 BF16 or AMX; auto must not pick bf16."""
    _x86(monkeypatch, False, False)
    choice = fm.choose_autocast("cpu")
    assert choice.name == "fp32" and choice.dtype is None and not fm.cpu_has_native_bf16()
    assert "neither AVX-512 BF16 nor AMX" in choice.reason and "emulated" in choice.reason
    with choice.autocast("cpu"):  # no autocast: float32 stays float32
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ONEDNN_MAX_CPU_ISA", "avx2"),
        ("DNNL_MAX_CPU_ISA", "AVX512_CORE"),
        ("ATEN_CPU_CAPABILITY", "avx2"),
    ],
)
def test_an_isa_capped_below_bf16_runs_float32(monkeypatch, no_caps, variable, value):
    """With torch capped below the bf16 instructions (the way to emulate an AVX2 machine),
    bf16 is emulated even on a processor that has them."""
    _x86(monkeypatch, True, True)
    monkeypatch.setenv(variable, value)
    choice = fm.choose_autocast("cpu")
    assert choice.name == "fp32" and variable in choice.reason


def test_an_older_torch_reads_the_processor_flags(monkeypatch, no_caps):
    monkeypatch.setattr(autocast_choice.platform, "machine", lambda: "x86_64")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.setattr(autocast_choice, "_cpuinfo_flags", lambda: {"avx2", "amx_bf16"})
    assert fm.choose_autocast("cpu").name == "bf16"
    monkeypatch.setattr(autocast_choice, "_cpuinfo_flags", lambda: {"avx2", "fma"})
    assert fm.choose_autocast("cpu").name == "fp32"


@pytest.mark.parametrize(
    ("features", "name"), [({"fp", "asimd", "bf16"}, "bf16"), ({"fp"}, "fp32")]
)
def test_arm_follows_its_bf16_extension(monkeypatch, no_caps, features, name):
    monkeypatch.setattr(autocast_choice.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(autocast_choice.platform, "system", lambda: "Linux")
    monkeypatch.setattr(autocast_choice, "_cpuinfo_flags", lambda: features)
    assert fm.choose_autocast("cpu").name == name


def test_cpuinfo_flags_parse_x86_and_arm(monkeypatch, tmp_path):
    text = "processor\t: 0\nflags\t\t: fpu avx2 AVX512_BF16\n\nFeatures\t: fp asimd bf16\n"
    (tmp_path / "cpuinfo").write_text(text)
    real = Path

    def fake_path(name):
        return real(tmp_path / "cpuinfo") if name == "/proc/cpuinfo" else real(name)

    monkeypatch.setattr(autocast_choice, "Path", fake_path)
    assert autocast_choice._cpuinfo_flags() == {"fpu", "avx2", "avx512_bf16", "fp", "asimd", "bf16"}


def test_cuda_autocasts_to_fp16_with_a_scaler_and_explicit_choices_are_kept(monkeypatch, no_caps):
    _x86(monkeypatch, False, False)
    cuda = fm.choose_autocast("cuda")
    assert cuda.name == "fp16" and cuda.dtype is torch.float16 and cuda.scaler
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", None)):
        choice = fm.choose_autocast("cpu", name)
        assert (choice.name, choice.dtype, choice.reason) == (name, dtype, f"{name} was asked for")


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match=r"precision='fp8' is not one of 'auto', 'fp16'"):
        fm.choose_autocast("cpu", "fp8")


def _load(name):
    if str(EXAMPLES) not in sys.path:  # as when run as a script: its helpers beside it
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "fp32")])
def test_the_checkpointed_example_follows_the_probe(monkeypatch, no_caps, native, expected):
    """``examples/checkpointed_maml.py --precision auto`` (its default) on a CPU: bf16 with the
    instructions, float32 without; its autocast context says the same."""
    _x86(monkeypatch, native, False)
    example = _load("checkpointed_maml")
    args = example.parser().parse_args(["--device", "cpu", "--modules", "2", "--adapt", "1"])
    assert args.precision == "auto"
    choice = example.precision_of(args)
    assert choice.name == expected
    setup = example.build(args)
    assert setup.scaler is None
    with setup.autocast:
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype is (torch.bfloat16 if native else torch.float32)


def test_the_checkpointed_example_prints_its_choice(monkeypatch, no_caps, capsys):
    _x86(monkeypatch, False, False)
    example = _load("checkpointed_maml")
    argv = ["--device", "cpu", "--modules", "2", "--adapt", "1", "--width", "8", "--rows", "4"]
    argv += [
        "--tasks",
        "2",
        "--iterations",
        "2",
        "--no-measure",
        "--window",
        "1",
        "--min-fall",
        "-100",
    ]
    example.main(argv)
    out = capsys.readouterr().out
    assert "precision: fp32 (the processor has neither AVX-512 BF16 nor AMX" in out
    assert "fp32 on cpu" in out


@pytest.mark.parametrize(
    ("native", "flag", "expected"),
    [(True, None, True), (False, None, False), (False, "--bf16", True), (True, "--no-bf16", False)],
)
def test_the_lora_example_follows_the_probe(monkeypatch, no_caps, native, flag, expected):
    _x86(monkeypatch, native, False)
    example = _load("lora_maml")
    args = example.parser().parse_args([] if flag is None else [flag])
    assert (example.precision_of(args).name == "bf16") == expected


def test_the_probe_answers_on_this_machine():
    """The real probe (no mocks) gives a bool and a reason on whatever runs the suite."""
    native, reason = autocast_choice._probe()
    assert isinstance(native, bool) and reason
    assert fm.choose_autocast("cpu").name == ("bf16" if native else "fp32")
