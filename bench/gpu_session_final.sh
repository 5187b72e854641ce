#!/usr/bin/env bash
# The end-of-session device call: the session's new kernels' tests under Dawn on the H200, the
# side-by-side harness (gates, eager, CUDA graph, memory, compile times), paired rounds against
# eager / torch.compile / CUDA graphs, and the roofline.  From the repo root after
# `source .gpu/env.sh`:
#   bash bench/gpu_session_final.sh OUTDIR        (QUICK=1: tiny configs, a lavapipe dry run)
# Knobs (environment): TESTS (test files run under Dawn), WORKLOADS / GATE_WORKLOADS (harness:
# gates; empty skips), PAIRED_ROUNDS (0 skips the paired rounds), ROOF_WORKLOADS (empty skips), T_* (time limits, s).
set -uo pipefail
out="$1"; mkdir -p "$out"
q=${QUICK:+--quick}
export PYTHONUNBUFFERED=1
tests=${TESTS:-"tests/kernels/test_multi_reduce_chain.py tests/kernels/test_pointwise_vec4.py
  tests/kernels/test_pointwise_step.py tests/compile/test_rewrites_chain.py tests/compile/test_fusion.py
  tests/runtime/test_launch.py tests/kernels/test_conv_staging.py tests/kernels/test_matmul_slices.py
  tests/kernels/test_attention.py"}
if [ -z "$q" ]; then
  # shellcheck disable=SC2086
  MEGANEURA_WEBGPU=dawn timeout "${T_TESTS:-90}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    $tests > "$out/tests.log" 2>&1
  tail -3 "$out/tests.log"
fi
gates=${GATE_WORKLOADS-${WORKLOADS:-whisper,resnet50,unet,smolvla,smollm2}}
if [ -n "$gates" ]; then
  timeout "${T_HARNESS:-240}" python3 bench/harness.py --workloads "$gates" \
    --impls "${IMPL:-dawn}" --warmup 3 --steps "${HARNESS_STEPS:-10}" $q --out "$out/final.json" \
    > "$out/harness.log" 2>&1
  grep -v "^\s*$" "$out/harness.log" | tail -6
fi
if [ "${PAIRED_ROUNDS:-0}" != 0 ]; then
  timeout "${T_PAIRED:-360}" python3 bench/paired.py --workloads "${WORKLOADS:-whisper,resnet50,unet,smolvla,smollm2}" \
    --impl "${IMPL:-dawn}" --rounds "$PAIRED_ROUNDS" ${PAIRED_ARGS:---torch-compile} $q \
    --out "$out/paired.json" > "$out/paired.log" 2>&1
  tail -22 "$out/paired.log"
fi
roof=${ROOF_WORKLOADS-whisper,resnet50,smollm2}
[ -z "$q" ] && [ -n "$roof" ] && timeout "${T_ROOF:-110}" python3 bench/roofline.py "$out/roofline" "$roof" \
  --impl dawn --inference --top 15 2>&1 | tail -8
exit 0
