#!/usr/bin/env bash
# `make gpu-check`: every CUDA test and the CUDA benchmarks on one GPU, then the tables for
# benchmarks/RESULTS.md (also written to benchmarks/out/gpu_check.md). Installs nothing that
# needs a network: optree, if missing, comes from a wheel in .wheels/ (README: "A GPU check").
# Without a CUDA device it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check: no CUDA device here (or no torch); nothing to check"
    exit 0
fi
if ! $PYTHON -c "import optree" 2>/dev/null; then
    $PYTHON -m pip install -q --no-index --find-links .wheels optree || {
        echo "gpu-check: optree is not installed and .wheels/ has no wheel for it (README: A GPU check)"
        exit 1
    }
fi

out=benchmarks/out/gpu_check.md
mkdir -p benchmarks/out
status=0
run() {  # a titled section: the command's output, into the report
    local title=$1
    shift
    echo
    echo "## $title"
    echo '```'
    echo "\$ $*"
    "$@" 2>&1 | grep -v -e Warning -e warnings.warn
    local rc=${PIPESTATUS[0]}
    echo '```'
    [ "$rc" -eq 0 ] || { echo "(exit status $rc)"; status=1; }
}

{
    echo "# GPU check: $($PYTHON -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'), Python $($PYTHON -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d)"
    run "CUDA tests" $PYTHON -m pytest -q -p no:cacheprovider -m cuda tests
    run "The motivating scenario: 40 self-checkpointed blocks of width 768, 4096 rows, fp16 + GradScaler" \
        $PYTHON examples/checkpointed_maml.py --device cuda --width 768 --rows 4096 --iterations 10 --repeats 3
    run "Per-layer checkpointing: funcmeta's layers and the model's own checkpoints (residual MLP, 5 steps)" \
        $PYTHON benchmarks/memory.py --device cuda --workloads residual --steps 5 --repeats 3 \
        --plot benchmarks/out/memory_cuda.png
    run "TF32 and second order" $PYTHON benchmarks/tf32.py --tasks 8 --steps 5
    run "The compiled meta-step against adapt_tasks and JAX on the GPU (where jax[cuda] is installed)" \
        $PYTHON benchmarks/compiled.py --device cuda --repeats 20
    run "Task batching against the loop" $PYTHON benchmarks/tasks.py --device cuda --repeats 5 \
        --meta-batch 32 --skip-memory
    run "Task batching against the peers" bash -c "cd benchmarks && $PYTHON peers.py --device cuda --repeats 5"
    run "Sequence models" bash -c "cd benchmarks && $PYTHON sequence_tasks.py --device cuda \
        --models bert gpt2 llama lstm gru --tasks 16 --repeats 3 --no-tune"
} | tee "$out"
# the status of the last section's pipeline is lost in the braces' subshell: read it back
grep -q "(exit status" "$out" && status=1
echo
echo "gpu-check: report in $out"
exit $status
