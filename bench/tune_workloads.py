"""Tune every kernel of the benchmark workloads on this device and fill the tuning cache, so
that later compiles (``tune="cache"``, the default; ``bench/harness.py``, ``bench/roofline.py``)
use the fastest configuration the candidates offer instead of the heuristic default.

  MEGANEURA_TUNE_CACHE=tuning.json python bench/tune_workloads.py [workloads] [--impl dawn]

For each workload it compiles the inference run and the SGD training step with ``tune=True``
(each description without a cache entry has its candidates timed on the GPU) and prints what
the tuner did and how long it took."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workloads import WORKLOADS  # noqa: E402

import meganeura as mn  # noqa: E402
from meganeura.compile.tune import default_cache_path  # noqa: E402
from meganeura.runtime.device import get_device  # noqa: E402


def tune_workload(w, dev) -> dict:
    """Tune the inference and the SGD training program of ``w``; what the tuner reported."""
    out = {}
    for mode in ("infer", "train"):
        t0 = time.perf_counter()
        if mode == "infer":
            sess = mn.compile(w.graph, outputs=w.outputs, device=dev, tune=True)
        else:
            sess = mn.compile(w.graph, loss=w.loss, outputs={}, device=dev, tune=True,
                              optimizer=mn.optim.SGD(lr=1e-4))
        rep = sess.tuning
        out[mode] = {"seconds": round(time.perf_counter() - t0, 2), "timed": rep.timed,
                     "cached": rep.cached, "changed": rep.changed}
        del sess
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workloads", nargs="?", default="whisper,resnet50,unet,smollm2,smolvla")
    p.add_argument("--impl", default="dawn")
    p.add_argument("--quick", action="store_true", help="tiny configs (lavapipe)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    dev = get_device(args.impl)
    results = {"device": dev.adapter_name, "cache": str(default_cache_path()), "workloads": {}}
    print(f"tuning on {dev.adapter_name}; cache {results['cache']}")
    print("| workload | program | configurations timed | from cache | differ from heuristic | s |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.workloads.split(","):
        w = WORKLOADS[name](quick=args.quick, variant="main")
        r = tune_workload(w, dev)
        results["workloads"][name] = r
        for mode, m in r.items():
            print(f"| {name} | {mode} | {m['timed']} | {m['cached']} | {m['changed']} | "
                  f"{m['seconds']} |", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
