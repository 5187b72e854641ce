"""The split-K sum kernel two ways, back to back in one pass (``matmul_bench.Timer``, what
``sess.profile()``'s in-stream column measures): the reduction the scheduler emits
(``ReduceKernel`` over the split axis: one invocation per output, scalar loads) and the same
sum as a pointwise kernel over the partials' ``split`` views (vec4 loads and stores, four
outputs per invocation).  Both are checked against numpy float64.

  python bench/splitk_sum_bench.py dawn [--shapes 12x128x576,...]
  python bench/splitk_sum_bench.py wgpu --smoke
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from matmul_bench import Timer  # noqa: E402

from meganeura import kernels as codegen  # noqa: E402
from meganeura.compile.schedule import split_k_sum_pointwise, split_k_sum_reduce  # noqa: E402
from meganeura.dtypes import f32  # noqa: E402
from meganeura.runtime.device import get_device  # noqa: E402

SHAPES = ("12x128x576", "12x128x1536", "12x128x3072", "3x1500x384", "6x50x960")


def reduce_sum(s: int, m: int, n: int):
    """The reduction the scheduler emits for a plain split-K sum with the vec4 sum off."""
    return split_k_sum_reduce((s, m, n), f32, f32, "splitk_sum")


def pointwise_sum(s: int, m: int, n: int):
    return split_k_sum_pointwise(f32, (s, m, n))


def bench(dev, timer, rng, s: int, m: int, n: int) -> dict:
    parts = rng.standard_normal((s, m, n)).astype(np.float32)
    ref = parts.astype(np.float64).sum(0)
    src, out = dev.create_buffer(parts.nbytes), dev.create_buffer(4 * m * n)
    dev.queue.write_buffer(src, 0, parts.tobytes())
    res = {}
    # the pointwise sum's s inputs are one range: bound once, as the scheduler's
    # binding_aliases does
    for name, desc, alias in (("reduce", reduce_sum(s, m, n), None),
                              ("pointwise", pointwise_sum(s, m, n), [0] * s + [s])):
        spec = codegen.emit(desc, dev, None, alias)
        t = timer([(spec, [src, out])])
        got = np.frombuffer(dev.read_buffer(out, 0, 4 * m * n), np.float32).reshape(m, n)
        err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
        res[name] = (t, err, spec.workgroups)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", nargs="?", default="dawn")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    dev = get_device(a.impl)
    timer, rng = Timer(dev), np.random.default_rng(0)
    bad = False
    for shape in (["3x16x32"] if a.smoke else a.shapes.split(",")):
        s, m, n = (int(x) for x in shape.split("x"))
        r = bench(dev, timer, rng, s, m, n)
        gb = 4 * (s + 1) * m * n / 1e9
        line = "  ".join(f"{k} {t * 1e6:6.2f} µs ({gb / t:5.0f} GB/s, err {e:.0e}, wg {w[0]})"
                         for k, (t, e, w) in r.items())
        print(f"{shape:12} {line}", flush=True)
        bad |= any(e > 1e-6 for _, e, _ in r.values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
