"""Gates against a float64 reference, for workloads where PyTorch's own f32 result is not
accurate enough to judge ours (e.g. ResNet-50's batch-norm parameter gradients at full size).

  python bench/gate_f64.py resnet50 OUT.json [--impl wgpu] [--torch-device cuda]

For every output and parameter gradient it records rel. L2 of ours (f32) vs float64, of
PyTorch f32 vs float64, and of ours vs PyTorch f32.  The f64-aware gate (DESIGN.md §5 made
explicit): ours passes where it is within the strict tolerance of float64, or no further from
float64 than twice PyTorch's own f32 error."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import STRICT, rel_l2  # noqa: E402


def torch_values(w, dtype, device):
    import torch

    torch.set_default_device(device)
    m = w.torch_model()
    w.load_torch(m, w.params)
    m = m.to(device=device, dtype=dtype)
    f = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in w.torch_feeds(device).items()}
    loss, outs = w.torch_loss(m, f)
    loss.backward()
    vals = {"loss": loss.detach().double().cpu().numpy(),
            **{f"out:{k}": v.detach().double().cpu().numpy() for k, v in outs.items()},
            **{f"grad:{k}": p.grad.detach().double().cpu().numpy()
               for k, p in m.named_parameters() if p.grad is not None}}
    torch.set_default_device("cpu")
    return vals


def f64_gates(ours, f32, f64, tol=STRICT) -> dict:
    rows = {}
    for k in f64:
        if k not in ours:
            continue
        rows[k] = {"ours_vs_f64": rel_l2(ours[k], f64[k]), "torch32_vs_f64": rel_l2(f32[k], f64[k]),
                   "ours_vs_torch32": rel_l2(ours[k], f32[k])}

    def ok(k, r):
        t = tol["bwd"] if k.startswith("grad:") else tol["fwd"]
        return r["ours_vs_f64"] <= max(t, 2.0 * r["torch32_vs_f64"])

    fails = sorted(k for k, r in rows.items() if not ok(k, r))
    worst = max(rows, key=lambda k: rows[k]["ours_vs_f64"])
    return {"rows": rows, "fails": fails, "pass": not fails, "worst": worst,
            "worst_row": rows[worst],
            "max_torch32_vs_f64": max(r["torch32_vs_f64"] for r in rows.values())}


def main(argv=None) -> int:
    import torch
    from workloads import WORKLOADS

    import meganeura as mn

    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("out")
    p.add_argument("--impl", default="wgpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variant", default="main", choices=["main", "minlat"])
    p.add_argument("--torch-device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = WORKLOADS[a.workload](quick=a.quick, variant=a.variant)
    f64 = torch_values(w, torch.float64, a.torch_device)
    f32 = torch_values(w, torch.float32, a.torch_device)
    g2, grads = mn.grad(w.graph, w.loss)
    outs = {"loss": g2[w.loss], **{f"out:{k}": g2[v] for k, v in w.outputs.items()},
            **{f"grad:{k}": v for k, v in grads.items()}}
    s = mn.compile(g2, outputs=outs, backend=a.impl)
    s.set_params(w.params)
    ours = s.run(**{k: v for k, v in w.feeds.items() if k in s.program.inference_feeds()})
    res = {"workload": a.workload, "variant": a.variant, "impl": a.impl,
           "torch_device": a.torch_device,
           **f64_gates(ours, f32, f64)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=float)
    r = res["worst_row"]
    verdict = "PASS" if res["pass"] else "FAIL"
    print(f"{a.workload}/{a.variant}: f64-aware gate {verdict}; worst {res['worst']}: "
          f"ours-vs-f64 {r['ours_vs_f64']:.2e}, torch-f32-vs-f64 {r['torch32_vs_f64']:.2e}, "
          f"ours-vs-torch-f32 {r['ours_vs_torch32']:.2e}; fails: {res['fails'][:5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
