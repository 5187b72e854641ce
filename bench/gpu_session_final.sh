#!/usr/bin/env bash
# The end-of-session device call (2026-12-01, third session): this session's new kernels' tests
# under Dawn on the H200, the side-by-side harness (gates, eager, CUDA graph, memory, compile
# times) and the roofline of three workloads.  From the repo root after `source .gpu/env.sh`:
#   bash bench/gpu_session_final.sh OUTDIR        (QUICK=1: tiny configs, a lavapipe dry run)
set -uo pipefail
out="$1"; mkdir -p "$out"
q=${QUICK:+--quick}
export PYTHONUNBUFFERED=1
if [ -z "$q" ]; then
  MEGANEURA_WEBGPU=dawn timeout "${T_TESTS:-90}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/kernels/test_multi_reduce_chain.py tests/kernels/test_pointwise_vec4.py \
    tests/kernels/test_pointwise_step.py tests/compile/test_rewrites_chain.py \
    tests/compile/test_fusion.py tests/runtime/test_launch.py tests/kernels/test_conv_staging.py \
    tests/kernels/test_matmul_slices.py tests/kernels/test_attention.py \
    > "$out/tests.log" 2>&1
  tail -3 "$out/tests.log"
fi
timeout "${T_HARNESS:-240}" python3 bench/harness.py --workloads "${WORKLOADS:-whisper,resnet50,unet,smolvla,smollm2}" \
  --impls "${IMPL:-dawn}" --warmup 3 --steps 10 $q --out "$out/final.json" > "$out/harness.log" 2>&1
grep -v "^\s*$" "$out/harness.log" | tail -6
[ -z "$q" ] && timeout "${T_ROOF:-110}" python3 bench/roofline.py "$out/roofline" whisper,resnet50,smollm2 \
  --impl dawn --inference --top 15 2>&1 | tail -8
exit 0
