"""Matmul configurations on the GPU: every candidate (``kernels.candidates``) and the heuristic
default for the SmolLM2 / Whisper projection shapes, split-K (partial products + the sum
kernel) where K is long, and 4096³ strict and fast; results checked against numpy float64.

  python bench/matmul_bench.py dawn [--before OLD_MATMUL.py] [--quick]
  python bench/matmul_bench.py dawn --tc-sweep [--out DIR] [--set full|final|const|const2]
      [--toggles disable_robustness]   (tensor-core configurations)
  python bench/matmul_bench.py dawn --sweep [--before OLD_MATMUL.py] [--out DIR] [--quick]
      (strict configurations and split-K at the workload GEMMs: WORKLOAD_GEMMS)

Timing: after ≥ 0.5 s of warm-up work, one compute pass holding ``reps`` back-to-back
dispatches between two GPU timestamps (≥ 5 ms in all, so Dawn's 65.5 µs timestamp
quantization does not matter), median of 5 such passes, per call.  ``--before`` times the
heuristic kernel of another matmul.py (e.g. ``git show <rev>:src/meganeura/kernels/matmul.py``)
the same way.  The last lines are a table: shape, B layout, µs and TFLOP/s of the heuristic,
the best configuration and the before kernel."""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np

from meganeura import kernels as codegen
from meganeura.compile.schedule import split_k_sum_kernel
from meganeura.dtypes import f16, f32
from meganeura.kernels import MatmulKernel, Strided
from meganeura.kernels.ir import Instr
from meganeura.kernels.matmul import SG_FEATURE, Cfg, config_name
from meganeura.runtime.device import get_device

ADD = (Instr("({0} + {1})", (("acc", 0), ("x", 0)), f32),)
SHAPES = [  # (M, N, K, epilogue add, split-K tries)
    (128, 576, 960, False), (128, 576, 576, True), (128, 960, 576, False),
    (128, 1536, 576, False), (128, 3072, 576, False), (128, 576, 1536, False),
    (128, 576, 3072, False), (1500, 1536, 384, True), (1500, 384, 384, False),
    (1, 576, 960, False),
]


class Timer:
    """GPU time per call of a sequence of dispatches (see the module docstring)."""

    def __init__(self, dev):
        self.dev, wgpu = dev, dev.module
        self.qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
        self.rb = dev.device.create_buffer(
            size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)

    def once(self, seq, reps: int) -> float:
        enc = self.dev.device.create_command_encoder()
        cp = enc.begin_compute_pass(timestamp_writes={
            "query_set": self.qs, "beginning_of_pass_write_index": 0,
            "end_of_pass_write_index": 1})
        for _ in range(reps):
            for pipe, bg, wg in seq:
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(*wg)
        cp.end()
        enc.resolve_query_set(self.qs, 0, 2, self.rb, 0)
        self.dev.queue.submit([enc.finish()])
        ts = np.frombuffer(self.dev.read_buffer(self.rb, 0, 16), dtype=np.uint64)
        return float(ts[1] - ts[0]) / 1e9 / reps

    def __call__(self, calls) -> float:
        """Median seconds per run of ``calls`` ([(spec, buffers)])."""
        seq = [(self.dev.pipeline(s), self.dev.bind_group(s, b), s.workgroups) for s, b in calls]
        est = max(self.once(seq, 3), 1e-7)
        reps = int(min(2000, max(10, 5e-3 / est)))
        self.once(seq, reps)  # clocks back up after the pipeline compile's idle gap
        return float(np.median([self.once(seq, reps) for _ in range(5)]))

    def warm(self, calls, seconds: float = 0.6) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self(calls)


def _problem(dev, rng, M, N, K, add, b_nk, fast=False):
    """(description, input arrays, buffers, float64 reference)."""
    a = rng.standard_normal((1, M, K), dtype=np.float32)
    w = rng.standard_normal((N, K) if b_nk else (K, N), dtype=np.float32)
    sa = Strided.contiguous(f32, (1, M, K))
    sb = Strided(f32, (1, K, N), (0, 1, K) if b_nk else (0, N, 1), 0, N * K)
    r16 = (lambda x: x.astype(np.float16).astype(np.float64)) if fast else (
        lambda x: x.astype(np.float64))
    rows = slice(-8, None) if M * N * K > 1e9 else slice(None)
    ref = r16(a[0, rows]) @ (r16(w).T if b_nk else r16(w))
    extra, ins = (), [a, w]
    if add:
        res = rng.standard_normal((1, M, N), dtype=np.float32)
        ins.append(res)
        extra = (Strided.contiguous(f32, (1, M, N)),)
        ref = ref + res[0, rows]
    desc = MatmulKernel(1, M, N, K, sa, sb, extra, ADD if add else (),
                        precision="fast" if fast else "strict")
    bufs = [dev.upload(x) for x in ins] + [dev.create_buffer(4 * M * N)]
    return desc, bufs, ref, rows


def _err(dev, buf, M, N, ref, rows) -> float:
    y = dev.read_array(buf, (M, N), f32)[rows].astype(np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def _split_calls(dev, desc, bufs, s, emit=None):
    """Split-K by ``s`` as the scheduler builds it: a batch of partial matmuls, then the sum
    kernel (with the epilogue); ``emit`` builds the partials (default: this checkout's)."""
    a, b, kc = desc.a, desc.b, desc.k // s
    a_s = Strided(a.dtype, (s, desc.m, kc), (a.strides[2] * kc,) + a.strides[1:], 0, a.extent)
    b_s = Strided(b.dtype, (s, kc, desc.n), (b.strides[1] * kc,) + b.strides[1:], 0, b.extent)
    part = MatmulKernel(s, desc.m, desc.n, kc, a_s, b_s, out_dtype=f32, name="matmul_splitk")
    tmp = dev.create_buffer(4 * s * desc.m * desc.n)
    shape = (s, desc.m, desc.n)
    extra = tuple(Strided(x.dtype, x.shape[1:], x.strides[1:], 0, x.extent) for x in desc.extra)
    red, n_views = split_k_sum_kernel(shape, f32, f32, desc.epilogue, extra)
    binds = [tmp] * n_views + bufs[2:]
    alias = codegen.binding_aliases(binds)
    return [((emit or codegen.emit)(part, dev), bufs[:2] + [tmp]),
            (codegen.emit(red, dev, None, alias),
             [b for i, b in enumerate(binds) if alias[i] == i])]


def _load_before(path):
    """The ``emit`` of another matmul.py, without registering it as a family."""
    import re

    src = re.sub(r'@kernel_family\("matmul", MatmulKernel[^)]*\)', "", open(path).read())
    spec = importlib.util.spec_from_loader("meganeura.kernels._before_matmul", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod.emit


def bench_shape(dev, timer, rng, M, N, K, add, b_nk, fast, before, rows_out) -> None:
    """Every candidate, split-K tries and the before kernel for one shape; one table row."""
    desc, bufs, ref, rows = _problem(dev, rng, M, N, K, add, b_nk, fast)
    flops = 2 * M * N * K
    res = []
    for i, d in enumerate(codegen.candidates(desc, codegen.make_target(dev))):
        spec = codegen.emit(d, dev)
        t = timer([(spec, bufs)])
        res.append((spec.meta["variant"] + (" (heuristic)" if i == 0 else ""), t,
                    _err(dev, bufs[-1], M, N, ref, rows)))
    if not fast and M > 4 and K >= 384:
        for s in (2, 3, 4, 6, 8, 12):
            if K % s == 0 and K // s >= 64:
                t = timer(_split_calls(dev, desc, bufs, s))
                res.append((f"split-K {s}", t, _err(dev, bufs[-1], M, N, ref, rows)))
    if before is not None:
        spec = before(desc, dev)  # the old emitter ignores ``config``
        t = timer([(spec, bufs)])
        res.append((f"before {spec.meta['variant']}", t, _err(dev, bufs[-1], M, N, ref, rows)))
    label = f"1x{M}x{N}x{K}{' +add' if add else ''} {'fast' if fast else 'strict'} " \
            f"B {'nk' if b_nk else 'kn'}"
    for name, t, e in res:
        print(f"  {label:42} {name:34} {t * 1e6:9.1f} µs {flops / t / 1e12:7.2f} TFLOP/s "
              f"err {e:.1e}", flush=True)
    tol = 1e-3 if fast else 1e-4
    bad = [n for n, _, e in res if not e < tol]
    ok = [r for r in res if r[2] < tol and not r[0].startswith("before")]
    best = min(ok, key=lambda r: r[1])
    bef = [r for r in res if r[0].startswith("before")]
    rows_out.append((label, res[0][1], best, bef[0][1] if bef else None, flops, bad))



# --tc-sweep: tensor-core (sgmat) configurations at 4096³ and at workload shapes.
TC_SWEEP = [Cfg("sgmat", *x) for x in (  # tm, tn, rm, rn, bk, vr (see kernels/matmul_sgmat)
    # 128x128: 8 subgroups of 64x32, 4 of 64x64, 4 of 128x32; option bits; K steps
    (128, 128, 2, 4, 32, 1), (128, 128, 2, 4, 32, 2), (128, 128, 2, 4, 32, 3),
    (128, 128, 2, 4, 32, 5), (128, 128, 2, 4, 32, 7), (128, 128, 4, 2, 32, 3),
    (128, 128, 2, 2, 32, 1), (128, 128, 2, 2, 32, 7), (128, 128, 2, 2, 64, 2),
    (128, 128, 2, 4, 64, 2), (128, 128, 2, 4, 16, 3), (128, 128, 1, 4, 32, 3),
    # 8 subgroups of 64x64: 128x256 and 256x128 (3/4 of the L2 traffic per flop of 128x128)
    (128, 256, 2, 4, 32, 0), (128, 256, 2, 4, 32, 2), (128, 256, 2, 4, 16, 1),
    (128, 256, 2, 4, 16, 3), (128, 256, 2, 4, 16, 5), (256, 128, 4, 2, 32, 0),
    (256, 128, 4, 2, 32, 2), (256, 128, 4, 2, 16, 3), (256, 128, 4, 2, 16, 7),
    # 16 subgroups: 256x256 tiles (half the L2 traffic per flop of 128x128), 64 accumulators
    (256, 256, 4, 8, 16, 1), (256, 256, 4, 8, 16, 3), (256, 256, 4, 8, 16, 5),
    (256, 256, 4, 8, 16, 7), (256, 256, 4, 8, 32, 0), (256, 256, 4, 8, 32, 2),
    (256, 256, 8, 4, 16, 1), (256, 128, 8, 2, 16, 1), (64, 256, 1, 4, 32, 3))]
# a few configurations for the side experiment (--toggles)
TC_QUICK = [Cfg("sgmat", *x) for x in (
    (128, 256, 2, 4, 32, 0), (128, 256, 2, 4, 32, 8), (128, 256, 2, 4, 16, 1),
    (128, 256, 2, 4, 48, 8))]
# --set final: the new default's neighbours (round 2), 4096³ f32 and f16 operands
TC_FINAL = [Cfg("sgmat", *x) for x in (
    (128, 256, 2, 4, 32, 8), (128, 256, 2, 4, 32, 16), (128, 256, 2, 4, 48, 8),
    (128, 128, 2, 4, 64, 0))]
# the workload shapes (small M or N): the candidates and these
TC_SMALL = [Cfg("sgmat", *x) for x in (
    (64, 64, 2, 2, 32, 1), (64, 64, 2, 2, 32, 5), (128, 64, 2, 2, 32, 1), (64, 128, 2, 2, 32, 3),
    (128, 128, 2, 2, 32, 1), (128, 128, 2, 4, 32, 1), (32, 64, 1, 2, 32, 1),
    (64, 32, 2, 1, 32, 1))]
# --set const: constant fragment offsets (option bit 32 "c", with 64 "t": B transposed) at
# 4096³ against the heuristic, f16 operands, two workload shapes; with --toggles: TC_CONST_NR
TC_CONST = [Cfg("sgmat", *x) for x in (
    (128, 256, 2, 4, 32, 32), (128, 256, 2, 4, 32, 96), (128, 256, 2, 4, 48, 96),
    (128, 256, 2, 4, 32, 40), (128, 256, 2, 4, 32, 34), (128, 256, 2, 4, 32, 48),
    (128, 256, 2, 4, 16, 32), (128, 256, 2, 4, 16, 33), (128, 256, 2, 4, 16, 37),
    (128, 256, 2, 4, 16, 97), (128, 256, 2, 4, 16, 101), (128, 256, 2, 4, 16, 45),
    (128, 256, 2, 4, 16, 39), (128, 128, 2, 4, 64, 34), (128, 128, 2, 4, 64, 32),
    (128, 128, 2, 4, 64, 98), (128, 128, 2, 4, 32, 33), (128, 128, 2, 4, 32, 37),
    (128, 128, 2, 4, 32, 39), (128, 128, 2, 4, 32, 101), (256, 128, 4, 2, 32, 32),
    (256, 128, 4, 2, 32, 96), (256, 128, 4, 2, 16, 37), (128, 128, 2, 2, 32, 37))]
TC_CONST_F16 = [Cfg("sgmat", *x) for x in ((128, 256, 2, 4, 32, 32), (128, 256, 2, 4, 16, 37))]
TC_CONST_SMALL = [Cfg("sgmat", *x) for x in (
    (32, 64, 1, 2, 32, 32), (64, 64, 2, 2, 32, 32), (64, 64, 2, 2, 16, 37),
    (128, 64, 2, 2, 32, 32), (64, 128, 2, 2, 32, 32))]
TC_CONST_NR = [Cfg("sgmat", *x) for x in (
    (128, 256, 2, 4, 32, 32), (128, 256, 2, 4, 16, 37), (128, 256, 2, 4, 16, 5),
    (128, 256, 2, 4, 16, 1))]
# --set const2: round 2 (the final device call): the constant-offset 256x128 family, double-
# buffered 128x128, and the plain 256x128 again (is the gain of "c" there real?)
TC_CONST2 = [Cfg("sgmat", *x) for x in (
    (256, 128, 4, 2, 32, 32), (256, 128, 4, 2, 32, 0), (256, 128, 4, 2, 32, 34),
    (256, 128, 4, 2, 48, 32), (256, 128, 4, 2, 16, 33), (128, 128, 2, 4, 32, 33),
    (128, 128, 2, 4, 32, 35))]
# ... and with f16 operands: fragments straight from global memory (option bit 128 "x")
TC_GLOBAL = [Cfg("sgmat", *x) for x in (
    (128, 256, 2, 4, 16, 128), (128, 256, 2, 4, 16, 130), (128, 128, 2, 2, 16, 128),
    (128, 128, 2, 2, 16, 130), (256, 128, 4, 2, 16, 130), (64, 64, 1, 1, 16, 128),
    (128, 128, 2, 4, 16, 130))]
# ablations (wrong results, timing only): where a configuration's time goes
TC_ABLATE = [Cfg("sgmat", *x) for x in (
    (128, 128, 2, 4, 32, 0), (128, 256, 2, 4, 16, 5), (256, 256, 4, 8, 16, 5))]
TC_SHAPES = [(4096, 4096, 4096, 1, f32), (4096, 4096, 4096, 1, f16), (1500, 384, 1536, 1, f32),
             (128, 576, 960, 1, f32), (1024, 196, 256, 4, f32)]  # M, N, K, batch, operands
# f16 operands in global memory (half the bytes through L2): a few configurations
TC_F16 = [Cfg("sgmat", *x) for x in (
    (128, 128, 2, 4, 32, 3), (128, 256, 2, 4, 16, 1), (256, 128, 4, 2, 32, 2),
    (256, 256, 4, 8, 16, 1), (256, 256, 4, 8, 16, 5))]


def _tc_problem(dev, rng, M, N, K, B, dt=f32, b_nk: bool = False):
    """A fast matmul of ``dt`` operands and its float64 reference (of the f16-rounded operands)
    on every 37th row of each batch (all tile rows and fragment rows are hit); ``b_nk``: B
    stored (N, K) as a Linear weight is (read through a transposed view)."""
    npt = np.float16 if dt is f16 else np.float32
    a = rng.standard_normal((B, M, K), dtype=np.float32).astype(npt)
    b = rng.standard_normal((B, K, N), dtype=np.float32).astype(npt)
    rows = np.unique(np.r_[np.arange(0, M, 37), M - 1])
    r16 = lambda x: x.astype(np.float16).astype(np.float64)  # noqa: E731
    ref = np.stack([r16(a[i, rows]) @ r16(b[i]) for i in range(B)])
    sb = (Strided(dt, (B, K, N), (N * K, 1, K), 0, B * N * K) if b_nk
          else Strided.contiguous(dt, (B, K, N)))
    desc = MatmulKernel(B, M, N, K, Strided.contiguous(dt, (B, M, K)), sb,
                        precision="fast", out_dtype=f32)
    bstore = np.ascontiguousarray(b.transpose(0, 2, 1)) if b_nk else b
    bufs = [dev.upload(a), dev.upload(bstore), dev.create_buffer(4 * B * M * N)]
    return desc, bufs, ref, rows


def _tc_configs(dev, desc, big: bool):
    """What to time at one shape (each tensor-core pipeline costs Dawn ~0.7 s to compile, so
    the lists are short): the heuristic default, then ``TC_SWEEP`` (4096³), ``TC_SMALL``
    (workload shapes) or ``TC_F16`` (f16 operands)."""
    from dataclasses import replace

    out = codegen.candidates(desc, codegen.make_target(dev))[:1]
    extra = TC_SWEEP if big else TC_SMALL
    if desc.a.dtype is f16:
        extra = TC_F16
    have = {d.config for d in out}
    return out + [replace(desc, config=tuple(g)) for g in extra if tuple(g) not in have]


def tc_sweep(dev, timer, rng, out_dir: str | None) -> None:
    """Compile, check and time tensor-core configurations; one line each, then a table of the
    best per shape.  A configuration that fails to emit or compile is reported and skipped."""
    if SG_FEATURE not in dev.features:
        print(f"tc-sweep: {dev.implementation} has no f16 subgroup matrices ({SG_FEATURE}); "
              "nothing to time", flush=True)
        return
    if dev.implementation == "dawn":  # the toggles really in force (robustness, ...)
        try:
            from wgpudawn.backends.dawn import extras

            print("dawn device toggles:", extras.get_toggles(dev.device), flush=True)
        except Exception as e:  # an older wgpudawn: say so, time anyway
            print(f"dawn device toggles unknown: {e}", flush=True)
    lines, best = [], []
    for shape in TC_SHAPES:
        best.append(_tc_shape(dev, timer, rng, shape, lines))
    if TC_SWEEP is not TC_QUICK and TC_ABLATE:
        lines += tc_ablation(dev, timer, rng)
    _tc_table(best, lines, out_dir)


def _tc_shape(dev, timer, rng, shape, lines: list[str]):
    """Every configuration of one shape (lines appended to ``lines``); returns (shape label,
    heuristic result, best three correct results, flops)."""
    M, N, K, B, dt = shape
    desc, bufs, ref, rows = _tc_problem(dev, rng, M, N, K, B, dt)
    flops, res = 2 * B * M * N * K, []
    label = f"{B}x{M}x{N}x{K}{' f16' if dt is f16 else ''}"
    for d in _tc_configs(dev, desc, M == 4096):
        try:
            spec = codegen.emit(d, dev)
            if not res:  # clocks up before the shape's first timing
                timer.warm([(spec, bufs)], 0.3)
            t = timer([(spec, bufs)])
        except Exception as e:  # a configuration the device rejects: report, go on
            print(f"  {label} {d.config} FAILED {type(e).__name__}: {str(e)[:300]}",
                  flush=True)
            continue
        y = dev.read_array(bufs[-1], (B, M, N), f32)[:, rows].astype(np.float64)
        err = float(np.abs(y - ref).max() / np.abs(ref).max())
        ln = (f"{label:22} {spec.meta['variant']:28} {t * 1e6:9.1f} us "
              f"{flops / t / 1e12:7.1f} TFLOP/s err {err:.1e} "
              f"smem {spec.meta['workgroup_storage']}")
        print("  " + ln, flush=True)
        lines.append(ln)
        res.append((t, spec.meta["variant"], err))
    ok = sorted(r for r in res if r[2] < 1e-3)
    return label, res[0] if res else None, ok[:3], flops


ABLATIONS = ("noload", "nostage", "mmaonly", "mmanobar", "l1hit", "l2hit", "nofrag", "nobar")
# "l1hit" / "l2hit": the global loads wrap K at these many elements, so after the first steps
# they hit L1 (a workgroup's 2 x 16 KB) or L2 (4 MB per operand); same instructions and bytes
WRAP_K = {"l1hit": 64, "l2hit": 512}


def _ablated(spec, what: str):
    """``spec`` with parts of its K loop removed (wrong values, timing only): "noload" its
    global loads; "nostage" also its workgroup stores (fragment loads, products, barriers);
    "mmaonly" also its fragment loads (loaded once before the loop: products and barriers);
    "mmanobar" also its barriers (the products alone: what the driver's matrix multiply
    issues at, the ceiling of any staging scheme); "l1hit" / "l2hit" (``WRAP_K``) the same
    loads from a K range that stays in L1 / L2 (latency against load throughput); "nofrag"
    the whole loop but fragments loaded once; "nobar" the whole loop without barriers."""
    import dataclasses
    import re

    head, loop = spec.wgsl.split("for (var k0", 1)
    if what in WRAP_K:
        def wrap(m):
            return m.group(0).replace("(kb + ", f"((kb % {WRAP_K[what]}u) + ")
        loop = re.sub(r"^\s+[ab]r\d+ = b[01]\[.*$", wrap, loop, flags=re.M)
        return dataclasses.replace(spec, wgsl=head + "for (var k0" + loop)
    if what == "nobar":
        cut = loop.find("subgroupMatrixStore") % (len(loop) + 1)
        loop = loop[:cut].replace("workgroupBarrier();", "") + loop[cut:]
        return dataclasses.replace(spec, wgsl=head + "for (var k0" + loop)
    if what == "nofrag":  # fragments loaded once before the loop; loads and stores stay
        frag = r"^\s+let \w+ = subgroupMatrixLoad<.*$"
        head += "\n".join(re.findall(frag, loop, flags=re.M)) + "\n    "
        loop = re.sub(frag, "", loop, flags=re.M)
        return dataclasses.replace(spec, wgsl=head + "for (var k0" + loop)
    pat = r"^\s+[ab]r\d+ = b[01]\[.*$" if what == "noload" else \
        r"^\s+([ab]r\d+ = b[01]\[|[AB][swq]\[).*$"  # element or packed stores
    loop = re.sub(pat, "", loop, flags=re.M)
    if what in ("mmaonly", "mmanobar"):  # single-buffered tiles: offsets loop-invariant
        frag = r"^\s+let \w+ = subgroupMatrixLoad<.*$"
        head += "\n".join(re.findall(frag, loop, flags=re.M)) + "\n    "
        loop = re.sub(frag, "", loop, flags=re.M)
    if what == "mmanobar":  # the K loop's barriers (the results' stores come after it)
        cut = loop.find("subgroupMatrixStore") % (len(loop) + 1)  # -1: the whole text
        loop = loop[:cut].replace("workgroupBarrier();", "") + loop[cut:]
    return dataclasses.replace(spec, wgsl=head + "for (var k0" + loop)


def tc_ablation(dev, timer, rng) -> list[str]:
    """``TC_ABLATE`` at 4096³ whole, without global loads and without staging."""
    desc, bufs, _, _ = _tc_problem(dev, rng, 4096, 4096, 4096, 1)
    flops, out = 2 * 4096**3, []
    from dataclasses import replace

    for g in TC_ABLATE:
        for what in ("whole", "noload", "nostage"):
            try:
                spec = codegen.emit(replace(desc, config=tuple(g)), dev)
                sp = spec if what == "whole" else _ablated(spec, what)
                t = timer([(sp, bufs)])
            except Exception as e:  # reported, the sweep goes on
                out.append(f"ablation {tuple(g)} {what} FAILED {str(e)[:200]}")
                print("  " + out[-1], flush=True)
                continue
            out.append(f"ablation {spec.meta['variant']:28} {what:8} {t * 1e6:9.1f} us "
                       f"{flops / t / 1e12:7.1f} TFLOP/s")
            print("  " + out[-1], flush=True)
    return out


def _tc_table(best, lines, out_dir) -> None:
    table = [f"{'shape':20} {'heuristic':36} best three (TFLOP/s)"]
    for shape, heur, top, flops in best:
        h = f"{heur[1]} {flops / heur[0] / 1e12:.1f}" if heur else "-"
        table.append(f"{shape:20} {h:36} " + ", ".join(
            f"{v} {flops / t / 1e12:.1f}" for t, v, _ in top))
    print("\n" + "\n".join(table), flush=True)
    if out_dir:
        with open(f"{out_dir}/tc_sweep.txt", "w") as f:
            f.write("\n".join(lines + [""] + table) + "\n")


# --sweep: the strict GEMMs of the Whisper-tiny encoder, ResNet-50 (1x1 convolutions, batch 4)
# and SmolLM2 training as the scheduler lays them out: name, (B, M, N, K), A and B storage
# ("mk": row-major, "km": transposed; "kn"/"nk" likewise), A broadcast over the batch, a fused
# add epilogue, and the split-K the scheduler used before this sweep (2026-12-01 morning).
WORKLOAD_GEMMS = [
    ("whisper fc2", (1, 1500, 384, 1536), "mk", "nk", False, True, 4),
    ("whisper fc1", (1, 1500, 1536, 384), "mk", "nk", False, True, 1),
    ("whisper qkv", (1, 1500, 1152, 384), "mk", "nk", False, True, 1),
    ("whisper out", (1, 1500, 384, 384), "mk", "nk", False, True, 1),
    ("whisper dW fc1", (1, 1536, 384, 1500), "km", "kn", False, False, 4),
    ("whisper dW qkv", (1, 1152, 384, 1500), "km", "kn", False, False, 5),
    ("whisper dX qkv", (1, 1500, 384, 1152), "mk", "kn", False, False, 4),
    ("whisper dW out", (1, 384, 384, 1500), "km", "kn", False, False, 6),
    ("resnet 256>1024 14x14", (4, 1024, 196, 256), "mk", "kn", True, False, 1),
    ("resnet 128>512 28x28", (4, 512, 784, 128), "mk", "kn", True, False, 1),
    ("resnet 64>256 56x56", (4, 256, 3136, 64), "mk", "kn", True, False, 1),
    ("resnet 256>64 56x56", (4, 64, 3136, 256), "mk", "kn", True, False, 1),
    ("resnet dW 1024>256 14x14", (4, 256, 1024, 196), "mk", "nk", False, False, 1),
    ("smollm2 up+gate", (1, 128, 3072, 576), "mk", "nk", False, False, 1),
    ("smollm2 dW up+gate", (1, 3072, 576, 128), "km", "kn", False, False, 1),
    ("smollm2 dX up+gate", (1, 128, 576, 3072), "mk", "kn", False, False, 12),
    ("smollm2 dX o", (1, 128, 576, 576), "mk", "kn", False, False, 9),
]
# strict tiled configurations timed at every workload GEMM besides the heuristic: (TM, TN, RM,
# RN, BK, vr, vl, ks), ks = K slices inside the workgroup
SWEEP_CFGS = [Cfg("tiled", *x) for x in (
    (128, 64, 8, 4, 16, 1, 1, 1), (128, 64, 8, 4, 32, 1, 1, 1), (128, 64, 8, 4, 16, 1, 1, 2),
    (128, 128, 8, 8, 16, 1, 1, 1), (64, 128, 4, 8, 16, 1, 1, 1),
    (64, 64, 4, 4, 16, 1, 1, 1), (64, 64, 4, 4, 32, 1, 1, 1), (64, 64, 4, 4, 16, 1, 1, 2),
    (64, 64, 4, 4, 16, 1, 1, 4), (64, 64, 8, 4, 16, 1, 1, 1), (64, 64, 8, 4, 16, 1, 1, 2),
    (64, 64, 4, 8, 16, 1, 1, 2), (32, 64, 4, 4, 16, 1, 1, 1), (32, 64, 4, 4, 16, 1, 1, 2),
    (32, 64, 4, 4, 32, 1, 1, 2), (32, 64, 4, 4, 16, 1, 1, 4), (64, 32, 4, 4, 16, 1, 1, 2),
    (32, 32, 4, 4, 16, 1, 1, 2), (32, 32, 4, 4, 16, 1, 1, 4), (128, 32, 8, 4, 16, 1, 1, 2),
    (32, 128, 4, 8, 16, 1, 1, 2), (32, 64, 2, 4, 16, 0, 1, 1))]


def _operand_view(rows, cols, layout, batch, bcast):
    """(Strided, stored shape) of a logical (batch, rows, cols) operand stored as ``layout``."""
    t = layout in ("km", "nk")
    mat = (cols, rows) if t else (rows, cols)
    st = (1, rows) if t else (cols, 1)
    nb = 1 if bcast else batch
    return (Strided(f32, (batch, rows, cols), (0 if bcast else rows * cols,) + st, 0,
                    nb * rows * cols), (nb,) + mat)


def _gemm_problem(dev, rng, shape, la, lb, bcast, add):
    """Description, buffers and the float64 reference (sampled rows) of one workload GEMM."""
    B, M, N, K = shape
    sa, ma = _operand_view(M, K, la, B, bcast)
    sb, mb = _operand_view(K, N, lb, B, False)
    a = rng.standard_normal(ma, dtype=np.float32)
    b = rng.standard_normal(mb, dtype=np.float32)
    la_ = (a.transpose(0, 2, 1) if la == "km" else a).astype(np.float64)
    lb_ = (b.transpose(0, 2, 1) if lb == "nk" else b).astype(np.float64)
    rows = np.unique(np.r_[np.arange(0, M, 7), M - 1])
    ref = np.stack([la_[0 if bcast else i][rows] @ lb_[i] for i in range(B)])
    ins, extra = [a, b], ()
    if add:
        res = rng.standard_normal((B, M, N), dtype=np.float32)
        ins.append(res)
        extra = (Strided.contiguous(f32, (B, M, N)),)
        ref = ref + res[:, rows]
    desc = MatmulKernel(B, M, N, K, sa, sb, extra, ADD if add else ())
    bufs = [dev.upload(x) for x in ins] + [dev.create_buffer(4 * B * M * N)]
    return desc, bufs, ref, rows


def _gemm_err(dev, desc, bufs, ref, rows) -> float:
    y = dev.read_array(bufs[-1], (desc.batch, desc.m, desc.n), f32)[:, rows].astype(np.float64)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def _gemm_tries(dev, desc, bufs, old_split, before):
    """(name, [calls]) to time at one GEMM: the heuristic as the scheduler builds it (with its
    split-K), the before kernel (with the old split-K), each ``SWEEP_CFGS`` entry unsplit and
    split-K tries with the heuristic's partials."""
    from dataclasses import replace

    from meganeura.compile.schedule import split_k

    s = split_k(desc)
    heur = _split_calls(dev, desc, bufs, s) if s > 1 else [(codegen.emit(desc, dev), bufs)]
    name = heur[0][0].meta["variant"] + (f" split {s}" if s > 1 else "")
    yield f"heuristic {name}", heur
    if before is not None:
        bc = (_split_calls(dev, desc, bufs, old_split, before) if old_split > 1
              else [(before(desc, dev), bufs)])
        yield f"before {bc[0][0].meta['variant']}" + (
            f" split {old_split}" if old_split > 1 else ""), bc
    for g in SWEEP_CFGS:
        try:
            yield config_name(g), [(codegen.emit(replace(desc, config=tuple(g)), dev), bufs)]
        except Exception as e:  # a configuration over the device's limits: reported
            print(f"    {config_name(g)} skipped: {type(e).__name__}: {str(e)[:120]}")
    if desc.batch == 1:
        for sp in (2, 3, 4, 6, 8, 12):
            if desc.k % sp == 0 and desc.k // sp >= 64 and sp != s:
                yield f"split {sp}", _split_calls(dev, desc, bufs, sp)


def sweep(dev, timer, rng, before, out_dir: str | None, warm: float) -> None:
    """Time and check ``_gemm_tries`` at every ``WORKLOAD_GEMMS`` entry; a table last.  Each
    try runs ``warm`` seconds first: on the H200 the SM clock fell during the first sweep
    (2026-12-01: times 4x the in-model ones after a few shapes; 5 ms of warm-up per try did
    not bring it back).  The heuristic is timed again last ("again"): a drifting clock shows."""
    lines, table = [], []
    for label, shape, la, lb, bcast, add, old_split in WORKLOAD_GEMMS:
        desc, bufs, ref, rows = _gemm_problem(dev, rng, shape, la, lb, bcast, add)
        flops, res = 2 * int(np.prod(shape)), []
        tag = f"{label} {'x'.join(map(str, shape))}"
        tries = list(_gemm_tries(dev, desc, bufs, old_split, before))
        for name, calls in tries + [("again " + tries[0][0], tries[0][1])]:
            try:
                timer.warm(calls, warm if lines else max(warm, 0.6))
                t = timer(calls)
            except Exception as e:  # reported, the sweep goes on
                print(f"  {tag} {name} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = _gemm_err(dev, desc, bufs, ref, rows)
            res.append((name, t, err))
            ln = f"{tag:42} {name:36} {t * 1e6:8.1f} us {flops / t / 1e12:6.2f} TF/s err {err:.1e}"
            print("  " + ln, flush=True)
            lines.append(ln)
        ok = sorted((r for r in res if r[2] < 1e-4 and not r[0].startswith("again")),
                    key=lambda r: r[1])
        h = res[0]
        bf = [r for r in res if r[0].startswith("before")]
        table.append(f"{tag:42} {h[1] * 1e6:7.1f} {flops / h[1] / 1e12:6.2f} "
                     f"{res[-1][1] * 1e6:7.1f} "
                     + (f"{bf[0][1] * 1e6:7.1f} {flops / bf[0][1] / 1e12:6.2f} " if bf else "")
                     + " | ".join(f"{n} {flops / t / 1e12:.1f}" for n, t, _ in ok[:3])
                     + "".join(f"  BAD: {n}" for n, _, e in res if not e < 1e-4))
    head = (f"{'gemm':42} {'heur us':>7} {'TF/s':>6} {'again':>7} {'bef us':>7} {'TF/s':>6} "
            "best three (TF/s)")
    print("\n" + "\n".join([head] + table), flush=True)
    if out_dir:
        with open(f"{out_dir}/matmul_sweep.txt", "w") as f:
            f.write("\n".join(lines + ["", head] + table) + "\n")


# --packed-ab: packed staging (matmul_sgmat.PACKED, one vec2<u32> store per four f16 through
# buffer views) against four f16 stores, interleaved rounds, at 4096³ f32 / f16 and Whisper's fc1
PACKED_CFGS = [None] + [Cfg("sgmat", *x) for x in (
    (128, 256, 2, 4, 32, 8), (128, 128, 2, 4, 64, 2), (256, 128, 4, 2, 32, 0),
    (128, 256, 2, 4, 16, 1), (128, 256, 2, 4, 32, 1), (256, 256, 4, 8, 16, 1))]
# --packed-ab --set f16: f16 operands at 4096³, where packed staging pays: the neighbours
PACKED_F16 = [None] + [Cfg("sgmat", *x) for x in (
    (128, 256, 2, 4, 48, 0), (128, 256, 2, 4, 16, 3), (128, 256, 2, 4, 16, 7),
    (256, 128, 4, 2, 16, 3), (256, 128, 4, 2, 32, 2), (128, 256, 2, 4, 32, 2),
    (128, 256, 2, 4, 32, 16), (256, 256, 4, 8, 16, 0), (128, 128, 2, 4, 32, 3))]


def _interleaved(dev, timer, label, specs: dict, bufs, ref, rows, shape, rounds: int):
    """Time every spec of ``specs`` (key -> KernelSpec) ``rounds`` times, interleaved (one
    round over all, then the next: clock drift hits all alike); prints a line per spec
    (best µs, TFLOP/s, every round, error against ``ref``) and returns {key: best seconds}."""
    B, M, N, K = shape
    flops = 2 * B * M * N * K
    if not specs:
        return {}
    times: dict = {key: [] for key in specs}
    errs = {}
    for rnd in range(rounds):
        for key, spec in specs.items():
            try:  # each timing right after 0.2 s of its own work: the clocks are up (the
                # error check's readback idles the GPU long enough for them to drop 3x)
                timer.warm([(spec, bufs)], 0.2)
                times[key].append(timer([(spec, bufs)]))
            except Exception as e:  # noqa: BLE001 - a config the device rejects: go on
                print(f"  {label} {key} FAILED {str(e)[:200]}", flush=True)
                continue
            if rnd == 0:
                y = dev.read_array(bufs[-1], (B, M, N), f32)[:, rows].astype(np.float64)
                errs[key] = float(np.abs(y - ref).max() / np.abs(ref).max())
    best = {}
    for key, ts in times.items():
        if not ts:
            continue
        best[key] = t = min(ts)
        print(f"{label:22} {specs[key].meta['variant']:26} {str(key[1:]):14} "
              f"{t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOP/s rounds "
              f"{', '.join(f'{x * 1e6:.1f}' for x in ts)} err {errs.get(key, -1):.1e}",
              flush=True)
    return best


def cfg_ab(dev, timer, rng, cfgs: list, rounds: int = 2,
           ablate: tuple[str, ...] = ABLATIONS[:2], ablate_all: bool = False,
           b_nk: bool = False) -> None:
    """``cfgs`` (None: the heuristic) at 4096³ with f32 and f16 operands, interleaved rounds,
    with the ``ablate`` variants (``_ablated``: parts of the K loop removed) of the heuristic
    tile (``ablate_all``: of every tile), which bound what better staging could gain; ``b_nk``:
    B stored (N, K)."""
    from dataclasses import replace

    for M, N, K, B, dt in TC_SHAPES[:2]:
        desc, bufs, ref, rows = _tc_problem(dev, rng, M, N, K, B, dt, b_nk)
        label = f"{B}x{M}x{N}x{K}{' f16' if dt is f16 else ''}{' nk' if b_nk else ''}"
        specs = {}
        for g in cfgs:
            d = desc if g is None else replace(desc, config=tuple(g))
            try:
                specs[(g, "")] = codegen.emit(d, dev)
            except Exception as e:  # noqa: BLE001 - report, go on
                print(f"  {label} {g} FAILED {str(e)[:200]}", flush=True)
        for g in [g for g in cfgs if (g, "") in specs and (ablate_all or g is None)]:
            for what in ablate:
                specs[(g, what)] = _ablated(specs[(g, "")], what)
        _interleaved(dev, timer, label, specs, bufs, ref, rows, (B, M, N, K), rounds)


def parse_cfgs(text: str) -> list:
    """``--cfg-ab`` text: ``;``-separated sgmat configurations ``tm,tn,rm,rn,bk,vr`` (or
    ``heur`` for the heuristic)."""
    out = []
    for part in text.split(";"):
        part = part.strip()
        if part:
            out.append(None if part == "heur" else
                       Cfg("sgmat", *(int(x) for x in part.split(","))))
    return out


def packed_ab(dev, timer, rng, rounds: int = 2, shapes=None, cfgs=None) -> None:
    """``PACKED_CFGS`` (None: the heuristic) with packed staging on and off, ``rounds``
    interleaved rounds per shape; one line per configuration: µs, TFLOP/s, error."""
    from dataclasses import replace

    from meganeura.kernels import matmul_sgmat

    for M, N, K, B, dt in shapes or TC_SHAPES[:3]:
        desc, bufs, ref, rows = _tc_problem(dev, rng, M, N, K, B, dt)
        label = f"{B}x{M}x{N}x{K}{' f16' if dt is f16 else ''}"
        specs = {}
        for g in cfgs or PACKED_CFGS:
            d = desc if g is None else replace(desc, config=tuple(g))
            for pk in (2, 1, 0):  # packed + eight-f16 loads, packed, four f16 stores
                matmul_sgmat.PACKED, matmul_sgmat.WIDE = pk > 0, pk > 1
                try:
                    specs[(g, pk)] = codegen.emit(d, dev)
                except Exception as e:  # noqa: BLE001 - report, go on
                    print(f"  {label} {g} packed={pk} FAILED {str(e)[:200]}", flush=True)
        matmul_sgmat.PACKED, matmul_sgmat.WIDE = True, False  # the defaults again
        keyed = {(g, f"packed={pk}"): sp for (g, pk), sp in specs.items()}
        _interleaved(dev, timer, label, keyed, bufs, ref, rows, (B, M, N, K), rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", nargs="?", default="dawn")
    ap.add_argument("--before")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tc-sweep", action="store_true")
    ap.add_argument("--packed-ab", action="store_true",
                    help="tensor-core configurations with packed staging on and off (with "
                         "--cfg-ab: those, f16 operands at 4096³)")
    ap.add_argument("--cfg-ab", metavar="CFGS",
                    help="tensor-core configurations 'tm,tn,rm,rn,bk,vr;...' ('heur': the "
                         "heuristic) at 4096³ f32/f16 in interleaved rounds, with the "
                         "heuristic's noload/nostage ablations")
    ap.add_argument("--ablate", default="noload,nostage",
                    help="--cfg-ab: the ablations (of the heuristic; --ablate-all: of every "
                         "configuration), comma-separated, of "
                         + ", ".join(ABLATIONS))
    ap.add_argument("--ablate-all", action="store_true",
                    help="--cfg-ab: the ablations of every configuration")
    ap.add_argument("--b-nk", action="store_true", help="--cfg-ab: B stored (N, K)")
    ap.add_argument("--sweep", action="store_true",
                    help="strict configurations at the workload GEMMs (WORKLOAD_GEMMS)")
    ap.add_argument("--out")
    ap.add_argument("--warm", type=float, default=0.1,
                    help="--sweep: seconds of warm-up work before each try")
    ap.add_argument("--set", choices=("full", "final", "const", "const2", "f16"), default="full",
                    help="tensor-core sweep: the full exploration, the short final list or the "
                         "constant-offset configurations (TC_CONST, round 2: TC_CONST2)")
    ap.add_argument("--toggles", default="",
                    help="extra Dawn toggles, comma-separated (e.g. disable_robustness); the "
                         "tensor-core sweep then times only TC_QUICK at 4096³")
    args = ap.parse_args()
    global TC_SHAPES, TC_SWEEP, TC_F16, TC_ABLATE, TC_SMALL
    if args.set == "final":
        TC_SHAPES, TC_SWEEP, TC_F16, TC_ABLATE = TC_SHAPES[:2], TC_FINAL, [], []
    if args.set == "const2":
        TC_SHAPES, TC_SWEEP, TC_F16, TC_ABLATE = TC_SHAPES[:2], TC_CONST2, TC_GLOBAL, []
    if args.set == "const":
        TC_SHAPES = [TC_SHAPES[i] for i in (0, 1, 2, 4)]
        TC_SWEEP, TC_F16, TC_SMALL, TC_ABLATE = TC_CONST, TC_CONST_F16, TC_CONST_SMALL, []
    if args.toggles:
        from meganeura.runtime import device as devmod

        devmod._DAWN_TOGGLES += tuple(args.toggles.split(","))
        if not args.cfg_ab:  # the sweep at 4096³ f32 only; --cfg-ab keeps f32 and f16
            TC_SHAPES = TC_SHAPES[:1]
        TC_SWEEP = TC_CONST_NR if args.set == "const" else TC_QUICK
    dev = get_device(args.impl)
    print(args.impl, dev.adapter_name, flush=True)
    timer, rng = Timer(dev), np.random.default_rng(0)
    if args.tc_sweep:
        return tc_sweep(dev, timer, rng, args.out)
    if args.packed_ab and args.cfg_ab:  # these configurations, f16 operands at 4096³
        return packed_ab(dev, timer, rng, shapes=TC_SHAPES[1:2], cfgs=parse_cfgs(args.cfg_ab))
    if args.cfg_ab:
        return cfg_ab(dev, timer, rng, parse_cfgs(args.cfg_ab),
                      ablate=tuple(a for a in args.ablate.split(",") if a),
                      ablate_all=args.ablate_all, b_nk=args.b_nk)
    if args.packed_ab:
        if args.set == "f16":
            return packed_ab(dev, timer, rng, shapes=TC_SHAPES[1:2], cfgs=PACKED_F16)
        return packed_ab(dev, timer, rng)
    before = _load_before(args.before) if args.before else None
    if args.sweep:
        if args.quick:  # a dry run: the first GEMM of each model, a few configurations
            global WORKLOAD_GEMMS, SWEEP_CFGS
            WORKLOAD_GEMMS = [WORKLOAD_GEMMS[i] for i in (3, 7, 12)]
            WORKLOAD_GEMMS = [(n, (b, min(m, 100), min(nn, 70), min(k, 96)), *r)
                              for n, (b, m, nn, k), *r in WORKLOAD_GEMMS]
            SWEEP_CFGS = SWEEP_CFGS[::7]
        return sweep(dev, timer, rng, before, args.out, args.warm)
    big = 1024 if args.quick else 4096
    d0, b0, _, _ = _problem(dev, rng, big, big, big, False, False)
    timer.warm([(codegen.emit(d0, dev), b0)])
    rows = []
    for M, N, K, add in SHAPES:
        for b_nk in (True, False):
            bench_shape(dev, timer, rng, M, N, K, add, b_nk, False, before, rows)
    for fast in (False, True):
        bench_shape(dev, timer, rng, big, big, big, False, False, fast, before, rows)
    print(f"\n{'shape':42} {'heur µs':>8} {'TF/s':>6} {'best µs':>8} {'TF/s':>6} "
          f"{'before µs':>9} best config")
    for label, th, (bn, tb, _), tbef, flops, bad in rows:
        bs = f"{tbef * 1e6:9.1f}" if tbef else f"{'-':>9}"
        print(f"{label:42} {th * 1e6:8.1f} {flops / th / 1e12:6.2f} {tb * 1e6:8.1f} "
              f"{flops / tb / 1e12:6.2f} {bs} {bn}{'  BAD: ' + ','.join(bad) if bad else ''}")


if __name__ == "__main__":
    main()
