#!/usr/bin/env bash
# The GPU checks, for a CUDA machine (about 10 minutes on one GPU). Every step runs whatever the one before
# it gave, each into its own log, and one summary table comes at the end:
#   install          `make install` when .venv/ is missing (the project, its extras, the default model)
#   gpu_tests        every test marked gpu: the Triton kernels in bf16 against fp32 references (2e-2), the
#                    cascade kernels in bf16, the engine's kernels against its torch references, pinned moves
#   kernel_tests     tests/test_kernels.py and tests/test_cascade.py on the GPU (fp32, 1e-5), the variant set
#   agreement        benchmarks/gpu_agreement.py: the engine vs transformers on the GPU, greedy, default model:
#                    fp32 token-identical; bf16 agreement as a share of tokens
#   kernel_bench     benchmarks/bench_kernels_gpu.py: decode attention's share of HBM bandwidth, copies,
#                    cascade and prefill, the engine's decode rates
#   engine_bench     benchmarks/bench_engine.py --quick: throughput against transformers
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   (logs in OUT_DIR, default benchmarks/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
rows=()
failed=0

step() {  # step NAME COMMAND...: runs it into $out/NAME.log; a row: name, result, seconds, the log's last line
    local name=$1
    shift
    local start=$SECONDS result=pass
    "$@" >"$out/$name.log" 2>&1 || { result=FAIL; failed=1; }
    local last
    last=$(grep -v '^\s*$' "$out/$name.log" | tail -1 | cut -c1-110)
    rows+=("$(printf '| %-14s | %-4s | %5ss | %s' "$name" "$result" "$((SECONDS - start))" "$last")")
    echo "${rows[-1]}"
}

if [ ! -x .venv/bin/python ]; then
    step install make install
fi
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: nothing to check here" >&2
    exit 1
fi
export TRITON_DEFAULT_FP_FUSION=1
step gpu_tests "$py" -m pytest -q -m gpu tests
step kernel_tests "$py" -m pytest -q tests/test_kernels.py tests/test_cascade.py tests/test_kernel_variants.py
step agreement "$py" benchmarks/gpu_agreement.py
step kernel_bench "$py" benchmarks/bench_kernels_gpu.py
step engine_bench "$py" benchmarks/bench_engine.py --quick

echo
echo "| step           | result | time | last line of its log ($out/STEP.log)"
printf '%s\n' "${rows[@]}"
exit $failed
