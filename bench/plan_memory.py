"""Our planned peak GPU memory per workload without a GPU (the plan is device-independent):
persistent tensors + inputs + the intermediate arena + fetched results, as the harness reports.

  python bench/plan_memory.py [workloads] [--json out.json] [--align BYTES]

``--align``: the device's storage-buffer offset alignment (the H200 reports 16 to Dawn;
lavapipe 32); default 256, WebGPU's largest, which every adapter accepts.
``--pipelines``: also count the distinct WGSL programs (pipelines) of the SGD training step,
emitted for the H200's limits.  ``--max-bindings 16``: sibling-reduction groups as a device with
16 storage buffers per stage gets them (the H200; default 8, what portable builds and CPUs get).
``--no-strided-slots``: inner-axis concats copied by their own kernel instead of written through
strided views (``compile.schedule.STRIDED_SLOTS``), the plans before the seventeenth session."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meganeura import optim  # noqa: E402
from meganeura.compile.memory import find_leaf_groups, make_plan  # noqa: E402
from meganeura.compile.passes import run_pipeline  # noqa: E402
from meganeura.program import build_program  # noqa: E402

H200_LIMITS = {"max_storage_buffer_binding_size": 2**31 - 1, "max_buffer_size": 2**34,
               "max_compute_workgroup_storage_size": 49152,
               "max_compute_invocations_per_workgroup": 1024,
               "max_storage_buffers_per_shader_stage": 16}


def distinct_pipelines(plan) -> int:
    """Distinct WGSL texts among the plan's kernels (what pipeline creation pays for)."""
    from meganeura.compile.emit import emit_stream
    from meganeura.kernels.common import make_target

    stream = emit_stream(plan, make_target(H200_LIMITS, {"shader-f16"}), "strict", "train")
    return len({d.spec.wgsl for d in stream.dispatches})


def peak_bytes(w, opt, align: int = 256, pipelines: bool = False, max_bindings: int = 8):
    prog = build_program(w.graph, w.loss, w.outputs if opt is None else {}, opt)
    low = run_pipeline(prog)
    inference = opt is None
    groups = find_leaf_groups(low.graph, any_rank=inference)
    plan = make_plan(low, inference, groups=groups, align=align, max_bindings=max_bindings)
    leaves = low.graph.leaves.values()
    persistent = sum(lf.value.size * 4 for lf in leaves if lf.kind in ("param", "state"))
    inputs = sum(lf.value.size * 4 for lf in leaves if lf.kind == "input")
    fetched = sum(loc.nbytes for loc, _ in plan.fetch.values())
    peak = persistent + inputs + plan.arena_bytes + fetched
    if pipelines:
        return peak, plan.dispatch_count, distinct_pipelines(plan)
    return peak, plan.dispatch_count


def main(argv=None):
    from workloads import WORKLOADS

    p = argparse.ArgumentParser()
    p.add_argument("workloads", nargs="?", default="smollm2,smolvla,whisper,resnet50,unet")
    p.add_argument("--json")
    p.add_argument("--align", type=int, default=256)
    p.add_argument("--pipelines", action="store_true")
    p.add_argument("--max-bindings", type=int, default=8)
    p.add_argument("--no-strided-slots", action="store_true")
    a = p.parse_args(argv)
    if a.no_strided_slots:
        from meganeura.compile import schedule

        schedule.STRIDED_SLOTS = False
    rows = {}
    for name in a.workloads.split(","):
        w = WORKLOADS[name](quick=False, variant="main")
        rows[name] = {k: peak_bytes(w, o, a.align, a.pipelines and k == "train_sgd",
                                    a.max_bindings)
                      for k, o in (("infer", None), ("train_sgd", optim.SGD(lr=1e-4)),
                                   ("train_adamw", optim.AdamW(lr=1e-4)))}
        print(name, {k: (round(v[0] / 2**20, 1), *v[1:]) for k, v in rows[name].items()},
              flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
