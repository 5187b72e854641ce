"""Dump every plan's kernel stream (labels, binds, WGSL) of the five workloads to OUTDIR, for
checking that a refactor leaves plans and emitted WGSL unchanged (diff two dumps).

  python bench/plan_fingerprint.py OUTDIR
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plan_memory import H200_LIMITS  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from meganeura import optim  # noqa: E402
from meganeura.compile.emit import emit_kernel  # noqa: E402
from meganeura.compile.memory import CopyOp, find_leaf_groups, make_plan  # noqa: E402
from meganeura.compile.passes import run_pipeline  # noqa: E402
from meganeura.kernels.common import make_target  # noqa: E402
from meganeura.program import build_program  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)


T = make_target(H200_LIMITS, {"shader-f16", "meganeura-subgroup-matrix-f16-16x16x16-sg32"})


summary = {}
for name in ["smollm2", "smolvla", "whisper", "resnet50", "unet"]:
    w = WORKLOADS[name](quick=False, variant="main")
    for tag, opt in (("infer", None), ("train_sgd", optim.SGD(lr=1e-4)),
                     ("train_adamw", optim.AdamW(lr=1e-4))):
        prog = build_program(w.graph, w.loss, w.outputs if opt is None else {}, opt)
        low = run_pipeline(prog)
        inference = opt is None
        groups = find_leaf_groups(low.graph, any_rank=inference)
        plan = make_plan(low, inference, groups=groups, align=32)
        lines = []
        for k in plan.kernels:
            if isinstance(k, CopyOp):
                lines.append(f"COPY {k.src} -> {k.dst}")
                continue
            for prec in ("strict", "fast") if tag == "train_sgd" else ("strict",):
                d = emit_kernel(k.desc, k.binds, T, prec)
                spec, binds = d.spec, list(d.binds)
                lines.append(f"KERNEL {k.label} {prec} wg={spec.workgroups} "
                             f"nb={spec.n_bindings} binds={binds}\n{spec.wgsl}")
        text = "\n".join(lines)
        open(f"{out}/{name}-{tag}.txt", "w").write(text)
        summary[f"{name}-{tag}"] = [plan.dispatch_count, plan.arena_bytes,
                                    hashlib.sha1(text.encode()).hexdigest()[:12]]
        print(name, tag, summary[f"{name}-{tag}"], flush=True)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
