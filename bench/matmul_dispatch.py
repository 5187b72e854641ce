"""Issue 3 measurements: f32 matmul throughput through our codegen, and host encode cost per
dispatch, on one WebGPU implementation.
Usage: python bench/matmul_dispatch.py wgpu|dawn OUT.json [strict|fast]
(fast: operands rounded to f16 on tensor cores where the device has them; rel_err is then the
rounding error against float64 of the f32 operands.)

Matmul time = GPU timestamp of the kernel (median over steps); correctness is checked on a
sample of rows against numpy float64 before timing."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import meganeura as mn
from meganeura.runtime.device import get_device


def matmul_case(dev, n: int, steps: int = 10, precision: str = "strict") -> dict:
    g = mn.Graph(f"mm{n}")
    a = g.param("a", (n, n))
    b = g.param("b", (n, n))
    y = a @ b
    t0 = time.perf_counter()
    s = mn.compile(g, outputs={"y": y}, device=dev, precision=precision)
    compile_s = time.perf_counter() - t0
    r = np.random.default_rng(0)
    A = r.standard_normal((n, n), dtype=np.float32)
    B = r.standard_normal((n, n), dtype=np.float32)
    s.set_params({"a": A, "b": B})
    out = s.run()["y"]
    rows = r.choice(n, 16, replace=False)
    want = A[rows].astype(np.float64) @ B.astype(np.float64)
    rel = float(np.abs(out[rows] - want).max() / np.abs(want).max())
    prof = s.profile(steps=steps, inference=True)
    per_call = sorted(k.total_ns / k.calls for k in prof.kernels)
    gpu_s = sum(per_call) / 1e9
    return {"n": n, "rel_err": rel, "gpu_ms": gpu_s * 1e3, "tflops": 2 * n**3 / gpu_s / 1e12,
            "wall_ms": prof.step_wall_ms, "compile_s": compile_s,
            "kernel": prof.rows()[0].label, "precision": precision,
            "variants": s.kernel_variants()["infer"]}


def encode_case(dev, n_ops: int = 200, reps: int = 20) -> dict:
    g = mn.Graph("chain")
    x = g.param("x", (64,))
    v = x
    for i in range(n_ops):
        v = v + float(i)
    s = mn.compile(g, outputs={"y": v}, device=dev, fuse=False)
    ex = s.infer
    n = sum(op[0] == "dispatch" for op in ex.ops)
    dev.queue.submit([ex.encode(dev)])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        cb = ex.encode(dev)
        best = min(best, time.perf_counter() - t0)
        dev.queue.submit([cb])
    s.run()
    return {"dispatches": n, "encode_us_per_dispatch": best / n * 1e6}


def main():
    backend, out = sys.argv[1], sys.argv[2]
    precision = sys.argv[3] if len(sys.argv) > 3 else "strict"
    dev = get_device(backend)
    res = {"backend": backend, "device": dev.describe(), "matmul": [], "encode": None}
    for n in (1024, 2048, 4096) + ((8192,) if precision == "fast" else ()):
        res["matmul"].append(matmul_case(dev, n, precision=precision))
        print(backend, res["matmul"][-1], flush=True)
    res["encode"] = encode_case(dev)
    print(backend, res["encode"], flush=True)
    res["device"]["limits"] = {k: v for k, v in res["device"]["limits"].items()}
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
