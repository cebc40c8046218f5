"""Test configuration: the folders mirror funcmeta's packages (``tests/core``, ``tests/batching``,
..., and ``tests/integration`` for end-to-end checks) and share ``helpers.py`` and ``zoo.py``
here; tests marked ``cuda`` skip cleanly where no CUDA device exists, and
run without TF32 where one does: they compare float32 results against references, and
cuDNN's default TF32 convolutions and RNNs round far beyond float32 (second order amplifies
it; docs/memory.md, "TF32 and second order")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import funcmeta as fm

# the shared helpers (helpers.py, zoo.py) sit here, above the test folders
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import report_refusals

# Under pytest-xdist (make test runs one worker per core) each worker computes on one thread:
# workers with several intra-op threads each would oversubscribe the cores, and a thread pool
# that waits for a descheduled thread slows every operation many times over on a shared machine.
# The processes a test starts (an example, a benchmark, gloo ranks) inherit one thread as well:
# on two shared cores a process with two threads waits at every parallel region.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = os.environ.get("FUNCMETA_TEST_THREADS", "1")
    torch.set_num_threads(int(_threads))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)


# a refusal of a capability this torch lacks is reported as skipped (helpers.report_refusals)
pytest_runtest_makereport = pytest.hookimpl(hookwrapper=True)(report_refusals)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _threads_restored():
    """An example's main sets torch's thread count (--threads): the next test in this process
    gets the count back."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _exact_float32_on_cuda(request):
    if request.node.get_closest_marker("cuda") is None or not torch.cuda.is_available():
        yield
        return
    with fm.exact_float32():
        yield
