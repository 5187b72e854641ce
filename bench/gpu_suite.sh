#!/usr/bin/env bash
# The whole test suite on a real GPU, once with wgpu-native and once with Dawn, side by side
# (from the repo root on the H200 machine, after `source .gpu/env.sh`):
#   bash bench/gpu_suite.sh [results dir, default $OUT or ./gpu-suite]
# Tests must hold on real GPUs as on lavapipe; prints one line per implementation last.
set -uo pipefail
out="${1:-${OUT:-gpu-suite}}"; mkdir -p "$out"
export XDG_RUNTIME_DIR=$(mktemp -d) OMP_NUM_THREADS=4
for impl in wgpu dawn; do
  ( MEGANEURA_WEBGPU=$impl timeout "${SUITE_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider \
      -o addopts="" -rfE --durations=5 tests > "$out/suite-$impl.log" 2>&1
    echo $? > "$out/rc-$impl" ) &
done
wait
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>/dev/null
for impl in wgpu dawn; do
  echo "suite $impl: rc=$(cat "$out/rc-$impl") $(grep -E '(passed|failed|error)' "$out/suite-$impl.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$out/suite-$impl.log" | head -20
done
