#!/usr/bin/env bash
# The tensor-core attention forward's where-the-time-goes probe in one device call (issue 12):
# variants and timing-only ablations at Whisper's (1, 6, 1500, 64) (attention_bench --fast-ab),
# the same with Dawn's robustness off, and the strict kernels' vec4 loads on the op paths.
#
#   source .gpu/env.sh; [OPS=0] bash bench/gpu_attn_probe.sh OUTDIR [FAST_VARIANTS]
set -uo pipefail
out=${1:?usage: bash bench/gpu_attn_probe.sh OUTDIR [VARIANTS]}
variants=${2:-main,no-all,no-stage,no-scores,no-softmax,no-pv}
mkdir -p "$out"
timeout "${T_AB:-200}" python3 bench/attention_bench.py dawn --fast-ab "$variants" \
  --shapes whisper --json "$out/fast-ab.json" > "$out/fast-ab.log" 2>&1
timeout "${T_ROB:-90}" python3 bench/attention_bench.py dawn --fast-ab main --shapes whisper \
  --toggles disable_robustness > "$out/fast-ab-norobust.log" 2>&1
if [ "${OPS:-1}" != 0 ]; then
  timeout "${T_OPS:-200}" python3 bench/attention_bench.py dawn --kvariants after,vec_loads --op \
    --json "$out/ops.json" > "$out/ops.log" 2>&1
fi
echo "== fast-ab"; grep -E "^whisper .*µs|Error|error" "$out/fast-ab.log" | tail -20
echo "== robustness off"; grep -E "^whisper .*µs|toggles" "$out/fast-ab-norobust.log" | tail -4
echo "== strict vec loads (op paths)"; grep -E "op path|total|µs" "$out/ops.log" | tail -30
