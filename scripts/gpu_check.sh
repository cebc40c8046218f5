#!/usr/bin/env bash
# `make gpu-check`: the CUDA tests and the CUDA benchmarks on one GPU, each section judged
# against its target (PASS or FAIL), then a table of the sections; all of it also goes to
# benchmarks/out/gpu_check.md (GPU_CHECK_REPORT). Installs nothing that needs a network:
# optree, if missing, comes from a wheel in .wheels/ (CONTRIBUTING.md: "A GPU check"). Without a CUDA
# device it says so and exits 0.
#
# The sections with a target run first, each under its own time limit (their limits add up to
# 500 s), then the sections without one; the whole check stays within GPU_CHECK_BUDGET seconds
# (default 540). A section that would start with under 30 s of the budget left is NOT RUN, and
# one that runs past its limit is stopped: FAIL, "over its limit". The verdicts come from
# scripts/gpu_judge.py (tested on a CPU in benchmarks/tests/test_gpu_judge.py): the CUDA tests
# by pytest's exit status (0 with a test passed; 5, no tests, is FAIL), every other target by
# its script's exit status and last line, `RESULT PASS|FAIL|SKIP (why) ...`. The check exits 1
# when a section with a target did not pass (FAIL, SKIP or NOT RUN), else 0.
#
# GPU_CHECK_ONLY="tests compiled" runs only the sections with one of the named keys (keys:
# tests scenario tf32 compiled sinusoid conv4 sharded memory tasks peers sequence).
# ("compiled memory" is the compiled step on checkpointed layers, keys compiled and memory.)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-540}
ONLY=${GPU_CHECK_ONLY:-}
out=${GPU_CHECK_REPORT:-benchmarks/out/gpu_check.md}
RESERVE=15 # seconds kept back from every section: timeout's grace period and the table
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check: no CUDA device here (or no torch); nothing to check"
    exit 0
fi
if ! $PYTHON -c "import optree" 2>/dev/null; then
    $PYTHON -m pip install -q --no-index --find-links .wheels optree || {
        echo "gpu-check: optree is not installed and .wheels/ has no wheel for it (CONTRIBUTING.md: A GPU check)"
        exit 1
    }
fi

mkdir -p "$(dirname "$out")"
: >"$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
records=$work/records.jsonl
: >"$records"
say() { echo "$@" | tee -a "$out"; }
judge() { $PYTHON scripts/gpu_judge.py judge --records "$records" "$@" | tee -a "$out"; }

# section KEYS NAME LIMIT KIND TARGET TITLE COMMAND...: run COMMAND under LIMIT seconds (less
# where the budget has less left), its output into the report, and judge it. KIND is tests,
# result (the command prints a RESULT line) or none; TARGET is the table's text, "" for none.
section() {
    local keys=$1 name=$2 limit=$3 kind=$4 target=$5 title=$6
    shift 6
    if [ -n "$ONLY" ]; then
        local key picked=0
        for key in $keys; do
            [[ " $ONLY " == *" $key "* ]] && picked=1
        done
        [ "$picked" -eq 1 ] || return 0
    fi
    say
    say "## $title"
    [ -n "$target" ] && say "Target: $target"
    local left=$((BUDGET - SECONDS - RESERVE))
    if [ "$left" -lt 30 ]; then
        judge --name "$name" --kind "$kind" --target "$target" \
            --not-run "the check's budget of ${BUDGET} s is spent"
        return 0
    fi
    local by_budget=()
    if [ "$limit" -gt "$left" ]; then
        limit=$left
        by_budget=(--by-budget)
    fi
    local log=$work/section.log
    : >"$log"
    say '```'
    say "\$ $* (limit ${limit} s)"
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | grep --line-buffered -v -e Warning -e warnings.warn |
        tee -a "$out" "$log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - started))
    say '```'
    say "(exit status $rc, $took s)"
    judge --name "$name" --kind "$kind" --target "$target" --log "$log" --rc "$rc" \
        --seconds "$took" --limit "$limit" "${by_budget[@]}"
}

say "# GPU check: $($PYTHON -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'), Python $($PYTHON -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d)"

# the sections with a target: their limits add up to 500 s of the 540
section tests "CUDA tests" 90 tests "pytest -m cuda exits 0, a test passed" "CUDA tests" \
    $PYTHON -m pytest -q -p no:cacheprovider -m cuda tests
section scenario "scenario" 80 result "query loss falls; memory <= 0.4x, time <= 2.5x unchecked" \
    "The motivating scenario: 40 self-checkpointed blocks of width 768, 4096 rows, fp16 + GradScaler" \
    $PYTHON examples/checkpointed_maml.py --device cuda --width 768 --rows 4096 --iterations 10 \
    --repeats 3 --max-memory-ratio 0.4 --max-time-ratio 2.5
section tf32 "TF32" 40 result "fm.exact_float32 error vs float64 <= 1e-3 (loop and batched)" \
    "TF32 and second order" $PYTHON benchmarks/checks/tf32.py --tasks 8 --steps 5 --max-exact-error 1e-3
section "compiled sinusoid" "compiled sinusoid" 80 result "compiled <= 1.5x JAX's time" \
    "The compiled meta-step, sinusoid: against adapt_tasks and JAX on the GPU (where jax[cuda] is installed)" \
    $PYTHON benchmarks/speed/compiled.py --device cuda --workloads sinusoid --tasks 32 --steps 5 \
    --repeats 50 --no-loop --task-chunk 0 --max-jax-ratio 1.5
section "compiled conv4" "compiled conv4" 150 result "first call (compile) <= 120 s; compiled <= JAX's time" \
    "The compiled meta-step, conv4" \
    $PYTHON benchmarks/speed/compiled.py --device cuda --workloads conv4 --tasks 32 --steps 5 \
    --repeats 20 --no-loop --task-chunk 0 --max-jax-ratio 1.0 --max-compile-seconds 120
section sharded "sharded" 60 result "adapted query loss falls; a rank's shards and gathered bytes bounded" \
    "The sharded decoder on one NCCL rank (the mesh on CUDA; more than one GPU is untested here)" \
    $PYTHON -m torch.distributed.run --standalone --nproc-per-node 1 examples/sharded_maml.py \
    --backend nccl --iterations 20 --check

# the sections without one, as far as the budget goes
section memory "memory" 120 none "" \
    "Per-layer checkpointing: funcmeta's layers and the model's own checkpoints (residual MLP, 5 steps)" \
    $PYTHON benchmarks/memory/memory.py --device cuda --workloads residual --steps 5 --repeats 3 \
    --plot benchmarks/out/memory_cuda.png
section "compiled memory" "compiled checkpointed" 150 none "" \
    "The compiled step on checkpointed layers (16 residual blocks of width 256, 512 rows, 5 steps): eager, checkpointed, compiled, both" \
    $PYTHON benchmarks/memory/compiled_checkpoint.py --device cuda --repeats 5
section tasks "tasks" 120 none "" "Task batching against the loop" \
    $PYTHON benchmarks/speed/tasks.py --device cuda --repeats 5 --meta-batch 32 --skip-memory
section peers "peers" 120 none "" "Task batching against the peers" \
    $PYTHON benchmarks/peers/peers.py --device cuda --repeats 5
section sequence "sequence" 180 none "" "Sequence models" \
    $PYTHON benchmarks/speed/sequence_tasks.py --device cuda \
    --models bert gpt2 llama lstm gru --tasks 16 --repeats 3 --no-tune

say
say "## Summary (${SECONDS} s of ${BUDGET})"
say
$PYTHON scripts/gpu_judge.py table --records "$records" | tee -a "$out"
status=${PIPESTATUS[0]}
echo
echo "gpu-check: report in $out"
exit "$status"
