"""Where a step's wall time goes, per workload: the host's part (``submit``: the step encoded
ahead submitted and the next one encoded, or with ``--preencode 0`` the step encoded and
submitted in segments) and the wait after it (``dev.sync``), against the GPU's own time (the
profile's in-stream kernel sum) and an idle queue's sync round trip.  The paired benchmark
times submit + sync the same way: this says whether the gap to the profile's sum of kernels is
host time, the wait's own latency, or GPU time between kernels (docs/benchmarks.md, sixteenth
session).

  python3 bench/step_split.py [workloads] [--impl dawn] [--steps 30] [--segments 12,96|0]
      [--preencode 0|1]
      [--out FILE.json]

Prints per workload and mode the median µs of the host part (``launch_us``), wait, wall, the
profile's GPU sum and wall − GPU per dispatch."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import _feed_arrays  # noqa: E402

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402
from meganeura.runtime.device import get_device  # noqa: E402


def split_times(sess, inference: bool, feeds: dict, steps: int) -> dict:
    """Median µs of launch (host), the wait after it and their sum over ``steps`` steps on
    resident feeds, after as many warm-up steps."""
    ex = sess.infer if inference else sess.train
    sess._upload_feeds(_feed_arrays(sess, inference, feeds))
    host, wait = [], []
    for i in range(2 * steps):
        t0 = time.perf_counter()
        ex.submit(fetch=False)  # with the next step encoded ahead unless $MEGANEURA_PREENCODE=0
        t1 = time.perf_counter()
        sess.dev.sync()
        t2 = time.perf_counter()
        if i >= steps:
            host.append(t1 - t0)
            wait.append(t2 - t1)
    med = lambda xs: float(np.median(xs)) * 1e6  # noqa: E731
    return {"launch_us": med(host), "wait_us": med(wait),
            "wall_us": med([h + w for h, w in zip(host, wait)]),
            "dispatches": len(ex.commands)}


def idle_sync_us(dev, n: int = 50) -> float:
    """An idle queue's sync round trip (a 4-byte copy and a map), median µs."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        dev.sync()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def run(name: str, dev, steps: int) -> list[dict]:
    from workloads import WORKLOADS

    w = WORKLOADS[name](quick=dev.is_cpu, variant="main")
    out = []
    for inference in (True, False):
        kw = dict(outputs=w.outputs) if inference else dict(
            loss=w.loss, outputs={}, optimizer=optim.SGD(lr=1e-4))
        sess = mn.compile(w.graph, device=dev, **kw)
        sess.set_params(w.params)
        rec = {"workload": name, "mode": "infer" if inference else "train",
               **split_times(sess, inference, w.feeds, steps)}
        feeds = sess.program.inference_feeds() if inference else sess.program.feeds
        prof = sess.profile(steps=2, inference=inference,
                            **{k: v for k, v in w.feeds.items() if k in feeds})
        rec["gpu_us"] = prof.gpu_ms_per_step * 1e3
        rec["gap_us_per_dispatch"] = (rec["wall_us"] - rec["gpu_us"]) / rec["dispatches"]
        out.append(rec)
        print(f"{name:9} {rec['mode']:5} launch {rec['launch_us']:8.0f}  wait "
              f"{rec['wait_us']:8.0f}  wall {rec['wall_us']:8.0f}  GPU (profile) "
              f"{rec['gpu_us']:8.0f} µs  dispatches {rec['dispatches']:5}  (wall − GPU) / "
              f"dispatch {rec['gap_us_per_dispatch']:5.2f} µs", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="?", default="whisper,resnet50,unet,smolvla,smollm2")
    ap.add_argument("--impl", default="dawn")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--segments", help="$MEGANEURA_SUBMIT_SEGMENTS for this run (0: one "
                    "command buffer)")
    ap.add_argument("--preencode", choices=("0", "1"), help="$MEGANEURA_PREENCODE for this "
                    "run (1, the default: the host part includes encoding the next step)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.segments is not None:
        os.environ["MEGANEURA_SUBMIT_SEGMENTS"] = a.segments
    if a.preencode is not None:
        os.environ["MEGANEURA_PREENCODE"] = a.preencode
    dev = get_device(a.impl)
    res = {"device": dev.adapter_name, "impl": a.impl, "segments": a.segments,
           "preencode": a.preencode,
           "idle_sync_us": idle_sync_us(dev), "date": time.strftime("%Y-%m-%d"), "rows": []}
    print(f"device {dev.adapter_name} ({a.impl}); idle sync round trip "
          f"{res['idle_sync_us']:.0f} µs", flush=True)
    for name in a.workloads.split(","):
        res["rows"] += run(name, dev, a.steps)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
