#!/usr/bin/env bash
# The tensor-core attention forward's measurement in one device call (issue 12): the driver's
# register count for each layout variant (bench/pipeline_stats.py), their speed at Whisper's
# (1, 6, 1500, 64) against the strict kernel (bench/attention_bench.py --fast-ab, two
# interleaved rounds, error against float64), and the fast attention tests under Dawn.
#
#   source .gpu/env.sh; bash bench/gpu_attention_fast.sh OUTDIR [variants]
#
# variants: names of attention_bench.FAST_VARIANTS (default: the unmeasured layouts of the
# seventh session against main).  The SPIR-V dump layer is taken from .gpu/tools when it was
# built and carried there (docs/gpu-runtime.md), else built with gcc into OUTDIR.
set -uo pipefail
out=${1:?usage: bash bench/gpu_attention_fast.sh OUTDIR [variants]}
variants=${2:-main,oshared,splitpf,oshared-splitpf,rows1-splitpf}
mkdir -p "$out"
layer=()
[ -e .gpu/tools/libmn_spirv_dump.so ] && layer=(--layer .gpu/tools)
timeout "${T_STATS:-150}" python3 bench/pipeline_stats.py "$out/ps" attn "${layer[@]}" \
  > "$out/ps.log" 2>&1
rm -f "$out"/ps/*.spv "$out"/ps/*.spvasm  # what comes back from the device is capped in files
timeout "${T_AB:-300}" python3 bench/attention_bench.py dawn --fast-ab "$variants" \
  --shapes whisper --json "$out/ab.json" > "$out/ab.log" 2>&1
MEGANEURA_WEBGPU=dawn timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider \
  -o addopts="" tests/kernels/test_attention_fast.py tests/compile/test_fast_attention.py \
  tests/compile/test_emit.py > "$out/tests.log" 2>&1
echo "== registers (kernel | count)"
grep "^|" "$out/ps.log" | awk -F'|' 'NR == 1 {for (i = 2; i < NF; i++) if ($i ~ /Register/) c = i}
  NR > 2 {print $2 "|" $c}'
echo "== tests"; tail -2 "$out/tests.log"
echo "== speed (µs per forward + combine)"; grep "^whisper" "$out/ab.log"
