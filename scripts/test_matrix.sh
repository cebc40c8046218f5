#!/usr/bin/env bash
# Run the test suite on each torch version given, each in its own virtual environment under
# .matrix/ (kept between runs, so a second run installs nothing new).
#   scripts/test_matrix.sh 2.5.1 2.9.1 2.15.0
#   MATRIX_PYTEST="-m 'not slow' tests/core" scripts/test_matrix.sh 2.11.0
#   MATRIX_INSTALL_ONLY=1 scripts/test_matrix.sh 2.6.0 2.7.1
#   MATRIX_JUNIT=floors.xml: the junit file's name (a subset's run keeps the whole suite's)
#
# A constraint file (.matrix/torch-VERSION/constraints.txt, `torch==VERSION`) pins torch through
# every install, so that no other requirement (peft's accelerate, say) can move it; a site-wide
# constraint that caps torch is replaced by it. The run fails when the environment's torch is not
# the one asked for, and writes .matrix/torch-VERSION/junit.xml and capabilities.json (what
# fm.torch_capabilities() says there) for scripts/torch_matrix.py (docs/torch-versions.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# each environment keeps what it installed; pip's cache would hold every wheel a second time
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
PYTEST_ARGS=${MATRIX_PYTEST:-"-m 'not slow'"}
WORKERS=${TEST_WORKERS:-auto}
[ "$#" -gt 0 ] || { echo "usage: $0 TORCH_VERSION..." >&2; exit 2; }
summary=()
for version in "$@"; do
    env=".matrix/torch-$version"
    echo "== torch $version ($env)"
    [ -x "$env/bin/python" ] || "$PYTHON" -m venv "$env"
    constraints="$PWD/$env/constraints.txt"
    echo "torch==$version" >"$constraints"
    # transformers 5 needs torch >= 2.6 (it disables its PyTorch models below that)
    if [ "$(printf '%s\n' "$version" 2.6 | sort -V | head -n1)" != 2.6 ]; then
        echo "transformers>=4.45,<5" >>"$constraints"
    fi
    # the venv's own setuptools (65 on Python 3.11) builds no wheel without the wheel package;
    # asked for with torch, which caps it on some releases
    PIP_CONSTRAINT="$constraints" "$env/bin/python" -m pip install -q "torch==$version" \
        "setuptools>=70.1"
    PIP_CONSTRAINT="$constraints" "$env/bin/python" -m pip install -q -e ".[dev]"
    installed=$("$env/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
    if [ "$installed" != "$version" ]; then
        echo "torch $version was asked for, but $env holds torch $installed" >&2
        summary+=("torch $version: the environment holds torch $installed")
        failed=1
        continue
    fi
    # the commit whose code ran (with "+" where the tree had changes), for the table
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    git diff --quiet HEAD 2>/dev/null || commit="$commit+"
    COMMIT=$commit "$env/bin/python" -c "import json, os, torch, funcmeta as fm; print(json.dumps({
        'torch': torch.__version__.split('+')[0], 'commit': os.environ['COMMIT'],
        'capabilities': fm.torch_capabilities()}))" >"$env/capabilities.json"
    [ -z "${MATRIX_INSTALL_ONLY:-}" ] || { summary+=("torch $installed: installed"); continue; }
    junit="$env/${MATRIX_JUNIT:-junit.xml}"
    rm -f "$junit"
    set +e
    eval "\"$env/bin/python\" -m pytest -q -p no:cacheprovider -n $WORKERS --dist loadgroup \
        --junitxml=\"$junit\" $PYTEST_ARGS"
    status=$?
    set -e
    # pytest's "no tests ran" (5) is a failure here too: a subset must select tests
    summary+=("torch $installed: exit $status")
    [ "$status" -eq 0 ] || failed=1
done
printf '%s\n' "${summary[@]}"
[ -z "${failed:-}" ]
