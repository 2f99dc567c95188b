#!/usr/bin/env bash
# The CUDA path, verified on any machine with a GPU in one command (at most 5 minutes):
#   bash benchmarks/gpu_check.sh
# 1. the CUDA tests (pytest -m cuda: engine, calibration and a whole analyze on CUDA equal to the CPU);
# 2. the PK benchmark with --device cuda: GPT-2-small shape against TransformerLens, 16 types, the floor, and
#    whole `headgraph analyze` processes on CUDA; then the large shape (32 layers x 32 heads, d_model 4096,
#    8 KV heads) without TransformerLens, whose per-head SVD loop alone would take minutes there.
# Needs headgraph's dependencies installed (pip install -e ".[test]"); runs from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HEADGRAPH_CACHE_DIR="${HEADGRAPH_CACHE_DIR:-$(mktemp -d)}"  # measure the GPU's kernel rates afresh
start=$SECONDS

python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch ' + torch.__version__ + ' sees no CUDA device')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== CUDA tests"
timeout 90 python3 -m pytest -m cuda -q -rs -p no:cacheprovider tests/test_pk.py tests/test_calibration.py tests/test_analyze.py

echo "== benchmark, GPT-2 small, CUDA"
timeout 120 python3 benchmarks/bench_pk.py --device cuda --only gpt2 --repeat 3 --analyze-repeat 1

echo "== benchmark, large shape, CUDA"
timeout 75 python3 benchmarks/bench_pk.py --device cuda --only large --repeat 1 --skip-tl --max-memory 16GiB

echo "gpu_check: done in $((SECONDS - start)) s"
