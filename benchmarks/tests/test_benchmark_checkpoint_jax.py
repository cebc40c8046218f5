"""``benchmarks/peers/checkpoint_jax.py`` runs end to end on a tiny residual stack: every funcmeta
way gives the plain run's meta-gradient checkpointed, and the table and the ratios line come
out (JAX is left out: the suite does not install it; peak memory too, each way's fresh
process costs seconds, and the workers measure with ``benchmarks/_common.py``'s ``measure``, which ``benchmarks/memory/memory.py`` uses too)."""

from __future__ import annotations

import re
import subprocess
import sys

from bench_scripts import script

from funcmeta._src.core.capabilities import missing

SCRIPT = script("peers/checkpoint_jax.py")


def test_the_benchmark_runs_and_each_checkpointed_way_matches_its_plain_one():
    args = ["--width", "16", "--depth", "3", "--rows", "8", "--steps", "2", "--repeats", "1"]
    # checkpoint_steps refuses below its floor (tests/core/test_capabilities.py): left out there
    ways = ["second", "takeover", "first", "tasks"]
    ways += ["steps"] if missing("checkpoint_steps") is None else []
    args += ["--ways", *ways, "--no-pin", "--no-memory"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    agree = dict(re.findall(r"^(\w+): checkpointed meta-gradient against plain: (\S+)", out, re.M))
    assert set(agree) == set(ways), out
    assert all(float(v) < 1e-5 for v in agree.values()), agree
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[2:] == ways, out
    assert "takeover / checkpoint_layers (checkpointed times)" in out
    assert re.search(r"per-layer (-|\d+\.\d\d)x memory, \d+\.\d\dx time", out), out
