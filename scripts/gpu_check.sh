#!/usr/bin/env bash
# `make gpu-check`: every CUDA test and the CUDA benchmarks on one GPU, then the tables for
# benchmarks/RESULTS.md (also written to benchmarks/out/gpu_check.md). Installs nothing that
# needs a network: optree, if missing, comes from a wheel in .wheels/ (README: "A GPU check").
# Without a CUDA device it says so and exits 0.
#
# The sections run most important first, each under its own time limit, and the whole check
# within GPU_CHECK_BUDGET seconds (default 540): a section that would start after the budget is
# spent is listed as not run, and one that runs past its limit is stopped and marked so; what
# it printed stays in the report. GPU_CHECK_ONLY="tests compiled" runs only the sections whose
# keys are named (keys: tests compiled scenario memory tf32 tasks peers sequence).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-540}
ONLY=${GPU_CHECK_ONLY:-}
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
: >"$out"
failed=0
say() { echo "$@" | tee -a "$out"; }

# run KEY LIMIT TITLE COMMAND...: a titled section, the command's output, into the report
run() {
    local key=$1 limit=$2 title=$3
    shift 3
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $key "* ]]; then
        return
    fi
    say
    say "## $title"
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then
        say "(not run: the check's budget of ${BUDGET} s is spent)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say '```'
    say "\$ $* (limit ${limit} s)"
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | grep -v -e Warning -e warnings.warn | tee -a "$out"
    local rc=${PIPESTATUS[0]}
    say '```'
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "(stopped after ${limit} s: over its limit)"
        failed=1
    elif [ "$rc" -ne 0 ]; then
        say "(exit status $rc)"
        failed=1
    fi
    say "($((SECONDS - started)) s)"
}

say "# GPU check: $($PYTHON -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'), Python $($PYTHON -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d)"
run tests 180 "CUDA tests" $PYTHON -m pytest -q -p no:cacheprovider -m cuda tests
run compiled 120 "The compiled meta-step, sinusoid: against adapt_tasks and JAX on the GPU (where jax[cuda] is installed)" \
    $PYTHON benchmarks/compiled.py --device cuda --workloads sinusoid --tasks 32 --steps 5 --repeats 50
run compiled 240 "The compiled meta-step, conv4" \
    $PYTHON benchmarks/compiled.py --device cuda --workloads conv4 --tasks 32 --steps 5 --repeats 20
run scenario 120 "The motivating scenario: 40 self-checkpointed blocks of width 768, 4096 rows, fp16 + GradScaler" \
    $PYTHON examples/checkpointed_maml.py --device cuda --width 768 --rows 4096 --iterations 10 --repeats 3
run memory 120 "Per-layer checkpointing: funcmeta's layers and the model's own checkpoints (residual MLP, 5 steps)" \
    $PYTHON benchmarks/memory.py --device cuda --workloads residual --steps 5 --repeats 3 \
    --plot benchmarks/out/memory_cuda.png
run tf32 60 "TF32 and second order" $PYTHON benchmarks/tf32.py --tasks 8 --steps 5
run tasks 120 "Task batching against the loop" $PYTHON benchmarks/tasks.py --device cuda --repeats 5 \
    --meta-batch 32 --skip-memory
run peers 120 "Task batching against the peers" bash -c "cd benchmarks && $PYTHON peers.py --device cuda --repeats 5"
run sequence 180 "Sequence models" bash -c "cd benchmarks && $PYTHON sequence_tasks.py --device cuda \
    --models bert gpt2 llama lstm gru --tasks 16 --repeats 3 --no-tune"
echo
echo "gpu-check: report in $out (${SECONDS} s)"
exit $failed
