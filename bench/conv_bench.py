"""Convolution kernels on one WebGPU implementation: the ResNet-50 (batch 4) and SD U-Net
(batch 2, small images) shapes, forward / input gradient / weight gradient, every tile
configuration of the ``candidates`` hook (the heuristic's first, marked ``*``), each checked
against float64 numpy before it is timed.

Usage: [CONV_ALL=1] python bench/conv_bench.py wgpu|dawn OUT.json [SHAPE_FILTER]
(CONV_ALL: time every configuration of the template, not only the ≤ 8 candidates.)

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
from meganeura.kernels import Strided, candidates, emit, make_target
from meganeura.kernels.conv import (
    CONFIGS,
    Conv2dInputGradKernel,
    Conv2dKernel,
    Conv2dWeightGradKernel,
    ConvGeom,
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
    "unet (2,128,8,8)": ((2, 128, 8, 8), (128, 128, 3, 3), 1, 1),
    "unet (2,128,16,16)": ((2, 128, 16, 16), (128, 128, 3, 3), 1, 1),
    "unet (2,64,32,32)": ((2, 64, 32, 32), (64, 64, 3, 3), 1, 1),
    "unet (2,128,32,32)": ((2, 128, 32, 32), (128, 128, 3, 3), 1, 1),
    "unet (2,256,16,16)": ((2, 256, 16, 16), (256, 256, 3, 3), 1, 1),
    "unet out (2,64,32,32)->4": ((2, 64, 32, 32), (4, 64, 3, 3), 1, 1),
}


def geom(xs, ws, s, p) -> ConvGeom:
    n, c, h, w = xs
    o, _, kh, kw = ws
    oh, ow = (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1
    return ConvGeom(n, c, h, w, o, kh, kw, oh, ow, (s, s), ((p, p), (p, p)))


def problems(xs, ws, s, p, rng):
    """(kind, description, inputs, output shape, float64 reference) of the three kernels."""
    G = geom(xs, ws, s, p)
    ys = (G.n, G.o, G.oh, G.ow)
    x, w, dy = (rng.standard_normal(sh, dtype=np.float32) for sh in (xs, ws, ys))
    a = {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": 1}
    S = weight_grad_split(G.n * G.oh * G.ow, G.o, G.c * G.kh * G.kw)
    C = Strided.contiguous
    wsh = ((S,) if S > 1 else ()) + ws
    x64 = x.astype(np.float64)
    return [
        ("fwd", Conv2dKernel(G, C(f32, xs), C(f32, ws)), [x, w], ys,
         lambda: _conv2d_ref([x64, w], a)[0]),
        ("dgrad", Conv2dInputGradKernel(G, C(f32, ys), C(f32, ws)), [dy, w], xs,
         lambda: _input_grad_ref([dy.astype(np.float64), w], dict(a, input_size=xs[2:]))[0]),
        (f"wgrad/{S}", Conv2dWeightGradKernel(G, C(f32, xs), C(f32, ys), S), [x, dy], wsh,
         lambda: _weight_grad_ref([x64, dy], dict(a, kernel_size=ws[2:], split=S))[0]),
    ]


def time_kernel(dev, spec, bufs, per_pass=20, passes=7) -> float:
    """Median seconds per dispatch: ``per_pass`` dispatches in one timestamped pass."""
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
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        time_kernel(dev, spec, bufs, 50, 2)


def run_problem(dev, target, label, kind, desc, inputs, oshape, ref) -> list[dict]:
    want = ref()
    scale = float(np.abs(want).max())
    rows = []
    descs = candidates(desc, target)
    if os.environ.get("CONV_ALL"):  # every configuration the device allows, not just ≤ 8
        descs += [dataclasses.replace(desc, tile=c.tuple()) for c in CONFIGS
                  if c.storage() <= target.lim("max_compute_workgroup_storage_size")]
        descs = list(dict.fromkeys(descs))
    for i, d in enumerate(descs):
        spec = emit(d, dev)
        bufs = [dev.upload(a) for a in inputs]
        bufs.append(dev.create_buffer(4 * int(np.prod(oshape))))
        dev.dispatch(spec, bufs)
        got = dev.read_array(bufs[-1], oshape, f32)
        err = float(np.abs(got - want).max()) / scale
        sec = time_kernel(dev, spec, bufs)
        flops = spec.meta["flops"]
        rows.append({"shape": label, "kind": kind, "tile": list(spec.meta["tile"]),
                     "heuristic": i == 0, "us": sec * 1e6, "tflops": flops / sec / 1e12,
                     "rel_err": err, "ok": err <= 1e-4, "workgroups": list(spec.workgroups)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    impl, out_path = sys.argv[1], sys.argv[2]
    filt = sys.argv[3] if len(sys.argv) > 3 else ""
    dev = get_device(impl)
    target = make_target(dev)
    print(impl, dev.adapter_name, flush=True)
    rng = np.random.default_rng(0)
    rows, warmed = [], False
    for label, (xs, ws, s, p) in SHAPES.items():
        if filt not in label:
            continue
        for kind, desc, inputs, oshape, ref in problems(xs, ws, s, p, rng):
            if not warmed:
                spec = emit(desc, dev)
                bufs = [dev.upload(a) for a in inputs] + [
                    dev.create_buffer(4 * int(np.prod(oshape)))]
                warm_up(dev, spec, bufs)
                warmed = True
            rows += run_problem(dev, target, label, kind, desc, inputs, oshape, ref)
    json.dump({"impl": impl, "adapter": dev.adapter_name, "rows": rows}, open(out_path, "w"),
              indent=1)
    print_table(rows)


def print_table(rows) -> None:
    """Per problem: the heuristic's time and the best candidate's."""
    print(f"{'shape':30} {'kind':8} {'heur us':>8} {'TF':>5}  {'best us':>8} {'TF':>5} best tile")
    seen = {}
    for r in rows:
        seen.setdefault((r["shape"], r["kind"]), []).append(r)
    for (shape, kind), rs in seen.items():
        h = rs[0]
        b = min(rs, key=lambda r: r["us"])
        bad = "" if all(r["ok"] for r in rs) else "  WRONG"
        print(f"{shape:30} {kind:8} {h['us']:8.1f} {h['tflops']:5.1f}  {b['us']:8.1f} "
              f"{b['tflops']:5.1f} {tuple(b['tile'])}{bad}")


if __name__ == "__main__":
    main()
