"""Elementwise kernels at the HBM roofline: the scalar variant (one element per invocation)
against vec4 (four per invocation, ``kernels/pointwise.py``) on the step's largest
elementwise kernels — an SGD update in place (w − lr·g, 134,515,008 elements: SmolLM2's flat
parameter vector), an exact-erf GELU over (1500, 1536) (Whisper's MLP), an AdamW-like update
(4 inputs, 3 outputs in place, 99,849,312 elements: SmolVLA's) and a small (1, 128, 576)
multiply (the many tiny kernels of a step: vec4 must not hurt them).

Each variant first runs once from the same data and its outputs are compared with the scalar
variant's bit for bit (the first and last 2²² elements of each output), then timed: median
per dispatch over 7 timestamped passes of 20 dispatches (``conv_bench.time_kernel``), after a
warm-up.  Two byte counts: ``bound`` as the profiler's roofline counts them (each bound
range once: an updated-in-place tensor counts once) and ``traffic`` (read and write of an
in-place range both counted: what HBM really moves).

    python3 bench/pointwise_bench.py dawn [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from conv_bench import time_kernel, warm_up  # noqa: E402

from meganeura.dtypes import f32  # noqa: E402
from meganeura.kernels import Instr, PointwiseKernel, Strided, emit  # noqa: E402
from meganeura.runtime.device import get_device  # noqa: E402

CONFIGS = ((1,), (4,))
HBM_GBS = 4800.0  # H200 (docs/roofline): the percentages below are of this bound
SAMPLE = 1 << 22  # elements compared at each end of every output


@dataclass(frozen=True)
class Case:
    name: str
    n: int
    n_in: int
    instrs: tuple
    outputs: tuple
    alias: tuple  # binding slots -> first slot of their range (in-place updates)


def cases(quick: bool) -> list[Case]:
    big, adam, act, small = 134_515_008, 99_849_312, 1500 * 1536, 128 * 576
    if quick:  # lavapipe dry run: a 128 MiB binding limit and a CPU
        big, adam, act = 1 << 20, (1 << 20) + 4, 3 * 1536
    sgd = (Instr("({0} * 0.001)", (("in", 1),), f32),
           Instr("({0} - {1})", (("in", 0), ("t", 0)), f32))
    gelu = (Instr("mn_gelu_erf({0})", (("in", 0),), f32, ("mn_erf", "mn_gelu_erf")),)
    adamw = (Instr("(0.9 * {0} + 0.1 * {1})", (("in", 2), ("in", 1)), f32),
             Instr("(0.999 * {0} + 0.001 * {1} * {1})", (("in", 3), ("in", 1)), f32),
             Instr("({0} / (sqrt({1}) + 1e-8))", (("t", 0), ("t", 1)), f32),
             Instr("({0} - 0.0001 * ({1} + 0.01 * {0}))", (("in", 0), ("t", 2)), f32))
    mul = (Instr("({0} * {1})", (("in", 0), ("in", 1)), f32),)
    return [Case(f"sgd update ({big},) in place", big, 2, sgd, (1,), (0, 1, 0)),
            Case(f"gelu erf ({act},)", act, 1, gelu, (0,), (0, 1)),
            Case(f"adamw-like ({adam},) 4 in / 3 out in place", adam, 4, adamw, (3, 0, 1),
                 (0, 1, 2, 3, 0, 2, 3)),
            Case(f"mul ({small},)", small, 2, mul, (0,), (0, 1, 2))]


def kernel(c: Case, config) -> PointwiseKernel:
    ins = (Strided.contiguous(f32, (c.n,)),) * c.n_in
    return PointwiseKernel((c.n,), ins, c.instrs, c.outputs, "pw_bench", config)


def _sample(dev, buf, n: int) -> np.ndarray:
    k = min(SAMPLE, n)
    head = dev.read_array(buf, (k,), f32)
    tail = dev.read_array(buf, (k,), f32, offset=4 * (n - k))
    return np.concatenate([head, tail])


def _restore(dev, pristine, bufs) -> None:
    enc = dev.device.create_command_encoder()
    for src, dst in zip(pristine, bufs, strict=True):
        enc.copy_buffer_to_buffer(src, 0, dst, 0, src.size)
    dev.queue.submit([enc.finish()])


def _buffers(dev, c: Case) -> tuple[list, list, list]:
    """(input buffers, buffer of each output, buffers bound in kept-slot order): an output
    aliased to an input (in place) lands in that input's buffer."""
    slot = [dev.create_buffer(4 * c.n) for _ in range(c.n_in)]
    for j in range(len(c.outputs)):
        a = c.alias[c.n_in + j]
        slot.append(dev.create_buffer(4 * c.n) if a == c.n_in + j else slot[a])
    kept = [b for i, b in enumerate(slot) if c.alias[i] == i]
    return slot[:c.n_in], slot[c.n_in:], kept


def measure(dev, c: Case, rng) -> list[dict]:
    """Every configuration of ``c``: outputs compared with the scalar one's, then timed."""
    pristine = [dev.upload(rng.random(c.n, dtype=np.float32) - np.float32(0.5 * (i < 3)))
                for i in range(c.n_in)]  # the 4th input of the AdamW case is v >= 0
    ins, outs, kept = _buffers(dev, c)
    nbytes = 4 * c.n * len(set(c.alias))
    traffic = 4 * c.n * len(c.alias)
    rows, ref = [], None
    for config in CONFIGS:
        spec = emit(kernel(c, config), dev.limits, dev.features, alias=c.alias)
        _restore(dev, pristine, ins)
        dev.dispatch(spec, kept)
        got = [_sample(dev, b, c.n) for b in outs]
        same = ref is None or all(np.array_equal(a, b, equal_nan=True)
                                  for a, b in zip(got, ref, strict=True))
        ref = got if ref is None else ref
        warm_up(dev, spec, kept, 0.3)
        sec = time_kernel(dev, spec, kept)
        rows.append({"case": c.name, "config": list(config), "us": sec * 1e6,
                     "GB_s": nbytes / sec / 1e9, "traffic_GB_s": traffic / sec / 1e9,
                     "pct_hbm": 100 * traffic / sec / 1e9 / HBM_GBS, "bytes": nbytes,
                     "traffic_bytes": traffic, "workgroups": list(spec.workgroups),
                     "bit_identical_to_scalar": bool(same)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("impl", nargs="?", default="dawn")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    dev = get_device(a.impl)
    rng = np.random.default_rng(0)
    print(f"device: {dev.adapter_name} ({dev.implementation})", flush=True)
    rows: list[dict] = []
    for c in cases(a.quick):
        rows += measure(dev, c, rng)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(f"{'case':<46s} {'config':>6s} {'µs':>9s} {'bound GB/s':>10s} {'traffic GB/s':>12s} "
          f"{'% HBM':>6s} {'bits':>5s}")
    for r in rows:
        cfg = "scalar" if r["config"] == [1] else "x4"
        print(f"{r['case']:<46s} {cfg:>6s} {r['us']:9.1f} {r['GB_s']:10.0f} "
              f"{r['traffic_GB_s']:12.0f} {r['pct_hbm']:5.0f}% "
              f"{'same' if r['bit_identical_to_scalar'] else 'DIFF':>5s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
