"""Batched matmul ``C[b] = A[b] @ B[b]`` (+ epilogue), operands read in place through strides.

Configurations (``Cfg``), chosen at compile time: ``MatmulKernel.config`` (the tuner's pick)
or ``variant`` (a named one: ``tiled64``, ``tiled64v``, ``tiled128``, ``tiled128v``,
``sgmat64``, ``sgmat128``, ``gemv``) force one, otherwise ``choose_config`` picks by shape:

* **tiled** — a workgroup computes a TM×TN tile of C, RM×RN results per invocation, stepping
  K by BK with the A and B tiles staged through workgroup memory.  ``vr`` gives each
  invocation contiguous rows/columns read from workgroup memory as vec4; otherwise rows
  ``ty + TY·i`` (scalar, conflict-free).  The staging thread→element map follows each operand's
  contiguous axis (a transposed operand is still read coalesced), as vec4 loads where strides
  and alignment allow; the next step's loads are issued into registers before the current step
  is computed (prefetch).  Bounds checks only where needed: interior tiles (a uniform branch)
  run unguarded loads and stores; a K tail is zero-filled.  Small tiles (32×32, 64×32) exist
  for the small-M GEMMs of transformer projections: they give enough workgroups to fill a big
  GPU.  ``ks`` K slices (tuner candidates): several groups of invocations share one tile's K
  loop and add their partial sums in slice order.
* **sgmat** (precision "fast", Dawn's f16 subgroup matrices, f32 accumulation) — the same
  staging (rounded to f16), each subgroup owns a block of 16×16 accumulator fragments; emitted
  by ``matmul_sgmat`` (double-buffered staging, grouped rasterization, direct fragment stores).
* **gemv** — when one of M, N is ≤ 4 (a matrix–vector product, M = 1 decoding, a 1-wide output
  layer): invocations split the long dimension *and* K, fold their share of K serially with
  four loads in flight, and a tree in workgroup memory adds the K partial sums.

The batch index comes from the (wrapped) workgroup id, so batches beyond 65,535 work; batch
broadcast is stride 0.  f16 operands are converted to f32 and accumulated in f32.
``candidates`` lists the configurations worth timing for one description (the tuner's hook).
"""

from __future__ import annotations

from typing import NamedTuple

from ..dtypes import DType, f16, f32
from ..errors import LimitError
from .archetypes import kernel_family
from .common import (
    SG_FEATURE,  # noqa: F401  (re-exported: the tensor-core tiles' feature)
    Bindings,
    CodegenError,
    bcast_strides,
    check_binding_size,
    check_bindings,
    check_dtypes,
    check_extent,
    check_invocations,
    check_workgroup_storage,
    emit_instrs,
    index_code,
    load,
    make_grid,
    make_target,
    module_header,
    module_source,
    pack_f16x4,
    pow2ceil,
    store_value,
    u,
)
from .ir import PRECISIONS, KernelSpec, MatmulKernel


class Cfg(NamedTuple):
    """One matmul configuration (a hashable tuple: ``MatmulKernel.config``).  ``kind`` "tiled":
    TM x TN output tile, RM x RN results per invocation, K step BK, ``vr`` vec4 reads of
    workgroup memory (RM, RN multiples of 4), ``vl`` vec4 global loads where the operand allows.
    "sgmat": rm x rn subgroups (of 32) along rows/columns, ``vr`` option bits (1 double
    buffering, 2 grouped rasterization, 4 two K steps per iteration, 8 f16 staging registers,
    16 A fragments loaded one at a time, 32 constant fragment offsets, 64 B stored transposed,
    128 fragments straight from global memory, 256 B fragments one at a time, 512 loads
    issued before the barrier, 1024 loads two steps ahead: ``matmul_sgmat``), ``vl`` as
    above.  ``ks`` (tiled only) K slices inside the workgroup: ``ks`` groups of invocations
    each compute every ``ks``-th BK step of the same tile (a staged step is ``ks``·BK long)
    and add their partial sums in slice order at the end, so a tile too few to fill the GPU
    gets ``ks`` times the invocations without a second kernel.  "gemv": no fields."""

    kind: str
    tm: int = 0
    tn: int = 0
    rm: int = 0
    rn: int = 0
    bk: int = 0
    vr: int = 0
    vl: int = 1
    ks: int = 1


GEMV = Cfg("gemv")
NAMED = {  # the named variants (``MatmulKernel.variant``) as configurations
    "tiled64": Cfg("tiled", 64, 64, 4, 4, 16, 0), "tiled64v": Cfg("tiled", 64, 64, 4, 4, 16, 1),
    "tiled128": Cfg("tiled", 128, 128, 8, 8, 16, 0),
    "tiled128v": Cfg("tiled", 128, 128, 8, 8, 16, 1),
    "sgmat64": Cfg("sgmat", 64, 64, 2, 2, 32), "sgmat128": Cfg("sgmat", 128, 128, 2, 4, 32),
    "gemv": GEMV,
}
TILES = {k: (v.tm, bool(v.vr)) for k, v in NAMED.items() if v.kind == "tiled"}
SGMAT = {k: (v.tm, v.tn, v.rm, v.rn) for k, v in NAMED.items() if v.kind == "sgmat"}
# Strict f32 tiles from big to small: the heuristic takes the first one giving at least
# FILL_WORKGROUPS workgroups, else the last.  H200, Dawn (bench/matmul_bench.py): 4096³
# 128x64 38.4 TFLOP/s, 128x128 37.0, 64x64 32.0; at M = 128 (1x128x576x960, 1x128x3072x576)
# 64x64 beats every smaller tile (41 vs 42-76 µs, 77 vs 122-150 µs): 2x2/2x4 blocks are too
# little work per invocation; small-M GEMMs get their parallelism from split-K instead
# (compile/schedule.py split_k).  Between them 64x64 tiles of 8x4 blocks on 128 invocations
# where they still give FILL_WORKGROUPS workgroups (--sweep, 2026-12-01, docs/benchmarks.md,
# µs at a reduced clock): ResNet-50's 1x1 GEMMs 4x512x784x128 101.6 vs 127.3 (4x4 on 256),
# 4x256x1024x196 98.6 vs 113.8, 4x1024x196x256 114.3 vs 125.7; SmolLM2's 3072x576x128 103.0
# vs 116.3; Whisper's 1500x1152x384 319.5 vs 340.5.  With fewer workgroups (4 warps each, one
# per SM) they lost: 1500x384x384 186 vs 176, 1500x384x1536 253 vs 116 (the clock possibly
# falling during that one).
STRICT_LADDER = (
    Cfg("tiled", 128, 64, 8, 4, 16, 1),
    Cfg("tiled", 64, 64, 8, 4, 16, 1),
    NAMED["tiled64v"],
)
# Tensor-core tiles (precision "fast"), H200, Dawn, 4096³, TFLOP/s with f32 / f16 operands
# (bench/matmul_bench.py --cfg-ab, docs/benchmarks.md, thirteenth session): 128x128 with four
# subgroups of 64x64 fragments, K step 32, grouped rasterization: 217.6-221.2 / 250.6-252.7
# (249 registers x 128 invocations: two workgroups per SM, so one multiplies while the other
# waits at its barrier); 128x256 with eight subgroups 217.9-218.1 / 242.6-244.2 (one per SM);
# 128x128 with eight subgroups of 64x32 and K step 64 182.2 f32.  Small shapes: 32x64 tiles
# (1500x384x1536: 51 TFLOP/s against 2-17 for 64x64 and larger).
TC_LADDER = (
    Cfg("sgmat", 128, 128, 2, 2, 32, 2),
    Cfg("sgmat", 128, 64, 2, 2, 32),
    NAMED["sgmat64"],
    Cfg("sgmat", 32, 64, 1, 2, 32),
)
# Small-M GEMMs of moderate K (SmolLM2's M = 128 projections with K = 576): one dispatch of
# 16x32 tiles, each computed by two K slices of 32 invocations (K step 16), instead of a
# split-K of 64x64 tiles plus the sum kernel.  H200, Dawn, two rounds (bench/small_m_bench.py,
# 2026-12-03, bench/results/h200-2026-12-03c), µs back to back / each dispatch in its own
# timestamped pass as sess.profile() times it, B (K, N) then (N, K); sliced against split-K:
# 1x128x576x576 10.5-13.0 / 16.4-19.2 and 12.0-20.3 / 17.9-28.4 against 16.1-18.6 / 27.7-31.7
# and 12.0-25.8 / 22.3-45.3; 1x128x960x576 10.6-13.6 / 16.5-20.0 and 12.0-12.1 / 18.2 against
# 13.6-26.4 / 23.9-43.9 and 13.8-13.9 / 24.3; 1x128x1536x576 14.6-17.8 / 20.2-23.6 and
# 17.0-21.0 / 22.6-26.7 against 17.4-20.4 / 28.0-31.1 and 17.8-21.1 / 28.4-32.1.  With K 960
# and more split-K stays ahead back to back (1x128x576x960 14.5 against 15.8-23.9,
# 1x128x576x1536 17 against 24-28), and at 96 or more 64x64 tiles (1x128x3072x576) the
# unsplit 64x64 tile wins (26.4 against 28.8-34.4).  In whole steps (bench/small_m_ab.py, six
# interleaved rounds, rule on / off): SmolLM2 inference 4.28 / 4.59 ms, training 12.87 /
# 13.37 (worst round 0.968); but SmolVLA's M = 50, K = 720 GEMMs lost (inference 3.14 / 2.93
# ms; 1x50x960x720 32.9 µs per pass against 17.7 + 8.2 split), so the rule keeps to M of 64
# or more (16-row tiles waste less) and K up to 640.
SMALL_M_SLICED = Cfg("tiled", 16, 32, 4, 4, 16, 1, 1, 2)
SMALL_M_ROWS = (64, 256)  # M range (measured: 128)
SMALL_M_K = (256, 640)  # K range where it beat split-K (measured: 576)
SMALL_M_TILES = 64  # fewer 64x64 output tiles than this
# Small-M GEMMs of K just past the sliced rule's range (SmolLM2's 1x128x576x960, the input
# gradient of the fused q/k/v projection): split-K, chunks of about SMALL_M_SPLIT_CHUNK on
# 16x32 tiles of two K slices with K step 8.  H200, Dawn, sixteenth session, µs back to back
# incl. the sum (bench/small_m_bench.py --wide --sort b2b, two runs): split 5 12.0-13.2 (10.7-
# 11.8 TFLOP/s), splits 3-8 12.4-13.9, against 14.4 for split 12 of 64x64 tiles (the rule
# before); K step 16 13.0-15.6.  Inside SmolLM2's training step (bench/small_m_ab.py --switch
# small_m_split, the profile's in-stream column, partials + sum): 12.1 against 13.7 µs.  The
# same rule lost at K 1536 (the forward's B (N, K), +add: 19.9 against 17.1 µs) and 3072 (27.0
# against 25.5), though back to back alone with B (K, N) it won there too (16.3 against 17.9+,
# 26.6 against 28.6+): so K stays at most 1024.
SMALL_M_SPLIT = Cfg("tiled", 16, 32, 4, 4, 8, 1, 1, 2)
SMALL_M_SPLIT_K = (SMALL_M_K[1] + 1, 1024)  # K range (measured: 960)
SMALL_M_SPLIT_CHUNK = 192
# further configurations the tuner times (candidates) besides the ladders, the ones that won
# some workload GEMM of the sweep first: 128-invocation 32x64 tiles, K-sliced tiles (``ks``)
STRICT_EXTRAS = (
    Cfg("tiled", 32, 64, 4, 4, 16, 1), Cfg("tiled", 32, 32, 4, 4, 16, 1, 1, 2),
    Cfg("tiled", 64, 64, 8, 4, 16, 1, 1, 2), NAMED["tiled128v"], Cfg("tiled", 64, 64, 4, 4, 32, 1),
    Cfg("tiled", 128, 128, 8, 8, 8, 1), Cfg("tiled", 64, 32, 4, 2, 16, 0),
    Cfg("tiled", 32, 32, 2, 2, 16, 0), Cfg("tiled", 32, 64, 2, 4, 16, 0),
)
# Tensor-core extras: the former ladder rungs 128x256 (eight subgroups, 218.9 TFLOP/s at 4096³
# f32) and 128x128 with K step 64 (182.2); constant fragment offsets (option bit 32) made
# 256x128 198.7 (105.3 without; bench/matmul_bench.py --tc-sweep --set const,
# docs/benchmarks.md).  (Double-buffered 128x128 with them, 154.4, needs 45.5 KiB: no room for
# the edge tiles' 8 KiB result scratch.)
TC_EXTRAS = (Cfg("sgmat", 128, 256, 2, 4, 32), Cfg("sgmat", 128, 128, 2, 4, 64, 2),
             NAMED["sgmat128"], Cfg("sgmat", 128, 256, 2, 4, 32, 8),
             Cfg("sgmat", 128, 256, 2, 4, 16), Cfg("sgmat", 256, 128, 4, 2, 32, 32))
FILL_WORKGROUPS = 256
# With K of at least LONG_K (per chunk, after split-K) a strict tile bigger than 64x64 needs
# FILL_WORKGROUPS_LONG_K workgroups (three per SM of a 132-SM GPU): each workgroup's run time
# grows with K and its tile, so a barely started second wave of big tiles idles most SMs for
# long; 64x64 tiles keep FILL_WORKGROUPS (so ResNet-50's 4x1024x196x512 keeps its 256).  H200,
# Dawn, inside Whisper's steps (bench/whisper_gemm_variants.py, 2026-12-01), µs per step:
# 1500x1536x384 on 64x64 tiles (576 workgroups) 401 inference / 645 training vs 437 / 729 on
# 128x64 (288).  Short-K GEMMs keep the big tiles (ResNet-50's 4x256x3136x64: 392 of 128x64).
FILL_WORKGROUPS_LONG_K = 396
LONG_K = 384
# tensor cores (precision "fast") only for GEMMs of at least this many 64×64 output tiles:
# smaller ones run faster on the strict kernels, which split K (H200: 1x128x576x960 62 µs on
# tensor cores against 13.5–17 µs strict)
TC_MIN_TILES = 64
# ... and not with K this short on a tensor-core tile bigger than 64x64: a few K steps cannot
# pay for the f16 staging and the result scratch (H200, Dawn, in the training steps,
# bench/fast_vs_strict.py: SmolLM2's LM-head weight gradient 1x49152x576x128 +add 654.5 µs on
# 128x256 against 227.5 strict; SmolVLA's 1x4096x720x50 490.3 on 128x64 against 424.9; the
# 64x64 / 32x64 tiles at K 50 win: 1x720x2048x50 270.5 against 316.5)
TC_SHORT_K = 128
GEMV_MAX = 4  # M or N up to this use the gemv variant
GEMV_THREADS = 256
GEMV_UNROLL = 4
MAX_CANDIDATES = 10
K_SLICES = (1, 2, 4, 8, 16)  # in-workgroup K slice counts (``Cfg.ks``)
SLICE_SUM_BYTES = 8192  # the K slices' exchange buffer (``_slice_sum``)
# Epilogues calling a WGSL helper function (erf's gelu) are emitted once, bounds-checked, for
# interior and edge tiles alike: an unchecked interior copy beside the checked one doubles
# the inlined helper code (8x4 register blocks: 64 copies of gelu instead of 32).  H200, Dawn,
# in Whisper's steps (bench/whisper_gemm_variants.py, 2026-12-01): fc1 1500x1536x384 + gelu
# 82.0 -> 78.9 µs per call (inference), + the training forward's erf form 84.2 -> 78.5.
# Staging the results through workgroup memory so one epilogue copy runs in a coalesced loop
# lost (149 vs 99 µs: docs/rejected-optimizations.md).
ONE_STORE_PATH_FOR_HELPERS = True


def _norm(s, shape, what, name):
    if len(s.shape) == 2:  # allow rank-2 views for batch 1 / broadcast
        s = type(s)(s.dtype, (1,) + tuple(s.shape), (0,) + tuple(s.strides), s.offset, s.extent)
    if len(s.shape) != 3:
        raise CodegenError(f"kernel {name!r}: {what} must be a rank-3 view, got shape {s.shape}")
    return s, bcast_strides(s, shape, f"{name} {what}")


def _candidates(k: MatmulKernel, target) -> list[MatmulKernel]:
    """Configurations worth timing for ``k`` on ``target`` (heuristic default first): the
    neighbours of the default on the tile ladder, and K-step / read-mode alternatives."""
    from dataclasses import replace

    t = make_target(target) if not hasattr(target, "lim") else target
    B, N, K = int(k.batch), int(k.n), int(k.k)
    fast = (k.precision == "fast" and k.a.dtype.is_float and SG_FEATURE in t.features
            and t.has_f16)
    first = _heuristic(k, fast)
    if first.kind == "gemv":
        return [replace(k, config=first)]
    ladder = TC_LADDER + TC_EXTRAS if fast else STRICT_LADDER + STRICT_EXTRAS
    b_k_contiguous = _k_contiguous(_norm(k.b, (B, K, N), "operand b", k.name)[1])
    out = []
    for g in (first,) + ladder:
        g = with_b_layout(g, b_k_contiguous)
        if g in out or len(out) >= MAX_CANDIDATES:
            continue
        try:
            emit(replace(k, config=g), t)
        except (CodegenError, LimitError):
            continue
        out.append(g)
    return [replace(k, config=g) for g in out]


@kernel_family("matmul", MatmulKernel, candidates=_candidates)
def emit(k: MatmulKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    B, M, N, K = int(k.batch), int(k.m), int(k.n), int(k.k)
    a, sa = _norm(k.a, (B, M, K), "operand a", name)
    b, sb = _norm(k.b, (B, K, N), "operand b", name)
    if a.dtype is not b.dtype:
        raise CodegenError(f"kernel {name!r}: operand dtypes differ ({a.dtype}, {b.dtype})")
    op_dt: DType = a.dtype
    if not (op_dt.is_float or op_dt.is_int):
        raise CodegenError(f"kernel {name!r}: matmul of {op_dt.name} operands")
    acc_t = f32 if op_dt.is_float else op_dt
    check_extent(name, "operand a", a, (B, M, K), sa, t)
    check_extent(name, "operand b", b, (B, K, N), sb, t)
    xs = _extras(k, (B, M, N), t)
    res_dt = k.epilogue[-1].dtype if k.epilogue else op_dt
    out_dt: DType = k.out_dtype or res_dt
    check_binding_size(name, "output", B * M * N, out_dt, t)
    n_in = 2 + len(k.extra)
    dts = [op_dt, op_dt] + [s.dtype for s in k.extra] + [out_dt]
    uses_f16 = check_dtypes(name, dts + [i.dtype for i in k.epilogue], t)

    bd = Bindings(dts, alias)
    check_bindings(name, bd.n, t)
    ctx = _Ctx(name, B, M, N, K, a, sa, b, sb, k, xs, op_dt, acc_t, out_dt, n_in, bd)
    g = _config(k, ctx, t)
    ops = []
    if g.kind == "gemv":
        body, shared, wg_size, grid, helpers, variant = _gemv(ctx, t)
    else:
        gen = _tiled
        if g.kind == "sgmat":
            from .matmul_sgmat import sgmat as gen
        body, shared, wg_size, grid, helpers, ops = gen(ctx, t, g)
        variant = config_name(g)
    uses_f16 = uses_f16 or g.kind == "sgmat"
    check_invocations(name, wg_size, t)
    check_workgroup_storage(name, shared[1], t)
    lines = module_header(uses_f16)
    if g.kind == "sgmat":
        # per-subgroup fragment offsets (lid / 32) are not uniform across the workgroup
        lines[-1:-1] = ["enable chromium_experimental_subgroup_matrix;",
                        "diagnostic(off, chromium.subgroup_matrix_uniformity);"]
        if any("buffer<" in d for d in shared[0]):  # packed staging (matmul_sgmat.PACKED)
            lines.insert(0, "requires buffer_view;")
    lines += _decls(bd, ops, acc_t)
    lines += shared[0]
    return KernelSpec(
        name=name, wgsl=module_source(lines, helpers, wg_size, body), n_bindings=bd.n,
        workgroups=grid.workgroups,
        meta={"archetype": "matmul", "variant": variant, "config": tuple(g),
              "workgroup_size": wg_size, "workgroup_storage": shared[1],
              "binding_dtypes": tuple(dts), "flops": 2 * B * M * N * K},
    )


def _decls(bd: Bindings, ops, acc_t) -> list[str]:
    """Binding declarations; operands loaded as vec4 are declared as arrays of vec4 (of f32,
    or of f16 for the tensor-core tile's f16 operands: ``_Operand.bt``)."""
    return bd.decls(vec4={bd.name(o.slot): o.bt for o in ops if o.w > 1})


def config_name(g: Cfg) -> str:
    """The variant name of a configuration (``meta["variant"]``): the named variant it is, or
    ``tiled<TM>x<TN>_<RM>x<RN>k<BK>[v][s]`` / ``sgmat<TM>x<TN>_<SGM>x<SGN>k<BK>``."""
    for name, cfg in NAMED.items():
        if cfg == g:
            return name
    if g.kind == "sgmat":
        opts = "".join(ch for bit, ch in ((1, "d"), (4, "u"), (2, "g"), (8, "h"), (16, "l"),
                                          (32, "c"), (64, "t"), (128, "x"), (256, "o"),
                                          (512, "e"), (1024, "p"), (2048, "f"),
                                          (4096, "z"), (8192, "i"))
                       if g.vr & bit)
        return f"sgmat{g.tm}x{g.tn}_{g.rm}x{g.rn}k{g.bk}{opts}{'' if g.vl else 's'}"
    ks = f"_ks{g.ks}" if g.ks != 1 else ""
    return (f"tiled{g.tm}x{g.tn}_{g.rm}x{g.rn}k{g.bk}{'v' if g.vr else ''}"
            f"{'' if g.vl else 's'}{ks}")


def with_b_layout(g: Cfg, b_k_contiguous: bool) -> Cfg:
    """``g`` with B staged transposed (``matmul_sgmat.BT``) where B is K-contiguous (a Linear
    weight stored (N, K), the transposed operand of a backward matmul) and ``g`` is a flat
    tensor-core tile: then B's registers run along K and are staged like A's, one packed store
    each, instead of four 2-byte stores into four rows.  H200, 4096³ with B stored (N, K):
    128x128 217.6 -> 219.7 TFLOP/s f32 operands, 128x256 163.8 -> 217.5
    (bench/results/h200-2026-12-03b/tc-nk-ab.log)."""
    from .matmul_sgmat import BT, CONST, GLOBAL

    if g.kind != "sgmat" or not b_k_contiguous or g.vr & (CONST | GLOBAL):
        return g
    return g._replace(vr=g.vr | BT)


def _k_contiguous(sb) -> bool:
    """Whether operand B's (batch, K, N) strides ``sb`` run along K (1 along K, not along N)."""
    return sb[1] == 1 and sb[2] != 1


def _check_config(g: Cfg, name: str) -> Cfg:
    """A configuration the emitters can build (whole thread blocks and fragments)."""
    bad = ""
    if g.kind == "tiled":
        if min(g.tm, g.tn, g.rm, g.rn, g.bk) <= 0 or g.tm % g.rm or g.tn % g.rn:
            bad = "the tile must split into whole per-invocation blocks"
        elif g.vr and (g.rm % 4 or g.rn % 4):
            bad = "vec4 reads (vr) need RM and RN multiples of 4"
        elif g.ks not in K_SLICES or (g.ks > 1 and (g.tm * g.tn // (g.rm * g.rn)) % 32):
            bad = (f"K slices (ks) must be one of {', '.join(map(str, K_SLICES))}, each slice "
                   "whole subgroups of 32")
    elif g.kind == "sgmat":
        if g.ks != 1:
            bad = "K slices (ks) exist for the tiled kernel only"
        elif min(g.rm, g.rn, g.bk) <= 0 or g.tm % (16 * g.rm) or g.tn % (16 * g.rn) or g.bk % 16:
            bad = "the tile must split into 16x16 fragments per subgroup and BK into 16s"
        elif (not 0 <= g.vr < 16384 or g.vr & 1025 == 1025 or g.vr & 1536 == 1536
              or g.vr & 5 == 4 or g.vr & 272 == 272
              or g.vr & 513 == 513 or (g.vr & 2048 and g.vr & (1 | 512 | 1024))
              or g.vr & 6144 == 4096
              or (g.vr & 128 and (g.vr & ~130 or g.bk != 16))
              or (g.vr & 8192 and g.vr & 2048)):
            bad = ("vr holds the option bits 1 (double buffering), 2 (grouped rasterization), "
                   "4 (two K steps per iteration, with double buffering only), 8 (f16 "
                   "staging registers), 16 (A fragments loaded one at a time), 32 (constant "
                   "fragment offsets), 64 (B transposed), 128 (fragments "
                   "from global memory, BK 16, with 2 only), 256 (B fragments one at a "
                   "time, not with 16), 512 (loads before the barrier, not with 1) and 1024 "
                   "(loads two steps ahead, not with 1 or 512), 2048 (L1 touch loads, not with 1, "
                   "512 or 1024), 4096 (touches two steps further, with 2048 only) and 8192 "
                   "(A's staged rows interleaved, not with 2048)")
    elif g != GEMV:
        bad = "unknown kind"
    if bad:
        raise CodegenError(f"kernel {name!r}: matmul config {tuple(g)}: {bad}")
    return g


def _config(k: MatmulKernel, c: _Ctx, t) -> Cfg:
    """The configuration for this kernel, precision and device (tensor cores only for
    "fast")."""
    name, op_dt = k.name, c.op_dt
    if k.precision not in PRECISIONS:
        raise CodegenError(f"kernel {name!r}: precision must be one of {PRECISIONS}, "
                           f"got {k.precision!r}")
    fast = k.precision == "fast" and op_dt.is_float and SG_FEATURE in t.features and t.has_f16
    if k.config:
        g = _check_config(Cfg(*k.config), name)
        if g == GEMV and min(c.M, c.N) > 2 * GEMV_MAX:
            raise CodegenError(f"kernel {name!r}: the gemv variant needs M or N ≤ "
                               f"{2 * GEMV_MAX}, got {c.M}×{c.N}")
    elif k.variant:
        g = NAMED[choose_variant(c.B, c.M, c.N, c.K, k.variant, name, fast)]
    else:
        g = _heuristic(k, fast)
    if not k.config:
        g = with_b_layout(g, _k_contiguous(c.sb))
    if g.kind == "sgmat" and not (op_dt.is_float and SG_FEATURE in t.features):
        raise CodegenError(f"kernel {name!r}: variant {config_name(g)!r} needs f16 subgroup "
                           f"matrices (Dawn, feature {SG_FEATURE!r}) and float operands")
    return g


def small_m_sliced(B: int, M: int, N: int, K: int) -> bool:
    """Whether a GEMM runs as one dispatch of ``SMALL_M_SLICED`` tiles (few rows, few output
    tiles, moderate K); ``compile.schedule.split_k`` does not split these."""
    return _small_m(B, M, N) and SMALL_M_K[0] <= K <= SMALL_M_K[1]


def small_m_split(B: int, M: int, N: int, K: int) -> bool:
    """Whether a GEMM is split into chunks of about ``SMALL_M_SPLIT_CHUNK`` computed on
    ``SMALL_M_SPLIT`` tiles (few rows and output tiles, K past the sliced rule's range)."""
    return _small_m(B, M, N) and SMALL_M_SPLIT_K[0] <= K <= SMALL_M_SPLIT_K[1]


def _small_m(B: int, M: int, N: int) -> bool:
    """One GEMM of few rows (``SMALL_M_ROWS``) and few output tiles, not a GEMV."""
    return (B == 1 and SMALL_M_ROWS[0] <= M <= SMALL_M_ROWS[1] and N > GEMV_MAX
            and -(-M // 64) * -(-N // 64) < SMALL_M_TILES)


def _heuristic(k: MatmulKernel, fast: bool) -> Cfg:
    """The default configuration of ``k`` (no tuned one): split-K partials by their whole
    GEMM (``partials_config``, strict), the rest by their shape (``choose_config``)."""
    if k.split_of and not fast:
        return partials_config(int(k.batch), int(k.m), int(k.n), int(k.split_of))
    return choose_config(int(k.batch), int(k.m), int(k.n), int(k.k), tensor_cores=fast)


def partials_config(split: int, M: int, N: int, K: int) -> Cfg:
    """The strict heuristic's tile for the ``split`` partials of a single M x N x K GEMM:
    ``SMALL_M_SPLIT`` for small-M GEMMs (``small_m_split``), else by the partials' shape."""
    if small_m_split(1, M, N, K):
        return SMALL_M_SPLIT
    return choose_config(split, M, N, K // split)


def choose_config(B: int, M: int, N: int, K: int, tensor_cores: bool = False) -> Cfg:
    """The heuristic default (what runs without a tuning cache): gemv when M or N ≤ 4, the
    K-sliced small tile for small-M GEMMs (``small_m_sliced``), else the biggest tile of the
    ladder that still gives ``FILL_WORKGROUPS`` workgroups (enough to fill a big GPU;
    ``FILL_WORKGROUPS_LONG_K`` for strict tiles over 64x64 with K ≥ ``LONG_K``), the smallest
    otherwise."""
    if min(M, N) <= GEMV_MAX:
        return GEMV
    if small_m_sliced(B, M, N, K):
        return SMALL_M_SLICED
    if B * -(-M // 64) * -(-N // 64) < TC_MIN_TILES:
        tensor_cores = False
    ladder = TC_LADDER if tensor_cores else STRICT_LADDER
    long_k = K >= LONG_K and not tensor_cores
    for g in ladder:
        fill = FILL_WORKGROUPS_LONG_K if long_k and g.tm * g.tn > 64 * 64 else FILL_WORKGROUPS
        if B * -(-M // g.tm) * -(-N // g.tn) >= fill:
            break
    else:
        g = ladder[-1]
    if tensor_cores and K <= TC_SHORT_K and g.tm * g.tn > 64 * 64:
        return choose_config(B, M, N, K, tensor_cores=False)
    return g


def choose_variant(B: int, M: int, N: int, K: int, forced: str = "", name: str = "",
                   tensor_cores: bool = False) -> str:
    """The variant name: ``forced`` (checked) or the heuristic default's (``choose_config``)."""
    if forced:
        if forced not in NAMED:
            raise CodegenError(f"kernel {name!r}: unknown matmul variant {forced!r}; expected "
                               f"{', '.join(NAMED)}")
        if forced == "gemv" and min(M, N) > 2 * GEMV_MAX:
            raise CodegenError(
                f"kernel {name!r}: the gemv variant needs M or N ≤ {2 * GEMV_MAX}, got {M}×{N}"
            )
        return forced
    return config_name(choose_config(B, M, N, K, tensor_cores))


def _extras(k: MatmulKernel, shape, t) -> dict[int, tuple[int, ...]]:
    """Strides over (batch, M, N) of the extra inputs the epilogue reads."""
    name, xs = k.name, {}
    for i in sorted({i for ins in k.epilogue for kind, i in ins.args if kind == "x"}):
        if i >= len(k.extra):
            raise CodegenError(f"kernel {name!r}: epilogue reads extra input {i} of {len(k.extra)}")
        s = k.extra[i]
        if len(s.shape) < 3:
            st = bcast_strides(s, shape, f"{name} extra {i}")
        else:
            _, st = _norm(s, shape, f"extra {i}", name)
        check_extent(name, f"extra input {i}", s, shape, st, t)
        xs[i] = st
    return xs


class _Ctx:
    def __init__(self, name, B, M, N, K, a, sa, b, sb, k, xs, op_dt, acc_t, out_dt, n_in, bd):
        self.name, self.B, self.M, self.N, self.K = name, B, M, N, K
        self.a, self.sa, self.b, self.sb = a, sa, b, sb
        self.k, self.xs, self.op_dt, self.acc_t, self.out_dt = k, xs, op_dt, acc_t, out_dt
        self.n_in, self.bd = n_in, bd

    def read(self, which: str, idx: str) -> str:
        """Operand element converted to the accumulator type."""
        binding = self.bd.name(0 if which == "a" else 1)
        v = load(binding, idx, self.op_dt)
        return v if self.op_dt is self.acc_t else f"{self.acc_t.wgsl}({v})"

    def store(self, lines, ind, bi: str, row: str, col: str, acc: str, helpers: set) -> None:
        """Epilogue and store of one result ``acc`` at (bi, row, col) (bounds checked by the
        caller)."""
        k = self.k
        lines.append(f"{ind}{{")
        i2 = ind + "    "
        conv = acc if self.acc_t is self.op_dt else f"{self.op_dt.wgsl}({acc})"
        lines.append(f"{i2}let accv: {self.op_dt.wgsl} = {conv};")
        names = {}
        for i, st in self.xs.items():
            s = k.extra[i]
            idx = index_code([bi, row, col], st, s.offset)
            lines.append(f"{i2}let e{i} = {load(self.bd.name(2 + i), idx, s.dtype)};")
            names[i] = (f"e{i}", s.dtype)

        def arg(a):
            kind, i = a
            if kind == "acc":
                return "accv", self.op_dt
            if kind == "x":
                return names[i]
            raise CodegenError(f"kernel {self.name!r}: epilogue operand {a!r}")

        if k.epilogue:
            res = emit_instrs(k.epilogue, arg, "q", lines, i2, helpers)
            v, vdt = res[-1]
        else:
            v, vdt = acc, self.acc_t  # no epilogue: store from the accumulator, unrounded
        oidx = index_code([bi, row, col], (self.M * self.N, self.N, 1))
        lines.append(f"{i2}{self.bd.name(self.n_in)}[{oidx}] = {store_value(v, vdt, self.out_dt)};")
        lines.append(f"{ind}}}")


def _fma(acc_t, x, y, c):
    return f"fma({x}, {y}, {c})" if acc_t is f32 else f"{c} + {x} * {y}"


def _tile_start(c: _Ctx, t, TM: int, TN: int, L: list[str], ind: str):
    """Lines mapping the workgroup to (batch ``bi``, tile origin ``row0``/``col0``) of a TM x TN
    tile grid, the uniform ``interior`` test (whole tile inside C, so loads and stores need no
    bounds checks) and the operands' batch bases.  Returns (grid, live_check, full_m, full_n)."""
    B, M, N = c.B, c.M, c.N
    mt, nt = -(-M // TM), -(-N // TN)
    grid = make_grid(c.name, mt * nt * B, t)
    L += [f"{ind}let wg = {grid.wg_expr};", f"{ind}let tn = wg % {u(nt)};",
          f"{ind}let tq = wg / {u(nt)};", f"{ind}let tm = tq % {u(mt)};",
          f"{ind}let bi = tq / {u(mt)};", f"{ind}let row0 = tm * {u(TM)};",
          f"{ind}let col0 = tn * {u(TN)};"]
    return tile_bounds(c, grid, TM, TN, L, ind)


def tile_bounds(c: _Ctx, grid, TM: int, TN: int, L: list[str], ind: str):
    """After ``bi``/``row0``/``col0`` are defined (any tile order): the ``live`` test of a
    wrapped grid, the uniform ``interior`` test and the operands' batch bases.  Returns
    (grid, live_check, full_m, full_n); shared by the tiled and the tensor-core tiles."""
    live_check = not grid.exact
    if live_check:
        L.append(f"{ind}let live = bi < {u(c.B)};")
    full_m, full_n = c.M % TM == 0, c.N % TN == 0
    conds = ([] if full_m else [f"row0 + {u(TM)} <= {u(c.M)}"])
    conds += ([] if full_n else [f"col0 + {u(TN)} <= {u(c.N)}"])
    conds += (["live"] if live_check else [])
    if conds:
        L.append(f"{ind}let interior = {' && '.join(conds)};")
    L.append(f"{ind}let abase = {index_code(['bi'], [c.sa[0]], c.a.offset)};")
    L.append(f"{ind}let bbase = {index_code(['bi'], [c.sb[0]], c.b.offset)};")
    return grid, live_check, full_m, full_n


class _Operand:
    """How one operand's (T x bk) tile is staged: ``n`` items per invocation, each ``w``
    consecutive elements (w = 4: one vec4 load) along the operand's contiguous axis
    (``k_fast``: along K), so neighbouring invocations read neighbouring addresses."""

    def __init__(self, c: _Ctx, which: str, T: int, bk: int, nthreads: int, want_vec: bool,
                 f16_vec: bool = False, rt16: bool = False, wide: bool = False):
        self.which, self.T, self.bk = which, T, bk
        self.arr, self.p = ("As", "a") if which == "a" else ("Bs", "b")
        _, s_x, s_k = (c.sa if which == "a" else (c.sb[0], c.sb[2], c.sb[1]))
        self.s_x, self.s_k = s_x, s_k
        self.k_fast = not (s_x == 1 and s_k != 1)
        self.dim = c.M if which == "a" else c.N
        self.slot = 0 if which == "a" else 1
        self.w = 1
        for w in ((8, 4) if wide and c.op_dt is f16 and (which == "a") == self.k_fast else (4,)):
            if want_vec and _vec_ok(c, which, self, f16_vec, w) and (
                    T * bk // w) % nthreads in (0, T * bk // w):
                self.w = w
                break
        # element types of vec4 loads in the binding (bt) and the registers (rt): f16 operands
        # stay f16 (``f16_vec``); ``rt16`` rounds f32 operands to f16 as they are loaded;
        # ``wide`` (w = 8): eight f16 as one vec4<u32> (16-byte loads, staged as they are)
        self.elem = c.op_dt.wgsl if self.w > 1 else c.acc_t.wgsl  # the binding's scalar
        self.bt = "u32" if self.w == 8 else self.elem
        self.rt = "f16" if rt16 and self.w == 4 else self.bt
        self.items = T * bk // self.w  # loads per step; fewer than invocations: some idle
        self.reg = "r"  # the staging registers are <p><reg><l>; "q": a second set
        self.n = max(1, self.items // nthreads)
        self.part = self.items < nthreads
        self.interleave = False  # ``interleave_rows``: the slow index permuted (coords)

    def interleave_rows(self) -> None:
        """Permute the slow index (A's rows) within groups of eight, 0 2 4 6 1 3 5 7, so
        that a subgroup's four rows of eight invocations each are every other row: with
        rows of BK + 8 f16 (BK 32: 80 bytes) four consecutive rows put three 8-byte stores
        on some bank, four alternate rows two (the minimum for 256 bytes; the bank model in
        tests/kernels/test_matmul_fast.py).  Applies only where eight invocations cover a
        row and the rows are a multiple of eight (else a no-op)."""
        along = (self.bk if self.k_fast else self.T) // self.w
        rows = self.T if self.k_fast else self.bk
        self.interleave = along == 8 and rows % 8 == 0 and not self.part

    def coords(self, L: list[str], ind: str, nthreads: int) -> None:
        """Each item's (row-or-column ``x``, ``kx``) within the tile (constant over K)."""
        w, along = self.w, (self.bk if self.k_fast else self.T) // self.w
        for l in range(self.n):
            e = f"(lid + {u(l * nthreads)})"
            fast, slow = f"{e} % {u(along)}", f"{e} / {u(along)}"
            if self.interleave:  # s -> (s & ~7) | (s & 3) << 1 | (s >> 2) & 1
                slow = (f"((({slow}) & ~7u) | ((({slow}) & 3u) << 1u) | "
                        f"((({slow}) >> 2u) & 1u))")
            if w > 1:
                fast = f"({fast}) * {u(w)}"
            x, kx = (slow, fast) if self.k_fast else (fast, slow)
            L += [f"{ind}let {self.p}x{l} = {x};", f"{ind}let {self.p}k{l} = {kx};"]


def _vec_ok(c: _Ctx, which: str, o: _Operand, f16_vec: bool = False, m: int = 4) -> bool:
    """vec4 loads (of ``m`` elements) need f32 elements (or f16 with ``f16_vec``), the
    contiguous axis of stride 1 and every other stride, the offset, the bound range and the
    contiguous extent multiples of ``m``, and a binding no other slot shares (its declared
    element type changes)."""
    v = c.a if which == "a" else c.b
    sbatch = (c.sa if which == "a" else c.sb)[0]
    other = o.s_x if o.k_fast else o.s_k
    contig = o.s_k if o.k_fast else o.s_x
    ext = c.K if o.k_fast else o.dim
    slot = 0 if which == "a" else 1
    alias = c.bd.alias
    shared = any(alias[i] == alias[slot] for i in range(len(alias)) if i != slot)
    elem_ok = c.op_dt is f32 or (f16_vec and c.op_dt is f16)
    return (elem_ok and contig == 1 and other % m == 0 and sbatch % m == 0
            and v.offset % m == 0 and v.extent % m == 0 and ext % m == 0 and not shared)


def _load_items(c: _Ctx, out: list[str], ii: str, o: _Operand, check_mn: bool, check_k: bool,
                live_check: bool) -> None:
    """Step ``kb``'s loads of operand ``o`` into its registers, zero outside the matrices."""
    full = o.dim % o.T == 0
    origin = "row0" if o.which == "a" else "col0"
    zero = f"vec4<{o.rt}>(0)" if o.w > 1 else f"{c.acc_t.wgsl}(0)"
    if o.part:
        out.append(f"{ii}if (lid < {u(o.items)}) {{")
        ii += "    "
    for l in range(o.n):
        x, kx = f"{o.p}x{l}", f"{o.p}k{l}"
        idx = f"{o.p}base + " + index_code([f"({origin} + {x})", f"(kb + {kx})"],
                                           [o.s_x, o.s_k])
        val = (f"{c.bd.name(o.slot)}[({idx}) / {u(o.w)}]" if o.w > 1 else c.read(o.which, idx))
        if o.w > 1 and o.rt != o.bt:
            val = f"vec4<{o.rt}>({val})"
        conds = [f"{origin} + {x} < {u(o.dim)}"] if check_mn and not full else []
        conds += [f"kb + {kx} < {u(c.K)}"] if check_k else []
        conds += ["live"] if check_mn and live_check else []
        r = f"{o.p}{o.reg}{l}"
        if conds:
            out += [f"{ii}if ({' && '.join(conds)}) {{", f"{ii}    {r} = {val};",
                    f"{ii}}} else {{", f"{ii}    {r} = {zero};", f"{ii}}}"]
        else:
            out.append(f"{ii}{r} = {val};")
    if o.part:
        out.append(f"{ii[:-4]}}}")


def _store_items(out: list[str], ii: str, o: _Operand, sh, conv, packed=None) -> None:
    """The registers of operand ``o`` into workgroup memory (``sh(arr, k, x, vec)``: the
    element, or with ``vec`` the aligned vec4 at x, when the layout has one; else None).
    ``packed(arr, k, x, along_k)``: where the layout has an f16 tile's packed view, the
    ``vec2<u32>`` holding the register's four elements (k..k+3 with ``along_k``, else
    x..x+3) when they are adjacent there, else None: each vec4 register rounded to f16 in
    one store."""
    if o.part:
        out.append(f"{ii}if (lid < {u(o.items)}) {{")
        ii += "    "
    for l in range(o.n):
        x, kx, r = f"{o.p}x{l}", f"{o.p}k{l}", f"{o.p}{o.reg}{l}"
        dst = packed(o.arr, kx, x, o.k_fast, o.w) if packed is not None and o.w > 1 else None
        if dst is None and o.w == 8:
            raise CodegenError("eight-f16 loads need a packed staging layout")
        if dst is not None:
            out.append(f"{ii}{dst} = {r if o.w == 8 else pack_f16x4(r, o.rt == 'f16')};")
            continue
        whole = sh(o.arr, kx, x, True) if o.w > 1 and not o.k_fast else None
        if whole is not None and conv is None:
            out.append(f"{ii}{whole} = {r};")
            continue
        for j in range(o.w):
            v = f"{r}.{'xyzw'[j]}" if o.w > 1 else r
            kj = f"({kx} + {u(j)})" if o.k_fast and j else kx
            xj = f"({x} + {u(j)})" if not o.k_fast and j else x
            out.append(f"{ii}{sh(o.arr, kj, xj, False)} = {conv(v) if conv else v};")
    if o.part:
        out.append(f"{ii[:-4]}}}")


def _k_loop(c: _Ctx, L: list[str], ind: str, bk: int, edges: bool, live_check: bool, ops,
            sh, conv, compute) -> None:
    """The K loop with register prefetch: step k's tiles go from registers to workgroup
    memory, then step k + bk's global loads are issued before computing on step k, so their
    latency hides behind the arithmetic.  Whole steps load unguarded along K; the K tail (K
    not a multiple of bk) is zero-filled; edge tiles check rows/columns, interior ones not."""
    i2, i3 = ind + "    ", ind + "        "
    kf, K = c.K - c.K % bk, c.K

    def load(ii: str, check_k: bool) -> None:
        if edges:
            L.append(f"{ii}if (interior) {{")
            for o in ops:
                _load_items(c, L, ii + "    ", o, False, check_k, live_check)
            L.append(f"{ii}}} else {{")
            for o in ops:
                _load_items(c, L, ii + "    ", o, True, check_k, live_check)
            L.append(f"{ii}}}")
        else:
            for o in ops:
                _load_items(c, L, ii, o, False, check_k, live_check)

    L += [f"{ind}{{", f"{i2}let kb = 0u;"]
    load(i2, kf == 0)
    L.append(f"{ind}}}")
    ks = -(-K // bk) * bk
    L.append(f"{ind}for (var k0: u32 = 0u; k0 < {u(ks)}; k0 = k0 + {u(bk)}) {{")
    for o in ops:
        _store_items(L, i2, o, sh, conv)
    L += [f"{i2}workgroupBarrier();", f"{i2}let kb = k0 + {u(bk)};"]
    if kf > bk:
        L.append(f"{i2}if (kb < {u(kf)}) {{")
        load(i3, False)
        L.append(f"{i2}}}")
    if kf != K:
        L.append(f"{i2}if (kb == {u(kf)}) {{")
        load(i3, True)
        L.append(f"{i2}}}")
    compute(L, i2)
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")


def _operands(c: _Ctx, L: list[str], ind: str, TM: int, TN: int, bk: int, nthreads: int,
              vec: bool, f16_vec: bool = False, rt16: bool = False, wide: bool = False,
              sets: str = "r", interleave: tuple[str, ...] = ()):
    """Both operands' staging plans, their per-invocation coordinates and registers (one
    set per letter of ``sets``); the operands named in ``interleave`` ("a", "b") stage their
    rows interleaved (``_Operand.interleave_rows``)."""
    ops = [_Operand(c, w, T, bk, nthreads, vec, f16_vec, rt16, wide)
           for w, T in (("a", TM), ("b", TN))]
    for o in ops:
        if o.which in interleave:
            o.interleave_rows()
        if o.items > nthreads and o.items % nthreads:
            raise CodegenError(f"kernel {c.name!r}: a {o.T}x{bk} tile does not split over "
                               f"{nthreads} invocations")
        o.coords(L, ind, nthreads)
        t = f"vec4<{o.rt}>" if o.w > 1 else c.acc_t.wgsl
        L += [f"{ind}var {o.p}{reg}{l}: {t};" for reg in sets for l in range(o.n)]
    return ops


def _tiled_compute(c: _Ctx, out: list[str], ii: str, g: Cfg, sa: int, sb: int) -> None:
    """c_ij += A·B over the staged K step: RM x RN results per invocation, rows ty·RM + i
    (``vr``: read as vec4) or ty + TY·i (scalar reads, conflict-free)."""
    RM, RN, TY, TX, jj = g.rm, g.rn, g.tm // g.rm, g.tn // g.rn, ii + "    "
    if g.ks > 1:  # slice sl computes its BK rows of the staged ks·BK step
        out.append(f"{ii}for (var kq: u32 = 0u; kq < {u(g.bk)}; kq = kq + 1u) {{")
        out.append(f"{jj}let kk = sl * {u(g.bk)} + kq;")
    else:
        out.append(f"{ii}for (var kk: u32 = 0u; kk < {u(g.bk)}; kk = kk + 1u) {{")
    if g.vr:
        for q in range(RM // 4):
            out.append(f"{jj}let a4{q} = As[kk * {u(sa // 4)} + ty * {u(RM // 4)} + {u(q)}];")
        for q in range(RN // 4):
            out.append(f"{jj}let b4{q} = Bs[kk * {u(sb // 4)} + tx * {u(RN // 4)} + {u(q)}];")
        out += [f"{jj}let a{i} = a4{i // 4}.{'xyzw'[i % 4]};" for i in range(RM)]
        out += [f"{jj}let b{j} = b4{j // 4}.{'xyzw'[j % 4]};" for j in range(RN)]
    else:
        out += [f"{jj}let a{i} = As[kk * {u(sa)} + ty + {u(TY * i)}];" for i in range(RM)]
        out += [f"{jj}let b{j} = Bs[kk * {u(sb)} + tx + {u(TX * j)}];" for j in range(RN)]
    for i in range(RM):
        for j in range(RN):
            out.append(f"{jj}c{i}_{j} = {_fma(c.acc_t, f'a{i}', f'b{j}', f'c{i}_{j}')};")
    out.append(f"{ii}}}")


def _tiled_stores(c: _Ctx, out: list[str], ii: str, g: Cfg, checks, helpers) -> None:
    """Epilogue and store of every result; ``checks`` (row and column bounds) guard them."""
    for i in range(g.rm):
        for j in range(g.rn):
            conds = [x for x, ok in ((f"r{i} < {u(c.M)}", checks[0]),
                                     (f"n{j} < {u(c.N)}", checks[1])) if ok]
            if conds:
                out.append(f"{ii}if ({' && '.join(conds)}) {{")
                c.store(out, ii + "    ", "bi", f"r{i}", f"n{j}", f"c{i}_{j}", helpers)
                out.append(f"{ii}}}")
            else:
                c.store(out, ii, "bi", f"r{i}", f"n{j}", f"c{i}_{j}", helpers)


def _tiled(c: _Ctx, t, g: Cfg):
    """Register-blocked f32 tile (config ``g``): operands staged through padded workgroup
    memory (row stride +4/+1 where the staging writes walk K, so they spread over banks)."""
    TX, TY = g.tn // g.rn, g.tm // g.rm
    nthreads, acc, bk = TX * TY * g.ks, c.acc_t.wgsl, g.bk * g.ks  # bk: the staged K step
    ind, i2 = "    ", "        "
    L: list[str] = []
    li = "li" if g.ks > 1 else "lid"
    if g.ks > 1:
        L += [f"{ind}let sl = lid / {u(TX * TY)};", f"{ind}let li = lid % {u(TX * TY)};"]
    L += [f"{ind}let tx = {li} % {u(TX)};", f"{ind}let ty = {li} / {u(TX)};"]
    grid, live_check, full_m, full_n = _tile_start(c, t, g.tm, g.tn, L, ind)
    edges = not (full_m and full_n) or live_check
    L += [f"{ind}var c{i}_{j}: {acc} = {acc}(0);" for i in range(g.rm) for j in range(g.rn)]
    ops = _operands(c, L, ind, g.tm, g.tn, bk, nthreads, bool(g.vl))
    pad = [(4 if g.vr else 1) if o.k_fast else 0 for o in ops]
    sa, sb = g.tm + pad[0], g.tn + pad[1]

    def sh(arr: str, k: str, x: str, vec: bool):
        s = sa if arr == "As" else sb
        if not g.vr:
            return None if vec else f"{arr}[({k}) * {u(s)} + {x}]"
        if vec:
            return f"{arr}[({k}) * {u(s // 4)} + ({x}) / 4u]"
        return f"{arr}[({k}) * {u(s // 4)} + ({x}) / 4u][({x}) % 4u]"

    _k_loop(c, L, ind, bk, edges, live_check, ops, sh, None,
            lambda out, ii: _tiled_compute(c, out, ii, g, sa, sb))
    red = _slice_sum(L, ind, g, acc)
    helpers: set[str] = set()
    for i in range(g.rm):
        L.append(f"{ind}let r{i} = row0 + "
                 f"{f'ty * {u(g.rm)} + {u(i)}' if g.vr else f'ty + {u(TY * i)}'};")
    for j in range(g.rn):
        L.append(f"{ind}let n{j} = col0 + "
                 f"{f'tx * {u(g.rn)} + {u(j)}' if g.vr else f'tx + {u(TX * j)}'};")
    j0 = ind
    if g.ks > 1:  # slice 0 holds the sums: it alone stores
        L.append(f"{ind}if (sl == 0u) {{")
        ind, i2 = i2, i2 + "    "
    if edges and _calls_helpers(c.k):
        L.append(f"{ind}if ({'live' if live_check else 'true'}) {{")
        _tiled_stores(c, L, i2, g, (not full_m, not full_n), helpers)
        L.append(f"{ind}}}")
    elif edges:
        L.append(f"{ind}if (interior) {{")
        _tiled_stores(c, L, i2, g, (False, False), helpers)
        L.append(f"{ind}}} else if ({'live' if live_check else 'true'}) {{")
        _tiled_stores(c, L, i2, g, (not full_m, not full_n), helpers)
        L.append(f"{ind}}}")
    else:
        _tiled_stores(c, L, ind, g, (False, False), helpers)
    if g.ks > 1:
        L.append(f"{j0}}}")
    et, div = (f"vec4<{acc}>", 4) if g.vr else (acc, 1)
    shared = ([f"var<workgroup> As: array<{et}, {bk * sa // div}>;",
               f"var<workgroup> Bs: array<{et}, {bk * sb // div}>;"] + red[0],
              4 * bk * (sa + sb) + red[1])
    return L, shared, nthreads, grid, helpers, ops


def _calls_helpers(k: MatmulKernel) -> bool:
    """Whether the epilogue calls a WGSL helper function and ``ONE_STORE_PATH_FOR_HELPERS``
    asks for one (checked) copy of it."""
    return ONE_STORE_PATH_FOR_HELPERS and any(ins.helpers or "mn_" in ins.expr
                                              for ins in k.epilogue)


def _slice_sum(L: list[str], ind: str, g: Cfg, acc: str) -> tuple[list[str], int]:
    """K slices (``ks`` > 1): slices 1.. put their partial sums in workgroup memory, slice 0
    adds them in slice order (a fixed order per output, like split-K's sum).  In rounds of
    ``q`` results per invocation, so the exchange buffer stays within ``SLICE_SUM_BYTES`` (the
    staging tiles plus it fit lavapipe's 32 KiB).  Returns its declaration and bytes."""
    if g.ks == 1:
        return [], 0
    T, R = (g.tm // g.rm) * (g.tn // g.rn), g.rm * g.rn
    q = max(d for d in range(1, R + 1) if R % d == 0 and
            (g.ks - 1) * T * d * 4 <= SLICE_SUM_BYTES or d == 1)
    regs = [f"c{i}_{j}" for i in range(g.rm) for j in range(g.rn)]
    for r0 in range(0, R, q):
        if r0:
            L.append(f"{ind}workgroupBarrier();")
        L.append(f"{ind}if (sl > 0u) {{")
        L += [f"{ind}    Cs[(sl - 1u) * {u(q * T)} + {u(x * T)} + li] = {regs[r0 + x]};"
              for x in range(q)]
        L += [f"{ind}}}", f"{ind}workgroupBarrier();", f"{ind}if (sl == 0u) {{"]
        L += [f"{ind}    {regs[r0 + x]} = {regs[r0 + x]} + Cs[{u((s - 1) * q * T + x * T)} + li];"
              for s in range(1, g.ks) for x in range(q)]
        L.append(f"{ind}}}")
    n = (g.ks - 1) * q * T
    return [f"var<workgroup> Cs: array<{acc}, {n}>;"], 4 * n


def _gemv_layout(c: _Ctx):
    """Which operand is the vector (S ≤ 4 rows or columns), the matrix's strides along the
    long dim P and K, and the invocations along P (tp) and K (tk)."""
    M, N, K = c.M, c.N, c.K
    _, sam, sak = c.sa
    _, sbk, sbn = c.sb
    if M <= N:
        # vector = rows of A (s = m), matrix = B indexed (p = n, k)
        lay = dict(S=M, P=N, vec="a", vst_s=sam, vst_k=sak, mat="b", mst_p=sbn, mst_k=sbk)
    else:
        lay = dict(S=N, P=M, vec="b", vst_s=sbn, vst_k=sbk, mat="a", mst_p=sam, mst_k=sak)
    k_fast = lay["mst_k"] == 1 and lay["mst_p"] != 1  # the matrix is contiguous along k
    if k_fast:
        tk = min(32, pow2ceil(K))
        tp = GEMV_THREADS // tk
    else:
        tp = min(32, pow2ceil(lay["P"]))
        tk = GEMV_THREADS // tp
    lay.update(k_fast=k_fast, tp=tp, tk=max(1, min(tk, pow2ceil(K))))
    return lay


def _gemv_loop(c: _Ctx, L: list[str], lay) -> None:
    """Each invocation folds its share of K (every tk-th element), GEMV_UNROLL matrix loads
    in flight while whole groups remain (same summation order)."""
    i2, i3 = "        ", "            "
    S, tk, K, mst_k = lay["S"], lay["tk"], c.K, lay["mst_k"]

    def step(kk: str, tag: str) -> tuple[list[str], list[str]]:
        midx = "mbase" + ("" if mst_k == 0 else " + " + index_code([kk], [mst_k]))
        ld = [f"{i3}let mv{tag} = {c.read(lay['mat'], midx)};"]
        fm = []
        for s in range(S):
            vidx = "vbase + " + index_code([u(s), kk], [lay["vst_s"], lay["vst_k"]])
            if vidx.endswith("+ 0u"):
                vidx = "vbase"
            fm.append(f"{i3}s{s} = "
                      f"{_fma(c.acc_t, c.read(lay['vec'], vidx), f'mv{tag}', f's{s}')};")
        return ld, fm

    L.append(f"{i2}var kk: u32 = kl;")
    if -(-K // tk) >= 2 * GEMV_UNROLL:
        L.append(f"{i2}for (; kk + {u((GEMV_UNROLL - 1) * tk)} < {u(K)}; "
                 f"kk = kk + {u(GEMV_UNROLL * tk)}) {{")
        loads, fmas = [], []
        for j in range(GEMV_UNROLL):
            ld, fm = step("kk" if j == 0 else f"(kk + {u(j * tk)})", str(j))
            loads += ld
            fmas += fm
        L += loads + fmas
        L.append(f"{i2}}}")
    L.append(f"{i2}for (; kk < {u(K)}; kk = kk + {u(tk)}) {{")
    ld, fm = step("kk", "")
    L += ld + fm
    L.append(f"{i2}}}")


def _gemv_tree(L: list[str], S: int, wg_size: int, tk: int, kstep: int) -> None:
    """Add the tk partial sums of each output in workgroup memory (a fixed tree)."""
    ind, i2 = "    ", "        "
    for s in range(S):
        L.append(f"{ind}red[{u(s * wg_size)} + lid] = s{s};")
    L.append(f"{ind}workgroupBarrier();")
    h = tk // 2
    while h >= 1:
        L.append(f"{ind}if (kl < {u(h)}) {{")
        for s in range(S):
            o = s * wg_size
            L.append(f"{i2}red[{u(o)} + lid] = red[{u(o)} + lid] + "
                     f"red[{u(o)} + lid + {u(h * kstep)}];")
        L.append(f"{ind}}}")
        L.append(f"{ind}workgroupBarrier();")
        h //= 2
    for s in range(S):
        L.append(f"{ind}s{s} = red[{u(s * wg_size)} + lid];")


def _gemv(c: _Ctx, t):
    """One of M, N is small (S ≤ 4): parallel over the long dim P and over K."""
    lay = _gemv_layout(c)
    S, P, vec, tp, tk = lay["S"], lay["P"], lay["vec"], lay["tp"], lay["tk"]
    wg_size = tp * tk
    pt = -(-P // tp)
    grid = make_grid(c.name, pt * c.B, t)
    acc = c.acc_t.wgsl
    ind, i2 = "    ", "        "
    L: list[str] = [f"{ind}let wg = {grid.wg_expr};", f"{ind}let tpi = wg % {u(pt)};",
                    f"{ind}let bi = wg / {u(pt)};"]
    if lay["k_fast"]:
        L += [f"{ind}let kl = lid % {u(tk)};", f"{ind}let pl = lid / {u(tk)};"]
        kstep = 1
    else:
        L += [f"{ind}let pl = lid % {u(tp)};", f"{ind}let kl = lid / {u(tp)};"]
        kstep = tp
    L.append(f"{ind}let p = tpi * {u(tp)} + pl;")
    L.append(f"{ind}let valid = p < {u(P)} && bi < {u(c.B)};")
    for s in range(S):
        L.append(f"{ind}var s{s}: {acc} = {acc}(0);")
    ops = {"a": (c.a, c.sa[0]), "b": (c.b, c.sb[0])}  # view, batch stride
    (vb, vsb), (mb, msb) = ops[vec], ops[lay["mat"]]
    L.append(f"{ind}if (valid) {{")
    L.append(f"{i2}let mbase = {index_code(['bi', 'p'], [msb, lay['mst_p']], mb.offset)};")
    L.append(f"{i2}let vbase = {index_code(['bi'], [vsb], vb.offset)};")
    _gemv_loop(c, L, lay)
    L.append(f"{ind}}}")
    if tk > 1:
        _gemv_tree(L, S, wg_size, tk, kstep)
    helpers: set[str] = set()
    L.append(f"{ind}if (valid && kl == 0u) {{")
    for s in range(S):
        row, col = (u(s), "p") if vec == "a" else ("p", u(s))
        c.store(L, i2, "bi", row, col, f"s{s}", helpers)
    L.append(f"{ind}}}")
    nbytes = S * wg_size * 4 if tk > 1 else 0
    shared = ([f"var<workgroup> red: array<{acc}, {S * wg_size}>;"] if tk > 1 else [], nbytes)
    return L, shared, wg_size, grid, helpers, f"gemv{'_t' if vec == 'b' else ''}"
