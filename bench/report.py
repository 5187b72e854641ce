"""Turn harness JSON into docs/benchmarks.md and PNG plots.

  python bench/report.py results.json [more.json ...] --out docs"""

from __future__ import annotations

import argparse
import json
import os


def _ms(cell, key):
    c = (cell or {}).get(key)
    return None if not c or "median_ms" not in c else c["median_ms"]


def _fmt(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def _passed(o) -> bool:
    """Strict gates against PyTorch f32, or (where recorded) the float64-aware gate."""
    g = o["gates"]
    return (g["fwd_pass"] and g["bwd_pass"]) or bool(o.get("gate64", {}).get("pass"))


def _best(rec, key):
    """Best valid (gates passed) time of ours over implementations, and which."""
    best = None
    for impl, o in rec.get("ours", {}).items():
        if "error" in o or not _passed(o):
            continue
        t = _ms(o, key)
        if t is not None and (best is None or t < best[0]):
            best = (t, impl)
    return best


def _fast_cell(rec):
    """Our fast cells (implementation, record) with passing fast gates, best inference first."""
    cells = [(impl, o["fast"]) for impl, o in rec.get("ours", {}).items()
             if "gates" in o.get("fast", {})]
    return sorted(cells, key=lambda c: c[1]["infer"]["median_ms"])


def fast_ratios(rec):
    """(our fast time / PyTorch's best fast time) for inference and SGD training, over passing
    cells; None where there is nothing to compare."""
    c = rec["torch"]["cells"]
    out = {}
    for key in ("infer", "train_sgd"):
        theirs = [t for t in (_ms(c.get("eager_tf32"), key), _ms(c.get("eager_bf16"), key)) if t]
        ours = [f[key]["median_ms"] for _, f in _fast_cell(rec)
                if f["gates"]["fwd_pass"] and f["gates"]["bwd_pass"]]
        out[key] = min(ours) / min(theirs) if ours and theirs else None
    return out


def fast_section(records) -> list[str]:
    L = ["\n## Fast path: our `precision=\"fast\"` vs PyTorch TF32 / bf16 autocast (eager; ms)\n",
         "Ours: matmuls with operands rounded to f16 and f32 accumulation on the tensor cores "
         "(Dawn's f16 subgroup matrices); convolutions, attention and everything else stay f32. "
         "wgpu-native has no tensor-core access, so there fast is the strict program. Fast "
         "gates: forward rel. L2 ≤ 1e-2, every gradient ≤ 5e-2 and cosine ≥ 0.99 against "
         "PyTorch f32. Ratio: our fast time ÷ the faster of PyTorch's TF32 and bf16. Compile "
         "times are after the strict sessions of the same process (driver cache warm for the "
         "f32 kernels); each distinct tensor-core pipeline costs Dawn and the driver 0.6–0.8 s "
         "on this machine, which makes fast compiles of the transformer training graphs slow.\n",
         "| workload | ours fast infer | ours fast train SGD | TF32 infer | TF32 train SGD | "
         "bf16 infer | bf16 train SGD | ratio infer | ratio train | fast gate fwd / bwd / "
         "cos | tensor-core matmuls infer / train | compile infer / train SGD (s) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            continue
        c = r["torch"]["cells"]
        fc = _fast_cell(r)
        if fc:
            impl, f = fc[0]
            g = f["gates"]
            ok = g["fwd_pass"] and g["bwd_pass"]
            mine = ((_fmt(f["infer"]["median_ms"]), _fmt(f["train_sgd"]["median_ms"])) if ok
                    else ("fail", "fail"))
            gate = (f"{g['fwd_rel_l2']:.1e} / {g['bwd_rel_l2']:.1e} / {g['bwd_min_cos']:.4f} "
                    f"{'pass' if ok else '**fail**'} ({impl})")
            tc = (f"{f['infer'].get('tensor_core_kernels', '?')} / "
                  f"{f['train_sgd'].get('tensor_core_kernels', '?')} | "
                  f"{_fmt(f.get('compile_infer_s'))} / {_fmt(f.get('compile_train_sgd_s'))}")
        else:
            mine, gate, tc = ("—", "—"), "not measured", "— | —"
        ra = fast_ratios(r)
        L.append(f"| {r['key']} | {mine[0]} | {mine[1]} | "
                 f"{_fmt(_ms(c.get('eager_tf32'), 'infer'))} | "
                 f"{_fmt(_ms(c.get('eager_tf32'), 'train_sgd'))} | "
                 f"{_fmt(_ms(c.get('eager_bf16'), 'infer'))} | "
                 f"{_fmt(_ms(c.get('eager_bf16'), 'train_sgd'))} | {_fmt(ra['infer'])} | "
                 f"{_fmt(ra['train_sgd'])} | {gate} | {tc} |")
    worst = [fast_ratios(r)["train_sgd"] for r in records if "error" not in r]
    worst = [x for x in worst if x is not None]
    if worst:
        L.append(f"\nWorst fast-path training ratio: {max(worst):.2f} (target ≤ 2.5).\n")
    return L


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return None if not n else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)


def headline(records) -> list[str]:
    """The figures the design's targets are stated in, computed from the tables below."""
    recs = [r for r in records if "error" not in r]
    L = ["\n## Headline\n"]

    def ratios(key, base):
        out = {}
        for r in recs:
            best = _best(r, key)
            t = _ms(r["torch"]["cells"].get(base), key)
            if best and t:
                out[r["key"]] = best[0] / t
        return out

    for key, what in (("train_sgd", "SGD"), ("train_adamw", "AdamW")):
        for variant in ("main", "minlat"):
            rs = {k: v for k, v in ratios(key, "compile_f32").items()
                  if k.endswith("/" + variant)}
            if rs:
                L.append(f"- Strict-f32 training ({what}, {variant} rows), our time ÷ "
                         f"torch.compile: median **{_median(list(rs.values())):.2f}** over "
                         f"{len(rs)} workloads that passed their gates ("
                         + ", ".join(f"{k.split('/')[0]} {v:.2f}" for k, v in rs.items()) + ").")
    for base, name in (("eager_f32", "PyTorch eager"), ("compile_f32", "torch.compile")):
        for key, what in (("infer", "inference"), ("train_sgd", "SGD training")):
            rs = ratios(key, base)
            wins = sorted(k for k, v in rs.items() if v < 1.0)
            L.append(f"- Strict-f32 {what} faster than {name}: **{len(wins)} of {len(recs)}** "
                     f"rows ({', '.join(wins) or 'none'}).")
    worst = [x for x in (fast_ratios(r)["train_sgd"] for r in recs) if x is not None]
    if worst:
        L.append(f"- Fast path, worst training ratio vs the faster of PyTorch TF32 / bf16: "
                 f"**{max(worst):.2f}** ({len(worst)} rows).")
    ours_c, theirs_c = [], []
    for r in recs:
        for o in r["ours"].values():
            if "error" not in o:
                ours_c += [o["compile_infer_s"], o["compile_train_sgd_s"]]
        c = r["torch"]["cells"].get("compile_f32", {})
        theirs_c += [c[k] for k in ("compile_infer_s", "compile_train_s") if c.get(k)]
    if ours_c and theirs_c:
        L.append(f"- Compile, graph → ready session (cold pipeline cache): {min(ours_c):.2f}–"
                 f"{max(ours_c):.2f} s, against torch.compile's {min(theirs_c):.1f}–"
                 f"{max(theirs_c):.1f} s.")
    return L


def build(records, out_dir, plan_memory=None) -> str:
    os.makedirs(out_dir, exist_ok=True)
    L = []
    meta = next((r for r in records if "torch" in r), {})
    dev = meta.get("torch", {}).get("device", "?")
    impl_dev = {}
    for r in records:
        for impl, o in r.get("ours", {}).items():
            impl_dev.setdefault(impl, o.get("device", "?"))
    L.append("# Benchmarks: meganeura vs PyTorch\n")
    tv = meta.get("torch", {}).get("torch", "?")
    L.append(f"Date: {meta.get('date', '?')}; GPU: {dev}; PyTorch {tv}; "
             f"our implementations: {', '.join(f'{k} ({v})' for k, v in impl_dev.items())}. "
             "Median of timed steps after warm-ups, GPU synchronized each step; IQR in the JSON. "
             "Strict f32 (TF32 off on both sides). A cell whose gate failed shows `fail`.\n")
    refreshed = sorted({(r.get("refresh"), r.get("ours_date")) for r in records
                        if r.get("refresh")})
    if refreshed:
        L.append("Our cells were re-measured later in the same setup ("
                 + ", ".join(f"run `{t}` on {d}" for t, d in refreshed)
                 + "; `bench/harness.py --refresh-ours`), against the PyTorch timings of the "
                 "first run; the gate references were recomputed by PyTorch in that run.\n")
    L.append("Software: wgpu 0.32.0 (wgpu-native) and wgpudawn 0.32.0.4 (Dawn) as pinned in "
             "pyproject.toml; NVIDIA driver 580.159.04, Vulkan (docs/gpu-runtime.md).\n")
    L.append("Reproduce on the GPU machine (after `source .gpu/env.sh`): `bash bench/gpu_run.sh "
             "$OUT [workloads]` (resumable: results accumulate in bench/results/h200.json), "
             "`python3 bench/gate_f64.py resnet50 $OUT/gate64.json --impl wgpu|dawn [--variant "
             "minlat]`; render with `python bench/report.py bench/results/h200.json --gate64 "
             "bench/results/gate64-*.json --plan-memory bench/results/plan-memory.json "
             "--out docs`.  This run: `bash bench/gpu_run.sh $OUT "
             "smollm2,smolvla --minlat --fast --refresh-ours r2` (then unet, whisper, resnet50 "
             "in two more calls).\n")
    if any(r.get("variant") == "minlat" for r in records):
        L.append("Rows `/minlat` are the minimal-latency variants: batch 1 (ResNet-50, U-Net), "
                 "sequence 2 (SmolLM2: the shortest next-token step), action chunk 1 (SmolVLA). "
                 "Whisper's main row already is batch 1, so it has no separate row.\n")
    L += headline(records)
    keys = [("infer", "inference"), ("train_sgd", "train step (SGD)"),
            ("train_adamw", "train step (AdamW)")]
    for key, title in keys:
        L.append(f"\n## Strict f32 — {title} (ms)\n")
        L.append("| workload | ours wgpu | ours dawn | PyTorch eager | torch.compile | "
                 "PyTorch CUDA graph | ours/eager | ours/compile |")
        L.append("|---|---|---|---|---|---|---|---|")
        for r in records:
            if "error" in r:
                L.append(f"| {r['key']} | error: {r['error'][:80]} | | | | | | |")
                continue
            cells = r["torch"]["cells"]
            ours = {}
            for impl in ("wgpu", "dawn"):
                o = r["ours"].get(impl)
                if o is None:
                    ours[impl] = "—"
                elif "error" in o:
                    ours[impl] = "error"
                elif not _passed(o):
                    ours[impl] = "fail"
                else:
                    strict = o["gates"]["fwd_pass"] and o["gates"]["bwd_pass"]
                    ours[impl] = _fmt(_ms(o, key)) + ("" if strict else " †")
            eager = _ms(cells.get("eager_f32"), key)
            comp = _ms(cells.get("compile_f32"), key)
            best = _best(r, key)
            ratio_e = _fmt(best[0] / eager) if best and eager else "—"
            ratio_c = _fmt(best[0] / comp) if best and comp else "—"
            graph = _ms(cells.get("cuda_graph_f32"), key)
            L.append(f"| {r['key']} | {ours['wgpu']} | {ours['dawn']} | {_fmt(eager)} | "
                     f"{_fmt(comp)} | {_fmt(graph)} | {ratio_e} | {ratio_c} |")
    L.append("\n## Compile time (s): graph → ready session vs torch.compile (first call)\n")
    L.append("Ours on both implementations, our pipeline cache emptied before each compile. The "
             "SGD train compile is the first to meet the training kernels, so it also pays the "
             "NVIDIA driver's shader compilation; the AdamW compile right after it mostly finds "
             "those shaders in the driver's cache (what a second process would see). In this "
             "run parameters were read at their offset inside the optimizer's flat vector, "
             "baked into the WGSL, so training graphs had many more distinct pipelines than "
             "inference (SmolLM2: 298 of 1,530 kernels vs 16 of 484). Since then parameters "
             "are bound as their own buffer range (and the plan has fewer kernels): distinct "
             "pipelines per SGD training step SmolLM2 298 → 51, SmolVLA 244 → 68, U-Net 219 "
             "→ 167, Whisper 128 → 79, ResNet-50 456 → 268 (`bench/plan_memory.py --align 32 "
             "--pipelines`; compile times not yet re-measured on the H200).\n")
    L.append("| workload | impl | ours infer (cold / warm) | ours train SGD (cold) | ours train "
             "AdamW (after SGD) | torch.compile fwd | torch.compile train |")
    L.append("|---|---|---|---|---|---|---|")
    for r in records:
        if "error" in r:
            continue
        c = r["torch"]["cells"].get("compile_f32", {})
        for impl, o in r["ours"].items():
            if "error" in o:
                continue
            L.append(f"| {r['key']} | {impl} | {o['compile_infer_s']:.2f} / "
                     f"{o['compile_infer_warm_s']:.2f} | {o['compile_train_sgd_s']:.2f} | "
                     f"{_fmt(o.get('compile_train_adamw_s'))} | "
                     f"{_fmt(c.get('compile_infer_s'))} | {_fmt(c.get('compile_train_s'))} |")
    L.append("\n## Peak GPU memory (MB): our plan's figure vs torch.cuda.max_memory_allocated\n")
    L.append("| workload | ours infer | torch infer | ours train SGD | torch train SGD | "
             "ours train AdamW | torch train AdamW |")
    L.append("|---|---|---|---|---|---|---|")
    for r in records:
        if "error" in r:
            continue
        o = next((o for o in r["ours"].values() if "error" not in o), None)
        e = r["torch"]["cells"]["eager_f32"]
        if o is None:
            continue

        def mb(x):
            return "—" if x is None else f"{x / 2**20:.1f}"
        L.append(f"| {r['key']} | {mb(o['infer']['peak_bytes'])} | {mb(e.get('infer_peak'))} | "
                 f"{mb(o['train_sgd']['peak_bytes'])} | {mb(e.get('train_sgd_peak'))} | "
                 f"{mb(o['train_adamw']['peak_bytes'])} | {mb(e.get('train_adamw_peak'))} |")
    if plan_memory:
        L.append("\nPlanned peak and dispatch counts after planner changes made since the run "
                 "above (one-op elementwise values read by several kernels recomputed in each "
                 "instead of stored, when that keeps nothing larger alive; fused-projection "
                 "weights read as their range of the parameter buffer instead of concatenated "
                 "every step; the arena placed first-fit or best-fit, whichever is smaller; "
                 "neighbouring elementwise kernels of a training step merged into one "
                 "dispatch; bindings aligned to the device's own storage-offset alignment "
                 "instead of 256 bytes, so SmolVLA's 720-wide parameters get their own "
                 "ranges too; relu's backward reading its output, so batch norm's output "
                 "need not stay alive; head concats of batch-1 attention gradients written "
                 "in place; the attention output stored as (B, S, H, D) for the output "
                 "projection; split-K matmuls taking their epilogue in the ordered sum; norms "
                 "applying their result in the reduction's own dispatch): our "
                 "figures recomputed without a GPU by "
                 "`bench/plan_memory.py --align 32` (the H200's alignment on wgpu-native; "
                 "Dawn's is 16 and gives the same plans), PyTorch's from the run above. "
                 "Latencies not yet re-measured.\n")
        L.append("| workload | ours infer | ours train SGD | torch train SGD | ours train AdamW "
                 "| torch train AdamW | dispatches infer / train (measured run → now) |")
        L.append("|---|---|---|---|---|---|---|")
        for r in records:
            pm = plan_memory.get(r.get("workload"))
            if pm is None or "error" in r or r.get("variant", "main") != "main":
                continue
            e = r["torch"]["cells"]["eager_f32"]

            def mb2(x):
                return "—" if x is None else f"{x / 2**20:.1f}"
            o = next((o for o in r["ours"].values() if "error" not in o), {})
            disp = (f"{o.get('infer', {}).get('dispatches', '?')} → {pm['infer'][1]} / "
                    f"{o.get('train_sgd', {}).get('dispatches', '?')} → {pm['train_sgd'][1]}")
            L.append(f"| {r['key']} | {mb2(pm['infer'][0])} | {mb2(pm['train_sgd'][0])} | "
                     f"{mb2(e.get('train_sgd_peak'))} | {mb2(pm['train_adamw'][0])} | "
                     f"{mb2(e.get('train_adamw_peak'))} | {disp} |")
    L.append("\n## Gates (strict: forward rel. L2 ≤ 1e-4, every gradient rel. L2 ≤ 1e-3)\n")
    L.append("| workload | impl | forward rel L2 | worst gradient rel L2 (param) | min cosine | "
             "result |")
    L.append("|---|---|---|---|---|---|")
    for r in records:
        for impl, o in r.get("ours", {}).items():
            if "error" in o:
                L.append(f"| {r['key']} | {impl} | error: {o['error'][:100]} | | | fail |")
                continue
            g = o["gates"]
            ok = "pass" if g["fwd_pass"] and g["bwd_pass"] else "**fail**"
            L.append(f"| {r['key']} | {impl} | {g['fwd_rel_l2']:.2e} | {g['bwd_rel_l2']:.2e} "
                     f"({g['worst_param']}) | {g['bwd_min_cos']:.6f} | {ok} |")
    g64 = [(r["key"], impl, o["gate64"]) for r in records
           for impl, o in r.get("ours", {}).items() if "gate64" in o]
    if g64:
        L.append("\n† Float64-aware gate (`bench/gate_f64.py`): where PyTorch's own f32 result "
                 "is too far from float64 to judge ours (ill-conditioned batch-norm gradients "
                 "at full size), ours must be within the strict tolerance of float64 or no "
                 "further from it than twice PyTorch f32's error.\n")
        L.append("| workload | impl | worst tensor | ours vs f64 | PyTorch f32 vs f64 | "
                 "ours vs PyTorch f32 | result |")
        L.append("|---|---|---|---|---|---|---|")
        for key, impl, g in g64:
            w = g["worst_row"]
            L.append(f"| {key} | {impl} | {g['worst']} | {w['ours_vs_f64']:.2e} | "
                     f"{w['torch32_vs_f64']:.2e} | {w['ours_vs_torch32']:.2e} | "
                     f"{'pass' if g['pass'] else '**fail**'} |")
    L += fast_section(records)
    L.append("\n## Dispatch profiles (our training step, SGD)\n")
    for r in records:
        for impl, o in r.get("ours", {}).items():
            if "profile" in o:
                L.append(f"\n### {r['key']} — {impl}\n\n```\n{o['profile']['table']}\n```")
                if o.get("trace"):
                    name = os.path.basename(o["trace"])
                    L.append(f"Trace: `docs/traces/{name}.gz` (Chrome / Perfetto)")
    _plots(records, out_dir)
    L.append("\n![ratios](bench-ratios.png)\n\n![compile](bench-compile.png)\n")
    return "\n".join(L) + "\n"


def _plots(records, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if "error" not in r]
    if not recs:
        return
    names = [r["key"] for r in recs]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names)), 3.8))
    width = 0.2
    for j, (key, base) in enumerate([("infer", "eager_f32"), ("train_sgd", "eager_f32"),
                                     ("infer", "compile_f32"), ("train_sgd", "compile_f32")]):
        vals = []
        for r in recs:
            best = _best(r, key)
            t = _ms(r["torch"]["cells"].get(base), key)
            vals.append(best[0] / t if best and t else 0)
        ax.bar([i + (j - 1.5) * width for i in range(len(names))], vals, width,
               label=f"{key} / {base.split('_')[0]}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("our time / PyTorch time (lower is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench-ratios.png"), dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names)), 3.8))
    ours = [next((o["compile_train_sgd_s"] for o in r["ours"].values() if "error" not in o), 0)
            for r in recs]
    tc = [r["torch"]["cells"].get("compile_f32", {}).get("compile_train_s") or 0 for r in recs]
    ax.bar([i - 0.2 for i in range(len(names))], ours, 0.4, label="meganeura (train graph)")
    ax.bar([i + 0.2 for i in range(len(names))], tc, 0.4, label="torch.compile (train)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench-compile.png"), dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default="docs")
    p.add_argument("--gate64", nargs="*", help="bench/gate_f64.py results to attach")
    p.add_argument("--plan-memory", help="bench/plan_memory.py --json output")
    args = p.parse_args(argv)
    records = []
    for path in args.results:
        records += json.load(open(path))
    for path in args.gate64 or []:  # float64-aware gates, attached to their workload/impl
        g = json.load(open(path))
        for r in records:
            if (r.get("workload") == g["workload"] and g["impl"] in r.get("ours", {})
                    and r.get("variant", "main") == g.get("variant", "main")):
                r["ours"][g["impl"]]["gate64"] = {k: v for k, v in g.items() if k != "rows"}
    pm = json.load(open(args.plan_memory)) if args.plan_memory else None
    text = build(records, args.out, pm)
    with open(os.path.join(args.out, "benchmarks.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
