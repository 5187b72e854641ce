"""Strict matmul configurations for the small-M GEMMs (SmolLM2's M = 128 projections) timed
two ways: back to back in one pass (``matmul_bench.Timer``: what the kernel costs inside a
long stream) and the way ``sess.profile()`` times a step (every dispatch in its own
timestamped pass, ``PassTimer``: what the roofline table shows).  Each configuration is a tile,
a K step, in-workgroup K slices (``Cfg.ks``) and a split-K count (partials + the sum kernel);
every result is checked against numpy float64.

  python bench/small_m_bench.py dawn [--shapes 128x576x960,...] [--layouts kn,nk]
      [--budget SECONDS] [--top 12] [--out DIR]
  python bench/small_m_bench.py wgpu --smoke    (a tiny shape and four configurations)

Prints one line per configuration, then per shape the best ten by per-pass time and the
heuristic's (``choose_config`` + ``schedule.split_k``), and a tiny kernel's per-pass time (the
profile's floor per dispatch)."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from matmul_bench import Timer, _err, _problem, _split_calls  # noqa: E402

from meganeura import kernels as codegen  # noqa: E402
from meganeura.compile.schedule import split_k  # noqa: E402
from meganeura.kernels.matmul import Cfg, choose_config, config_name, partials_config  # noqa: E402,E501
from meganeura.runtime.device import get_device  # noqa: E402

SHAPES = ("128x576x960", "128x576x576", "128x960x576", "128x1536x576", "128x3072x576",
          "128x576x1536", "128x576x3072")  # M x N x K (the profile's label order)
# Round 1 (2026-12-03, bench/results/h200-2026-12-03c/small_m_r1.txt) swept 4x4-block tiles
# 16x32 ... 64x64 with K steps 4-16, K slices 1-16 and split-K 1-12: 16x32 tiles of two K
# slices won most shapes, and the time tracked the number of staged K steps (each one a
# global-load latency), so round 2 (the default) takes longer staged steps and few splits.
TILES = ((16, 32, 4, 4), (32, 32, 4, 4), (16, 64, 4, 4), (32, 16, 4, 4), (32, 64, 4, 4),
         (64, 32, 4, 4), (64, 64, 4, 4))
SLICES = (1, 2, 4, 8)
STEPS = (8, 16, 32, 64)
SPLITS = (1, 2, 3)
# ``--wide`` (fifteenth session): what the profile's in-stream column (1 + R back-to-back
# dispatches, like "b2b" here) asks at K >= 960: many splits of short chunks, staged steps from
# 16, and the 64x64 tile the heuristic picks for split partials
WIDE = {"tiles": ((16, 32, 4, 4), (32, 32, 4, 4), (32, 64, 4, 4), (64, 32, 4, 4),
                  (64, 64, 4, 4), (64, 64, 8, 4)),
        "slices": (1, 2), "steps": (8, 16, 32),
        "splits": (2, 3, 4, 5, 6, 8, 10, 12, 15, 16, 20, 24), "staged": (16, 64),
        "max_wgs": 3600}
NARROW = {"tiles": TILES, "slices": SLICES, "steps": STEPS, "splits": SPLITS,
          "staged": (32, 128), "max_wgs": 1600}


class PassTimer:
    """GPU time per run of a dispatch sequence with every dispatch in its own timestamped
    compute pass, as ``runtime.profile`` encodes a step: mean over ``reps`` runs of the summed
    pass durations."""

    def __init__(self, dev, reps: int = 64):
        self.dev, self.reps, wgpu = dev, reps, dev.module
        self.count = 2 * 4 * reps  # room for up to four dispatches per run
        self.qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=self.count)
        self.rb = dev.device.create_buffer(
            size=8 * self.count, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)

    def once(self, seq) -> float:
        enc, i = self.dev.device.create_command_encoder(), 0
        for _ in range(self.reps):
            for pipe, bg, wg in seq:
                cp = enc.begin_compute_pass(timestamp_writes={
                    "query_set": self.qs, "beginning_of_pass_write_index": i,
                    "end_of_pass_write_index": i + 1})
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(*wg)
                cp.end()
                i += 2
        enc.resolve_query_set(self.qs, 0, i, self.rb, 0)
        self.dev.queue.submit([enc.finish()])
        ts = np.frombuffer(self.dev.read_buffer(self.rb, 0, 8 * i), dtype=np.uint64)
        d = ts[1::2].astype(np.float64) - ts[0::2].astype(np.float64)
        return float(np.maximum(d, 0).sum()) / 1e9 / self.reps

    def __call__(self, calls) -> float:
        if len(calls) > 4:
            raise ValueError("PassTimer: at most four dispatches per run")
        seq = [(self.dev.pipeline(s), self.dev.bind_group(s, b), s.workgroups) for s, b in calls]
        self.once(seq)
        return float(np.median([self.once(seq) for _ in range(3)]))


def configs(M: int, N: int, K: int, smoke: bool = False, space: dict = NARROW):
    """(Cfg, split) pairs worth timing at M x N x K: enough workgroups to fill a 132-SM GPU
    (96-1600), 64-1024 invocations, a staged K step (slices x K step) within
    ``space["staged"]`` (32-128) and no longer than a split-K chunk."""
    if smoke:
        return [(Cfg("tiled", 16, 32, 4, 4, 4, 1, 1, 8), 1),
                (Cfg("tiled", 32, 32, 4, 4, 8, 1, 1, 4), 2),
                (Cfg("tiled", 16, 32, 4, 4, 8, 1, 1, 2), 1), (Cfg("tiled", 64, 64, 8, 4, 16, 1), 2)]
    out = []
    lo, hi = space["staged"]
    for (tm, tn, rm, rn), ks, bk, s in itertools.product(
            space["tiles"], space["slices"], space["steps"], space["splits"]):
        threads = ks * (tm // rm) * (tn // rn)
        wgs = s * -(-M // tm) * -(-N // tn)
        if K % s or not 64 <= threads <= 1024 or not 96 <= wgs <= space["max_wgs"] or \
                ks * bk > K // s:
            continue
        if not lo <= ks * bk <= hi:  # the staged step along K
            continue
        out.append((Cfg("tiled", tm, tn, rm, rn, bk, 1, 1, ks), s))
    return out


def _restricted(space: dict, tiles: str | None, splits: str | None) -> dict:
    """``space`` cut to the tiles ("TMxTN", any blocks) and split counts asked for."""
    out = dict(space)
    if tiles:
        want = {tuple(int(x) for x in t.split("x")) for t in tiles.split(",")}
        out["tiles"] = tuple(t for t in space["tiles"] if t[:2] in want)
    if splits:
        out["splits"] = tuple(int(x) for x in splits.split(","))
    return out


def heuristic(desc) -> tuple[Cfg, int]:
    """What runs without a tuning cache: the scheduler's split and the tile of its partials."""
    s = split_k(desc)
    if s == 1:
        return choose_config(1, desc.m, desc.n, desc.k), 1
    return partials_config(s, desc.m, desc.n, desc.k), s


def calls_for(dev, desc, bufs, g: Cfg, s: int):
    if s == 1:
        return [(codegen.emit(replace(desc, config=tuple(g)), dev), bufs)]
    emit = lambda d, t: codegen.emit(replace(d, config=tuple(g)), t)  # noqa: E731
    return _split_calls(dev, desc, bufs, s, emit)


def bench_shape(dev, timers, rng, shape: str, b_nk: bool, budget: float, smoke: bool,
                space: dict = NARROW):
    M, N, K = (int(x) for x in shape.split("x"))
    desc, bufs, ref, rows = _problem(dev, rng, M, N, K, False, b_nk)
    flops, res, t_end = 2 * M * N * K, [], time.perf_counter() + budget
    hg, hs = heuristic(desc)
    todo = [(hg, hs, True)] + [(g, s, False) for g, s in configs(M, N, K, smoke, space)
                               if (g, s) != (hg, hs)]
    label = f"1x{M}x{N}x{K} B {'nk' if b_nk else 'kn'}"
    timers[0].warm(calls_for(dev, desc, bufs, hg, hs), 0.5)
    for g, s, is_h in todo:
        if time.perf_counter() > t_end:
            print(f"  {label}: budget spent after {len(res)} of {len(todo)}", flush=True)
            break
        try:
            calls = calls_for(dev, desc, bufs, g, s)
            tb, tp = timers[0](calls), timers[1](calls)
        except Exception as e:  # a configuration that does not emit: skipped, said
            print(f"  {label} {config_name(g)} s{s} skipped: {type(e).__name__}: "
                  f"{str(e)[:120]}", flush=True)
            continue
        err = _err(dev, bufs[-1], M, N, ref, rows)
        name = f"{config_name(g)} split{s}" + (" (heuristic)" if is_h else "")
        res.append((tp, tb, name, err))
        print(f"  {label:22} {name:44} b2b {tb * 1e6:7.1f} µs  per-pass {tp * 1e6:7.1f} µs "
              f"{flops / tp / 1e12:6.2f} TFLOP/s err {err:.1e}", flush=True)
    return label, flops, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", nargs="?", default="dawn")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layouts", default="kn,nk")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per shape and layout")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--wide", action="store_true", help="the WIDE space (many splits)")
    ap.add_argument("--sort", choices=("pass", "b2b"), default="pass",
                    help="rank each shape's best by per-pass time (the profile with "
                    "repeats=0) or back-to-back time (its in-stream column)")
    ap.add_argument("--tiles", help="only these tiles of the space, e.g. 16x32,64x64")
    ap.add_argument("--splits", help="only these split counts, e.g. 3,5,8")
    ap.add_argument("--out")
    a = ap.parse_args()
    space = _restricted(WIDE if a.wide else NARROW, a.tiles, a.splits)
    dev = get_device(a.impl)
    rng = np.random.default_rng(0)
    timers = (Timer(dev), PassTimer(dev, 8 if a.smoke else 64))
    shapes = ["16x32x64"] if a.smoke else a.shapes.split(",")
    tiny, tb, _, _ = _problem(dev, rng, 8, 8, 8, False, False)
    floor = timers[1]([(codegen.emit(tiny, dev), tb)])
    lines = [f"device {dev.adapter_name} ({a.impl}); per-pass floor (8x8x8 matmul) "
             f"{floor * 1e6:.1f} µs"]
    for shape, lay in itertools.product(shapes, a.layouts.split(",")):
        label, flops, res = bench_shape(dev, timers, rng, shape, lay == "nk", a.budget, a.smoke,
                                        space)
        ok = sorted((r for r in res if r[3] < 1e-4), key=lambda r: r[1] if a.sort == "b2b"
                    else r[0])
        bad = [r[2] for r in res if not r[3] < 1e-4]
        lines.append(f"== {label}" + (f" ({len(bad)} WRONG: {', '.join(bad[:4])})" if bad else ""))
        lines += [f"  {n:44} per-pass {tp * 1e6:7.1f} µs {flops / tp / 1e12:6.2f} TFLOP/s  "
                  f"b2b {t * 1e6:7.1f} µs {flops / t / 1e12:6.2f}"
                  for tp, t, n, _ in ok[:a.top] + [r for r in res[:1] if r not in ok[:a.top]]]
    print("\n".join(lines), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "small_m.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if any("WRONG" in x for x in lines):
        sys.exit(1)


if __name__ == "__main__":
    main()
