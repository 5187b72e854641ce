#!/usr/bin/env bash
# Packed f16 staging through WGSL buffer views (kernels/common.BUFFER_VIEW_FEATURE) in one
# device call: the probe, the tensor-core matmul with packed staging on and off
# (bench/matmul_bench.py --packed-ab), the tensor-core attention forward likewise
# (attention_bench --fast-ab main,unpacked), Whisper-tiny's fast step (--fast-e2e) and the
# tensor-core tests under Dawn.  Tables last.
#
#   source .gpu/env.sh; bash bench/gpu_packed.sh OUTDIR
set -uo pipefail
out=${1:?usage: bash bench/gpu_packed.sh OUTDIR}
mkdir -p "$out"
python3 bench/probe_buffer_view.py > "$out/probe.log" 2>&1
timeout "${T_MM:-200}" python3 bench/matmul_bench.py dawn --packed-ab > "$out/mm.log" 2>&1
timeout "${T_AB:-150}" python3 bench/attention_bench.py dawn --fast-ab main,unpacked \
  --shapes whisper > "$out/ab.log" 2>&1
MEGANEURA_WEBGPU=dawn timeout "${T_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider \
  -o addopts="" tests/kernels/test_attention_fast.py tests/kernels/test_matmul_fast.py \
  tests/compile/test_fast_attention.py > "$out/tests.log" 2>&1
timeout "${T_E2E:-150}" python3 bench/attention_bench.py dawn --fast-e2e > "$out/e2e.log" 2>&1
echo "== probe"; cat "$out/probe.log"
echo "== tests"; tail -3 "$out/tests.log"
echo "== matmul"; grep -E "packed=|FAILED" "$out/mm.log"
echo "== attention"; grep "^whisper" "$out/ab.log"
echo "== e2e"; tail -8 "$out/e2e.log"
