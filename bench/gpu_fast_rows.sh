#!/usr/bin/env bash
# The fast path against strict in the transformer steps, in one device call: which kernels of
# SmolLM2's and SmolVLA's training steps are slower fast than strict (bench/fast_vs_strict.py,
# per label), then the harness's fast rows of both (gates, PyTorch TF32 / bf16).  Made to check
# matmul.TC_SHORT_K (measured in the ninth session: docs/benchmarks.md).
#
#   source .gpu/env.sh; bash bench/gpu_fast_rows.sh OUTDIR [workloads]
set -uo pipefail
out=${1:?usage: bash bench/gpu_fast_rows.sh OUTDIR [workloads]}
wl=${2:-smollm2,smolvla}
mkdir -p "$out"
timeout "${T_FVS:-150}" python3 bench/fast_vs_strict.py dawn "$wl" --steps 5 > "$out/fvs.log" 2>&1
timeout "${T_H:-300}" python3 bench/harness.py --workloads "$wl" --impls dawn --fast \
  --warmup 3 --steps 10 --out "$out/harness.json" > "$out/harness.log" 2>&1
echo "== kernels fast loses on (µs per step)"; grep -E "^== |tensor-core labels" "$out/fvs.log"
grep -E "^  \+[0-9]{2,}" "$out/fvs.log" | tail -8
echo "== harness"; grep " | " "$out/harness.log" | tail -4
