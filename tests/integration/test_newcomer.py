"""A fresh clone on a CPU-only machine, following the README: the core install brings numpy
(torch warns at import without it), ``.venv`` stays out of git, the README's Install section
clones and names the CPU-only torch, ``import funcmeta`` warns of nothing, and
``examples/sinusoid.py`` draws its progress bar only on a terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
# the smallest sinusoid run: one shot setting, two iterations, two held-out tasks
SINUSOID = ["--iterations", "2", "--shots", "5", "--eval-tasks", "2"]


def core_dependencies() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    return re.findall(r'"([A-Za-z0-9_.-]+)', deps)


def install_section() -> str:
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Install\n(.*?)(?=^## )", readme, re.M | re.S)
    assert section is not None, "the README has no Install section"
    return section.group(1)


def test_the_core_install_brings_numpy():
    assert "numpy" in core_dependencies()


def test_git_ignores_the_virtual_environment():
    lines = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert lines & {".venv", ".venv/", "/.venv", "/.venv/"}, ".gitignore does not ignore .venv"


def test_the_install_section_clones_and_names_the_cpu_only_torch():
    section = install_section()
    assert re.search(r"^git clone \S+ funcmeta$", section, re.M), "no git clone line"
    assert CPU_TORCH in section
    assert section.index(CPU_TORCH) < section.index("pip install -e .", section.index(CPU_TORCH))


def test_importing_funcmeta_warns_of_nothing():
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", "import funcmeta"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == ""


def run_sinusoid(tmp_path: Path, **streams) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / "examples" / "sinusoid.py"), *SINUSOID]
    argv += ["--plot", str(tmp_path / "s.png")]
    return subprocess.run(argv, cwd=tmp_path, timeout=120, **streams)


def test_sinusoid_draws_no_progress_bar_into_a_pipe(tmp_path):
    pytest.importorskip("tqdm", reason="tqdm is not installed: pip install -e '.[examples]'")
    done = run_sinusoid(tmp_path, capture_output=True)  # bytes: text mode reads \r as \n
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, err[-2000:]
    assert "\r" not in err and "\r" not in out, repr(err[-500:])
    assert re.search(r"^took \d+ s$", out, re.M), out


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_sinusoid_draws_its_bar_on_a_terminal_and_its_time_on_a_line_of_its_own(tmp_path):
    pytest.importorskip("tqdm", reason="tqdm is not installed: pip install -e '.[examples]'")
    import fcntl
    import struct
    import termios

    controller, terminal = os.openpty()
    # 24 rows of 100 columns: a terminal of no size gets a bar of no width
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def read() -> None:  # drains the terminal, so that a full buffer cannot stall the run
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the run has ended and closed its side
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        done = run_sinusoid(tmp_path, stdout=terminal, stderr=terminal)
    finally:
        os.close(terminal)
        reader.join(timeout=30)
        os.close(controller)
    text = b"".join(chunks).decode(errors="replace")
    assert done.returncode == 0, text[-2000:]
    assert "MAML  5-shot:" in text, text[-2000:]  # the bar
    took = re.search(r"took \d+ s", text)
    assert took is not None, text[-2000:]
    assert took.start() == 0 or text[took.start() - 1] in "\r\n", repr(text[: took.end()][-200:])


def test_ci_runs_the_fast_and_the_slow_tests_and_each_half_selects_tests():
    """make test leaves out the tests marked slow, make test-slow runs exactly those, and
    .ci/run runs both: CI runs every test, and neither half is empty (pytest's exit code 5)."""
    make = (ROOT / "Makefile").read_text()
    ci = (ROOT / ".ci" / "run").read_text().split()
    assert '-m "not slow"' in make.split("\ntest:")[1].split("\n\n")[0]
    assert "-m slow" in make.split("\ntest-slow:")[1].split("\n\n")[0]
    assert ci.index("test") < ci.index("test-slow") and ci[ci.index("test") - 1] == "make"
    for marker in ("slow", "not slow"):
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, "tests/inner"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        last = run.stdout.splitlines()[-1]
        assert run.returncode == 0 and re.match(r"[1-9]\d*/\d+ tests collected", last), last
