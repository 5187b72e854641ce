#!/usr/bin/env bash
# The re-measures the 2026-12-01 (third) session left for the next device call: what landed after
# its side-by-side (Whisper's GEMM split/tile rules, SmolLM2's short-loop attention) timed in the
# real step.  From the repo root after `source .gpu/env.sh`:   bash bench/gpu_remeasure.sh OUTDIR
# ~3 min: the short-attention tests under Dawn (the 16 × 64 forward tile's values on the H200),
# paired rounds ours vs eager / CUDA graph for Whisper and SmolLM2, the roofline of both and
# SmolLM2's attention share of its training step.
set -uo pipefail
out="$1"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
MEGANEURA_WEBGPU=dawn timeout 40 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels/test_attention_short.py tests/compile/test_schedule.py > "$out/tests.log" 2>&1
tail -2 "$out/tests.log"
timeout 90 python3 bench/paired.py --workloads whisper,smollm2 --impl dawn --rounds 5 \
  --out "$out/paired.json" > "$out/paired.log" 2>&1
tail -13 "$out/paired.log"
timeout 60 python3 bench/roofline.py "$out/roof" whisper,smollm2 --impl dawn --inference --top 15 \
  2>&1 | tail -4
python3 bench/attention_bench.py dawn --share "$out/roof/roofline.json" 2>&1 | tail -1
