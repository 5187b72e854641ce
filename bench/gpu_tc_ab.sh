#!/usr/bin/env bash
# Tensor-core matmul configurations in one device call (issue 11): the driver's register count
# for each (bench/pipeline_stats.py, f16 operands), their speed at 4096³ with f32 and f16
# operands in interleaved rounds with the heuristic's noload / nostage ablations
# (bench/matmul_bench.py --cfg-ab), and the tensor-core matmul tests under Dawn.
#
#   source .gpu/env.sh; bash bench/gpu_tc_ab.sh OUTDIR 'tm,tn,rm,rn,bk,vr;...'
#   (ABLATE=noload,nostage,mmaonly,mmanobar: the heuristic's ablations; AB_ARGS: more
#   matmul_bench.py flags, e.g. "--ablate-all --b-nk"; T_TESTS=0 skips the tests)
#
# The SPIR-V dump layer is taken from .gpu/tools when it was built and carried there
# (docs/gpu-runtime.md), else built with gcc into OUTDIR.
set -uo pipefail
out=${1:?usage: bash bench/gpu_tc_ab.sh OUTDIR CFGS}
cfgs=${2:?usage: bash bench/gpu_tc_ab.sh OUTDIR CFGS}
mkdir -p "$out"
layer=()
[ -e .gpu/tools/libmn_spirv_dump.so ] && layer=(--layer .gpu/tools)
timeout "${T_STATS:-150}" python3 bench/pipeline_stats.py "$out/ps" mm "${layer[@]}" \
  --mm-f16 --mm-cfgs "$cfgs" > "$out/ps.log" 2>&1
rm -f "$out"/ps/*.spv "$out"/ps/*.spvasm  # what comes back from the device is capped in files
timeout "${T_AB:-300}" python3 bench/matmul_bench.py dawn --cfg-ab "heur;$cfgs" \
  --ablate "${ABLATE:-noload,nostage}" ${AB_ARGS:-} \
  > "$out/ab.log" 2>&1
[ "${T_TESTS:-150}" != 0 ] && MEGANEURA_WEBGPU=dawn timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider \
  -o addopts="" tests/kernels/test_matmul_fast.py > "$out/tests.log" 2>&1
echo "== registers (kernel | count)"
grep "^|" "$out/ps.log" | awk -F'|' 'NR == 1 {for (i = 2; i < NF; i++) if ($i ~ /Register/) c = i}
  NR > 2 {print $2 "|" $c}'
[ "${T_TESTS:-150}" != 0 ] && { echo "== tests"; tail -2 "$out/tests.log"; }
echo "== speed"; grep -E "TFLOP/s|FAILED" "$out/ab.log"
