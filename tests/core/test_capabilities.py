"""Each capability either runs on the installed torch or refuses at the call that would use
it, naming the capability, the torch installed and the torch it needs; a private access a
capability needs that the running torch lacks (a fence probe that says no) refuses it too.

On a torch below a floor (``make test-matrix`` on 2.5.1) the refusals here are the real
ones; on newer torch the same calls run, and the refusals are shown with the running
torch's version or a probe replaced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcmeta as fm
from funcmeta._src.core import capabilities
from funcmeta._src.core.capabilities import CAPABILITIES, missing, torch_release
from funcmeta._src.core.fence import ACCESSES

HOOKS_QUERY = "torch._C._autograd._top_saved_tensors_default_hooks"


def _steps_call(**options):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    fmodel = fm.functional_model(net)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    result = fm.adapt(
        fmodel, fmodel.params, F.mse_loss, (x, y), fm.optim.sgd(lr=0.1), steps=2, **options
    )
    F.mse_loss(fmodel(result.params, x), y).backward()
    return [p.grad for p in net.parameters()]


def test_torch_release_reads_major_and_minor():
    assert torch_release("2.11.0+cu130") == (2, 11)
    assert torch_release("2.5.1") == (2, 5)
    assert torch_release("3.0.0a0+git1234") == (3, 0)
    with pytest.raises(ValueError, match="cannot read a torch release"):
        torch_release("nightly")


def test_the_core_floor_is_the_package_floor():
    """pyproject.toml's ``torch>=`` is the floor of the core (the inner loops), and no
    capability's floor lies below it."""
    from test_torch_version import _claimed, _version

    claimed = _version(_claimed().split(">=")[1])[:2]
    assert CAPABILITIES["inner loops"].floor == claimed
    assert all(c.floor >= claimed for c in CAPABILITIES.values())


@pytest.mark.parametrize("name", sorted(CAPABILITIES))
def test_below_a_floor_the_reason_names_capability_installed_and_needed(name):
    floor = CAPABILITIES[name].floor
    if floor == CAPABILITIES["inner loops"].floor:
        assert missing(name, f"{floor[0]}.{floor[1]}.0") is None
        return
    older = f"{floor[0]}.{floor[1] - 1}.0+cpu"
    why = missing(name, older)
    assert why == f"{name} needs torch >= {floor[0]}.{floor[1]}, and torch {older} is installed"


def test_checkpoint_steps_runs_or_refuses_on_the_running_torch():
    """On 2.5 to 2.7 (no query of the saved-tensor hooks in force) a step checkpoint could
    not refuse a forward that writes a saved tensor in place: it refuses itself, by name.
    From 2.8 on it runs and gives the plain run's meta-gradients."""
    why = missing("checkpoint_steps")
    if why is not None:
        with pytest.raises(fm.UnsupportedTorchError) as raised:
            _steps_call(checkpoint_steps=True)
        message = str(raised.value)
        assert message.startswith("checkpoint_steps=True: checkpoint_steps needs ")
        assert torch.__version__ in message and "torch>=2.8" in message
        return
    for a, b in zip(_steps_call(checkpoint_steps=True), _steps_call(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_missing_private_access_refuses_its_capability(monkeypatch):
    """The fence's probe acts: where the query of the saved-tensor hooks is missing, a step
    checkpoint refuses (naming the access), whatever the torch release says."""
    assert HOOKS_QUERY in ACCESSES
    monkeypatch.setitem(ACCESSES, HOOKS_QUERY, lambda: False)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    with pytest.raises(fm.UnsupportedTorchError, match=r"which torch 2\.13\.0 lacks") as raised:
        fm.AdaptOptions(checkpoint_steps=True)
    assert HOOKS_QUERY in str(raised.value)
    # the other options do not need it
    fm.AdaptOptions(first_order=True)


def test_an_older_torch_refuses_at_the_call(monkeypatch):
    """The refusal comes from the call that would use the capability (and only that one)."""
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    with pytest.raises(fm.UnsupportedTorchError, match=r"torch 2\.6\.0\+cu124 is installed"):
        _steps_call(checkpoint_steps=True)
    _steps_call()  # the plain inner loop runs
    with pytest.raises(fm.UnsupportedTorchError, match=r"sharded models needs torch >= 2\.11"):
        fm.distributed.shard_model(nn.Linear(2, 2), None)


def test_shard_model_refuses_below_its_floor_before_reading_its_arguments():
    if missing("sharded models") is None:
        with pytest.raises(TypeError, match=r"shard_model takes an nn\.Module"):
            fm.distributed.shard_model("no module", None)
        return
    with pytest.raises(fm.UnsupportedTorchError, match=r"fm\.distributed\.shard_model: sharded"):
        fm.distributed.shard_model("no module", None)


def test_torch_capabilities_lists_every_capability():
    found = fm.torch_capabilities()
    assert list(found) == list(CAPABILITIES)
    assert found["inner loops"] is None
    assert all(v is None or v.startswith(k) for k, v in found.items())
    assert capabilities.torch_capabilities is fm.torch_capabilities
