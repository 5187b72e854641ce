"""Sum over a short leading axis (partial sums: split-K, attention dQ blocks, per-image weight
gradients) with the two layouts of ``kernels/reduce.py``: serial (one invocation per output,
``UNROLL`` loads in flight) and lanes (32 outputs × TY invocations, a tree in workgroup
memory).  ``SERIAL_MAX`` decides between them today; this measures where the switch belongs
for wide outputs.

    python3 bench/reduce_layout_bench.py dawn [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from conv_bench import time_kernel, warm_up  # noqa: E402

from meganeura.dtypes import f32  # noqa: E402
from meganeura.kernels import Instr, ReduceKernel, Strided, emit  # noqa: E402
from meganeura.kernels import reduce as reduce_mod  # noqa: E402
from meganeura.runtime.device import get_device  # noqa: E402


def sum_kernel(R: int, N: int) -> ReduceKernel:
    shape = (R, N)
    return ReduceKernel(shape, (0,), "sum", (Strided.contiguous(f32, shape),),
                        (Instr("{0}", (("in", 0),), f32),), name="partial_sum")


def measure(dev, R: int, N: int, serial_max: int, rng) -> dict:
    old = reduce_mod.SERIAL_MAX
    reduce_mod.SERIAL_MAX = serial_max
    try:
        spec = emit(sum_kernel(R, N), dev.limits, dev.features)
    finally:
        reduce_mod.SERIAL_MAX = old
    x = rng.standard_normal((R, N)).astype(np.float32)
    bufs = [dev.upload(x), dev.create_buffer(4 * N)]
    dev.dispatch(spec, bufs)
    got = dev.read_array(bufs[-1], (N,), f32)
    want = x.sum(0, dtype=np.float64)
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    warm_up(dev, spec, bufs, 0.05)
    sec = time_kernel(dev, spec, bufs)
    return {"R": R, "N": N, "layout": list(spec.meta["layout"]), "us": sec * 1e6,
            "GB_s": 4 * R * N / sec / 1e9, "rel_err": err}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("impl", nargs="?", default="dawn")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    dev = get_device(a.impl)
    rng = np.random.default_rng(0)
    Ns = (4096, 65536) if a.quick else (4096, 65536, 262144, 576000)
    Rs = (8, 24, 47) if a.quick else (8, 16, 24, 32, 47, 64, 96, 128)
    rows = []
    print(f"device: {dev.adapter_name} ({dev.implementation})")
    print(f"{'R':>4s} {'N':>7s} | {'lanes µs':>9s} {'GB/s':>6s} | {'serial µs':>9s} {'GB/s':>6s}")
    for N in Ns:
        for R in Rs:
            lanes = measure(dev, R, N, 0, rng)
            serial = measure(dev, R, N, 1 << 20, rng)
            rows += [{"layout_kind": "lanes", **lanes}, {"layout_kind": "serial", **serial}]
            print(f"{R:4d} {N:7d} | {lanes['us']:9.1f} {lanes['GB_s']:6.0f} | "
                  f"{serial['us']:9.1f} {serial['GB_s']:6.0f}"
                  f"  err {max(lanes['rel_err'], serial['rel_err']):.1e}", flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
