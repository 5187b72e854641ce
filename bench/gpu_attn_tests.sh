#!/usr/bin/env bash
# The tensor-core attention's tests under Dawn on the GPU machine (issue 12): the fast forward's
# kernel tests, the split forward + combine and the compile-level fast attention tests.
#
#   source .gpu/env.sh; bash bench/gpu_attn_tests.sh OUTDIR
set -uo pipefail
out=${1:?usage: bash bench/gpu_attn_tests.sh OUTDIR}
mkdir -p "$out"
MEGANEURA_WEBGPU=dawn timeout "${T_TESTS:-300}" python3 -m pytest -q -x \
  tests/kernels/test_attention_fast.py tests/kernels/test_attention_split.py \
  tests/compile/test_fast_attention.py tests/kernels/test_attention.py -k "${K_TESTS:-not slow}" \
  > "$out/tests.log" 2>&1
echo "== tests (Dawn)"; tail -3 "$out/tests.log"
