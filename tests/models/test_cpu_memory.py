"""fm.keep_freed_memory: large tensors stop costing page faults, and results stay the same
(second-order MAML through conv4, and through PyTorch's attention layer and an LSTM).

The setting lasts for the whole process, so each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import funcmeta._src.cpu_memory.glibc as cpu_memory

GLIBC = cpu_memory.why_not_kept() is None

PROBE = r"""
import json, resource, torch, torch.nn.functional as F
import funcmeta as fm

def faults(rounds=4):
    # a 64 MiB tensor, written and freed: above glibc's largest mmap threshold
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        x = torch.empty(16 << 20)
        x.fill_(1.0)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

class Sequence(torch.nn.Module):
    # a classifier over sequences: PyTorch's attention layer, then an LSTM
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0,
                                                          batch_first=True)
        self.lstm = torch.nn.LSTM(16, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.lstm(self.attention(x))[0][:, -1])

def meta_gradients():
    torch.manual_seed(0)
    grads = []
    for net, shape in [(fm.models.conv4(5, hidden=8), (1, 28, 28)), (Sequence(), (12, 16))]:
        fmodel = fm.functional_model(net)
        support = (torch.randn(4, 5, *shape), torch.arange(5).repeat(4, 1))
        query = (torch.randn(4, 5, *shape), torch.arange(5).repeat(4, 1))
        loss = fm.recipes.maml(fmodel, fmodel.params, F.cross_entropy, support, query,
                               steps=2, lr=0.4, task_chunk=None).loss
        grads += torch.autograd.grad(loss, list(fmodel.params.values()))
    return grads

faults()  # warm-up: the interpreter's own first touches
before, grads_before = faults(), meta_gradients()
kept = fm.keep_freed_memory()
again = fm.keep_freed_memory()
faults()  # the first 64 MiB block after the change comes from the heap: fresh pages once
after, grads_after = faults(), meta_gradients()
print(json.dumps({
    "kept": kept, "again": again, "before": before, "after": after,
    "same": len(grads_before) == len(grads_after) > 10
            and all(torch.equal(a, b) for a, b in zip(grads_before, grads_after)),
}))
"""


def probe() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], check=True, capture_output=True, text=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason=f"not applicable here: {cpu_memory.why_not_kept()}")
def test_freed_blocks_are_reused_without_page_faults_and_results_stay_the_same():
    found = probe()
    assert found["kept"] is True and found["again"] is True
    # 4 rounds of 64 MiB: about 65,000 faults of 4 KiB pages with glibc's defaults
    assert found["before"] > 30_000, found
    assert found["after"] < 1_000, found
    assert found["same"], "the meta-gradients changed with the allocator setting"


def test_elsewhere_it_says_why_and_changes_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_memory, "_state", {"kept": False})
    monkeypatch.setattr(cpu_memory.platform, "libc_ver", lambda: ("musl", "1.2"))
    monkeypatch.setattr(cpu_memory.sys, "platform", "linux")
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda *a: calls.append(a))
    assert cpu_memory.why_not_kept() == "the C library is musl, not glibc"
    assert cpu_memory.keep_freed_memory() is False
    assert calls == []  # no allocator was touched
    monkeypatch.setattr(cpu_memory.sys, "platform", "darwin")
    assert "darwin" in cpu_memory.why_not_kept()
    assert cpu_memory.keep_freed_memory() is False
