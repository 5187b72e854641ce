"""Where a step's wall time goes besides kernels: the same compiled step timed with the
commands submitted as one command buffer vs in segments (``$MEGANEURA_SUBMIT_SEGMENTS``),
against the sum of its kernels' GPU times (``sess.profile``) and the host encode time.

  python bench/step_overhead.py [workloads] [--impl dawn] [--segments 12,96 0 8,20,40,...]

Prints per workload and mode: wall ms per step (median of ``--steps``, sync each step,
inputs resident), kernel-sum ms, and the difference (gaps between dispatches + submit +
wait)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402


def measure(w, dev, inference: bool, segments: list[str], steps: int) -> dict:
    from harness import ours_step_times

    kw = dict(outputs=w.outputs) if inference else dict(loss=w.loss,
                                                         optimizer=optim.SGD(lr=1e-4))
    sess = mn.compile(w.graph, device=dev, **kw)
    sess.set_params(w.params)
    feeds = sess.program.inference_feeds() if inference else sess.program.feeds
    prof = sess.profile(steps=3, inference=inference,
                        **{k: v for k, v in w.feeds.items() if k in feeds})
    ex = sess.infer if inference else sess.train
    res = {"kernel_ms": prof.gpu_ms_per_step, "encode_us": prof.encode_us_per_step,
           "dispatches": len(ex.commands), "wall_ms": {}}
    for _ in range(2):  # two interleaved rounds: drift shows as disagreement
        for seg in segments:
            os.environ["MEGANEURA_SUBMIT_SEGMENTS"] = seg
            t = ours_step_times(sess, inference, w.feeds, 3, steps)
            res["wall_ms"].setdefault(seg, []).append(float(np.median(t)) * 1e3)
    os.environ.pop("MEGANEURA_SUBMIT_SEGMENTS", None)
    return res


def main(argv=None) -> None:
    from workloads import WORKLOADS

    from meganeura.runtime.device import get_device

    p = argparse.ArgumentParser()
    p.add_argument("workloads", nargs="?", default="whisper,resnet50")
    p.add_argument("--impl", default="dawn")
    # the default cuts, one command buffer, and cuts that grow with the step (the candidate
    # from bench/step_split.py: the host encodes 4-10 µs per dispatch on Dawn, so with 12,96
    # the GPU starves while the last segment is encoded; docs/benchmarks.md sixteenth session)
    p.add_argument("--segments", nargs="+", default=["12,96", "0", "8,20,40,80,160,320,640"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev = get_device(a.impl)
    out = {}
    for name in a.workloads.split(","):
        w = WORKLOADS[name](a.quick, "main")
        for inference in (True, False):
            key = f"{name}/{'infer' if inference else 'train'}"
            out[key] = measure(w, dev, inference, a.segments, a.steps)
            r = out[key]
            walls = "  ".join(f"[{s}] " + "/".join(f"{x:.3f}" for x in v)
                              for s, v in r["wall_ms"].items())
            print(f"{key:22s} kernels {r['kernel_ms']:.3f} ms, {r['dispatches']} cmds, encode "
                  f"{r['encode_us']:.0f} µs | wall {walls}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
