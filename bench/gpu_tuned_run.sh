#!/usr/bin/env bash
# One device call: the side-by-side benchmark untuned, then the tuner on the workloads we lose,
# then our cells again with the tuned cache, a roofline of the training steps and the decode
# attention table.  From the repo root after `source .gpu/env.sh`:
#   bash bench/gpu_tuned_run.sh OUTDIR [impl, default dawn]
# Each stage has its own time limit so a slow one cannot starve the rest; results are written
# as each workload finishes.  QUICK=1: tiny configs (a dry run on lavapipe).  FAST=1: the tuned
# refresh also measures precision="fast"; PAIRED=1 (+ PAIRED_COMPILE=1): bench/paired.py rounds.
set -uo pipefail
out="$1"; impl="${2:-dawn}"
mkdir -p "$out"
q=${QUICK:+--quick}
export MEGANEURA_TUNE_CACHE="$out/tuning-cache.json" PYTHONUNBUFFERED=1
all="${WORKLOADS:-whisper,resnet50,unet,smollm2,smolvla}"
lose="${TUNE_WORKLOADS:-whisper,resnet50}"
MEGANEURA_TUNE=0 timeout "${T_HARNESS:-230}" python3 bench/harness.py --workloads "$all" \
  --impls "$impl" --warmup 3 --steps 10 $q --out "$out/untuned.json" 2>&1 | grep -v "^\s*$"
timeout "${T_TUNE:-90}" python3 bench/tune_workloads.py "$lose" --impl "$impl" $q \
  --json "$out/tune-report.json"
cp "$out/untuned.json" "$out/tuned.json"
timeout "${T_REFRESH:-80}" python3 bench/harness.py --workloads "$lose" --impls "$impl" \
  --warmup 3 --steps 10 $q ${FAST:+--fast} --refresh-ours tuned --out "$out/tuned.json" 2>&1 \
  | grep -v "^\s*$"
# PAIRED=1: ours and PyTorch in interleaved rounds (PAIRED_COMPILE=1 adds torch.compile cells)
[ -n "${PAIRED:-}" ] && timeout "${T_PAIRED:-300}" python3 bench/paired.py --workloads "$all" \
  --impl "$impl" --rounds 3 $q ${PAIRED_COMPILE:+--torch-compile} --out "$out/paired.json" \
  2>&1 | tail -25
[ -z "$q" ] && timeout "${T_ROOF:-60}" python3 bench/roofline.py "$out/roofline" "$lose" \
  --impl "$impl" --top 12 2>&1 | tail -40
[ -z "$q" ] && timeout "${T_ATT:-30}" python3 bench/attention_bench.py "$impl" --quick \
  --json "$out/attention.json" 2>&1 | tail -30
python3 - "$out" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from harness import summary_line
out = sys.argv[1]
for tag in ("untuned", "tuned"):
    try:
        recs = json.load(open(f"{out}/{tag}.json"))
    except OSError:
        continue
    print(f"== {tag}")
    for r in recs:
        print(summary_line(r))
PY
