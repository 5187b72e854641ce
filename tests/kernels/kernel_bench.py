"""Kernel-level timings of the codegen archetypes on one implementation (GPU timestamps; not a
test, pytest does not collect it).  Usage on a GPU machine, from the repository root:

    python tests/codegen/kernel_bench.py wgpu|dawn OUT.json
    MM_ONLY=1 MM_SIZES=2048,4096 MM_VARIANTS=tiled64v,tiled128v python tests/codegen/...

Sizes are for a big GPU (8192² reductions, 4096³ matmuls).  Dawn's timestamps on the H200 were
quantized to 65.5 µs, so short kernels read 0 or 65.5 µs there.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from meganeura.dtypes import f32
from meganeura.kernels import Instr, MatmulKernel, PointwiseKernel, ReduceKernel, Strided, emit
from meganeura.kernels.reduce import split_plan
from meganeura.runtime.device import get_device


def timeit(dev, spec, bufs, reps=20):
    """Median GPU time of one dispatch (timestamp queries around separate passes)."""
    wgpu = dev.module
    pipe = dev.pipeline(spec)
    bg = dev.bind_group(spec, bufs)
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * reps)
    rb = dev.device.create_buffer(
        size=16 * reps, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
    )
    dev.dispatch(spec, bufs)
    dev.sync()
    enc = dev.device.create_command_encoder()
    for r in range(reps):
        cp = enc.begin_compute_pass(timestamp_writes={
            "query_set": qs,
            "beginning_of_pass_write_index": 2 * r,
            "end_of_pass_write_index": 2 * r + 1,
        })
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(*spec.workgroups)
        cp.end()
    enc.resolve_query_set(qs, 0, 2 * reps, rb, 0)
    dev.queue.submit([enc.finish()])
    ts = np.frombuffer(dev.read_buffer(rb, 0, 16 * reps), dtype=np.uint64).astype(np.float64)
    return float(np.median(ts[1::2] - ts[0::2])) / 1e9


def main() -> None:
    impl, out_path = sys.argv[1], sys.argv[2]
    dev = get_device(impl)
    print(impl, dev.adapter_name, dev.backend_type, sorted(dev.features), flush=True)
    res = {"impl": impl, "adapter": dev.adapter_name, "rows": []}

    def row(name, sec, flops=0, nbytes=0, err=None):
        sec = max(sec, 1e-9)
        r = {"name": name, "ms": sec * 1e3,
             "tflops": flops / sec / 1e12 if flops else None,
             "gbps": nbytes / sec / 1e9 if nbytes else None, "err": err}
        res["rows"].append(r)
        print(json.dumps(r), flush=True)

    rng = np.random.default_rng(0)
    variants = os.environ.get("MM_VARIANTS", "tiled64v,tiled128v").split(",")
    sizes = [int(x) for x in os.environ.get("MM_SIZES", "2048,4096").split(",")]
    for n in sizes:
        A = rng.standard_normal((n, n), dtype=np.float32)
        B = rng.standard_normal((n, n), dtype=np.float32)
        ba, bb, bc = dev.upload(A), dev.upload(B), dev.create_buffer(4 * n * n)
        s = Strided.contiguous(f32, (1, n, n))
        for var in variants:
            spec = emit(MatmulKernel(1, n, n, n, s, s, variant=var), dev)
            t = timeit(dev, spec, [ba, bb, bc], 10)
            C = dev.read_array(bc, (n, n), f32)
            want = A[-8:].astype(np.float64) @ B
            row(f"matmul{n} {var}", t, 2 * n**3,
                err=float(np.abs(C[-8:] - want).max() / np.abs(want).max()))
    if os.environ.get("MM_ONLY"):
        json.dump(res, open(out_path, "w"), indent=1)
        return

    # gemv: x (1, K) @ W^T with W (N, K) row-major (k-contiguous), and x @ W with W (K, N)
    K = N = 8192
    W = rng.standard_normal((N, K), dtype=np.float32)
    x = rng.standard_normal((1, K), dtype=np.float32)
    bw, bx, by = dev.upload(W), dev.upload(x), dev.create_buffer(4 * N)
    for label, sb, ref_w in (
        ("W^T k-major", Strided(f32, (1, K, N), (0, 1, K), 0, N * K), W.T),
        ("W n-major", Strided.contiguous(f32, (1, K, N)), W.reshape(K, N)),
    ):
        spec = emit(MatmulKernel(1, 1, N, K, Strided.contiguous(f32, (1, 1, K)), sb), dev)
        t = timeit(dev, spec, [bx, bw, by])
        y = dev.read_array(by, (N,), f32)
        ref = (x.astype(np.float64) @ ref_w)[0]
        row(f"gemv 1x{N}x{K} {label}", t, 2 * N * K, 4 * N * K,
            float(np.abs(y - ref).max() / np.abs(ref).max()))

    # reductions over a 8192² matrix: rows, columns, everything (one kernel and split)
    side = 8192
    X = rng.random((side, side), dtype=np.float32)
    bxx = dev.upload(X)
    for axes, outn in (((1,), side), ((0,), side), ((0, 1), 1)):
        k = ReduceKernel((side, side), axes, "sum", (Strided.contiguous(f32, (side, side)),), ())
        spec = emit(k, dev)
        bo = dev.create_buffer(4 * outn)
        t = timeit(dev, spec, [bxx, bo])
        got = dev.read_array(bo, (outn,), f32)
        ref = X.astype(np.float64).sum(axis=axes).reshape(-1)
        row(f"sum axes={axes} of {side}^2 {spec.meta['layout']}", t, 0, 4 * side * side,
            float(np.abs(got - ref).max() / np.abs(ref).max()))
    cols = Strided(f32, (64, 50176), (1, 64), 0, 64 * 50176)  # bias-gradient-like
    spec = emit(ReduceKernel((64, 50176), (1,), "sum", (cols,), ()), dev)
    bo = dev.create_buffer(256)
    row(f"column-ish sum 64 x 50176 strided {spec.meta['layout']}",
        timeit(dev, spec, [bxx, bo]), 0, 4 * 64 * 50176)
    for shape, axes, st, label in (
        ((side * side,), (0,), None, "full sum split"),
        ((64, 50176), (1,), (1, 64), "column-ish 64x50176 split"),
    ):
        s0 = Strided(f32, shape, st, 0, side * side) if st else Strided.contiguous(f32, shape)
        plan = split_plan(ReduceKernel(shape, axes, "sum", (s0,), ()), dev)
        if plan is None:
            print(label, "no split")
            continue
        p1, p2, (tsh, _) = plan
        s1, s2 = emit(p1, dev), emit(p2, dev)
        tmp = dev.create_buffer(4 * int(np.prod(tsh)))
        bo = dev.create_buffer(4 * max(1, int(np.prod(tsh[1:]))))
        t = timeit(dev, s1, [bxx, tmp]) + timeit(dev, s2, [tmp, bo])
        row(f"{label} split={p1.split} {s1.meta['layout']} + final", t, 0,
            4 * int(np.prod(shape)))

    # pointwise: a 2-D wrapped grid and a transposed read with a helper
    n = side * side
    a, b, c = (dev.create_buffer(4 * n) for _ in range(3))
    add = Instr("({0} + {1})", (("in", 0), ("in", 1)), f32)
    spec = emit(PointwiseKernel((n,), (Strided.contiguous(f32, (n,)),) * 2, (add,), (0,)), dev)
    row("add 2^26 (2D-wrapped grid)", timeit(dev, spec, [a, b, c]), 0, 12 * n)
    gelu = Instr("mn_gelu_erf({0})", (("in", 0),), f32, ("mn_gelu_erf",))
    tview = Strided(f32, (side, side), (1, side), 0, n)
    spec = emit(PointwiseKernel((side, side), (tview,), (gelu,), (0,)), dev)
    row("gelu_erf transposed 8192^2", timeit(dev, spec, [a, c]), 0, 8 * n)
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
