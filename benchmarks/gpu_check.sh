#!/usr/bin/env bash
# The GPU checks, in order, for the day a CUDA machine is at hand (under 10 minutes on one GPU):
#   1. every test marked gpu (Triton kernels against their references in bf16, the engine on CUDA,
#      pinned-memory moves on the copy stream);
#   2. the whole test suite through the Triton kernels on CUDA;
#   3. benchmarks/bench_kernels_gpu.py (decode-attention bandwidth, block copies, engine decode rates).
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   (logs go to OUT_DIR, default benchmarks/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
status=0
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
"$py" -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.log" || status=1
TIEREDKV_ATTENTION_BACKEND=triton "$py" -m pytest -q -x tests/test_engine_matches_hf.py tests/test_kernels.py \
    tests/test_data_path.py 2>&1 | tee "$out/triton_tests.log" || status=1
"$py" benchmarks/bench_kernels_gpu.py 2>&1 | tee "$out/bench_kernels_gpu.log" || status=1
exit $status
