"""Whisper-tiny's GEMMs under split-K / tile-config variants, measured inside the model.

  python bench/whisper_gemm_variants.py [--variants base,a,b] [--rounds 2] [--quick] [--json F]
  python bench/whisper_gemm_variants.py --list [workloads] [--json F]

The variants replace ``compile.schedule.split_k`` and ``kernels.matmul.choose_config`` for
named GEMM shapes only, and ``kernels.conv.choose_split_k`` for named conv GEMMs, or set a
rule (``ONE_STORE_PATH_FOR_HELPERS``, the pre-wmm5 ``mn_gelu_erf``) — monkeypatched here: the
library has no hooks for this — compile
Whisper's inference and SGD training step once per variant, and profile them interleaved
(A B … A B …) ``--rounds`` times so a GPU clock drifting during the run shows up as rounds
disagreeing rather than as a variant winning.  Which variants run: ``--variants`` or else
``$MEGANEURA_BENCH_GEMM_VARIANTS`` (comma separated; default all).  Prints, per variant and
round, the GPU µs per step of every matmul shape and conv (plus its split-K sum) and the step's
GPU ms, then a summary table (medians over rounds).

``--list``: device-free, the GEMM labels and tile configs each workload's main inference and
SGD training plans get under the current heuristics, for the H200's limits (diff two checkouts'
outputs to see which shapes a heuristic change moves)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meganeura.compile import schedule  # noqa: E402
from meganeura.kernels import conv, matmul, wgsl_helpers  # noqa: E402
from meganeura.kernels.matmul import NAMED, Cfg  # noqa: E402

ENV = "MEGANEURA_BENCH_GEMM_VARIANTS"
# mn_gelu_erf before wmm5 (erf and erfc nested, each with its own branches)
NESTED_GELU = """fn mn_gelu_erf(x: f32) -> f32 {
    let u = x * 0.70710678118654752;
    if (x < 0.0) {
        return 0.5 * x * mn_erfc(-u);
    }
    return 0.5 * x * (1.0 + mn_erf(u));
}
"""
CFGS = {"128x64": Cfg("tiled", 128, 64, 8, 4, 16, 1), "64x64w": Cfg("tiled", 64, 64, 8, 4, 16, 1),
        "tiled64v": NAMED["tiled64v"], "tiled128v": NAMED["tiled128v"],
        # wave-count candidates: 96-row tiles (12x4 blocks, 128 invocations) and 64x32 (4x4, 128)
        "96x64": Cfg("tiled", 96, 64, 12, 4, 16, 1), "64x32v": Cfg("tiled", 64, 32, 4, 4, 16, 1)}
# Whisper-tiny's GEMM shapes (M, N, K) at 1,500 frames
FC2, FC1, QKV, OUT = (1500, 384, 1536), (1500, 1536, 384), (1500, 1152, 384), (1500, 384, 384)
W_FC2, W_FC1 = (1536, 384, 1500), (384, 1536, 1500)
W_QKV, DX_QKV, W_OUT = (1152, 384, 1500), (1500, 384, 1152), (384, 384, 1500)
LONG_K = (FC2, W_FC2, W_FC1, W_QKV, DX_QKV, W_OUT)
CONV2 = (384, 1500, 1152)  # the stem's second conv (stride 2) as a GEMM (out channels, pixels, K)
# name -> ({shape: split}, {shape: config name}[, {rule: value}]); shapes absent keep the
# heuristic's choice.  Rules: "gelu" "nested" = mn_gelu_erf as before wmm5 (``NESTED_GELU``),
# "one_path" = kernels.matmul.ONE_STORE_PATH_FOR_HELPERS, "conv_split" = {conv GEMM (M, N, K):
# global split-K}.
VARIANTS: dict[str, tuple] = {
    "base": ({}, {}),
    "main": ({}, {}, {"gelu": "nested", "one_path": False}),  # main before wmm5
    "gelu1": ({}, {}, {"one_path": False}),  # the new gelu, epilogue copies as before
    "cs6": ({}, {}, {"conv_split": {CONV2: 6}}),
    "t96": ({}, {FC1: "96x64", QKV: "96x64", OUT: "96x64", FC2: "96x64"},
            {"conv_split": {CONV2: 3}}),
    "t64x32": ({}, {FC1: "64x32v", QKV: "64x32v", OUT: "64x32v", FC2: "64x32v"},
               {"conv_split": {CONV2: 6}}),
    "cs2": ({}, {}, {"conv_split": {CONV2: 2}}),
    "s2": ({FC2: 2, FC1: 2, QKV: 2, OUT: 2}, {}),
    "s3": ({FC2: 3, W_FC2: 3, W_FC1: 3, W_QKV: 3, DX_QKV: 3, W_OUT: 3}, {}),
    "s6": ({s: 6 for s in LONG_K}, {FC1: "tiled64v", QKV: "tiled64v", OUT: "64x64w"}),
    "s8": ({FC2: 8, W_FC2: 10, W_FC1: 10, W_QKV: 10, DX_QKV: 8, W_OUT: 10},
           {FC1: "64x64w", QKV: "128x64", OUT: "128x64"}),
    "s12": ({s: 12 for s in LONG_K}, {FC1: "tiled128v"}),
    "s4v": ({}, {FC2: "tiled64v", W_FC2: "tiled64v", W_QKV: "tiled64v", DX_QKV: "tiled64v"}),
}


@contextlib.contextmanager
def patched(name: str):
    """Compile under variant ``name``: its splits / configs for its shapes, the heuristics'
    elsewhere.  A config is keyed by the unsplit shape (a split GEMM is a batch of ``s``
    matmuls of K / s, so batch x K gives the shape's K back)."""
    splits, cfgs, rules = (*VARIANTS[name], {})[:3]
    old_split, old_cfg = schedule.split_k, matmul.choose_config
    old_path, old_conv_split = matmul.ONE_STORE_PATH_FOR_HELPERS, conv.choose_split_k
    old_gelu = wgsl_helpers.HELPERS["mn_gelu_erf"]
    conv_splits = rules.get("conv_split", {})

    def choose_split_k(M, N, K, GB, *args):
        s = conv_splits.get((M, N, K)) if GB == 1 else None
        return old_conv_split(M, N, K, GB, *args) if s is None else s

    def split_k(desc):
        s = splits.get((desc.m, desc.n, desc.k)) if desc.batch == 1 else None
        if s is None:
            return old_split(desc)
        if desc.k % s:
            raise ValueError(f"variant {name!r}: split {s} does not divide K = {desc.k}")
        return s

    def choose_config(B, M, N, K, tensor_cores=False):
        c = cfgs.get((M, N, B * K))
        return old_cfg(B, M, N, K, tensor_cores) if c is None else CFGS[c]

    schedule.split_k, matmul.choose_config = split_k, choose_config
    matmul.ONE_STORE_PATH_FOR_HELPERS = rules.get("one_path", old_path)
    if rules.get("gelu") == "nested":
        wgsl_helpers.HELPERS["mn_gelu_erf"] = (NESTED_GELU, ("mn_erf", "mn_erfc"))
    conv.choose_split_k = choose_split_k
    try:
        yield
    finally:
        schedule.split_k, matmul.choose_config = old_split, old_cfg
        matmul.ONE_STORE_PATH_FOR_HELPERS, conv.choose_split_k = old_path, old_conv_split
        wgsl_helpers.HELPERS["mn_gelu_erf"] = old_gelu


def gemm_groups(prof) -> dict[str, float]:
    """GPU µs per step of each matmul shape ``MxNxK`` (all its calls, split-K sums included),
    and of each convolution (``conv2d (N, C, H, W)``, its split-K sum included)."""
    out: dict[str, float] = {}
    for k in prof.kernels:
        m = re.match(r"matmul 1x(\d+x\d+x\d+)|(conv2d\w* \([\d, ]+\))", k.label)
        if m:
            key = m.group(1) or m.group(2).replace(" ", "")
            out[key] = out.get(key, 0.0) + k.total_ns / 1e3 / prof.steps
    return out


def compile_all(names, quick: bool, dev):
    from workloads import WORKLOADS

    import meganeura as mn
    from meganeura import optim

    w = WORKLOADS["whisper"](quick=quick, variant="main")
    sessions = {}
    for name in names:
        with patched(name):
            for mode in ("infer", "train"):
                kw = (dict(outputs=w.outputs) if mode == "infer"
                      else dict(loss=w.loss, optimizer=optim.SGD(lr=1e-4)))
                sess = mn.compile(w.graph, precision="strict", device=dev, tune=False, **kw)
                sess.set_params(w.params)
                ex = sess.infer if mode == "infer" else sess.train
                sessions[name, mode] = (sess, [(d.label, _variant(d)) for d in ex.stream.dispatches
                                               if d.label.startswith(("matmul", "conv"))])
    return w, sessions


def _variant(d) -> str:
    """A dispatch's variant, ``+<n>h`` when its epilogue calls WGSL helpers: the number of
    inlined helper calls in its WGSL (one copy per result, or two with an edge copy)."""
    n = len(re.findall(r"= mn_\w+\(q", d.spec.wgsl))
    return d.variant + (f"+{n}h" if n else "")


def measure(a) -> dict:
    from meganeura.runtime import profile as profile_mod
    from meganeura.runtime.device import get_device

    profile_mod.WARMUP_SECONDS = 0.3
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    dev = get_device(a.impl)
    t0 = time.time()
    w, sessions = compile_all(names, a.quick, dev)
    print(f"compiled {len(sessions)} sessions in {time.time() - t0:.1f} s", flush=True)
    res = {"device": dev.adapter_name, "impl": a.impl, "runs": [],
           "plans": {f"{n}/{m}": v[1] for (n, m), v in sessions.items()}}
    for r in range(a.rounds):
        for mode in ("infer", "train"):
            for name in names:
                sess = sessions[name, mode][0]
                feeds = (sess.program.inference_feeds() if mode == "infer"
                         else sess.program.feeds)
                prof = sess.profile(steps=a.steps, inference=mode == "infer",
                                    **{k: v for k, v in w.feeds.items() if k in feeds})
                row = {"variant": name, "mode": mode, "round": r,
                       "gpu_ms": prof.gpu_ms_per_step, "wall_ms": prof.step_wall_ms,
                       "gemm_us": gemm_groups(prof)}
                res["runs"].append(row)
                if a.json:  # partial results survive a time limit
                    with open(a.json, "w") as f:
                        json.dump(res, f, indent=1)
                print(f"r{r} {mode:5} {name:6} GPU {row['gpu_ms']:7.3f} ms  " + "  ".join(
                    f"{s} {u:.0f}" for s, u in sorted(row["gemm_us"].items())), flush=True)
    return res


def summary(res: dict) -> str:
    """Medians over rounds: per mode, per shape, µs per variant; the step GPU ms last."""
    lines = []
    for mode in ("infer", "train"):
        runs = [r for r in res["runs"] if r["mode"] == mode]
        names = list(dict.fromkeys(r["variant"] for r in runs))
        shapes = sorted({s for r in runs for s in r["gemm_us"]})
        lines.append(f"\n{mode}: µs/step (median of rounds; spread min-max)")
        lines.append(f"{'shape':16}" + "".join(f"{n:>16}" for n in names))
        for s in shapes + ["STEP ms"]:
            cells = []
            for n in names:
                v = [r["gpu_ms"] if s == "STEP ms" else r["gemm_us"].get(s, float("nan"))
                     for r in runs if r["variant"] == n]
                cells.append(f"{statistics.median(v):7.1f}({min(v):.0f}-{max(v):.0f})"
                             if s != "STEP ms" else
                             f"{statistics.median(v):7.3f}({min(v):.2f}-{max(v):.2f})")
            lines.append(f"{s:16}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def list_plans(workloads: str, variant: str = "base") -> dict:
    """Device-free: every matmul dispatch label and config of each workload's plans (under
    ``variant``)."""
    from plan_memory import H200_LIMITS
    from workloads import WORKLOADS

    from meganeura import optim
    from meganeura.compile.emit import emit_stream
    from meganeura.compile.memory import find_leaf_groups, make_plan
    from meganeura.compile.passes import run_pipeline
    from meganeura.kernels.common import make_target
    from meganeura.program import build_program

    out = {}
    target = make_target(H200_LIMITS, {"shader-f16"})
    for name in workloads.split(","):
        w = WORKLOADS[name](quick=False, variant="main")
        for mode, opt in (("infer", None), ("train", optim.SGD(lr=1e-4))):
            with patched(variant):
                low = run_pipeline(build_program(w.graph, w.loss, w.outputs if opt is None else {},
                                                 opt))
                groups = find_leaf_groups(low.graph, any_rank=opt is None)
                plan = make_plan(low, opt is None, groups=groups, max_bindings=16)
                stream = emit_stream(plan, target, "strict", mode)
            rows = sorted({f"{d.label}  [{_variant(d)}]" for d in stream.dispatches
                           if d.label.startswith("matmul")})
            out[f"{name}-{mode}"] = rows
            if not rows:
                print(f"{name}-{mode}: no matmul dispatches", flush=True)
            for r in rows:
                print(f"{name}-{mode}: {r}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workloads", nargs="?", default="smollm2,smolvla,whisper,resnet50,unet")
    p.add_argument("--list", action="store_true")
    p.add_argument("--variants", default=os.environ.get(ENV, ",".join(VARIANTS)))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--impl", default="dawn")
    p.add_argument("--quick", action="store_true", help="tiny Whisper (lavapipe dry run)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.list and "," in a.variants:
        a.variants = "base"
    res = list_plans(a.workloads, a.variants) if a.list else measure(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if not a.list:
        print(summary(res))


if __name__ == "__main__":
    main()
