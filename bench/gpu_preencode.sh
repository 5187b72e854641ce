#!/usr/bin/env bash
# Steps encoded ahead (GPUStream.prepare, $MEGANEURA_PREENCODE) on the H200, in one device call
# (from the repo root, after source .gpu/env.sh):
#   bash bench/gpu_preencode.sh OUTDIR [workloads, default all five]
# 1) the launch tests under Dawn (encode ahead, Dawn's raw webgpu.h encode path); 2) every
# submit mode of bench/step_overhead.py (0/12,96 is the behaviour before); 3) step_split with
# the encode ahead.  Prints the wall per mode last.  About 6-8 minutes for all five.
set -uo pipefail
out=${1:?usage: bash bench/gpu_preencode.sh OUTDIR [workloads]}
wl=${2:-smollm2,resnet50,whisper,smolvla,unet}
mkdir -p "$out"
MEGANEURA_WEBGPU=dawn timeout "${T_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider \
  -o addopts="" tests/runtime/test_launch.py tests/runtime/test_session.py > "$out/tests.log" 2>&1
echo "dawn tests rc=$? $(grep -cE '^(FAILED|ERROR)' "$out/tests.log") failed"
timeout "${T_SO:-330}" python3 bench/step_overhead.py "$wl" --impl dawn --json "$out/so.json" \
  > "$out/so.log" 2>&1; echo "step_overhead rc=$?"
timeout "${T_SPLIT:-120}" python3 bench/step_split.py "$wl" --impl dawn --steps 20 \
  --out "$out/split.json" > "$out/split.log" 2>&1; echo "step_split rc=$?"
grep -E "FAILED|Error" "$out/tests.log" | head -5
cat "$out/so.log" | grep -v "^ " | tail -12
tail -10 "$out/split.log"
