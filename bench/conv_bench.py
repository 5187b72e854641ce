"""Convolution kernels on one WebGPU implementation: the ResNet-50 (batch 4) and SD U-Net
(batch 2, small images) shapes, forward / input gradient / weight gradient, each checked
against float64 numpy before it is timed.

Two groups of rows per problem, from the same process (so before/after share one run):
* ``old``: the kernels as planned before the global split-K (forward and input gradient
  unsplit, the weight gradient split by the old rule) with every tile configuration of the
  ``candidates`` hook (the heuristic's first, marked ``*``);
* ``new``: the split-K the plan now uses (``with_split_k``, ``weight_grad_split``) and a sweep
  of other splits, each with its heuristic tile; a split's time is its partial kernel plus the
  reduction adding the partials (what the plan runs).

* ``mm`` (1×1, stride-1, unpadded convolutions only): the batched matmul the plan runs for them
  when ``ops.conv`` picks the matmul form (``MatmulKernel`` over strided views, exactly as the
  schedule builds it; the weight gradient as one partial product per image plus the reduction
  adding them), its heuristic configuration (marked ``*``) and the matmul ``candidates``.

* ``pf`` (``CONV_PF=1``): each split of the ``new`` group again with register prefetch
  (``TileCfg.PF``) on its heuristic tile (``CONV_PF_HEUR=1``: the plan's split only;
  ``CONV_SKIP_OLD=1`` leaves the ``old`` group out).

* ``st`` (``CONV_ST=1``, instead of the groups above): the staging sweep over the forward
  convolutions ResNet-50 inference runs on the conv kernels (``INFER``): the plan as compiled
  now (marked heuristic), then at the plan's split and half of it each ``ST_VARIANTS``
  entry (staging mode ``TileCfg.ST``, prefetch, K step) on the heuristic tile, the first being
  the template before the staging modes; the two gradients at their plan's split, ST 0, 1, 4.

Usage: [CONV_ALL=1] [CONV_PF=1] [CONV_ST=1] python bench/conv_bench.py wgpu|dawn OUT.json
[SHAPE_FILTER]
(SHAPE_FILTER "1x1 (": only the 1×1 stride-1 shapes.)
(CONV_ALL: the old rows time every configuration of the template, not only the ≤ 8
candidates.)

Timing: back-to-back dispatches of one kernel inside one compute pass between two timestamps
(Dawn's timestamps are coarse on the H200, so one pass holds many dispatches); the median over
passes, after ≥ 0.5 s of warm-up work (the GPU downclocks when idle)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from meganeura.dtypes import f32
from meganeura.kernels import (
    Instr,
    MatmulKernel,
    ReduceKernel,
    Strided,
    candidates,
    emit,
    make_target,
)
from meganeura.kernels.conv import (
    CONFIGS,
    Conv2dInputGradKernel,
    Conv2dKernel,
    Conv2dWeightGradKernel,
    ConvGeom,
    TileCfg,
    choose_cfg,
    gemm_shape,
    tile_cfg,
    with_split_k,
)
from meganeura.ops.conv import _conv2d_ref, _input_grad_ref, _weight_grad_ref, weight_grad_split
from meganeura.runtime.device import get_device

# label -> (x shape, w shape, stride, pad)
SHAPES = {
    "r50 3x3 (4,64,56,56)": ((4, 64, 56, 56), (64, 64, 3, 3), 1, 1),
    "r50 3x3 (4,128,28,28)": ((4, 128, 28, 28), (128, 128, 3, 3), 1, 1),
    "r50 3x3 (4,256,14,14)": ((4, 256, 14, 14), (256, 256, 3, 3), 1, 1),
    "r50 3x3 (4,512,7,7)": ((4, 512, 7, 7), (512, 512, 3, 3), 1, 1),
    "r50 3x3s2 (4,256,28,28)": ((4, 256, 28, 28), (256, 256, 3, 3), 2, 1),
    "r50 1x1 (4,1024,14,14)": ((4, 1024, 14, 14), (256, 1024, 1, 1), 1, 0),
    "r50 1x1 (4,2048,7,7)": ((4, 2048, 7, 7), (512, 2048, 1, 1), 1, 0),
    "r50 1x1 (4,256,14,14)->1024": ((4, 256, 14, 14), (1024, 256, 1, 1), 1, 0),
    # the other 1x1 stride-1 convolutions of ResNet-50 (batch 4)
    "r50 1x1 (4,64,56,56)->64": ((4, 64, 56, 56), (64, 64, 1, 1), 1, 0),
    "r50 1x1 (4,64,56,56)->256": ((4, 64, 56, 56), (256, 64, 1, 1), 1, 0),
    "r50 1x1 (4,256,56,56)->64": ((4, 256, 56, 56), (64, 256, 1, 1), 1, 0),
    "r50 1x1 (4,256,56,56)->128": ((4, 256, 56, 56), (128, 256, 1, 1), 1, 0),
    "r50 1x1 (4,128,28,28)->512": ((4, 128, 28, 28), (512, 128, 1, 1), 1, 0),
    "r50 1x1 (4,512,28,28)->128": ((4, 512, 28, 28), (128, 512, 1, 1), 1, 0),
    "r50 1x1 (4,512,28,28)->256": ((4, 512, 28, 28), (256, 512, 1, 1), 1, 0),
    "r50 1x1 (4,1024,14,14)->512": ((4, 1024, 14, 14), (512, 1024, 1, 1), 1, 0),
    "r50 1x1 (4,512,7,7)->2048": ((4, 512, 7, 7), (2048, 512, 1, 1), 1, 0),
    # the rest of ResNet-50's forward convolutions on the conv path (strided, stem)
    "r50 3x3s2 (4,128,56,56)": ((4, 128, 56, 56), (128, 128, 3, 3), 2, 1),
    "r50 3x3s2 (4,512,14,14)": ((4, 512, 14, 14), (512, 512, 3, 3), 2, 1),
    "r50 1x1s2 (4,256,56,56)->512": ((4, 256, 56, 56), (512, 256, 1, 1), 2, 0),
    "r50 1x1s2 (4,512,28,28)->1024": ((4, 512, 28, 28), (1024, 512, 1, 1), 2, 0),
    "r50 1x1s2 (4,1024,14,14)->2048": ((4, 1024, 14, 14), (2048, 1024, 1, 1), 2, 0),
    "r50 stem 7x7s2 (4,3,224,224)": ((4, 3, 224, 224), (64, 3, 7, 7), 2, 3),
    "unet (2,128,8,8)": ((2, 128, 8, 8), (128, 128, 3, 3), 1, 1),
    "unet (2,128,16,16)": ((2, 128, 16, 16), (128, 128, 3, 3), 1, 1),
    "unet (2,64,32,32)": ((2, 64, 32, 32), (64, 64, 3, 3), 1, 1),
    "unet (2,128,32,32)": ((2, 128, 32, 32), (128, 128, 3, 3), 1, 1),
    "unet (2,256,16,16)": ((2, 256, 16, 16), (256, 256, 3, 3), 1, 1),
    "unet out (2,64,32,32)->4": ((2, 64, 32, 32), (4, 64, 3, 3), 1, 1),
}

# CONV_ST=1: the forward convolutions ResNet-50 inference runs on the conv kernels (batch 4;
# the 1×1 ones below MATMUL_MIN_TILES and the strided ones), the staging sweep only
INFER = ("r50 3x3 (4,256,14,14)", "r50 1x1 (4,1024,14,14)", "r50 3x3 (4,128,28,28)",
         "r50 3x3 (4,512,7,7)", "r50 1x1 (4,512,7,7)->2048", "r50 1x1 (4,512,28,28)->128",
         "r50 3x3 (4,64,56,56)", "r50 1x1 (4,2048,7,7)", "r50 3x3s2 (4,256,28,28)",
         "r50 1x1s2 (4,1024,14,14)->2048", "r50 1x1s2 (4,512,28,28)->1024",
         "r50 1x1 (4,1024,14,14)->512", "r50 stem 7x7s2 (4,3,224,224)")  # most time first
# (ST, PF, K-step factor, (TM, TN, RM, RN) or None for the heuristic tile's) variants timed by
# the staging sweep; the first is the template before the staging modes ("before").  The two
# larger tiles (32 results per invocation, 256 invocations) are timed at the split and twice it.
ST_VARIANTS = ((0, 0, 1, None), (1, 0, 1, None), (2, 0, 1, None), (3, 0, 1, None),
               (4, 0, 1, None), (4, 1, 1, None), (4, 2, 1, None), (4, 0, 2, None),
               (4, 0, 1, (128, 64, 8, 4)), (4, 0, 1, (64, 128, 4, 8)))
GRAD_VARIANTS = ((0, 0, 1, None), (1, 0, 1, None), (4, 0, 1, None))

# CONV_TINY=1: a dry run of the whole script on a CPU adapter (lavapipe)
TINY = {
    "tiny 3x3 (1,64,4,4)": ((1, 64, 4, 4), (64, 64, 3, 3), 1, 1),
    "tiny 1x1s2 (1,32,6,6)": ((1, 32, 6, 6), (64, 32, 1, 1), 2, 0),
    "tiny 1x1 (2,24,5,3)": ((2, 24, 5, 3), (40, 24, 1, 1), 1, 0),
}


def geom(xs, ws, s, p) -> ConvGeom:
    n, c, h, w = xs
    o, _, kh, kw = ws
    oh, ow = (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1
    return ConvGeom(n, c, h, w, o, kh, kw, oh, ow, (s, s), ((p, p), (p, p)))


def old_weight_grad_split(n_reduce: int, rows: int, cols: int) -> int:
    """The weight-gradient split rule before 2026-12 (chunks >= 1024, 128 tiles)."""
    tiles = max(1, -(-rows // 64) * -(-cols // 64))
    return max(1, min(n_reduce // 1024, -(-128 // tiles), 32))


def problems(xs, ws, s, p, rng):
    """(kind, unsplit description, inputs, output shape, float64 reference, old split, new
    split, splits to sweep) of the three kernels."""
    G = geom(xs, ws, s, p)
    ys = (G.n, G.o, G.oh, G.ow)
    x, w, dy = (rng.standard_normal(sh, dtype=np.float32) for sh in (xs, ws, ys))
    a = {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": 1}
    kt, rows, cols = G.n * G.oh * G.ow, G.o, G.c * G.kh * G.kw
    C = Strided.contiguous
    x64 = x.astype(np.float64)
    fwd = Conv2dKernel(G, C(f32, xs), C(f32, ws))
    dgr = Conv2dInputGradKernel(G, C(f32, ys), C(f32, ws))
    sweep = (2, 4, 8, 16)
    return [
        ("fwd", fwd, [x, w], ys, lambda: _conv2d_ref([x64, w], a)[0], 1,
         with_split_k(fwd).split_k, sweep),
        ("dgrad", dgr, [dy, w], xs,
         lambda: _input_grad_ref([dy.astype(np.float64), w], dict(a, input_size=xs[2:]))[0], 1,
         with_split_k(dgr).split_k, sweep),
        ("wgrad", Conv2dWeightGradKernel(G, C(f32, xs), C(f32, ys)), [x, dy], ws,
         lambda: _weight_grad_ref([x64, dy], dict(a, kernel_size=ws[2:], split=1))[0],
         old_weight_grad_split(kt, rows, cols), weight_grad_split(kt, rows, cols),
         (2, 4, 8, 16, 32)),
    ]


def mm_problems(G: ConvGeom) -> dict:
    """kind -> (matmul description, partial sums S) of a 1×1, stride-1, unpadded convolution's
    three GEMMs as the schedule builds them (``ops.conv`` matmul form: views, no copies; the
    weight gradient one partial product per image); {} for other convolutions.  Operands
    are bound in the reverse order of the conv kernels' (w, x / w, dy / dy, x)."""
    if (G.kh, G.kw, G.stride, G.pad, G.groups) != (1, 1, (1, 1), ((0, 0), (0, 0)), 1):
        return {}
    n, c, o, hw = G.n, G.c, G.o, G.h * G.w

    def v(shape, strides, ext):
        return Strided(f32, shape, strides, 0, ext)

    x, dy = v((n, c, hw), (c * hw, hw, 1), n * c * hw), v((n, o, hw), (o * hw, hw, 1), n * o * hw)
    return {
        "fwd": (MatmulKernel(n, o, hw, c, v((1, o, c), (0, c, 1), o * c), x, out_dtype=f32), 1),
        "dgrad": (MatmulKernel(n, c, hw, o, v((1, c, o), (0, 1, c), o * c), dy, out_dtype=f32),
                  1),
        "wgrad": (MatmulKernel(n, o, c, hw, dy, v((n, hw, c), (c * hw, 1, hw), n * c * hw),
                               out_dtype=f32), n),
    }


def prefetched(desc):
    """``desc`` with its heuristic tile and register prefetch (``TileCfg.PF``)."""
    cfg = choose_cfg(*gemm_shape(desc))
    return dataclasses.replace(desc, tile=dataclasses.replace(cfg, PF=1).tuple())


def with_split(desc, S: int):
    """``desc`` computing S partial sums (the weight gradient's ``split`` or ``split_k``)."""
    if isinstance(desc, Conv2dWeightGradKernel):
        return dataclasses.replace(desc, split=S)
    return dataclasses.replace(desc, split_k=S)


def sum_kernel(S: int, oshape) -> ReduceKernel:
    """The reduction the plan adds S partial sums with (compile/schedule.py)."""
    shape = (S,) + tuple(oshape)
    return ReduceKernel(shape, (0,), "sum", (Strided.contiguous(f32, shape),),
                        (Instr("{0}", (("in", 0),), f32),), name="splitk_sum")


def time_kernel(dev, spec, bufs, per_pass=20, passes=7) -> float:
    """Median seconds per dispatch: ``per_pass`` dispatches in one timestamped pass."""
    if os.environ.get("CONV_TINY"):
        per_pass, passes = 2, 2
    wgpu = dev.module
    pipe, bg = dev.pipeline(spec), dev.bind_group(spec, bufs)
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * passes)
    rb = dev.device.create_buffer(
        size=16 * passes, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    enc = dev.device.create_command_encoder()
    for r in range(passes):
        cp = enc.begin_compute_pass(timestamp_writes={
            "query_set": qs, "beginning_of_pass_write_index": 2 * r,
            "end_of_pass_write_index": 2 * r + 1})
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        for _ in range(per_pass):
            cp.dispatch_workgroups(*spec.workgroups)
        cp.end()
    enc.resolve_query_set(qs, 0, 2 * passes, rb, 0)
    dev.queue.submit([enc.finish()])
    ts = np.frombuffer(dev.read_buffer(rb, 0, 16 * passes), dtype=np.uint64).astype(np.float64)
    return float(np.median(ts[1::2] - ts[0::2])) / 1e9 / per_pass


def warm_up(dev, spec, bufs, seconds=0.6) -> None:
    if os.environ.get("CONV_TINY"):
        seconds = 0.0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        time_kernel(dev, spec, bufs, 50, 2)


def measure(dev, d, inputs, oshape, S, want, scale) -> dict:
    """Check then time ``d`` (S partial sums) and, for S > 1, the reduction adding them."""
    spec = emit(d, dev)
    pshape = ((S,) if S > 1 else ()) + tuple(oshape)
    bufs = [dev.upload(a) for a in inputs] + [dev.create_buffer(4 * int(np.prod(pshape)))]
    dev.dispatch(spec, bufs)
    got = dev.read_array(bufs[-1], pshape, f32)
    got = got.sum(0, dtype=np.float64) if S > 1 else got
    err = float(np.abs(got - want).max()) / scale
    warm_up(dev, spec, bufs, 0.03)  # clocks up again after the host-side check
    sec = time_kernel(dev, spec, bufs)
    sum_sec = 0.0
    if S > 1:
        red = emit(sum_kernel(S, oshape), dev)
        sum_sec = time_kernel(dev, red, [bufs[-1], dev.create_buffer(4 * int(np.prod(oshape)))])
    tot = sec + sum_sec
    return {"tile": list(spec.meta.get("tile") or spec.meta["config"]), "split": S, "us": tot * 1e6,
            "sum_us": sum_sec * 1e6, "tflops": spec.meta["flops"] / tot / 1e12, "rel_err": err,
            "ok": err <= 1e-4, "workgroups": list(spec.workgroups)}


def run_mm(dev, target, label, kind, mm, inputs, oshape, want, scale) -> list[dict]:
    """The ``mm`` rows: the matmul form's heuristic configuration first, then its candidates."""
    rows = []
    desc, S = mm
    for i, d in enumerate(candidates(desc, target)):
        r = measure(dev, d, inputs[::-1], oshape, S, want, scale)
        rows.append({"shape": label, "kind": kind, "group": "mm", "heuristic": i == 0, **r})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_problem(dev, target, label, kind, desc, inputs, oshape, ref, s_old, s_new,
                sweep, mm=None) -> list[dict]:
    want = ref()
    scale = float(np.abs(want).max())
    rows = []
    old = with_split(desc, s_old) if s_old > 1 else desc
    descs = [] if os.environ.get("CONV_SKIP_OLD") else candidates(old, target)
    if os.environ.get("CONV_ALL"):  # every configuration the device allows, not just ≤ 8
        descs += [dataclasses.replace(old, tile=c.tuple()) for c in CONFIGS
                  if c.storage() <= target.lim("max_compute_workgroup_storage_size")]
        descs = list(dict.fromkeys(descs))
    for i, d in enumerate(descs):
        r = measure(dev, d, inputs, oshape, s_old, want, scale)
        rows.append({"shape": label, "kind": kind, "group": "old", "heuristic": i == 0, **r})
        print(json.dumps(rows[-1]), flush=True)
    for S in dict.fromkeys((s_new, *sweep)):
        d = with_split(desc, S) if S > 1 else desc
        r = measure(dev, d, inputs, oshape, S, want, scale)
        rows.append({"shape": label, "kind": kind, "group": "new", "heuristic": S == s_new,
                     **r})
        print(json.dumps(rows[-1]), flush=True)
        if os.environ.get("CONV_PF") and (S == s_new or not os.environ.get("CONV_PF_HEUR")):
            r = measure(dev, prefetched(d), inputs, oshape, S, want, scale)
            rows.append({"shape": label, "kind": kind, "group": "pf",
                         "heuristic": S == s_new, **r})
            print(json.dumps(rows[-1]), flush=True)
    if mm is not None:
        rows += run_mm(dev, target, label, kind, mm, inputs, oshape, want, scale)
    return rows


def staged(desc, S: int, st: int, pf: int, bkx: int, shape=None):
    """``desc`` split S ways on its heuristic tile (or TM, TN, RM, RN = ``shape`` without
    in-workgroup split) with staging ``st``, prefetch ``pf`` and ``bkx`` times its K step."""
    d = with_split(desc, S) if S > 1 else desc
    cfg = choose_cfg(*gemm_shape(d))
    if shape is not None:
        cfg = TileCfg(*shape)
    return dataclasses.replace(d, tile=dataclasses.replace(cfg, ST=st, PF=pf,
                                                           BK=cfg.BK * bkx).tuple())


def run_staging(dev, target, label, kind, desc, inputs, oshape, ref, s_new) -> list[dict]:
    """The ``st`` rows: the plan's split and half of it (forward; the larger tiles at it and
    twice it, ST 4 also at a quarter; the gradients at the plan's split, GRAD_VARIANTS) × the
    staging variants; ``heuristic`` marks the plan as it is now (split and default tile, no
    forced tile)."""
    want = ref()
    scale = float(np.abs(want).max())
    rows = []
    plan = with_split(desc, s_new) if s_new > 1 else desc
    r = measure(dev, plan, inputs, oshape, s_new, want, scale)
    rows.append({"shape": label, "kind": kind, "group": "st", "heuristic": True, "st": None,
                 **r})
    print(json.dumps(rows[-1]), flush=True)
    fwd = kind == "fwd"
    splits = (s_new, max(1, s_new // 2)) if fwd else (s_new,)
    K = gemm_shape(desc)[2]
    for st, pf, bkx, shape in ST_VARIANTS if fwd else GRAD_VARIANTS:
        more = (min(2 * s_new, 32, max(1, K // 64)),) if shape else ()
        more += (max(1, s_new // 4),) if (st, pf, bkx, shape) == (4, 0, 1, None) else ()
        for S in dict.fromkeys(more + (splits[:1] if shape else splits)):
            d = staged(desc, S, st, pf, bkx, shape)
            if tile_cfg(d.tile).storage() + 8192 > target.lim(
                    "max_compute_workgroup_storage_size"):  # (+ the table, at most 8 KiB)
                continue
            r = measure(dev, d, inputs, oshape, S, want, scale)
            rows.append({"shape": label, "kind": kind, "group": "st", "heuristic": False,
                         "st": [st, pf, bkx, shape], **r})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_staging(rows) -> None:
    """Per problem: before (plan split, ST 0), the plan now (heuristic), the best variant."""
    print(f"{'shape':32} {'kind':6} {'before':>7} {'now':>7} {'TF':>5} {'best':>7} {'TF':>5} "
          f"{'S':>3}  (ST, PF, BKx, tile)")
    seen = {}
    for r in rows:
        if r["group"] == "st":
            seen.setdefault((r["shape"], r["kind"]), []).append(r)
    for (shape, kind), rs in seen.items():
        now = next(r for r in rs if r["heuristic"])
        var = [r for r in rs if not r["heuristic"]] or [now]
        before = next((r for r in var if r["st"] == [0, 0, 1, None] and
                       r["split"] == now["split"]),
                      now)
        b = min(var, key=lambda r: r["us"])
        bad = "" if all(r["ok"] for r in rs) else "  WRONG"
        print(f"{shape:32} {kind:6} {before['us']:7.1f} {now['us']:7.1f} {now['tflops']:5.1f} "
              f"{b['us']:7.1f} {b['tflops']:5.1f} {b['split']:3d}  {tuple(b['st'] or ())}"
              f"{bad}")


def main() -> None:
    impl, out_path = sys.argv[1], sys.argv[2]
    filt = sys.argv[3] if len(sys.argv) > 3 else ""
    dev = get_device(impl)
    target = make_target(dev)
    print(impl, dev.adapter_name, flush=True)
    rng = np.random.default_rng(0)
    rows, warmed = [], False
    st_mode = bool(os.environ.get("CONV_ST"))
    shapes = TINY if os.environ.get("CONV_TINY") else (
        {k: SHAPES[k] for k in INFER} if st_mode else SHAPES)
    for label, (xs, ws, s, p) in shapes.items():
        if filt not in label:
            continue
        mms = mm_problems(geom(xs, ws, s, p))
        for kind, desc, inputs, oshape, ref, s_old, s_new, sweep in problems(xs, ws, s, p, rng):
            if not warmed:
                spec = emit(desc, dev)
                bufs = [dev.upload(a) for a in inputs] + [
                    dev.create_buffer(4 * int(np.prod(oshape)))]
                warm_up(dev, spec, bufs)
                warmed = True
            if st_mode:  # (the gradients of 1×1 stride-1 convolutions mostly run as matmuls)
                if kind == "fwd" or not mms:
                    rows += run_staging(dev, target, label, kind, desc, inputs, oshape, ref,
                                        s_new)
            else:
                rows += run_problem(dev, target, label, kind, desc, inputs, oshape, ref, s_old,
                                    s_new, sweep, mms.get(kind))
            with open(out_path, "w") as f:  # after every problem: a cut-off run keeps its rows
                json.dump({"impl": impl, "adapter": dev.adapter_name, "rows": rows}, f, indent=1)
    print_staging(rows) if st_mode else print_table(rows)


def print_table(rows) -> None:
    """Per problem: old heuristic and best old configuration; the new plan (split S) and the
    best split of the sweep (µs include the reduction adding the partials)."""
    print(f"{'shape':28} {'kind':6} {'old us':>7} {'TF':>5} {'best':>7} {'new us':>7} {'TF':>5} "
          f"{'S':>3} {'bestS us':>8} {'S':>3} {'pf us':>7} {'mm us':>7} {'TF':>5} {'mmbest':>7}  "
          "old best tile")
    seen = {}
    for r in rows:
        seen.setdefault((r["shape"], r["kind"]), []).append(r)
    for (shape, kind), rs in seen.items():
        new = [r for r in rs if r["group"] == "new"]
        old = [r for r in rs if r["group"] == "old"] or new
        mm = [r for r in rs if r["group"] == "mm"]
        pf = [r for r in rs if r["group"] == "pf"]
        ph = next((r for r in pf if r["heuristic"]), {"us": float("nan")})
        mh = mm[0] if mm else {"us": float("nan"), "tflops": float("nan")}
        mb = min(mm, key=lambda r: r["us"]) if mm else mh
        h, b = old[0], min(old, key=lambda r: r["us"])
        nh = next(r for r in new if r["heuristic"]) if new else h
        nb = min(new or old, key=lambda r: r["us"])
        bad = "" if all(r["ok"] for r in rs) else "  WRONG"
        print(f"{shape:28} {kind:6} {h['us']:7.1f} {h['tflops']:5.1f} {b['us']:7.1f} "
              f"{nh['us']:7.1f} {nh['tflops']:5.1f} {nh['split']:3d} {nb['us']:8.1f} "
              f"{nb['split']:3d} {ph['us']:7.1f} {mh['us']:7.1f} {mh['tflops']:5.1f} "
              f"{mb['us']:7.1f}  "
              f"{tuple(b['tile'])}{bad}")


if __name__ == "__main__":
    main()
