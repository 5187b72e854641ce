#!/usr/bin/env bash
# Issue-3 GPU check on the H200 machine, in one command (from the repo root, after
#   source .gpu/env.sh):  bash bench/gpu_check.sh  [results dir, default $OUT or ./gpu-results]
# 1) the GPU test subset with wgpu-native and with Dawn; 2) f32 matmul throughput and host encode
# cost per dispatch on both.  Prints a short table last.
set -uo pipefail
out="${1:-${OUT:-gpu-results}}"; mkdir -p "$out"
export XDG_RUNTIME_DIR=$(mktemp -d)
tests="tests/runtime tests/kernels tests/compile tests/test_cli.py"
for impl in wgpu dawn; do
  MEGANEURA_WEBGPU=$impl timeout 240 python3 -m pytest -q --maxfail=30 -p no:cacheprovider $tests \
    > "$out/tests-$impl.log" 2>&1; echo "tests $impl: rc=$? $(tail -1 "$out/tests-$impl.log")"
done
for impl in wgpu dawn; do
  timeout 150 python3 bench/matmul_dispatch.py $impl "$out/matmul-$impl.json" > "$out/bench-$impl.log" 2>&1
  echo "bench $impl rc=$?"
done
python3 - "$out" <<'PY'
import json, sys, os
d = sys.argv[1]
print(f"{'impl':6} {'n':>5} {'TFLOP/s':>8} {'gpu ms':>8} {'rel err':>9}  encode µs/dispatch")
for impl in ("wgpu", "dawn"):
    p = os.path.join(d, f"matmul-{impl}.json")
    if not os.path.exists(p):
        print(impl, "no result"); continue
    r = json.load(open(p))
    for m in r["matmul"]:
        print(f"{impl:6} {m['n']:>5} {m['tflops']:>8.2f} {m['gpu_ms']:>8.3f} {m['rel_err']:>9.2e}  "
              f"{r['encode']['encode_us_per_dispatch']:.2f}")
PY
