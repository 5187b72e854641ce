"""Compile time of every workload's programs, device-free: the host-side stages of
``mn.compile`` (autodiff + optimizer, graph passes, schedule + memory plan, WGSL emission) for
the inference run and the SGD training step, best of ``--repeat`` runs.

  python bench/compile_time.py [workloads] [--repeat 3] [--json out.json]

Pipeline creation (the driver compiling WGSL) is not included: it depends on the driver and
its cache (GPU-NOTES); ``bench/harness.py`` reports whole-compile times on a device.  Garbage
collection is paused as ``mn.compile`` pauses it."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plan_memory import H200_LIMITS  # noqa: E402

from meganeura import optim  # noqa: E402
from meganeura.compile.emit import emit_stream  # noqa: E402
from meganeura.compile.memory import find_leaf_groups, make_plan  # noqa: E402
from meganeura.compile.passes import run_pipeline  # noqa: E402
from meganeura.kernels.common import make_target  # noqa: E402
from meganeura.program import build_program  # noqa: E402

STAGES = ("autodiff", "passes", "plan", "emit")


def time_stages(w, train: bool, target) -> dict[str, float]:
    """Seconds per stage for one compile of ``w`` (training step or inference run)."""
    opt = optim.SGD(lr=1e-3) if train else None
    t = [time.perf_counter()]
    prog = build_program(w.graph, w.loss, {} if train else w.outputs, opt)
    t.append(time.perf_counter())
    low = run_pipeline(prog)
    t.append(time.perf_counter())
    plan = make_plan(low, not train, groups=find_leaf_groups(low.graph, any_rank=not train),
                     align=32)
    t.append(time.perf_counter())
    emit_stream(plan, target, "strict", "train" if train else "infer")
    t.append(time.perf_counter())
    return {s: b - a for s, a, b in zip(STAGES, t, t[1:])}


def best_of(w, train: bool, target, repeat: int) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        gc.disable()
        try:
            runs.append(time_stages(w, train, target))
        finally:
            gc.enable()
            gc.collect()
    best = min(runs, key=lambda r: sum(r.values()))
    return {**{k: round(v, 3) for k, v in best.items()}, "total": round(sum(best.values()), 3)}


def main(argv=None) -> int:
    from workloads import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workloads", nargs="?", default=",".join(WORKLOADS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    target = make_target(H200_LIMITS, {"shader-f16"})
    out = {}
    print("| workload | program | " + " | ".join(STAGES) + " | total s |")
    print("|---|---|" + "---:|" * (len(STAGES) + 1))
    for name in args.workloads.split(","):
        w = WORKLOADS[name](quick=False, variant="main")
        for mode in ("infer", "train"):
            r = best_of(w, mode == "train", target, args.repeat)
            out[f"{name}-{mode}"] = r
            print(f"| {name} | {mode} | " + " | ".join(f"{r[s]:.3f}" for s in STAGES)
                  + f" | {r['total']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
