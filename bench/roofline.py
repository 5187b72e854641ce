"""Roofline profile of every workload's training step (and inference) on this device: per
kernel the flops and compulsory bytes from its description, achieved TFLOP/s and GB/s from GPU
timestamps, the binding limit and the percent of the roofline bound.

  python bench/roofline.py OUTDIR [workloads] [--impl dawn] [--precision strict] [--top 15]

Writes OUTDIR/roofline.json and OUTDIR/roofline.md (tables, largest kernels first) and prints
a short summary last: GPU ms per step and the time-weighted percent of bound per workload."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402


def profile_workload(w, dev, precision: str, inference: bool, steps: int,
                     repeats: int | None = None):
    kw = dict(outputs=w.outputs) if inference else dict(
        loss=w.loss, optimizer=optim.SGD(lr=1e-4))
    sess = mn.compile(w.graph, precision=precision, device=dev, **kw)
    sess.set_params(w.params)
    feeds = sess.program.inference_feeds() if inference else sess.program.feeds
    return sess.profile(steps=steps, inference=inference, repeats=repeats,
                        **{k: v for k, v in w.feeds.items() if k in feeds})


def weighted_pct(rows) -> float | None:
    """Percent of bound over the whole step, weighted by each kernel's total time."""
    known = [r for r in rows if r["pct_of_bound"] is not None]
    total = sum(r["mean_us"] * r["calls"] for r in known)
    if not total:
        return None
    bound = sum(r["pct_of_bound"] / 100 * r["mean_us"] * r["calls"] for r in known)
    return 100 * bound / total


def markdown(results: dict, top: int) -> str:
    out = [f"# Roofline per workload\n\nDevice: {results['device']}; {results['impl']}, "
           f"precision {results['precision']}; {results['date']}.\n"]
    for key, r in results["workloads"].items():
        out.append(f"\n## {key}: {r['gpu_ms']:.2f} ms GPU per step, {r['dispatches']} "
                   f"dispatches, {r['weighted_pct']:.0f}% of roofline bound (time-weighted)"
                   + _floor_note(r) + "\n")
        out.append("| kernel | calls | µs in stream | µs alone | TFLOP/s | GB/s | bound | "
                   "% of bound |")
        out.append("|---|---|---|---|---|---|---|---|")
        for row in r["rows"][:top]:
            pct = "" if row["pct_of_bound"] is None else f"{row['pct_of_bound']:.0f}"
            est = "~" if row.get("estimated") else ""
            out.append(f"| `{row['label'][:70]}` | {row['calls']} | {row['mean_us']:.1f}{est} | "
                       f"{row.get('alone_us', row['mean_us']):.1f} | {row['tflops']:.2f} | "
                       f"{row['gbps']:.0f} | {row['bound']} | {pct} |")
        if r.get("split_k"):
            out.append("\n| split-K GEMM (partials + sum) | calls | µs in stream | TFLOP/s |")
            out.append("|---|---|---|---|")
            out += [f"| `{g['label'][:70]}` | {g['calls']} | {g['mean_us']:.1f} | "
                    f"{g['tflops']:.2f} |" for g in r["split_k"][:top]]
    return "\n".join(out) + "\n"


def _floor_note(r: dict) -> str:
    if r.get("pass_floor_us") is None:
        return ""
    if r.get("stream_floor_us") is None or not r.get("repeats"):
        return f"; an empty dispatch takes {r['pass_floor_us']:.1f} µs timed this way"
    return (f"; an empty dispatch: {r['stream_floor_us']:.1f} µs in stream, "
            f"{r['pass_floor_us']:.1f} µs alone in its pass (~: in place, estimated)")


def main(argv=None) -> None:
    import datetime

    from workloads import WORKLOADS

    from meganeura.runtime.device import get_device

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("workloads", nargs="?", default="smollm2,smolvla,whisper,resnet50,unet")
    p.add_argument("--impl", default="dawn")
    p.add_argument("--precision", default="strict")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--inference", action="store_true")
    p.add_argument("--repeats", type=int, default=None,
                   help="in-stream timing repeats (Session.profile; 0: alone times only)")
    a = p.parse_args(argv)
    dev = get_device(a.impl)
    res = {"device": dev.adapter_name, "impl": a.impl, "precision": a.precision,
           "date": datetime.date.today().isoformat(), "workloads": {}}
    os.makedirs(a.out, exist_ok=True)
    for name in a.workloads.split(","):
        w = WORKLOADS[name](quick=False, variant="main")
        for inference in ((False, True) if a.inference else (False,)):
            prof = profile_workload(w, dev, a.precision, inference, a.steps, a.repeats)
            rows = prof.roofline()
            key = f"{name}-{'infer' if inference else 'train'}"
            res["workloads"][key] = {"gpu_ms": prof.gpu_ms_per_step, "rows": rows,
                                     "dispatches": prof.dispatches_per_step,
                                     "pass_floor_us": prof.pass_floor_us,
                                     "stream_floor_us": prof.stream_floor_us,
                                     "repeats": prof.repeats,
                                     "alone_ms": prof.alone_ms_per_step,
                                     "wall_ms": prof.step_wall_ms,
                                     "split_k": prof.split_k_groups(),
                                     "weighted_pct": weighted_pct(rows) or 0.0}
            print(f"{key:18} GPU {prof.gpu_ms_per_step:8.2f} ms/step  "
                  f"{res['workloads'][key]['weighted_pct']:5.1f}% of bound", flush=True)
            json.dump(res, open(os.path.join(a.out, "roofline.json"), "w"), indent=1)
    open(os.path.join(a.out, "roofline.md"), "w").write(markdown(res, a.top))


if __name__ == "__main__":
    main()
