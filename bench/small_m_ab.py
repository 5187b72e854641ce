"""A scheduling switch on against off inside whole workload steps, in one process: both
programs of each workload compiled first ("on", and "off" with the switch flipped), then
``--rounds`` interleaved rounds of our inference and SGD training steps, then one
``sess.profile()`` of each training step (the rows of the small-M matmuls, and the split-K
GEMMs as partials + sum).  Switches (``SWITCHES``): ``small_m``, the small-M rule
(``kernels.matmul.small_m_sliced``: one K-sliced dispatch instead of split-K; off = the
previous heuristic); ``split_sum``, plain split-K sums as vec4 pointwise kernels
(``compile.schedule.SPLIT_SUM_POINTWISE``; off = the reduction); ``small_m_split``, the
small-M split rule for K past the sliced range (``kernels.matmul.small_m_split``: chunks of
about 192 on 16x32 K-sliced tiles; off = split 12 of 64x64 tiles); ``split_576``, a
candidate: the K 256-640 GEMMs split that way too instead of one sliced dispatch (off = the
rules as they are).

    python3 bench/small_m_ab.py --workloads smollm2,smolvla,unet --impl dawn --out $OUT/ab.json
        [--switch small_m|split_sum|small_m_split|split_576]

Prints per workload and mode the median ms per step of both and their ratio (range over
rounds), then the profiled rows."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import ours_step_times  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402
from meganeura.compile import schedule  # noqa: E402
from meganeura.kernels import matmul as mm  # noqa: E402
from meganeura.runtime.device import get_device  # noqa: E402

OFF = (1, 0)  # an empty K range: small_m_sliced is never true
KEEP = object()  # "on" = the module's value as it is
# switch -> [(module, attribute, its value when on (KEEP: as is), its value when off)]
SWITCHES = {"small_m": [(mm, "SMALL_M_K", KEEP, OFF)],
            "split_sum": [(schedule, "SPLIT_SUM_POINTWISE", KEEP, False)],
            "small_m_split": [(mm, "SMALL_M_SPLIT_K", KEEP, OFF)],
            # a candidate: the K 256-640 GEMMs split too (chunks of ~192 on the split tile)
            # instead of one sliced dispatch; off = the rules as they are
            "split_576": [(mm, "SMALL_M_K", OFF, KEEP), (mm, "SMALL_M_SPLIT_K", (256, 1024), KEEP)]}


def _sessions(w, dev, switch: str, on: bool) -> dict:
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _, _ in SWITCHES[switch]]
    for mod, attr, v_on, v_off in SWITCHES[switch]:
        v = v_on if on else v_off
        if v is not KEEP:
            setattr(mod, attr, v)
    try:
        inf = mn.compile(w.graph, outputs=w.outputs, device=dev)
        tr = mn.compile(w.graph, loss=w.loss, outputs={}, optimizer=optim.SGD(lr=1e-4),
                        device=dev)
    finally:
        for mod, attr, v in saved:
            setattr(mod, attr, v)
    inf.set_params(w.params)
    tr.set_params(w.params)
    return {"infer": inf, "train": tr}


def _rows(prof, top: int = 12) -> list[dict]:
    """The profile's matmul rows with M ≤ ``SMALL_M_ROWS[1]`` (and their split-K sums)."""
    out = []
    for r in prof.roofline():
        dims = r["label"].split()[1].split("x") if r["label"].startswith("matmul") else []
        if len(dims) == 4 and dims[1].isdigit() and int(dims[1]) <= mm.SMALL_M_ROWS[1]:
            out.append({k: r[k] for k in ("label", "calls", "mean_us", "tflops")})
    return sorted(out, key=lambda r: -r["mean_us"] * r["calls"])[:top]


def run(name: str, impl: str, rounds: int, steps: int, quick: bool,
        switch: str = "small_m") -> dict:
    w = WORKLOADS[name](quick=quick, variant="main")
    dev = get_device(impl)
    sess = {"on": _sessions(w, dev, switch, True), "off": _sessions(w, dev, switch, False)}
    rec: dict = {"workload": name, "median_ms": {}, "ratio": {}, "profile": {},
                 "dispatches": {k: {m: len(x.infer.stream.dispatches if m == "infer" else
                                          x.train.stream.dispatches) for m, x in s.items()}
                                for k, s in sess.items()}}
    for mode in ("infer", "train"):
        per = {k: [] for k in sess}
        for r in range(rounds):
            for k in (list(sess) if r % 2 == 0 else list(sess)[::-1]):
                ts = ours_step_times(sess[k][mode], mode == "infer", w.feeds, 2, steps)
                per[k].append(float(np.median(ts)) * 1e3)
        ratio = np.array(per["on"]) / np.array(per["off"])
        rec["median_ms"][mode] = {k: float(np.median(v)) for k, v in per.items()}
        rec["ratio"][mode] = [float(np.median(ratio)), float(ratio.min()), float(ratio.max())]
    if dev.has_timestamps:
        for k, s in sess.items():
            feeds = s["train"].program.feeds
            prof = s["train"].profile(steps=3, **{f: v for f, v in w.feeds.items() if f in feeds})
            rec["profile"][k] = {"gpu_ms": prof.gpu_ms_per_step, "rows": _rows(prof),
                                 "split_k": prof.split_k_groups()[:8]}
    return rec


def report(rec: dict) -> list[str]:
    lines = []
    for mode, r in rec["ratio"].items():
        m = rec["median_ms"][mode]
        d = {k: rec["dispatches"][k][mode] for k in ("on", "off")}
        lines.append(f"{rec['workload']:8} {mode:5} on {m['on']:8.2f} ms  off "
                     f"{m['off']:8.2f} ms  ratio {r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})  "
                     f"dispatches {d['on']} / {d['off']}")
    for k, p in rec["profile"].items():
        lines.append(f"  profile {k}: {p['gpu_ms']:.2f} ms GPU per training step")
        lines += [f"    {x['label'][:58]:58} {x['calls']:4} {x['mean_us']:7.1f} µs "
                  f"{x['tflops']:6.2f} TFLOP/s" for x in p["rows"]]
        lines += [f"    {x['label'][:48]:48} (partials + sum) {x['calls']:4} "
                  f"{x['mean_us']:7.1f} µs {x['tflops']:6.2f} TFLOP/s"
                  for x in p.get("split_k", [])]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="smollm2,smolvla,unet")
    ap.add_argument("--impl", default="dawn")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="tiny configs (lavapipe)")
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="small_m")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    recs, lines = [], []
    for name in a.workloads.split(","):
        recs.append(run(name, a.impl, a.rounds, a.steps, a.quick, a.switch))
        lines += report(recs[-1])
        print("\n".join(report(recs[-1])), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(recs, f, indent=1)
    print("== summary\n" + "\n".join(x for x in lines if " ratio " in x), flush=True)


if __name__ == "__main__":
    main()
