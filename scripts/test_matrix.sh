#!/usr/bin/env bash
# Run the test suite on each torch version given, each in its own virtual environment under
# .matrix/ (kept between runs, so a second run installs nothing new).
#   scripts/test_matrix.sh 2.5.0 2.15.0
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ "$#" -gt 0 ] || { echo "usage: $0 TORCH_VERSION..." >&2; exit 2; }
summary=()
for version in "$@"; do
    env=".matrix/torch-$version"
    echo "== torch $version ($env)"
    [ -x "$env/bin/python" ] || "$PYTHON" -m venv "$env"
    extra=()
    # transformers 5 needs torch >= 2.6 (it disables its PyTorch models below that)
    if [ "$(printf '%s\n' "$version" 2.6 | sort -V | head -n1)" != 2.6 ]; then
        extra=("transformers>=4.45,<5")
    fi
    # an explicit version: a site-wide pip constraint that caps torch must not apply to it,
    # nor downgrade it when the package's own requirements are resolved
    PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install -q "torch==$version"
    PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install -q -e ".[dev]" "${extra[@]}"
    installed=$("$env/bin/python" -c "import torch; print(torch.__version__)")
    set +e
    "$env/bin/python" -m pytest -q -p no:cacheprovider
    status=$?
    set -e
    summary+=("torch $installed: exit $status")
    [ "$status" -eq 0 ] || failed=1
done
printf '%s\n' "${summary[@]}"
[ -z "${failed:-}" ]
