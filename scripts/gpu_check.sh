#!/usr/bin/env bash
# The GPU check, one command for a lent CUDA machine (budget: under 5 minutes on one H100/H200):
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]        # default: $OUT if set, else ./gpu_results
#
# 1. the GPU tests without the Triton interpreter: tests/kernels/test_gpu.py (fused kernel against the
#    PyTorch chunk path, values and gradients, float32/float16/bfloat16 inputs with float32
#    accumulation, ragged T; CUDA autocast for linear_attention, the decay family and a hybrid
#    TransformerLM) and tests/kernels/test_triton.py (the kernel against its twin, compiled);
# 2. python -m linattn.bench on CUDA against SDPA (FlashAttention), float16 and float32,
#    T = 1024 ... 65536, H = 8, D = 64;
# 3. if fla-core is importable (carried as a wheel in .whl/, installed below), linattn against
#    flash-linear-attention's chunk_linear_attn, chunk_gla and chunk_gated_delta_rule, one shape each.
#
# Rehearsal on a CPU (how it was tested without a GPU): LINATTN_GPU_REHEARSAL=1 bash scripts/gpu_check.sh
# runs step 1 under TRITON_INTERPRET=1 with small shapes, step 2 on the CPU with tiny sizes.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-gpu_results}}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
if [ "${LINATTN_GPU_REHEARSAL:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  DEV=(--device cpu --seq-lens 64 200 --heads 2 --head-dim 16 --repeats 2)
else
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.cuda.get_device_name(), torch.__version__)" || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  DEV=(--device cuda --seq-lens 1024 4096 16384 65536 --heads 8 --head-dim 64 --repeats 5 --warmup 2)
fi
echo "== 1. GPU tests"
"$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/kernels/test_gpu.py tests/kernels/test_triton.py \
  2>&1 | tee "$RESULTS/tests.log" || status=1
echo "== 2. benchmark against SDPA ($(( $(date +%s) - start )) s so far)"
for dtype in float16 float32; do
  "$PY" -m linattn.bench "${DEV[@]}" --dtype "$dtype" --methods sdpa baseline_chunk chunk fused \
    --reference fused --no-progress --json "$RESULTS/bench_$dtype.json" 2>&1 | tee "$RESULTS/bench_$dtype.txt" || status=1
done
echo "== 3. flash-linear-attention peers ($(( $(date +%s) - start )) s so far)"
"$PY" scripts/gpu_peers.py --json "$RESULTS/fla_peers.json" 2>&1 | tee "$RESULTS/fla_peers.txt" || status=1
echo "== done in $(( $(date +%s) - start )) s, status $status"
exit $status
