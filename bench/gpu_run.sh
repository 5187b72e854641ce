#!/usr/bin/env bash
# The side-by-side benchmark on the H200 machine (from the repo root, after source .gpu/env.sh):
#   bash bench/gpu_run.sh OUTDIR [workloads, default all] [extra harness args]
# Results accumulate in OUTDIR/results.json (a workload already there is skipped, so a run cut
# short by the 10-minute limit continues where it stopped); then docs are rendered into
# OUTDIR/docs (benchmarks.md + PNG plots) and a one-line summary per workload is printed.
set -uo pipefail
out="${1:-${OUT:-bench-results}}"; shift || true
workloads="${1:-whisper,smolvla,smollm2,resnet50,unet}"; shift || true
mkdir -p "$out/work/docs"
seed=bench/results/h200.json   # earlier results (copied back into the repo) are kept, not rerun
[ -f "$seed" ] && [ ! -f "$out/results.json" ] && cp "$seed" "$out/results.json"
export XDG_RUNTIME_DIR=$(mktemp -d) PYTHONUNBUFFERED=1
timeout "${BENCH_TIMEOUT:-530}" python3 bench/harness.py --workloads "$workloads" --impls wgpu,dawn --torch-compile --profile \
  --trace-dir "$out/work" --warmup 3 --steps 20 --out "$out/results.json" "$@" 2>&1 | tee -a "$out/harness.log"
python3 bench/report.py "$out/results.json" --out "$out/work/docs" > /dev/null
tar -C "$out/work" -czf "$out/bundle.tgz" .   # traces + rendered docs in one file
python3 -c "
import json,sys; sys.path.insert(0,'bench')
from harness import summary_line
for r in json.load(open('$out/results.json')): print(summary_line(r))"
