"""Strict f32 vs fast (tensor-core) matmul throughput and compile time on one implementation:
the table in docs/gpu-runtime.md ("Tensor-core matmul").  Run on the GPU machine:

  python bench/matmul_fast.py dawn [N ...]      (default sizes 2048 4096 8192)

Time = the kernel's GPU timestamp, mean over 30 profiled runs; compile = graph to ready session
(one square matmul).  Prints one line per size and precision."""

from __future__ import annotations

import sys
import time

import numpy as np

import meganeura as mn
from meganeura.runtime.device import get_device


def main(backend: str = "dawn", *sizes: str) -> None:
    dev = get_device(backend)
    r = np.random.default_rng(0)
    for n in [int(x) for x in sizes] or (2048, 4096, 8192):
        a_v = r.standard_normal((n, n), dtype=np.float32)
        b_v = r.standard_normal((n, n), dtype=np.float32)
        for precision in ("strict", "fast"):
            g = mn.Graph("mm")
            a, b = g.param("a", (n, n)), g.param("b", (n, n))
            t0 = time.perf_counter()
            s = mn.compile(g, outputs={"y": a @ b}, device=dev, precision=precision)
            compile_s = time.perf_counter() - t0
            s.set_params({"a": a_v, "b": b_v})
            s.run()
            prof = s.profile(steps=30, inference=True)
            ns = min(k.total_ns / k.calls for k in prof.kernels)
            print(f"{n} {precision:6} {2 * n**3 / ns / 1e3:7.1f} TFLOP/s  compile {compile_s:.2f} s"
                  f"  {s.kernel_variants()['infer']}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
