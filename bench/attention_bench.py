"""Attention kernels one at a time (fwd, dQ, dK/dV) at the Whisper-tiny, SmolLM2 and a D = 128
shape, every tile configuration the tuner would time (``kernels.candidates``, the heuristic
first, marked ``*``), dispatched directly through ``kernels.emit`` and the runtime device.
Checks each result against a float64 numpy reference (relative max error) and prints µs
(median GPU timestamp of one dispatch) and TFLOP/s.  Optionally times PyTorch's
scaled_dot_product_attention (f32, CUDA) at the same shapes for comparison.

  python bench/attention_bench.py [dawn|wgpu] [--quick] [--torch] [--json PATH]
      [--short] [--shapes whisper,smollm2] [--share ROOFLINE_JSON]
      [--roof OUTDIR] [--kvariants before,after,...]
      [--fwd-sweep OUTDIR [--winfer main,after,after@8,...]]
      [--fast-e2e] [--fast-ab main,no-prefetch,...] [--toggles disable_robustness]
      [--table MD]

``--table MD``: only issue 12's attention table (every shape: ours strict forward and forward +
backward as the op runs them, ours fast forward as compile picks it, PyTorch SDPA f32 and bf16;
µs and TFLOP/s), written as markdown to MD.
``--fast-e2e``: first, Whisper-tiny's inference and training step profiled strict, fast with
the strict attention forward and fast with the tensor-core one (GPU ms per step).
``--fast-ab VARIANTS``: only the tensor-core forward: each variant of ``FAST_VARIANTS``
(kernels/attention_fast.py's switches; ``no-<phase>`` ones are timing-only ablations) ×
configurations × key chunks at Whisper's and SmolLM2's shapes (``--shapes`` picks), against the
strict forward of the op, in two interleaved rounds.

``--fwd-sweep OUTDIR``: only the long forward: with ``--winfer`` first the Whisper-tiny
inference step profiled per variant (OUTDIR/whisper-infer-<variant>.json), then its variants
(``FWD_VARIANTS`` × tiles × key chunks, ``FWD_SWEEP``) at Whisper's shape, two interleaved
rounds (clock drift shows as a round-to-round difference).

``--share ROOFLINE_JSON``: no device; SmolLM2's attention share of a profiled step (every
attention kernel and attention-shaped reduce).  ``--short``: first, one layer's attention
trained and profiled like the real step (each dispatch in its own timestamped pass) for
each variant of the short-problem plan (``SHORT_VARIANTS``: before / after in one process);
``--shapes``: op paths of these only.  ``--roof OUTDIR``: first, SmolLM2's whole training step
profiled (``bench/roofline.py``) per kernel variant of ``--kvariants`` (``KERNEL_VARIANTS``:
the short-loop switches of kernels/attention.py; default before,after), one roof-<name>.json
each and its attention share; ``--kvariants`` also picks the op paths' variants.

``--quick``: the heuristic configuration only; ``--all``: every configuration that fits (the
unsplit (8, 16, 4, 2) one is the configuration before split-K: the "before" row);
``--smoke``: tiny shapes, few timings (a check that the script runs, e.g. on lavapipe).

Then: split-K forward (n key chunks + the combine kernel, µs summed) and dK/dV (n query chunks;
the partial sums' reduce is not included), the precision "fast" forward (tensor cores; only
where the device has f16 subgroup matrices), and the decode table (SmolLM2-135M attention of
one new token over a KV cache of 512 / 2048 rows, batch 1 and 8, unsplit vs split-K)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from meganeura import kernels
from meganeura.dtypes import f32
from meganeura.kernels import attention as A
from meganeura.kernels import attention_combine as AC
from meganeura.kernels import attention_fast as AF
from meganeura.kernels.attention_combine import AttentionCombineKernel
from meganeura.kernels.common import make_target
from meganeura.kernels.ir import Strided
from meganeura.ops.attention import (
    SPLIT_HEADS_BELOW,
    _attention_ref,
    _grad_parts,
    fwd_splits,
    grad_plan,
)
from meganeura.runtime.device import get_device

# name: (B, Hq, Hkv, S, D, causal)
SHAPES = {
    "whisper": (1, 6, 6, 1500, 64, False),
    "smollm2": (1, 9, 3, 128, 64, True),
    "d128": (1, 8, 8, 1024, 128, False),
}
KINDS = ("fwd", "dq", "dkdv")
OUTS = {"fwd": ("out", "lse"), "dq": ("dq",), "dkdv": ("dk", "dv")}


def problem(shape, seed=0):
    """float32 inputs (q, k, v, dout, lse, delta), attrs and float64 references."""
    B, Hq, Hkv, S, D, causal = shape
    r = np.random.default_rng(seed)
    a = {"causal": causal, "scale": 1 / math.sqrt(D), "window": 0, "q_offset": 0,
         "has_mask": False}
    x = {"q": r.standard_normal((B, Hq, S, D)), "k": r.standard_normal((B, Hkv, S, D)),
         "v": r.standard_normal((B, Hkv, S, D))}
    x = {n: v.astype(np.float32) for n, v in x.items()}
    base = [x[n].astype(np.float64) for n in ("q", "k", "v")]
    out, lse = _attention_ref(base, a)
    dout = r.standard_normal(out.shape).astype(np.float32)
    delta = (dout.astype(np.float64) * out).sum(-1)
    x.update(dout=dout, lse=lse.astype(np.float32), delta=delta.astype(np.float32))
    # dK/dV per query head where the op would split (too few kv heads × key blocks)
    a["split_heads"] = Hq != Hkv and B * Hkv * -(-S // 16) < SPLIT_HEADS_BELOW
    dq, dk, dv = _grad_parts(base + [dout.astype(np.float64), lse, delta], a)
    return x, a, {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def describe(kind, x, a):
    v = {n: Strided.contiguous(f32, arr.shape) for n, arr in x.items() if n[0] != "_"}
    extra = (None, None, None) if kind == "fwd" else (v["dout"], v["lse"], v["delta"])
    return A.KIND_TYPES[kind](kind, v["q"], v["k"], v["v"], None, *extra, a["causal"],
                              a["scale"], a["window"], a["q_offset"], name=f"attention_{kind}",
                              split_heads=kind == "dkdv" and a["split_heads"])


def rel_err(got, want):
    want = np.asarray(want, np.float64)
    fin = np.isfinite(want)
    if not np.array_equal(fin, np.isfinite(got)):
        return float("inf")
    scale = max(float(np.abs(want[fin]).max(initial=0.0)), 1e-30)
    return float(np.abs(got[fin] - want[fin]).max(initial=0.0)) / scale


SMOKE = {"whisper": (1, 2, 2, 70, 64, False), "smollm2": (1, 3, 1, 33, 64, True),
         "d128": (1, 1, 1, 40, 128, False)}
# warm_s: back-to-back work before each timing (clocks ramp up; at 0.1 s the first
# configuration timed in a process read 5x slow on the H200, 2026-12-01)
REPEATS = {"n": 2000, "warm_s": 0.3}


def time_dispatch(dev, spec, bufs):
    """GPU µs of one dispatch: ``n`` dispatches in one timestamped pass (Dawn quantizes
    timestamps to ~65 µs, so single dispatches cannot be timed), n sized for ~20 ms, the
    median of 3 such passes, after ``warm_s`` seconds of back-to-back work (clocks ramp up)."""
    import wgpu as _w

    wgpu = dev.module or _w
    pipe, bg = dev.pipeline(spec), dev.bind_group(spec, bufs)
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
    res = dev.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE
                                   | wgpu.BufferUsage.COPY_SRC)

    def once(n, stamp=True):
        enc = dev.device.create_command_encoder()
        tw = {"query_set": qs, "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}
        cp = enc.begin_compute_pass(timestamp_writes=tw) if stamp else enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        for _ in range(n):
            cp.dispatch_workgroups(*spec.workgroups)
        cp.end()
        if stamp:
            enc.resolve_query_set(qs, 0, 2, res, 0)
        dev.queue.submit([enc.finish()])
        if not stamp:
            dev.sync()
            return 0.0
        ts = np.frombuffer(dev.read_buffer(res, 0, 16), dtype=np.uint64).astype(np.float64)
        return max(ts[1] - ts[0], 0.0) / 1e3 / n

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < REPEATS["warm_s"]:
        once(20, stamp=False)
    est = max(once(20), 1.0)
    n = int(min(max(20_000 / est, 20), REPEATS["n"]))
    return float(np.median([once(n) for _ in range(3)]))


COMBINE_US: dict[int, float] = {}  # the last combine kernel's µs, by key chunks


def run_config(dev, desc, x, ref, poison=True):
    """(spec, worst relative error over the outputs, µs).  Split descriptions: the partials'
    sum (dK/dV, on the host) or the combine kernel (fwd, timed too) before the check."""
    kind, n = desc.kind, desc.splits
    spec = kernels.emit(desc, dev.limits, dev.features)
    names = ["q", "k", "v"] + (["mask"] if desc.mask is not None else []) + \
        ([] if kind == "fwd" else ["dout", "lse", "delta"])
    q, k, v = x["q"].shape, x["k"].shape, x["v"].shape
    kv = (q[:2] + k[2:], q[:2] + v[2:]) if desc.split_heads else (k, v)
    shapes = {"fwd": [q[:3] + v[3:], q[:3]], "dq": [q], "dkdv": list(kv)}[kind]
    shapes = [(n * s[0],) + s[1:] for s in shapes]
    nkb = -(-k[2] // desc.dq_block) if desc.dq_block else 0
    if nkb:  # dK, dV and the fused dQ's partials (one per key block), packed in one output
        shapes.append((nkb * q[0],) + q[1:])
        parts = shapes
        shapes = [(sum(int(np.prod(sh)) for sh in parts),)]
    bufs = [dev.upload(x[m]) for m in names]
    outs = [dev.upload(np.full(s, np.nan, np.float32)) for s in shapes]  # poisoned
    dev.dispatch(spec, bufs + outs)
    got = [dev.read_array(b, s, f32) for b, s in zip(outs, shapes, strict=True)]
    if nkb:
        cuts = np.cumsum([int(np.prod(sh)) for sh in parts])[:2]
        got = [g.reshape(sh) for g, sh in zip(np.split(got[0], cuts), parts, strict=True)]
    us = time_dispatch(dev, spec, bufs + outs)
    if n > 1 and kind == "fwd":
        comb = kernels.emit(AttentionCombineKernel(Strided.contiguous(f32, shapes[0]),
                                                   Strided.contiguous(f32, shapes[1]), n),
                            dev.limits, dev.features)
        fin = [dev.upload(np.full(s, np.nan, np.float32)) for s in (q[:3] + v[3:], q[:3])]
        dev.dispatch(comb, outs + fin)
        got = [dev.read_array(b, s, f32) for b, s in zip(fin, (q[:3] + v[3:], q[:3]),
                                                        strict=True)]
        COMBINE_US[n] = time_dispatch(dev, comb, outs + fin)
        us += COMBINE_US[n]
    elif n > 1 or nkb:
        got = [g.reshape((nkb if i == 2 else n, -1) + g.shape[1:]).sum(0)
               for i, g in enumerate(got)]
    names = OUTS[kind] + (("dq",) if nkb else ())
    err = max(rel_err(g, ref[m]) for g, m in zip(got, names, strict=True))
    return spec, err, us


def configs(desc, t, everything=False):
    """The tuner's candidates (heuristic first); with ``everything`` also every other
    configuration that fits and is not larger than the problem."""
    cands = kernels.candidates(desc, t)
    if not everything:
        return cands
    own_n, _ = A._problem(desc)
    seen = {c.config for c in cands}
    D, Dv = desc.q.shape[3], desc.v.shape[3]
    return cands + [dataclasses.replace(desc, config=c) for c in A.CONFIGS if c not in seen
                    and A.config_fits(desc.kind, c, D, Dv, t) and c[0] * c[2] <= 2 * own_n]


def torch_times(shape, dtype="float32"):
    """PyTorch SDPA (CUDA, ``dtype``: float32 with TF32 off, or bfloat16) fwd and fwd+bwd µs
    at ``shape``, or None without CUDA."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    B, Hq, Hkv, S, D, causal = shape
    kw = {"device": "cuda", "dtype": getattr(torch, dtype)}
    q = torch.randn(B, Hq, S, D, requires_grad=True, **kw)
    k = torch.randn(B, Hkv, S, D, requires_grad=True, **kw)
    v = torch.randn(B, Hkv, S, D, requires_grad=True, **kw)
    g = torch.randn(B, Hq, S, D, **kw)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)

    def both():
        fwd().backward(g)

    res = []
    for fn in (fwd, both):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            fn()
        e1.record()
        torch.cuda.synchronize()
        res.append(e0.elapsed_time(e1) / 50 * 1e3)
    return res


def split_rows(dev, x, a, sname, shape):
    """Split-K forward and dK/dV of one shape (heuristic tiles for each split count, a few
    other forward tiles at 6 chunks), and dK/dV with the fused dQ at 4/6/8 query chunks where
    the op fuses it for a long loop."""
    B, Hq, Hkv, S, D, causal = shape
    blk = grad_plan(B, Hq, Hkv, S, S, D, causal, 0)["dq_block"] if S >= 512 else 0
    todo = [("fwd", n, (), 0) for n in (2, 3, 4, 6, 8)]
    todo += [("fwd", 6, c, 0) for c in ((8, 16, 4, 2), (32, 8, 2, 4), (16, 16, 4, 2),
                                        (16, 8, 4, 2))]
    todo += [("dkdv", n, (), 0) for n in (2, 3, 4)]
    todo += [("dkdv", n, (), blk) for n in ((4, 6, 8) if blk else ())]
    todo += [("dkdv", 4, (8, 16, 4, 1), blk)] if blk == 32 else []
    rows = []
    t = make_target(dev.limits, dev.features)
    for kind, n, cfg, b in todo:
        if cfg and not A.config_fits(kind, cfg, D, D, t):
            continue
        desc = dataclasses.replace(describe(kind, x, a), splits=n, config=cfg, dq_block=b)
        spec, err, us = run_config(dev, desc, x, x["_ref"])
        fl = spec.meta["flops"] * (0.5 if causal else 1.0)
        name = f"{kind}{'+dq' if b else ''}_split{n}"
        rows.append({"shape": sname, "kind": name, "config": list(spec.meta["config"]),
                     "us": us, "err": err, "tflops": fl / us / 1e6})
        print(f"{sname:8} {name:13} {str(spec.meta['config']):14} {us:9.1f} µs "
              f"{fl / us / 1e6:7.2f} TFLOP/s  err {err:.1e}", flush=True)
    if blk:
        rows += serial_reduce_rows(dev, sname, -(-S // blk), (B, Hq, S, D))
    return rows


def serial_reduce_rows(dev, sname, n, shape):
    """The fused dQ's partial sum with the reduce family's default layout and, as an
    experiment (bench only), with its serial one-invocation-per-output loop (SERIAL_MAX)."""
    from meganeura.kernels import reduce as RK

    rows, keep = [], RK.SERIAL_MAX
    for serial in (keep, max(keep, n)):
        RK.SERIAL_MAX = serial
        try:
            us = reduce_us(dev, n, shape)
        finally:
            RK.SERIAL_MAX = keep
        rows.append({"shape": sname, "kind": "dq_sum", "partials": n, "serial_max": serial,
                     "us": us})
        print(f"{sname:8} sum of {n} dQ partials, SERIAL_MAX={serial}: {us:8.1f} µs", flush=True)
    return rows


def fast_rows(dev, x, a, sname, shape):
    """The tensor-core forward (every fast configuration that fits, split and not)."""
    rows = []
    t = make_target(dev.limits, dev.features)
    base = dataclasses.replace(describe("fwd", x, a), precision="fast")
    if not AF.usable(base, t):
        print(f"{sname:8} fast: no f16 subgroup matrices on this device (strict kernel)")
        return rows
    for cfg in AF.FAST_CONFIGS:
        for n in (1, fwd_splits(shape[0], shape[1], shape[2], shape[3], shape[3]), 4):
            desc = dataclasses.replace(base, config=cfg, splits=n)
            try:
                spec, _, us = run_config(dev, desc, x, x["_ref"])
            except kernels.CodegenError:
                continue
            err = fast_err(dev, desc, x)
            fl = spec.meta["flops"] * (0.5 if shape[5] else 1.0)
            rows.append({"shape": sname, "kind": "fwd_fast", "config": list(cfg), "splits": n,
                         "us": us, "tflops": fl / us / 1e6, "rel_l2": err})
            print(f"{sname:8} fwd fast {cfg} splits={n} {us:9.1f} µs {fl / us / 1e6:7.2f} "
                  f"TFLOP/s  rel L2 {err:.1e}", flush=True)
    return rows


# the tensor-core forward's switches (kernels/attention_fast.py), by name; the layouts measured
# before them (halves, il, il4, pf+blk, pf+pack, pf+reread): docs/benchmarks.md
_MAIN = {"AF.SF_PAD": 2, "AF.PREFETCH": True, "AF.ROW_BLOCKS": 2, "AF.GROUP_KEYS": 512,
         "AF.ABLATE": frozenset(), "AF.LEAN": True, "AF.O_SHARED": False,
         "AF.SPLIT_PREFETCH": False, "AF.PACKED": True, "AF.VEC_LOADS": True,
         "AF.LANE_VEC": True, "AF.TREE_REDUCE": True, "AF.REG_STAGE": True,
         "AF.HOIST_FIRST": True, "AF.OUT_VEC": True, "AF.EXP_F16": False,
         "AF.PACK_F32": True, "AF.TAIL_CHUNK": True}
FAST_VARIANTS = {"main": _MAIN, "no-prefetch": dict(_MAIN, **{"AF.PREFETCH": False}),
                 "unpacked": dict(_MAIN, **{"AF.PACKED": False}),
                 "scalar-loads": dict(_MAIN, **{"AF.VEC_LOADS": False}),
                 "lanes-off": dict(_MAIN, **{"AF.LANE_VEC": False}),
                 "serial-reduce": dict(_MAIN, **{"AF.TREE_REDUCE": False}),
                 "loop-stage": dict(_MAIN, **{"AF.REG_STAGE": False}),
                 "nohoist": dict(_MAIN, **{"AF.HOIST_FIRST": False}),
                 "scalarout": dict(_MAIN, **{"AF.OUT_VEC": False}),
                 "exp16": dict(_MAIN, **{"AF.EXP_F16": True}),
                 "scalarcomb": dict(_MAIN, **{"AC.VEC_COMBINE": False}),
                 "f16vals": dict(_MAIN, **{"AF.PACK_F32": False}),
                 "split": _MAIN, "even": dict(_MAIN, **{"AF.TAIL_CHUNK": False}),
                 "lanes-off-serial": dict(_MAIN, **{"AF.LANE_VEC": False,
                                                    "AF.TREE_REDUCE": False}),
                 "pad4": dict(_MAIN, **{"AF.SF_PAD": 4}),
                 "rows1": dict(_MAIN, **{"AF.ROW_BLOCKS": 1}),
                 "rows3": dict(_MAIN, **{"AF.ROW_BLOCKS": 3}),
                 "nogroup": dict(_MAIN, **{"AF.GROUP_KEYS": 0}),
                 "rows1-nogroup": dict(_MAIN, **{"AF.ROW_BLOCKS": 1, "AF.GROUP_KEYS": 0}),
                 "lean-off": dict(_MAIN, **{"AF.LEAN": False}),
                 "oshared": dict(_MAIN, **{"AF.O_SHARED": True}),
                 "splitpf": dict(_MAIN, **{"AF.SPLIT_PREFETCH": True}),
                 "oshared-splitpf": dict(_MAIN, **{"AF.O_SHARED": True,
                                                   "AF.SPLIT_PREFETCH": True}),
                 "rows1-splitpf": dict(_MAIN, **{"AF.ROW_BLOCKS": 1, "AF.SPLIT_PREFETCH": True})}
# timing only (wrong results): each phase of the key loop left out (attention_fast.ABLATE)
FAST_VARIANTS.update({f"no-{a}": dict(_MAIN, **{"AF.ABLATE": frozenset({a})})
                      for a in sorted(AF.ABLATE_PHASES)})
# every phase of the key loop left out at once: what is outside its work (prologue, stores,
# loop control, the combine kernel, launch); "no-prologue" also without Q's staging and the
# first tile's
_LOOP = AF.ABLATE_PHASES - {"qstage", "first", "qload"}
FAST_VARIANTS["no-all"] = dict(_MAIN, **{"AF.ABLATE": _LOOP})
FAST_VARIANTS["no-prologue"] = dict(_MAIN, **{"AF.ABLATE": frozenset(AF.ABLATE_PHASES)})
FAST_AB = {"no": (((4, 64),), (3,)), "lanes": (((4, 64),), (3,)), "serial": (((4, 64),), (3,)),
           "loop": (((4, 64),), (3,)), "nohoist": (((4, 64),), (3,)),
           "scalarout": (((4, 64),), (3,)), "exp16": (((4, 64),), (3,)),
           "scalarcomb": (((4, 64),), (3,)), "f16vals": (((4, 64),), (3,)),
           # key chunks 0: compile's split (attention_fast.fast_split; "even": no tail chunk)
           "split": (((4, 64),), (0,)), "even": (((4, 64),), (0,)),
           "main": (((4, 64), (4, 32)), (2, 3, 4)),
           "rows3": (((4, 64), (4, 32)), (3, 4, 5, 6)),
           "rows1": (((4, 64),), (3, 6)),
           "*": (((4, 64), (4, 32)), (3, 4, 6))}


def fast_ab(dev, names, shapes=("whisper", "smollm2"), rounds=2, smoke=False):
    """Tensor-core forward variants (``FAST_VARIANTS`` × configurations × key chunks) against
    the strict forward of the op (its split count, combine included), ``rounds`` interleaved
    rounds; µs per forward (+ combine), relative max error against float64."""
    rows = []
    for sname in shapes:
        shape = SHAPES[sname]
        x, a, ref = problem(shape)
        x["_ref"] = ref
        base = describe("fwd", x, a)
        n0 = fwd_splits(shape[0], shape[1], shape[2], shape[3], shape[3])
        cells = [("strict", (), n0)]
        for name in names:
            cfgs, splits = FAST_AB.get(name.split("-")[0], FAST_AB["*"])
            cells += [(name, c, n) for c in cfgs for n in (splits if not smoke else (1, 3))]
        got = {}
        for rnd in range(rounds):
            for name, cfg, n in (cells if rnd % 2 == 0 else cells[::-1]):
                with variant(FAST_VARIANTS.get(name, {})):
                    ns, keys = AF.fast_split(*shape[:4], shape[3], n0) if n == 0 else (n, 0)
                    desc = dataclasses.replace(
                        base, splits=ns, config=cfg, chunk_keys=keys,
                        precision="strict" if name == "strict" else "fast")
                    try:
                        _, err, us = run_config(dev, desc, x, ref)
                    except kernels.CodegenError as e:
                        print(f"{sname:8} {name:7} {cfg} x{n}: {e}", flush=True)
                        continue
                got.setdefault((name, cfg, ns), []).append((us, err))
        fl = 4 * shape[0] * shape[1] * shape[3] ** 2 * shape[4] * (0.5 if shape[5] else 1)
        print(f"{sname:8} combine µs by chunks: " + ", ".join(
            f"x{n} {us:.1f}" for n, us in sorted(COMBINE_US.items())), flush=True)
        for (name, cfg, n), rs in got.items():
            us = float(np.median([r[0] for r in rs]))
            rows.append({"shape": sname, "kind": "fwd_fast_ab", "variant": name,
                         "config": list(cfg), "splits": n, "us": us,
                         "us_rounds": [r[0] for r in rs], "err": max(r[1] for r in rs),
                         "tflops": fl / us / 1e6})
            print(f"{sname:8} {name:7} {str(cfg):9} x{n} {us:8.1f} µs {fl / us / 1e6:6.1f} "
                  f"TFLOP/s rounds {', '.join(f'{r[0]:.1f}' for r in rs)} err "
                  f"{max(r[1] for r in rs):.1e}", flush=True)
    return rows


def fast_err(dev, desc, x):
    """Relative L2 error of the fast forward's output against float64 (the fast gate)."""
    q, v = x["q"].shape, x["v"].shape
    spec = kernels.emit(dataclasses.replace(desc, splits=1), dev.limits, dev.features)
    bufs = [dev.upload(x[m]) for m in ("q", "k", "v")]
    outs = [dev.upload(np.zeros(s, np.float32)) for s in (q[:3] + v[3:], q[:3])]
    dev.dispatch(spec, bufs + outs)
    got = dev.read_array(outs[0], q[:3] + v[3:], f32).astype(np.float64)
    want = x["_ref"]["out"]
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


DECODE = {"L512_b1": (1, 512), "L2048_b1": (1, 2048), "L512_b8": (8, 512), "L2048_b8": (8, 2048)}


def decode_rows(dev, smoke=False):
    """SmolLM2-135M decode attention (9 query / 3 kv heads, D = 64, one token over a cache
    whose rows past the position are masked as in models/llama.py's decode graph)."""
    rows = []
    for name, (B, L) in DECODE.items():
        if smoke:
            B, L = min(B, 2), L // 8
        r = np.random.default_rng(0)
        x = {"q": r.standard_normal((B, 9, 1, 64)), "k": r.standard_normal((B, 3, L, 64)),
             "v": r.standard_normal((B, 3, L, 64))}
        pos = L - L // 8  # most of the cache filled
        mask = np.where(np.arange(L) <= pos, 0.0, -np.inf).reshape(1, 1, 1, L)
        x = {n: a.astype(np.float32) for n, a in x.items()} | {"mask": mask.astype(np.float32)}
        a = {"causal": False, "scale": 0.125, "window": 0, "q_offset": 0, "has_mask": True}
        out, lse = _attention_ref([x[n].astype(np.float64) for n in ("q", "k", "v", "mask")], a)
        ref = {"out": out, "lse": lse}
        v = {n: Strided.contiguous(f32, arr.shape) for n, arr in x.items()}
        base = A.AttentionFwdKernel("fwd", v["q"], v["k"], v["v"], v["mask"], None, None, None,
                                    False, 0.125, 0, 0, name="attention_fwd")
        auto = fwd_splits(B, 9, 3, 1, L)
        for n in sorted({1, auto, max(1, auto // 4)}):
            spec, err, us = run_config(dev, dataclasses.replace(base, splits=n), x, ref)
            rows.append({"shape": f"decode_{name}", "kind": "fwd", "splits": n, "auto": n == auto,
                         "config": list(spec.meta["config"]), "us": us, "err": err})
            print(f"decode {name:9} B={B} L={L:5} splits={n:3}{'*' if n == auto else ' '} "
                  f"{us:9.1f} µs  err {err:.1e}", flush=True)
    return rows


# --sweep: (shape, kind, tile configuration (() = heuristic), splits, dq_block, fma) in one
# run, the old configurations among them (before/after from the same process); one JSON line
# per timing appended to the --json path as it is measured (a cut-short run keeps its rows)
SWEEP_CFGS = ((8, 16, 4, 2), (16, 8, 2, 4), (16, 16, 2, 2), (8, 8, 4, 4), (16, 8, 4, 4),
              (8, 8, 4, 2), (16, 16, 1, 2), (8, 8, 2, 4), (8, 4, 4, 8), (16, 4, 2, 8),
              (16, 4, 4, 8), (32, 4, 2, 8))
W, SM = "whisper", "smollm2"


def _fused(blk, counts):
    return [(W, "dkdv", c, n, blk, True) for n in counts for c in A.CONFIGS
            if c[0] * c[2] == blk]


# most telling first (a run cut short keeps them): before, the fused dQ, the reduces it needs
SWEEP = (
    [(W, "fwd", (8, 16, 4, 2), 4, 0, False), (W, "dq", (8, 16, 4, 2), 1, 0, False),
     (W, "dkdv", (8, 16, 4, 2), 4, 0, False)]
    + _fused(32, (4, 2, 1))
    + [(W, "reduce", (), n, 0, True) for n in (4, 47, 24)]
    + [(W, "fwd", c, n, 0, True) for n in (4, 3, 6) for c in SWEEP_CFGS]
    + _fused(64, (4, 2, 1)) + _fused(16, (4, 2))
    + [(SM, k, (), 1, 0, f) for k in KINDS for f in (False, True)]
    + [(SM, "dkdv", (), 1, b, True) for b in (16, 32)]
    + [(SM, "reduce", (), n, 0, True) for n in (4, 8)]
    + [(W, "dq", c, n, 0, True) for n in (1, 2, 4) for c in SWEEP_CFGS]
    + [(W, "dkdv", c, n, 0, True) for n in (4, 1) for c in SWEEP_CFGS[:4]]
    + [(W, "fwd", c, 1, 0, True) for c in SWEEP_CFGS]
)


def reduce_us(dev, n, shape, members=1):
    """GPU µs of the graph's sum of ``n`` stacked partials of ``shape`` (the reduce kernel
    the op adds after split dQ, split dK/dV and the fused dQ's partials); ``members`` such sums
    of one shape compile to one multi-reduce dispatch (dK's and dV's sums)."""
    import meganeura as mn
    from meganeura.ops import reduce as R

    g = mn.Graph()
    xs = [g.input(f"x{i}", (n,) + shape) for i in range(members)]
    outs = {f"y{i}": R.sum(x, (0,)) for i, x in enumerate(xs)}
    sess = mn.compile(g, outputs=outs, device=dev, optimizer=None)
    specs = [d.spec for d in sess.executable.infer.dispatches]
    if len(specs) != 1 or specs[0].n_bindings != 2 * members:
        return float("nan")
    bufs = [dev.upload(np.zeros((n,) + shape, np.float32)) for _ in range(members)]
    bufs += [dev.upload(np.zeros(shape, np.float32)) for _ in range(members)]
    return time_dispatch(dev, specs[0], bufs)


def sweep(dev, path, smoke=False):
    """Time every ``SWEEP`` entry that fits (errors checked as usual)."""
    t = make_target(dev.limits, dev.features)
    probs = {}
    for sname, kind, cfg, n, blk, fma in (SWEEP[:3] + SWEEP[3::9]) if smoke else SWEEP:
        shape = SHAPES[sname]
        if kind == "reduce":
            B, Hq, _, S, D, _ = shape
            us = reduce_us(dev, n, (B, Hq, S, D))
            _emit(path, {"shape": sname, "kind": "reduce", "splits": n, "us": us})
            print(f"{sname:8} reduce of {n:3} partials {(B, Hq, S, D)}: {us:8.1f} µs", flush=True)
            continue
        if sname not in probs:
            probs[sname] = problem(shape)
        x, a, ref = probs[sname]
        desc = dataclasses.replace(describe(kind, x, a), config=cfg, splits=n, dq_block=blk)
        if cfg and not A.config_fits(kind, cfg, shape[4], shape[4], t):
            continue
        A.FMA = fma
        try:
            spec, err, us = run_config(dev, desc, x, ref)
        finally:
            A.FMA = True
        row = {"shape": sname, "kind": kind, "config": list(spec.meta["config"]), "splits": n,
               "dq_block": blk, "fma": fma, "us": us, "err": err,
               "workgroups": list(spec.workgroups)}
        _emit(path, row)
        print(f"{sname:8} {kind:5} {str(row['config']):15} splits={n} dq_block={blk:3} "
              f"fma={fma:d} {us:9.1f} µs err {err:.1e}", flush=True)


def _emit(path, row) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def op_path(dev, sname, shape):
    """The kernels the compiled program runs for one attention at ``shape`` (the op's split
    and fused-dQ choices, heuristic tiles): forward (+ combine), backward (dK/dV with the dQ
    partials, or dQ + dK/dV, plus every partial sum's reduce), µs each and the total with the
    issue's FLOP count (4·S²·D·H forward, 2.5× that backward; causal: half)."""
    B, Hq, Hkv, S, D, causal = shape
    x, a, ref = problem(shape)
    plan = grad_plan(B, Hq, Hkv, S, S, D, causal, 0)
    a["split_heads"] = plan["split_heads"]
    parts = {}
    desc = dataclasses.replace(describe("fwd", x, a), splits=fwd_splits(B, Hq, Hkv, S, S))
    parts["fwd"] = run_config(dev, desc, x, ref)[1:]
    n, blk, nq = plan["splits"], plan["dq_block"], plan["dq_splits"]
    if not blk:
        parts["dq"] = run_config(dev, dataclasses.replace(describe("dq", x, a), splits=nq), x,
                                 ref)[1:]
        if nq > 1:
            parts["dq_sum"] = (0.0, reduce_us(dev, nq, (B, Hq, S, D)))
    dx = dict(x, delta=ref["out"].astype(np.float32)) if plan["delta_in_kernel"] else x
    desc = dataclasses.replace(describe("dkdv", dx, a), splits=n, dq_block=blk,
                               delta_out=plan["delta_in_kernel"])
    parts["dkdv" + ("+dq" if blk else "") + ("+delta" if desc.delta_out else "")] = \
        run_config(dev, desc, dx, ref)[1:]
    if not desc.delta_out:
        parts["delta"] = (0.0, delta_us(dev, (B, Hq, S, D)))
    if plan["grad_sum"]:
        parts["grad_sum"] = (0.0, grad_sum_us(dev, (B, Hq, Hkv, S, S, D, D), n,
                                              plan["split_heads"], blk))
    elif blk:
        parts["dq_sum"] = (0.0, reduce_us(dev, -(-S // blk), (B, Hq, S, D)))
    if (n > 1 or plan["split_heads"]) and not plan["grad_sum"]:
        lead = n * (Hq // Hkv if plan["split_heads"] else 1)  # partials per dK (dV) element
        parts["dkdv_sums"] = (0.0, reduce_us(dev, lead, (B, Hkv, S, D), members=2))
    fl = 4 * S * S * D * Hq * B * (0.5 if causal else 1.0)
    fwd = parts["fwd"][1]
    bwd = sum(us for k, (_, us) in parts.items() if k != "fwd")
    for k, (err, us) in parts.items():
        print(f"op path {sname:8} {k:9} {us:9.1f} µs  err {err:.1e}", flush=True)
    tf = 3.5 * fl / (fwd + bwd) / 1e6
    print(f"op path {sname:8} fwd {fwd:8.1f} µs ({fl / fwd / 1e6:5.2f} TFLOP/s)  bwd "
          f"{bwd:8.1f} µs  total {fwd + bwd:8.1f} µs = {tf:5.2f} TFLOP/s", flush=True)
    return [{"shape": sname, "kind": "op_path", "plan": plan, "parts": parts, "fwd_us": fwd,
             "bwd_us": bwd, "total_us": fwd + bwd, "tflops": tf}]


def fast_fwd_us(dev, shape):
    """The forward compile runs under precision "fast" (the tensor-core kernel where it pays,
    with compile's key chunks (``fast_split``), combine included): (µs, error, on tensor
    cores?); the strict forward's where it does not apply."""
    B, Hq, Hkv, S, D, causal = shape
    x, a, ref = problem(shape)
    t = make_target(dev.limits, dev.features)
    n = fwd_splits(B, Hq, Hkv, S, S)
    desc = dataclasses.replace(describe("fwd", x, a), precision="fast", splits=n)
    tc = AF.usable(desc, t) and AF.pays(desc)
    if tc:
        n, keys = AF.fast_split(B, Hq, Hkv, S, S, n)
        desc = dataclasses.replace(desc, splits=n, chunk_keys=keys)
    else:
        desc = dataclasses.replace(desc, precision="strict")
    _, err, us = run_config(dev, desc, x, ref)
    return us, err, tc


def attention_table(dev, path=None, rounds=2):
    """Issue 12's attention table: per shape, ours strict (the op's kernels: forward, forward +
    backward), ours fast forward, PyTorch SDPA f32 (TF32 off) and bf16, µs and TFLOP/s
    (4·S²·D·H forward, 3.5× that forward + backward; causal: half).  Markdown to ``path``.
    Every cell is measured ``rounds`` times (all shapes, then again) and the last round is
    reported: the first cells of a process read slow while the clocks ramp up (the first
    strict Whisper forward read 229 µs against 192 in the rounds after)."""
    for _ in range(rounds - 1):
        for shape in SHAPES.values():
            op_path(dev, "warm-up", shape)
            fast_fwd_us(dev, shape)
            torch_times(shape), torch_times(shape, "bfloat16")
    head = ("| shape (B, Hq, Hkv, S, D, causal) | ours strict fwd | ours fast fwd (× strict) | "
            "SDPA f32 fwd | SDPA bf16 fwd | ours strict fwd+bwd | SDPA f32 fwd+bwd | "
            "SDPA bf16 fwd+bwd |")
    lines, rows = [head, "|" + "---|" * 8], []

    def cell(us, fl):
        return f"{us:.1f} µs ({fl / us / 1e6:.1f})" if us else "—"

    for sname, shape in SHAPES.items():
        B, Hq, Hkv, S, D, causal = shape
        fl = 4 * S * S * D * Hq * B * (0.5 if causal else 1.0)
        strict = op_path(dev, sname, shape)[0]
        fast, ferr, tc = fast_fwd_us(dev, shape)
        t32, t16 = torch_times(shape) or (0, 0), torch_times(shape, "bfloat16") or (0, 0)
        rows.append({"shape": sname, "kind": "table", "strict_fwd_us": strict["fwd_us"],
                     "strict_total_us": strict["total_us"], "fast_fwd_us": fast,
                     "fast_err": ferr, "fast_on_tensor_cores": tc, "sdpa_f32_us": list(t32),
                     "sdpa_bf16_us": list(t16)})
        note = "" if tc else ", strict kernel"
        lines.append(f"| {sname} {shape} | {cell(strict['fwd_us'], fl)} | "
                     f"{cell(fast, fl)} ×{strict['fwd_us'] / fast:.2f}{note} | "
                     f"{cell(t32[0], fl)} | {cell(t16[0], fl)} | "
                     f"{cell(strict['total_us'], 3.5 * fl)} | {cell(t32[1], 3.5 * fl)} | "
                     f"{cell(t16[1], 3.5 * fl)} |")
    text = "\n".join(lines)
    print(text, flush=True)
    if path:
        Path(path).write_text(text + "\n")
    return rows


def grad_sum_us(dev, dims, n, heads, blk):
    """GPU µs of the one ``attention_grad_sum`` kernel of a short backward."""
    from meganeura.kernels.attention_combine import AttentionGradSumKernel, grad_sum_sizes

    size = sum(grad_sum_sizes(dims, n, heads, blk))
    spec = kernels.emit(AttentionGradSumKernel(Strided.contiguous(f32, (size,)), dims, n, heads,
                                               blk), dev.limits, dev.features)
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    bufs = [dev.upload(np.zeros(sh, np.float32)) for sh in
            ((size,), (B, Hq, Sq, D), (B, Hkv, Skv, D), (B, Hkv, Skv, Dv))]
    return time_dispatch(dev, spec, bufs)


def delta_us(dev, shape):
    """GPU µs of the graph's δ = rowsum(dO·O) reduce (one fused kernel)."""
    import meganeura as mn
    from meganeura.ops import reduce as R

    g = mn.Graph()
    do, o = g.input("do", shape), g.input("o", shape)
    sess = mn.compile(g, outputs={"d": R.sum(do * o, -1)}, device=dev, optimizer=None)
    specs = [d.spec for d in sess.executable.infer.dispatches]
    if len(specs) != 1:
        return float("nan")
    bufs = [dev.upload(np.zeros(shape, np.float32)) for _ in range(2)]
    return time_dispatch(dev, specs[0], bufs + [dev.upload(np.zeros(shape[:-1], np.float32))])


# --short: the attention of one layer trained as the real step profiles it (sess.profile():
# each dispatch in its own timestamped pass, as bench/roofline.py), per variant of the short
# plan (module switches of ops/attention.py, set in one process: before/after in one run)
SHORT_VARIANTS = {
    "before": {"GRAD_SUM": False, "DELTA_IN_KERNEL": False, "A.EARLY_LOADS": False},
    "delta_only": {"GRAD_SUM": False},
    "sum_n1": {"SHORT_SPLIT_TARGET": 0},
    "sum_n2": {"SHORT_SPLIT_ROWS": 64},
    "after": {},
    "after_n8": {"SHORT_SPLIT_TARGET": 1024, "SHORT_SPLIT_ROWS": 16},
    "after_kv_heads": {"SPLIT_HEADS_BELOW": 0},
    "after_late_loads": {"A.EARLY_LOADS": False},
    "after_cfg_16x16": {"A.CONFIGS": ((16, 16, 1, 2),) + A.CONFIGS},
    "after_fwd_own8": {"A.MIN_OWN_BLOCK": 8},  # the forward in 8-row blocks (144 workgroups)
}


@contextlib.contextmanager
def variant(sets):
    """Module switches set for the block (``A.NAME``: kernels/attention.py, ``AF.NAME``:
    kernels/attention_fast.py, else ops/attention.py), restored after."""
    ops_att = sys.modules["meganeura.ops.attention"]
    prefixes = {"A.": A, "AF.": AF, "AC.": AC}

    def target(key):
        for pre, mod in prefixes.items():
            if key.startswith(pre):
                return mod, key[len(pre):]
        return ops_att, key

    mods = {k: target(k) for k in sets}
    keep = {k: getattr(*mods[k]) for k in sets}
    for k, val in sets.items():
        setattr(*mods[k], val)
    try:
        yield
    finally:
        for k, val in keep.items():
            setattr(*mods[k], val)


def short_rows(dev, shapes=("smollm2", "whisper"), steps=20):
    """Per variant and shape: GPU µs per training step of q, k, v -> attention -> (o·c).sum()
    (SGD), the attention kernels' and reduces' µs, dispatches; printed and returned."""
    import meganeura as mn
    from meganeura import optim

    rows = []
    for sname in shapes:
        B, Hq, Hkv, S, D, causal = SHAPES[sname]
        r = np.random.default_rng(0)
        for name, sets in SHORT_VARIANTS.items():
            if sname == "whisper" and name not in ("before", "after"):
                continue
            with variant(sets):
                g = mn.Graph()
                q = g.param("q", (B, Hq, S, D))
                k_ = g.param("k", (B, Hkv, S, D))
                v = g.param("v", (B, Hkv, S, D))
                c = g.input("c", (B, Hq, S, D))
                loss = (mn.ops.attention(q, k_, v, causal=causal) * c).sum()
                sess = mn.compile(g, loss=loss, optimizer=optim.SGD(lr=1e-4), device=dev)
                sess.set_params({n: r.standard_normal(p.shape).astype(np.float32)
                                 for n, p in g.params.items()})
                prof = sess.profile(steps=steps, c=r.standard_normal(c.shape).astype(np.float32))
            kern = [(kt.label, kt.mean_s * 1e6) for kt in prof.rows()]
            att = sum(us for lab, us in kern if lab.startswith(("attention", "reduce",
                                                                  "multi_reduce"))
                      and "->()" not in lab)  # not the loss's sum
            row = {"shape": sname, "kind": "short_step", "variant": name,
                   "sets": {k: str(val)[:40] for k, val in sets.items()},
                   "gpu_us": prof.gpu_ms_per_step * 1e3, "dispatches": prof.dispatches_per_step,
                   "attention_and_reduces_us": att, "kernels": kern}
            rows.append(row)
            print(f"short {sname:8} {name:15} step {row['gpu_us']:8.1f} µs  {row['dispatches']:3} "
                  f"dispatches  attention+reduces {att:8.1f} µs  | " + "; ".join(
                      f"{lab[:40]} {us:.1f}" for lab, us in kern if us > 0), flush=True)
    return rows


# --kvariants NAMES (with --roof and/or the op paths): the short-loop kernel switches of
# kernels/attention.py, set in one process (before / after and each change alone)
# (H200 2026-12-01: "after" then was today's "cfg_default", "fwd_16x64" today's "after")
KERNEL_VARIANTS = {
    "before": {"A.SHORT_EARLY_KV": False, "A.SHORT_REG_STAGE": False, "A.SHORT_FWD_FIRST": ()},
    "early_kv": {"A.SHORT_REG_STAGE": False, "A.SHORT_FWD_FIRST": ()},
    "reg_stage": {"A.SHORT_EARLY_KV": False, "A.SHORT_FWD_FIRST": ()},
    "cfg_default": {"A.SHORT_FWD_FIRST": ()},  # both switches, the forward's old tiles
    "fwd_16x16": {"A.SHORT_FWD_FIRST": ((16, 16, 1, 2),)},  # 16 rows × 32 keys, 256 inv.
    "after": {},  # as the code is: 16 rows × 64 keys, 256 invocations
    "vec_loads": {"A.STRICT_VEC_LOADS": True},  # q/k/v bindings as vec4 (same values)
    "fwd_own8": {"A.SHORT_FWD_FIRST": (), "A.MIN_OWN_BLOCK": 8},  # 8-row blocks (144 wgs)
}


def roof_rows(dev, names, outdir, quick=False, steps=3):
    """--roof OUTDIR: SmolLM2's whole training step profiled as ``bench/roofline.py`` does,
    once per kernel variant (``KERNEL_VARIANTS``) in this process (one workload build); writes
    OUTDIR/roof-<variant>.json (roofline.json's layout) and prints each attention share."""
    import os

    import roofline
    from workloads import WORKLOADS

    os.makedirs(outdir, exist_ok=True)
    w = WORKLOADS["smollm2"](quick=quick, variant="main")
    rows = []
    for name in names:
        with variant(KERNEL_VARIANTS[name]):
            prof = roofline.profile_workload(w, dev, "strict", False, steps)
        res = {"device": dev.adapter_name, "variant": name, "sets": {
            k: str(v) for k, v in KERNEL_VARIANTS[name].items()}, "workloads": {
            "smollm2-train": {"gpu_ms": prof.gpu_ms_per_step, "rows": prof.roofline(),
                              "dispatches": prof.dispatches_per_step}}}
        path = os.path.join(outdir, f"roof-{name}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"roof {name:10} GPU {prof.gpu_ms_per_step:8.3f} ms/step", flush=True)
        us, total = attention_share(path, layers=2 if quick else 30)
        rows.append({"kind": "roof", "variant": name, "attention_us": us, "step_us": total})
    return rows


def attention_share(path, key="smollm2-train", marks=("9, 128, 64)", "3, 3, 128, 64)"),
                    layers=30):
    """The attention share of a profiled step (``bench/roofline.py``'s roofline.json): every
    ``attention*`` kernel plus the reduces over attention-shaped tensors (``marks``: SmolLM2's
    (·, 9, 128, 64) and (·, 3, 3, 128, 64) — δ = rowsum(dO·O), the dQ partial sum, the dK/dV
    head sums), each listed; returns (attention µs per step, step µs)."""
    with open(path) as f:
        res = json.load(f)["workloads"][key]
    rows = res["rows"]
    steps = max(r["calls"] for r in rows if r["label"].startswith("attention")) // layers
    total = sum(r["mean_us"] * r["calls"] for r in rows) / steps
    att = [r for r in rows if r["label"].startswith("attention") or (
        r["label"].startswith(("reduce", "multi_reduce")) and any(m in r["label"] for m in marks))]
    for r in att:
        print(f"share {key}: {r['label'][:72]:72} {r['calls'] // steps:3}×{r['mean_us']:6.1f} µs")
    us = sum(r["mean_us"] * r["calls"] for r in att) / steps
    print(f"share {key}: attention {us:8.1f} µs of {total:8.1f} µs per step = "
          f"{100 * us / total:5.2f} % ({res['dispatches']} dispatches per step)")
    return us, total


# --fwd-sweep: the long forward's variants, set in one process: "after" as the code is,
# "before" rolled (no ``FWD_UNROLL``), "unroll_all" every tile unrolled, "reg_q" Whisper's
# forward built as a short loop (Q staged through registers, K/V tile 0 loaded before Q),
# "main" the split tile and rolled kernel before 2026-12-01's fifth session.  (The two H200
# runs of docs/benchmarks.md "strict forward at Whisper's shape" ran this with the switches
# of commits 8614591 / 6ea2518, since removed as rejected: docs/rejected-optimizations.md)
FWD_VARIANTS = {
    "after": {},
    "before": {"A.FWD_UNROLL": ()},
    "unroll_all": {"A.FWD_UNROLL": A.CONFIGS},
    "reg_q": {"A.FWD_UNROLL": (), "A.SHORT_LOOP": 1 << 30},
    "main": {"A.FWD_UNROLL": (), "A.SPLIT_FWD_FIRST": ((16, 8, 4, 4),)},
    "vec_loads": {"A.STRICT_VEC_LOADS": True},  # q/k/v bindings as vec4 (same values)
}
# (variant, tile configuration, key chunks) timed at Whisper's shape
_T = (16, 16, 4, 2)
FWD_SWEEP = ([("main", (16, 8, 4, 4), 6), ("before", _T, 6), ("after", _T, 6),
              ("unroll_all", (16, 8, 4, 4), 6), ("reg_q", _T, 6)]
             + [("after", _T, n) for n in (4, 5, 8)])


def fwd_sweep(dev, t, sname="whisper", rounds=2, smoke=False):
    """The long forward's variants (``FWD_SWEEP``) at one shape, split forward + combine µs
    and the relative max error against float64; ``rounds`` passes over the whole list (ABAB:
    clock drift shows as a round-to-round difference), the minimum reported."""
    shape = SHAPES[sname]
    x, a, ref = problem(shape)
    D = shape[4]
    best: dict = {}
    todo = FWD_SWEEP
    if smoke:  # lavapipe: 32 KiB of workgroup storage; the smoke shape's keys as a long loop
        todo = list(dict.fromkeys((v, (8, 8, 2, 2), n) for v, _, n in todo))
        A.SHORT_LOOP = 1
    for r in range(rounds):
        for name, cfg, n in todo:
            if not A.config_fits("fwd", cfg, D, D, t):
                continue
            with variant(FWD_VARIANTS[name]):
                desc = dataclasses.replace(describe("fwd", x, a), splits=n, config=cfg)
                spec, err, us = run_config(dev, desc, x, ref)
            key = (name, cfg, n)
            row = best.setdefault(key, {"shape": sname, "kind": "fwd_sweep", "variant": name,
                                        "config": list(cfg), "splits": n, "us_rounds": [],
                                        "err": err})
            row["us_rounds"].append(us)
            row["err"] = max(row["err"], err)
            fl = 4 * shape[3] ** 2 * D * shape[1] * shape[0]
            print(f"sweep r{r} {sname:8} {name:13} {str(cfg):14} x{n} {us:8.1f} µs "
                  f"{fl / us / 1e6:6.2f} TFLOP/s err {err:.1e}", flush=True)
    rows = list(best.values())
    for row in rows:
        row["us"] = min(row["us_rounds"])
    return rows


def whisper_infer_rows(dev, names, outdir, quick=False, steps=3):
    """Whisper-tiny inference profiled (``bench/roofline.py``) per forward variant: ``names``
    of ``FWD_VARIANTS``, or ``<variant>@<chunks>`` (the op's key chunks forced through
    ``SPLIT_TARGET_FWD``); the step's GPU ms and its attention kernels' µs per call."""
    import roofline
    from workloads import WORKLOADS

    w = WORKLOADS["whisper"](quick=quick, variant="main")
    rows = []
    for name in names:
        base, _, n = name.partition("@")
        sets = dict(FWD_VARIANTS[base])
        if n:  # fwd_splits: ceil(target / items) chunks, items = 282 (row blocks of 32)
            sets["SPLIT_TARGET_FWD"] = 282 * (int(n) - 1) + 1
        with variant(sets):
            prof = roofline.profile_workload(w, dev, "strict", True, steps)
        kern = [r for r in prof.roofline() if r["label"].startswith("attention")]
        row = {"kind": "whisper_infer", "variant": name, "gpu_ms": prof.gpu_ms_per_step,
               "dispatches": prof.dispatches_per_step,
               "attention": [(r["label"], r["calls"], r["mean_us"]) for r in kern]}
        rows.append(row)
        with open(os.path.join(outdir, f"whisper-infer-{name.replace('@', '-x')}.json"), "w") as f:
            json.dump(row, f, indent=1)
        print(f"whisper infer {name:16} GPU {prof.gpu_ms_per_step:7.3f} ms/step  " + "; ".join(
            f"{lab[:44]} {c}x{us:.1f}" for lab, c, us in row["attention"]), flush=True)
    return rows


def fast_e2e_rows(dev, quick=False, steps=3, rounds=2):
    """Whisper-tiny's step profiled (``bench/roofline.py``; GPU ms per step, attention kernels)
    strict, and fast with its attention forward on the strict kernel ("fast, strict attn":
    ``FAST_MIN_KEYS`` out of reach) or on the tensor cores ("fast"), inference and SGD
    training, ``rounds`` interleaved rounds."""
    import roofline
    from workloads import WORKLOADS

    w = WORKLOADS["whisper"](quick=quick, variant="main")
    cells = [("strict", "strict", None), ("fast, strict attn", "fast", 10 ** 9),
             ("fast", "fast", AF.FAST_MIN_KEYS)]
    got: dict = {}
    for rnd in range(rounds):
        for inference in (True, False):
            for name, prec, keys in (cells if rnd % 2 == 0 else cells[::-1]):
                with variant({} if keys is None else {"AF.FAST_MIN_KEYS": keys}):
                    prof = roofline.profile_workload(w, dev, prec, inference, steps)
                att = [(r["label"], r["calls"], r["mean_us"]) for r in prof.roofline()
                       if r["label"].startswith("attention")]
                got.setdefault((name, inference), []).append((prof.gpu_ms_per_step, att))
    rows = []
    for (name, inference), rs in got.items():
        ms = [r[0] for r in rs]
        rows.append({"kind": "whisper_fast_e2e", "variant": name,
                     "mode": "infer" if inference else "train", "gpu_ms": float(np.median(ms)),
                     "gpu_ms_rounds": ms, "attention": rs[-1][1]})
        print(f"whisper {'infer' if inference else 'train'} {name:18} GPU "
              f"{np.median(ms):7.3f} ms/step (rounds {', '.join(f'{m:.3f}' for m in ms)}); "
              + "; ".join(f"{lab[:30]} {c}x{us:.1f}" for lab, c, us in rs[-1][1][:3]),
              flush=True)
    return rows


def config_rows(dev, t, sname, shape, quick, everything):
    """Every tile configuration of each kernel at one shape, then split-K and fast rows."""
    rows = []
    x, a, ref = problem(shape)
    x["_ref"] = ref
    for kind in KINDS:
        desc = describe(kind, x, a)
        cands = configs(desc, t, everything)
        for n, c in enumerate(cands[:1] if quick else cands):
            spec, err, us = run_config(dev, c, x, ref)
            fl = spec.meta["flops"] * (0.5 if shape[5] else 1.0)  # causal: half the pairs
            us = max(us, 1e-3)
            rows.append({"shape": sname, "kind": kind, "config": list(c.config),
                         "default": n == 0, "us": us, "tflops": fl / us / 1e6, "err": err,
                         "wg": spec.meta["workgroup_size"],
                         "workgroups": list(spec.workgroups)})
            print(f"{sname:8} {kind:5} {str(c.config):16}{'*' if n == 0 else ' '} "
                  f"{us:9.1f} µs {fl / us / 1e6:7.2f} TFLOP/s  err {err:.1e}", flush=True)
    rows += split_rows(dev, x, a, sname, shape)
    return rows + fast_rows(dev, x, a, sname, shape)


def main(argv) -> None:
    if "--share" in argv:  # no device: the attention share of a roofline.json (30 layers)
        attention_share(argv[argv.index("--share") + 1])
        return
    backend = next((a for a in argv if not a.startswith("-")), "dawn")
    quick = "--quick" in argv
    if "--smoke" in argv:
        SHAPES.update(SMOKE)
        REPEATS.update(n=3, warm_s=0.0)

    if "--toggles" in argv:  # extra Dawn toggles (e.g. disable_robustness), before the device
        from meganeura.runtime import device as devmod

        devmod._DAWN_TOGGLES += tuple(argv[argv.index("--toggles") + 1].split(","))
    dev = get_device(backend)
    t = make_target(dev.limits, dev.features)
    print(f"device: {dev.adapter_name} ({dev.implementation})", flush=True)
    if "--sweep" in argv:
        if "--smoke" not in argv:
            REPEATS.update(warm_s=0.15)
        path = argv[argv.index("--json") + 1] if "--json" in argv else None
        return sweep(dev, path, "--smoke" in argv)
    rows = []
    path = argv[argv.index("--json") + 1] if "--json" in argv else None

    def save():  # after every section: a run cut short keeps what it measured
        if path:
            with open(path, "w") as f:
                json.dump({"device": dev.describe(), "rows": rows}, f, indent=1)

    if "--table" in argv:  # issue 12's attention table (markdown next to the JSON)
        rows += attention_table(dev, argv[argv.index("--table") + 1])
        save()
        return
    if "--fast-e2e" in argv:  # Whisper's step, fast with and without the tensor-core forward
        smoke = "--smoke" in argv
        rows += fast_e2e_rows(dev, quick=smoke, steps=1 if smoke else 3,
                              rounds=1 if smoke else 2)
        save()
        if "--fast-ab" not in argv:
            return
    if "--fast-ab" in argv:  # the tensor-core forward's variants against the strict one
        names = argv[argv.index("--fast-ab") + 1].split(",")
        smoke = "--smoke" in argv
        shapes = (argv[argv.index("--shapes") + 1].split(",") if "--shapes" in argv
                  else ("whisper", "smollm2"))
        rows += fast_ab(dev, names, shapes, rounds=1 if smoke else 2, smoke=smoke)
        save()
        ab = [r for r in rows if r["kind"] == "fwd_fast_ab"]
        best = sorted((r for r in ab if r["variant"] != "strict"), key=lambda r: r["us"])
        for r in [r for r in ab if r["variant"] == "strict"] + best[:6]:
            print(f"table {r['shape']:8} {r['variant']:7} {str(tuple(r['config'])):9} "
                  f"x{r['splits']} {r['us']:8.1f} µs err {r['err']:.1e}")
        return
    if "--fwd-sweep" in argv:  # the long forward's variants, then Whisper's inference
        smoke = "--smoke" in argv
        os.makedirs(argv[argv.index("--fwd-sweep") + 1], exist_ok=True)
        if "--winfer" in argv:  # the op in the model first
            rows += whisper_infer_rows(dev, argv[argv.index("--winfer") + 1].split(","),
                                       argv[argv.index("--fwd-sweep") + 1], quick=smoke,
                                       steps=1 if smoke else 3)
            save()
        rows += fwd_sweep(dev, t, rounds=1 if smoke else 2, smoke=smoke)
        save()
        for r in sorted((r for r in rows if r["kind"] == "fwd_sweep"), key=lambda r: r["us"]):
            print(f"best {r['variant']:13} {str(tuple(r['config'])):14} x{r['splits']} "
                  f"{r['us']:8.1f} µs (rounds {', '.join(f'{u:.1f}' for u in r['us_rounds'])})"
                  f" err {r['err']:.1e}")
        return
    kv = argv[argv.index("--kvariants") + 1].split(",") if "--kvariants" in argv else None
    if "--roof" in argv:  # SmolLM2's whole step per kernel variant (first)
        rows += roof_rows(dev, kv or ["before", "after"], argv[argv.index("--roof") + 1],
                          quick="--smoke" in argv, steps=1 if "--smoke" in argv else 3)
        save()
    if "--short" in argv:  # the profiled one-layer step per short-plan variant (first)
        rows += short_rows(dev, ("smollm2",) if "--smoke" in argv else ("smollm2", "whisper"),
                           3 if "--smoke" in argv else 20)
        save()
    for sname, shape in SHAPES.items():  # first: the headline numbers
        if "--shapes" in argv and sname not in argv[argv.index("--shapes") + 1].split(","):
            continue
        table = KERNEL_VARIANTS if kv else SHORT_VARIANTS
        for name in kv or (("before", "after") if "--short" in argv else ("after",)):
            print(f"op path {sname:8} variant {name}", flush=True)
            with variant(table[name]):  # "after": as the code is
                rows += [dict(r, variant=name) for r in op_path(dev, sname, shape)]
            save()
    if "--torch" in argv:
        for sname, shape in SHAPES.items():
            tt = torch_times(shape)
            if tt:
                print(f"torch SDPA f32 {sname:8} fwd {tt[0]:8.1f} µs  fwd+bwd {tt[1]:8.1f} µs")
                rows.append({"shape": sname, "kind": "torch", "fwd_us": tt[0],
                             "fwd_bwd_us": tt[1]})
        save()
    if "--op" in argv:
        return
    rows += decode_rows(dev, "--smoke" in argv)  # cheap
    save()
    for sname, shape in SHAPES.items():
        rows += config_rows(dev, t, sname, shape, quick, "--all" in argv)
        save()
    print("\nbest per kernel (heuristic in brackets):")
    for sname in SHAPES:
        for kind in KINDS:
            rs = [r for r in rows if r["shape"] == sname and r["kind"] == kind and "default" in r]
            if rs:
                b = min(rs, key=lambda r: r["us"])
                d = next(r for r in rs if r["default"])
                print(f"{sname:8} {kind:5} best {b['us']:8.1f} µs {str(b['config']):16} "
                      f"[{d['us']:8.1f} µs {str(d['config'])}] max err "
                      f"{max(r['err'] for r in rs):.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
