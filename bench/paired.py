"""Paired, interleaved timing: ours against PyTorch in alternating rounds, so that drift of the
machine (clock boost, other processes, the launch-bound eager path moving ±30–50 % between
calls minutes apart) hits both sides alike.

``bench/harness.py`` times PyTorch first and ours afterwards (and checks the gates); a ratio
from it compares two moments.  Here every cell is built first — our inference and SGD training
sessions, the PyTorch twin eager, optionally ``torch.compile`` and the CUDA-graph replay — and
then ``--rounds`` rounds each time every cell for ``--steps`` steps (after ``--warmup``), in a
rotating order.  Reported per cell: the median over all timed steps; per ratio (ours ÷ a
PyTorch cell): the median over rounds and its range.  A claim "faster" needs the *worst*
round's ratio below 1.

    python3 bench/paired.py --workloads whisper,resnet50 --impl dawn --rounds 5 \
        --out $OUT/paired.json [--torch-compile] [--no-cuda-graph] [--quick] [--fast]

``--fast`` adds our ``precision="fast"`` cells ("fast/infer", "fast/train") and the ratios
fast ÷ strict ("fast/ours/…": below 1 = the fast program is faster) and fast ÷ each PyTorch
cell; ``--no-torch`` leaves PyTorch out (ours only).

Timing only: the gates (exactness against PyTorch) are ``harness.py``'s job.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from harness import (  # noqa: E402
    cuda_graph_steps,
    ours_step_times,
    step_seconds,
    torch_reference,
)

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402


def _torch_cells(w, args) -> dict:
    """name -> timer(warmup, steps) -> ms per step, for the PyTorch side."""
    import torch

    m, feeds, _ = torch_reference(w, args)
    cuda = torch.cuda.is_available() and args.torch_device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def infer_fn(model):
        def fwd():
            with torch.no_grad():
                w.torch_loss(model, feeds)
        return fwd

    def train_fn(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            w.torch_loss(model, feeds)[0].backward()
            opt.step()
        return step

    fns = {"eager/infer": infer_fn(m), "eager/train": train_fn(m)}
    if args.torch_compile:
        torch._dynamo.reset()
        cm = torch.compile(m)
        fns["compile/infer"], fns["compile/train"] = infer_fn(cm), train_fn(cm)
    if cuda and not args.no_cuda_graph:
        steps = cuda_graph_steps(w, m, feeds)
        fns.update({"graph/infer": steps["infer"], "graph/train": steps["train_sgd"]})
    return {k: _torch_timer(fn, sync) for k, fn in fns.items()}


def _torch_timer(fn, sync):
    def timer(warmup: int, steps: int) -> list[float]:
        return [t * 1e3 for t in step_seconds(fn, sync, warmup, steps)]
    return timer


def _ours_cells(w, impl: str, precision: str = "strict") -> dict:
    """Our inference run and SGD training step, compiled once, as timers ("ours/…", or
    "fast/…" for ``precision="fast"``)."""
    from meganeura.runtime.device import get_device

    dev = get_device(impl)
    inf = mn.compile(w.graph, outputs=w.outputs, device=dev, precision=precision)
    inf.set_params(w.params)
    tr = mn.compile(w.graph, loss=w.loss, outputs={}, optimizer=optim.SGD(lr=1e-4), device=dev,
                    precision=precision)
    tr.set_params(w.params)

    def timer(sess, inference):
        return lambda warmup, steps: [t * 1e3 for t in ours_step_times(
            sess, inference, w.feeds, warmup, steps)]
    mine = "fast" if precision == "fast" else "ours"
    return {f"{mine}/infer": timer(inf, True), f"{mine}/train": timer(tr, False)}


def run_workload(name: str, args) -> dict:
    from workloads import WORKLOADS

    w = WORKLOADS[name](quick=args.quick, variant="main")
    cells = {**({} if args.no_torch else _torch_cells(w, args)), **_ours_cells(w, args.impl)}
    if args.fast:
        cells.update(_ours_cells(w, args.impl, "fast"))
    for timer in cells.values():  # first calls: torch.compile compiles, pipelines warm up
        timer(1, 1)
    names = list(cells)
    per_round: dict[str, list[float]] = {k: [] for k in names}
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            ts = cells[k](args.warmup, args.steps)
            samples[k] += ts
            per_round[k].append(float(np.median(ts)))
    rec = {"workload": name, "impl": args.impl, "rounds": args.rounds, "steps": args.steps,
           "date": time.strftime("%Y-%m-%d"),
           "median_ms": {k: float(np.median(v)) for k, v in samples.items()},
           "round_median_ms": per_round, "ratios": {}}
    for mode in ("infer", "train"):
        for mine, others in (("ours", ("eager", "compile", "graph")),
                             ("fast", ("ours", "eager", "compile", "graph"))):
            if f"{mine}/{mode}" not in per_round:
                continue
            ours = np.array(per_round[f"{mine}/{mode}"])
            for other in others:
                k = f"{other}/{mode}"
                if k in per_round:
                    r = ours / np.array(per_round[k])
                    rec["ratios"][f"{mine}/{k}"] = {"median": float(np.median(r)),
                                                    "min": float(r.min()),
                                                    "max": float(r.max())}
    del cells
    gc.collect()
    return rec


def verdict(ratio: dict) -> str:
    if ratio["max"] < 1:
        return "faster"
    if ratio["min"] > 1:
        return "slower"
    return "parity"


def print_table(recs: list[dict]) -> None:
    print(f"{'workload':10s} {'cell':18s} {'ours ms':>8s} {'theirs ms':>9s} "
          f"{'ratio med [min, max]':>24s}  verdict")
    for rec in recs:
        for key, r in rec["ratios"].items():
            mine, theirs = key.split("/", 1)
            mode = key.split("/")[-1]
            cell = theirs if mine == "ours" else f"fast÷{theirs}"
            print(f"{rec['workload']:10s} {cell:18s} {rec['median_ms'][f'{mine}/{mode}']:8.2f} "
                  f"{rec['median_ms'][theirs]:9.2f} "
                  f"{r['median']:8.2f} [{r['min']:.2f}, {r['max']:.2f}]  {verdict(r)}")


def plot(recs: list[dict], path: str) -> None:
    """Bars: ours ÷ each PyTorch cell (median over rounds, whiskers: the best and worst round),
    and with ``--fast`` our fast program ÷ our strict one, inference and training side by side
    per workload; below 1 = ours (fast) faster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in recs if r.get("ratios")]
    series = [(f"ours/{o}", f"÷ {o}") for o in ("eager", "compile", "graph")
              if any(f"ours/{o}/infer" in r["ratios"] for r in recs)]
    if any("fast/ours/infer" in r["ratios"] for r in recs):
        series.append(("fast/ours", "fast ÷ strict (ours)"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    width = 0.8 / max(len(series), 1)
    for ax, mode in zip(axes, ("infer", "train")):
        for j, (key, label) in enumerate(series):
            xs, med, lo, hi = [], [], [], []
            for i, r in enumerate(recs):
                q = r["ratios"].get(f"{key}/{mode}")
                if q:
                    xs.append(i + (j - (len(series) - 1) / 2) * width)
                    med.append(q["median"])
                    lo.append(q["median"] - q["min"])
                    hi.append(q["max"] - q["median"])
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(recs)), [r["workload"] for r in recs])
        ax.set_title({"infer": "inference", "train": "SGD training step"}[mode])
    axes[0].set_ylabel("ratio (< 1: ours / fast faster)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="whisper,resnet50,unet,smolvla,smollm2")
    p.add_argument("--impl", default="dawn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--torch-device", default=None)
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--fast", action="store_true",
                   help="also our precision='fast' cells, ratios against strict and PyTorch")
    p.add_argument("--no-torch", action="store_true", help="our cells only")
    p.add_argument("--quick", action="store_true", help="tiny configs (lavapipe/CPU)")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", help="only draw the PNG of the --out JSON (no timing)")
    args = p.parse_args(argv)
    if args.plot:
        with open(args.out) as f:
            plot(json.load(f), args.plot)
        return 0
    if args.torch_device is None and not args.no_torch:
        import torch

        args.torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    recs = []
    for name in args.workloads.split(","):
        t0 = time.perf_counter()
        try:
            rec = run_workload(name, args)
        except Exception as e:  # noqa: BLE001 - record, keep going with the next workload
            rec = {"workload": name, "error": f"{type(e).__name__}: {e}"[:600], "ratios": {}}
            print(f"{name}: ERROR {rec['error'][:200]}", flush=True)
        rec["seconds"] = time.perf_counter() - t0
        recs.append(rec)
        with open(args.out, "w") as f:
            json.dump(recs, f, indent=1)
        print(f"{name}: {rec['seconds']:.0f} s", flush=True)
    print_table([r for r in recs if "error" not in r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
