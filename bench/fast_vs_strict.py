"""Which kernels make ``precision="fast"`` slower than strict f32 in a workload's step?

Profiles the SGD training step (or ``--inference``) of each workload strict and fast on one
device, matches kernels by label and prints, per label, µs per step strict and fast and the
fast kernel's variant; the labels where fast loses most come last, with the totals.

    python3 bench/fast_vs_strict.py dawn smollm2,smolvla [--inference] [--steps 5]

``--quick`` builds the tiny workload configurations (lavapipe: the path runs, the numbers mean
nothing there)."""

from __future__ import annotations

import argparse
import gc
import sys

sys.path[:0] = [__file__.rsplit("/", 1)[0], __file__.rsplit("/", 2)[0]]  # bench/, the repo

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402


def _profile(w, dev, precision: str, inference: bool, steps: int) -> dict:
    """{label: (µs per step, variant)} of one compiled step."""
    if inference:
        sess = mn.compile(w.graph, outputs=w.outputs, device=dev, precision=precision)
    else:
        sess = mn.compile(w.graph, loss=w.loss, outputs={}, optimizer=optim.SGD(lr=1e-4),
                          device=dev, precision=precision)
    sess.set_params(w.params)
    wanted = sess.infer_feeds if inference else sess.train_feeds  # inference: no labels
    prof = sess.profile(steps=steps, inference=inference,
                        **{k: v for k, v in w.feeds.items() if k in wanted})
    ex = sess.infer if inference else sess.train
    variants = {d.label: d.spec.meta.get("variant", "") for d in ex.stream.dispatches}
    out = {k.label: (k.total_ns / 1e3 / steps, variants.get(k.label, "")) for k in prof.kernels}
    del sess
    gc.collect()
    return out


def compare(name: str, dev, inference: bool, steps: int, quick: bool, top: int = 25) -> None:
    """Print the per-label comparison of one workload (see the module docstring)."""
    from workloads import WORKLOADS

    w = WORKLOADS[name](quick, "main")
    s = _profile(w, dev, "strict", inference, steps)
    f = _profile(w, dev, "fast", inference, steps)
    rows = []
    for label in sorted(set(s) | set(f)):
        ts, _ = s.get(label, (0.0, ""))
        tf, var = f.get(label, (0.0, ""))
        rows.append((tf - ts, label, ts, tf, var))
    rows.sort()
    mode = "inference" if inference else "SGD training"
    print(f"== {name} {mode}: strict {sum(r[2] for r in rows):.1f} µs, fast "
          f"{sum(r[3] for r in rows):.1f} µs per step (sum of kernels)")
    for r in rows[:5] + [None] + rows[max(5, len(rows) - top):]:
        if r is None:
            print("   ...")
            continue
        d, label, ts, tf, var = r
        print(f"  {d:+9.1f} µs  strict {ts:8.1f}  fast {tf:8.1f}  {var:26} {label[:90]}")
    tc = [r for r in rows if r[4].startswith("sgmat")]
    lose = [r for r in tc if r[0] > 0]
    print(f"  tensor-core labels: {len(tc)}, slower than strict: {len(lose)} "
          f"({sum(r[0] for r in lose):.1f} µs lost), faster: {len(tc) - len(lose)} "
          f"({-sum(r[0] for r in tc if r[0] <= 0):.1f} µs won)", flush=True)


def main(argv=None) -> int:
    from meganeura.runtime.device import get_device

    ap = argparse.ArgumentParser()
    ap.add_argument("impl", nargs="?", default="dawn")
    ap.add_argument("workloads", nargs="?", default="smollm2,smolvla")
    ap.add_argument("--inference", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    dev = get_device(args.impl)
    for name in args.workloads.split(","):
        compare(name, dev, args.inference, args.steps, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
