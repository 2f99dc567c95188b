#!/usr/bin/env bash
# The CUDA path, verified on any machine with a GPU in one command (at most 5 minutes):
#   bash benchmarks/gpu_check.sh
# 1. the CUDA tests (pytest -m cuda: engine, calibration, PK on CUDA equal to the CPU, whole analyses of bf16
#    checkpoints streamed onto the GPU with roles and causal effects equal to the CPU's, each stage's GPU peak);
# 2. bench_scale with --device cuda --types all: whole `headgraph analyze` processes (PK of all 16 types, roles,
#    causal effects on 8 inputs per set and loss effects on 4 of them, a third of the defaults' inputs, embedded
#    store; no report, whose figures are CPU work) on random-init bf16 checkpoints of the TinyLlama-1.1B shape and
#    of the Llama-3-8B shape (32 heads, 8 KV heads, d_model 4096, vocab 128256) in its first SCALE_8B_LAYERS layers
#    (8 unless set; SCALE_8B_LAYERS=32 for the whole model, whose 16 GB of bf16 weights its forward passes hold as
#    stored, and which needs more than this check's budget), each analyze cut at 60 s (its stack printed then):
#    every step's seconds and peak memory, then one table of both;
# 3. the PK benchmark with --device cuda: GPT-2-small shape against TransformerLens, 16 types and the floor
#    (its whole-analyze table is left to step 2); then the large shape (32 layers x 32 heads, d_model 4096,
#    8 KV heads) without TransformerLens, whose per-head SVD loop alone would take minutes there.
# Each step runs under its own limit, cut to what is left of the budget (GPU_CHECK_BUDGET_S, 300 s); a step that
# fails or runs out is reported and the next one still runs. Last, a table of every step: seconds and outcome;
# the exit status is 1 when any step did not pass. Needs headgraph's dependencies installed
# (pip install -e ".[test]"); runs from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${HEADGRAPH_CACHE_DIR:-}" ]; then  # measure the GPU's kernel rates afresh, in a folder removed on exit
    HEADGRAPH_CACHE_DIR="$(mktemp -d)"
    trap 'rm -rf "$HEADGRAPH_CACHE_DIR"' EXIT
fi
export HEADGRAPH_CACHE_DIR
budget=${GPU_CHECK_BUDGET_S:-300}
layers_8b=${SCALE_8B_LAYERS:-8}
start=$SECONDS
status=0
steps=()

python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch ' + torch.__version__ + ' sees no CUDA device')" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND under min(LIMIT_S, what is left of the budget)
    local name=$1 limit=$2 left rc=0 began=$SECONDS outcome=passed
    shift 2
    left=$((budget - (SECONDS - start)))
    if ((left < limit)); then limit=$left; fi
    if ((left < 15)); then
        steps+=("$(printf '  %-64s %6s  %s' "$name" - "not run: the ${budget} s budget is spent")")
        status=1
        return
    fi
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" || rc=$?
    if ((rc == 124)); then outcome="ran out of its ${limit} s"; elif ((rc != 0)); then outcome="failed (exit $rc)"; fi
    if ((rc != 0)); then status=1; fi
    steps+=("$(printf '  %-64s %4d s  %s' "$name" $((SECONDS - began)) "$outcome")")
}

step "CUDA tests" 60 \
    python3 -m pytest -m cuda -q -rs -p no:cacheprovider \
    tests/test_pk.py tests/test_calibration.py tests/test_analyze.py tests/test_workflow.py
step "bench_scale: TinyLlama-1.1B, Llama-3-8B (${layers_8b} of 32 layers), --types all, CUDA" 125 \
    python3 benchmarks/bench_scale.py --device cuda --types all --max-memory 16GiB --no-report --timeout 60 \
    --causal-n 8 --causal-loss-inputs 4 \
    --shape tinyllama-1.1b --shape "llama3-8b:${layers_8b}"
step "bench_pk: GPT-2 small vs TransformerLens, 16 types, floor, CUDA" 45 \
    python3 benchmarks/bench_pk.py --device cuda --only gpt2 --repeat 3 --skip-analyze --scipy-pairs 30
step "bench_pk: large shape (32 layers), CUDA" 70 \
    python3 benchmarks/bench_pk.py --device cuda --only large --repeat 1 --skip-tl --max-memory 16GiB --scipy-pairs 12

echo "== gpu_check: $((SECONDS - start)) s of a ${budget} s budget"
printf '%s\n' "${steps[@]}"
exit "$status"
