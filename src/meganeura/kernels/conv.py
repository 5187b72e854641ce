"""Convolution kernels (NCHW) as implicit GEMMs: forward (bias and an optional pointwise
epilogue fused), input gradient and weight gradient — one tiled kernel template, three ways of
addressing its operands.  No im2col buffer is built: each K step stages a BK-deep slice of both
GEMM operands into workgroup memory straight from the tensors (padding reads as zero), then
every invocation accumulates an RM×RN block of the output tile in registers.  The tile
configuration (``TileCfg``: TM×TN tile, RM×RN register block, KS-way in-workgroup split-K,
BK) is chosen from the GEMM's size so that small spatial sizes still give many workgroups
(``choose_cfg``); ``conv_candidates`` offers the tuner the others.  How a step is staged
(``TileCfg.ST``: per-element branches, or branch-free with every read of the step issued
before its stores, an im2col offset table instead of div/mod, vec4 loads) and whether the next
step is prefetched or double-buffered (``TileCfg.PF``) are part of the configuration; each
kernel's default is in ``STAGING`` (measured on the H200, docs/benchmarks.md).

The three GEMMs (per group ``g``; ``Og = O/groups``, ``Cg = C/groups``):

==============  =================  =====================  ======================
kernel          rows (M)           columns (N)            reduction (K)
==============  =================  =====================  ======================
forward         out channel o<Og   (n, oh, ow)            (c, i, j): Cg·kh·kw
input grad      in channel c<Cg    (n, h, w)              (o, i, j): Og·kh·kw
weight grad     out channel o<Og   (c, i, j)              (n, oh, ow) (one chunk)
==============  =================  =====================  ======================

Columns run over spatial positions (or the weight's contiguous inner axes), so neighbouring
invocations store to neighbouring addresses.  The input gradient of a strided convolution reads
``dy`` only where ``h + pad - i·dil`` is a multiple of the stride (the other GEMM terms are
zero).  The weight gradient reduces over ``N·OH·OW``; with ``split = S`` each workgroup sums one
of ``S`` consecutive chunks (``ceil(N·OH·OW / S)`` long) into its own slice of a
``(S, O, Cg, kh, kw)`` output, and an ordinary reduction adds them afterwards — deterministic,
no float atomics.  Interior K steps run without K bounds checks; one guarded step handles the
tail.  Operands are read through their strides (any 4-D view, broadcast allowed); f16 operands
accumulate in f32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..dtypes import DType, f32
from .archetypes import register
from .common import (
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
    i32_lit,
    load,
    make_grid,
    make_target,
    module_header,
    module_source,
    store_value,
    u,
    view4,
)
from .ir import Instr, KernelSpec, Strided

TILE_SIZES = (16, 32, 64)
# Elements of padding after each staged row in workgroup memory.  An operand staged along K
# (weights, and both weight-gradient operands) has neighbouring invocations write one column
# each, T elements apart: with T = 64 or 32 every one of them hit the same bank (16-way
# conflicts on every staging store).  T + 4 spreads them over 8 banks (2-way) and keeps rows
# 16-byte aligned for the vec4 reads.
SH_PAD = 4


@dataclass(frozen=True)
class ConvGeom:
    """Shapes of one convolution: input (n, c, h, w), weight (o, c/groups, kh, kw), output
    (n, o, oh, ow); ``pad`` is ((top, bottom), (left, right))."""

    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    oh: int
    ow: int
    stride: tuple[int, int] = (1, 1)
    pad: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def og(self) -> int:
        return self.o // self.groups

    def check(self, name: str) -> None:
        g = self.groups
        if g < 1 or self.c % g or self.o % g:
            raise CodegenError(f"kernel {name!r}: groups={g} must divide {self.c} and {self.o}")
        for ax, (size, k, s, p, d, out) in enumerate((
                (self.h, self.kh, self.stride[0], self.pad[0], self.dilation[0], self.oh),
                (self.w, self.kw, self.stride[1], self.pad[1], self.dilation[1], self.ow))):
            want = (size + p[0] + p[1] - d * (k - 1) - 1) // s + 1
            if want != out or out < 1:
                raise CodegenError(f"kernel {name!r}: output size {out} along spatial axis {ax} "
                                   f"should be {want} ({self})")


@dataclass(frozen=True)
class Conv2dKernel:
    """y[n, o, oh, ow] = Σ x·w (+ bias[o]) (+ epilogue).  ``epilogue`` instrs see ``("acc", 0)``
    (the convolution plus bias, in the operand dtype), earlier results ``("t", j)`` and
    ``("x", i)``: ``extra`` inputs read at the output element (Strided over (N, O, OH, OW),
    broadcasting allowed).  The stored value is the last epilogue instr.  Bindings: x, w,
    [bias], extra…, out (contiguous (N, O, OH, OW))."""

    geom: ConvGeom
    x: Strided
    w: Strided
    bias: Strided | None = None
    extra: tuple[Strided, ...] = ()
    epilogue: tuple[Instr, ...] = ()
    out_dtype: DType | None = None
    tile: tuple[int, ...] = ()  # force (TM, TN)
    name: str = "conv2d"
    # > 1: a global split-K.  The kernel writes ``split_k`` partial sums over consecutive
    # chunks of K to a contiguous (split_k, N, O, OH, OW) output (bias in chunk 0, no
    # epilogue); the schedule adds them in order (and runs any epilogue there).
    split_k: int = 1


@dataclass(frozen=True)
class Conv2dInputGradKernel:
    """dx[n, c, h, w] of conv2d given dy (N, O, OH, OW) and w.  Bindings: dy, w, dx."""

    geom: ConvGeom
    dy: Strided
    w: Strided
    out_dtype: DType | None = None
    tile: tuple[int, ...] = ()
    name: str = "conv2d_dgrad"
    naive: bool = False  # strided convs: one GEMM over all taps (no phase decomposition)
    split_k: int = 1  # > 1: partial sums to a (split_k, N, C, H, W) output, as Conv2dKernel


@dataclass(frozen=True)
class Conv2dWeightGradKernel:
    """dw[(s,) o, c, i, j] of conv2d given x and dy; ``split`` partial sums over consecutive
    chunks of the (n, oh, ow) range.  Bindings: x, dy, dw."""

    geom: ConvGeom
    x: Strided
    dy: Strided
    split: int = 1
    out_dtype: DType | None = None
    tile: tuple[int, ...] = ()
    name: str = "conv2d_wgrad"


def conv2d_with_epilogue(desc: Conv2dKernel, extra: tuple[Strided, ...],
                         epilogue: tuple[Instr, ...], out_dtype: DType) -> Conv2dKernel:
    """The planner's hook for epilogue fusion: ``desc`` computing ``epilogue`` on its result
    (a ReLU/SiLU/residual add after the convolution) in the same kernel."""
    return Conv2dKernel(desc.geom, desc.x, desc.w, desc.bias, tuple(extra), tuple(epilogue),
                        out_dtype, desc.tile, name="conv2d_ep", split_k=desc.split_k)


# ---------------------------------------------------------------------------------------------
# small WGSL helpers


def _lin(terms, offset: int | str = 0) -> str:
    """``offset + Σ expr·stride`` (u32), skipping zero strides and literal-zero coordinates."""
    out = []
    if isinstance(offset, str):
        out.append(offset)
    elif offset:
        out.append(u(offset))
    for e, st in terms:
        if st == 0 or e == "0u":
            continue
        out.append(e if st == 1 else f"{e} * {u(st)}")
    return " + ".join(out) if out else "0u"


def _split3(k: str, inner: tuple[int, int], p: str, lines: list[str], ind: str):
    """Coordinates (a, b, c) of ``k`` over a row-major (·, B, C) box: WGSL expressions."""
    bb, cc = inner
    if bb * cc == 1:
        return k, "0u", "0u"
    if cc == 1:
        lines.append(f"{ind}let {p}a = {k} / {u(bb)};")
        lines.append(f"{ind}let {p}b = {k} % {u(bb)};")
        return f"{p}a", f"{p}b", "0u"
    if bb == 1:
        lines.append(f"{ind}let {p}a = {k} / {u(cc)};")
        lines.append(f"{ind}let {p}c = {k} % {u(cc)};")
        return f"{p}a", "0u", f"{p}c"
    lines.append(f"{ind}let {p}a = {k} / {u(bb * cc)};")
    lines.append(f"{ind}let {p}r = {k} % {u(bb * cc)};")
    lines.append(f"{ind}let {p}b = {p}r / {u(cc)};")
    lines.append(f"{ind}let {p}c = {p}r % {u(cc)};")
    return f"{p}a", f"{p}b", f"{p}c"


def _mul(e: str, k: int) -> str:
    if e == "0u" or k == 0:
        return "0u"
    return e if k == 1 else f"{e} * {u(k)}"


def _spatial(base: str, e: str, k: int, sign: str, p: str, lines, ind) -> str:
    """i32 coordinate ``base sign e·k`` as a new let; returns its name."""
    m = _mul(e, k)
    if m == "0u":
        return base
    lines.append(f"{ind}let {p} = {base} {sign} i32({m});")
    return p


def _read(binding: str, idx: str, dt: DType) -> str:
    v = load(binding, idx, dt)
    return v if dt is f32 else f"f32({v})"


# ---------------------------------------------------------------------------------------------
# the implicit-GEMM template


@dataclass
class _Operand:
    """One GEMM operand: ``hoist(r, tag, lines, ind)`` emits what depends only on the staged
    row/column ``r`` (a u32 expression, maybe out of range) and defines ``ok{tag}`` (its
    validity); ``load(k, tag, lines, ind) -> (extra condition or "", index)`` addresses element
    (r, k).  ``k_fast``: neighbouring invocations walk k when staging (else r)."""

    binding: str
    dtype: DType
    k_fast: bool
    hoist: Callable
    load: Callable
    # names (before the tag) ``hoist`` defines: with ST >= 1, staging rounds that stage the
    # same row/column as round 0 alias round 0's lets instead of recomputing them
    hoisted: tuple[str, ...] = ()
    table: _OffsetTable | None = None  # ST >= 2: K index -> offset entry, one per workgroup
    # ST >= 3: ``quad(k, tag, lines, ind) -> (condition, vec4 index)`` of the four elements
    # (r, k..k+3) (k_fast) or (r..r+3, k) starting at a multiple of 4, all valid or none
    quad: Callable | None = None
    # ST = 4, columns staged four at a time from scalar loads (one vec4 store), the work the
    # four share done once: ``gather(k, tag, column tags, lines, ind) -> [(condition, index)]``
    # per column (without it: ``load`` per column)
    gather: Callable | None = None


@dataclass
class _OffsetTable:
    """A K-indexed u32 table in workgroup memory (``Kt``), filled once per workgroup for the
    K range it reduces (``length`` entries from ``kbeg``): ``entry(k, lines, ind)`` emits the
    lets for K index ``k`` and returns the entry expression.  The operand's table-mode ``load``
    reads ``Kt[k - kbeg]`` — one workgroup-memory read instead of the div/mod chain that
    splits k into (channel, tap) for every staged element."""

    length: int
    entry: Callable


@dataclass
class _Gemm:
    name: str
    M: int
    N: int
    K: int | None  # None: the K range comes from kbeg/kend lines (split chunks)
    GB: int  # independent GEMMs (groups × splits)
    tile: TileCfg
    A: _Operand
    B: _Operand
    gb_lines: Callable  # (lines, ind) -> decompose ``gb`` into the kernel's own indices
    krange: Callable | None  # (lines, ind) -> defines kbeg, kend (runtime, uniform)
    store: Callable  # (lines, ind, r, col, acc, helpers)
    # Runtime (workgroup-uniform) column count, a WGSL expression defined by gb_lines; ``N`` is
    # then its maximum (for the grid).
    n_bound: str | None = None


@dataclass(frozen=True)
class TileCfg:
    """One configuration of the GEMM template: a TM×TN output tile per workgroup; each
    invocation accumulates RM×RN results (contiguous rows and columns) over one of KS slices of
    every staged K step (KS·BK deep), so (TM/RM)·(TN/RN)·KS invocations per workgroup.  KS > 1
    is an in-workgroup split-K: the KS partial tiles are added in workgroup memory in a fixed
    order (deterministic) and stored by all invocations, neighbours on neighbouring columns."""

    TM: int
    TN: int
    RM: int
    RN: int
    KS: int = 1
    BK: int = 16
    # 1: register prefetch (the next step's loads issued before this step's FMAs); 2: and two
    # staging buffers used in turn, so one barrier per K step instead of two
    PF: int = 0
    # Staging code: 0 reads each element under a branch and stores it at once; 1 reads every
    # element of the step first, branch-free (a load at a clamped index, the value selected),
    # then stores them all; 2 as 1, plus the forward's im2col offsets from a per-workgroup
    # table (``_OffsetTable``) instead of div/mod per element (other kernels: as 1); 3 as 2,
    # plus vec4 loads of four K-consecutive weights and, for 1×1 stride-1 forwards, of four
    # consecutive input columns (one vec4 store to workgroup memory) where aligned
    # (``_Operand.quad``); 4 as 3, plus other columns staged four at a time (scalar loads, one
    # vec4 store; table-read ones share one table read: ``_Operand.gather``).
    ST: int = 0

    @property
    def slice_threads(self) -> int:
        return (self.TM // self.RM) * (self.TN // self.RN)

    @property
    def threads(self) -> int:
        return self.slice_threads * self.KS

    @property
    def vec(self) -> bool:
        """Workgroup memory as vec4 (4-wide reads of both operands)."""
        return self.RM % 4 == 0 and self.RN % 4 == 0

    def storage(self) -> int:
        """Bytes of workgroup memory: the staged K step (rows padded by SH_PAD), or the
        partial tiles if larger."""
        red = self.KS * self.TM * self.TN if self.KS > 1 else 0
        return 4 * max(self.stage_elems() * (2 if self.PF == 2 else 1), red)

    def stage_elems(self) -> int:
        """f32 elements of one staged K step (both operands, rows padded)."""
        return self.BK * self.KS * (self.TM + self.TN + 2 * SH_PAD)

    def tuple(self) -> tuple[int, ...]:
        base = (self.TM, self.TN, self.RM, self.RN, self.KS, self.BK)
        if self.ST:
            return base + (self.PF, self.ST)
        return base + (1,) if self.PF else base


def _legacy(tm: int, tn: int) -> TileCfg:
    """A (TM, TN) pair of the first template: 256 invocations, 8 or 16 invocation rows."""
    ty = 8 if tm == 8 else 16
    return TileCfg(tm, tn, tm // ty, tn // (256 // ty))


# (TM, TN) pairs accepted as ``tile`` (the first template's shapes)
TILES = {(8, 32), (8, 64), (8, 128)} | {(tm, tn) for tm in TILE_SIZES for tn in TILE_SIZES}


def tile_cfg(forced) -> TileCfg:
    """The TileCfg of a description's ``tile`` field: a (TM, TN) pair from ``TILES`` or a full
    (TM, TN, RM, RN, KS, BK) tuple."""
    forced = tuple(forced)
    if len(forced) == 2 and forced in TILES:
        return _legacy(*forced)
    if len(forced) in (6, 7, 8):
        c = TileCfg(*(int(v) for v in forced))
        ok = all(v >= 1 for v in forced[:6]) and c.TM % c.RM == 0 and c.TN % c.RN == 0
        ok = ok and c.PF in (0, 1, 2) and c.ST in (0, 1, 2, 3, 4)
        if ok and c.threads <= 1024 and c.BK % 4 == 0:
            return c
    raise CodegenError(f"conv tile must be a (TM, TN) pair from {sorted(TILES)} or a valid "
                       f"(TM, TN, RM, RN, KS, BK[, PF[, ST]]) tuple, got {forced}")


def _units(c: TileCfg, M: int, N: int, GB: int) -> int:
    return -(-M // c.TM) * -(-N // c.TN) * GB


# The heuristic's ladder, most efficient per invocation first: the first whose grid has
# enough workgroups wins; small problems take in-workgroup split-K instead.
_LADDER = (TileCfg(64, 64, 4, 4), TileCfg(32, 64, 4, 4, 2), TileCfg(64, 32, 4, 4, 2),
           TileCfg(32, 32, 4, 4, 4, 8))
_SMALL = (TileCfg(32, 32, 4, 4, 4, 8), TileCfg(16, 32, 4, 4, 8, 8), TileCfg(16, 16, 4, 4, 16, 4))
_FEW_ROWS = (TileCfg(8, 64, 2, 4, 4, 8), TileCfg(8, 32, 1, 4, 4, 8))
# (64, 64, 8, 8) blocks (64 or 128 invocations) measured 3-5x slower than every other
# configuration on the H200 (855 µs vs 151-233 µs at (4,256,14,14)): not offered
_EXTRA = (TileCfg(32, 32, 4, 4, 2),)
CONFIGS = tuple(dict.fromkeys(_LADDER + _SMALL + _FEW_ROWS + _EXTRA))  # all the tuner tries
# workgroups each ladder step needs (H200, bench/conv_bench.py: 64×64 tiles won from ~100
# workgroups up, e.g. the 1×1 input gradient at (4,1024,14,14): 36 µs vs 52 µs with 32×64)
_LADDER_FILL = (96, 192, 192, 256)
FILL = 256  # workgroups wanted (about two per SM of a large GPU; shapes only, plans portable)


def choose_cfg(M: int, N: int, K: int, GB: int, forced=(), st: int = 0,
               pf: int = 0, bkx: int = 1) -> TileCfg:
    """The tile configuration for an M×N×K GEMM repeated GB times (``forced``: the
    description's ``tile``; ``st``, ``pf``: the default's staging mode and prefetch, ``bkx``
    its K step factor for tiles without in-workgroup split).  Big grids take 64×64 tiles;
    grids too small to fill the GPU take smaller tiles, then in-workgroup split-K while each
    slice keeps ≥ 4 K steps."""
    if forced:
        return tile_cfg(forced)
    c = _choose_tile(M, N, K, GB)
    return dataclasses.replace(c, ST=st, PF=pf, BK=c.BK * (bkx if c.KS == 1 else 1))


def _heuristic(k, M: int, N: int, K: int, GB: int, t) -> TileCfg:
    """The configuration emitted for ``k``: its forced tile, or the heuristic's with the
    kernel's defaults (``staging``); single-buffered, then with the base K step, where the
    device's workgroup memory does not hold them (WebGPU guarantees only 16 KiB)."""
    c = choose_cfg(M, N, K, GB, k.tile, *staging(k))
    room = t.lim("max_compute_workgroup_storage_size")
    if not k.tile and c.PF == 2 and c.storage() > room:
        c = dataclasses.replace(c, PF=1)
    if not k.tile and c.storage() > room:
        c = dataclasses.replace(c, BK=_choose_tile(M, N, K, GB).BK)
    return c


def _choose_tile(M: int, N: int, K: int, GB: int) -> TileCfg:
    if M <= 8:
        cands = [c for c in _FEW_ROWS if K >= 4 * c.BK * c.KS] + [_legacy(8, 32)]
        return cands[0] if _units(_legacy(8, 64), M, N, GB) < FILL else _legacy(8, 64)
    for c, fill in zip(_LADDER, _LADDER_FILL, strict=True):
        if _units(c, M, N, GB) >= fill:
            return c
    for c in _SMALL:
        if K >= 4 * c.BK * c.KS and _units(c, M, N, GB) * c.KS >= 4 * FILL:
            return c
    fits = [c for c in _SMALL if K >= 4 * c.BK * c.KS]
    return fits[-1] if fits else _LADDER[-1]


# Global split-K (forward and input gradient; the weight gradient splits in the graph, see
# ops/conv.py weight_grad_split): a GEMM with fewer 64×64 tiles than SPLIT_K_FEW and K ≥ 2
# chunks is cut into K chunks of about SPLIT_K_CHUNK.  Fitted to the split sweep of
# `CONV_ALL=1 bench/conv_bench.py dawn` (H200, 2026-12-01; docs/benchmarks.md): the best split
# kept chunks of 128–384 at every ResNet-50 shape (3×3 at 7×7: 16 chunks, 215 → 72 µs), and
# K = 256 lost when split (1×1 256→1024: 66 µs unsplit, 107 split in two).
SPLIT_K_FEW = 256
SPLIT_K_CHUNK = 256
SPLIT_K_MAX = 16


def split_chunk(K: int, S: int) -> int:
    """K per chunk of an S-way split: ceil(K / S) rounded up to a multiple of 16 (whole K
    steps of every configuration but the last chunk)."""
    if S <= 1:
        return K
    per = -(-K // S)
    return -(-per // 16) * 16


# 1×1 forwards (vec4 staging, K step 32) take chunks of 512: `CONV_ST=1 bench/conv_bench.py
# dawn` (H200, 2026-12-01, docs/benchmarks.md "conv staging"): K = 512 unsplit 27–69 µs
# against 31–87 µs in two chunks plus the sum kernel; K = 1024 in two chunks as fast as in four
SPLIT_K_CHUNK_1X1 = 512


def choose_split_k(M: int, N: int, K: int, GB: int, chunk: int = SPLIT_K_CHUNK) -> int:
    """How many K chunks (partial sums the schedule adds) a conv GEMM is cut into: 1 unless
    its 64×64 tiles cannot fill a large GPU and K holds two chunks of about ``chunk``; every
    chunk non-empty.  Shapes only, so plans stay portable."""
    tiles = -(-M // 64) * -(-N // 64) * GB
    if M <= 8 or tiles >= SPLIT_K_FEW:
        return 1
    s = min(K // chunk, SPLIT_K_MAX)
    if s <= 1:
        return 1
    return -(-K // split_chunk(K, s))


def _check_split(name: str, S) -> int:
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise CodegenError(f"kernel {name!r}: split_k must be an int >= 1, got {S!r}")
    return S


# Default staging mode (``TileCfg.ST``) per kernel: see docs/benchmarks.md (conv staging).
# `CONV_ST=1 bench/conv_bench.py dawn` (H200, 2026-12-01; docs/benchmarks.md "conv staging"):
# ResNet-50's conv-path forwards 2,168 → 1,632 µs per inference step with ST 4 (1×1 at 14×14
# 55 → 34 µs), the gradients (input ST 4, weight ST 1) 2,464 → 1,995 µs over 16 problems.
# The weight gradient's operands are both staged along K, where ST 4 stages as ST 1.
STAGING = {"conv2d": (4, 0), "conv2d_input_grad": (4, 0), "conv2d_weight_grad": (1, 0)}
# 1×1 forwards: K step 32 (BK × 2) — 5–15 % faster at every measured 1×1 shape (same bench)
POINTWISE_BKX = 2


def staging(k) -> tuple[int, int, int]:
    """The heuristic's (staging mode ``ST``, prefetch ``PF``, K step factor) for conv
    description ``k``."""
    if isinstance(k, Conv2dKernel):
        pointwise = (k.geom.kh, k.geom.kw) == (1, 1)
        return STAGING["conv2d"] + ((POINTWISE_BKX if pointwise else 1),)
    if isinstance(k, Conv2dInputGradKernel):
        return STAGING["conv2d_input_grad"] + (1,)
    return STAGING["conv2d_weight_grad"] + (1,)


def _candidate_cfgs(M: int, N: int, K: int, GB: int, st: int = 0, pf: int = 0,
                    bkx: int = 1) -> list[TileCfg]:
    """Configurations worth timing for one GEMM shape (the heuristic's first, then it with
    the other staging modes, with prefetch and with double buffering)."""
    first = choose_cfg(M, N, K, GB, st=st, pf=pf, bkx=bkx)
    modes = [dataclasses.replace(first, ST=m) for m in (4, 3, 2, 1, 0) if m != st]
    rest = [dataclasses.replace(c, ST=st, PF=pf) for c in (
        *(_FEW_ROWS if M <= 8 else ()), *_LADDER, *_SMALL, *_EXTRA)]
    allc = [first, *modes[:1], *(dataclasses.replace(first, PF=p) for p in (0, 1, 2) if p != pf),
            *modes[1:], *rest]
    out = []
    for c in allc:
        if c not in out and (c.KS == 1 or K >= 2 * c.BK * c.KS):
            out.append(c)
    return out[:8]


class _Item(NamedTuple):
    """One staging round of one operand: ``q`` elements per invocation (1, or 4 read as one
    vec4), at staged row/column ``rn`` and K offset ``kn`` (WGSL names)."""

    which: str
    l: int
    rn: str
    kn: str
    op: _Operand
    T: int
    partial: bool
    n_el: int
    q: int


class _GemmGen:
    """The implicit-GEMM kernel of ``gm`` in steps: tile head, hoisted staging maps, K steps
    (stage both operands, multiply-accumulate from workgroup memory), K loop, stores."""

    def __init__(self, gm: _Gemm, t):
        self.gm = gm
        c = self.cfg = gm.tile
        self.TM, self.TN, self.RM, self.RN = c.TM, c.TN, c.RM, c.RN
        self.nth, self.nts = c.threads, c.slice_threads
        self.TX = self.TN // self.RN
        self.BKs = c.BK * c.KS  # staged per barrier
        self.mt, self.nt = -(-gm.M // self.TM), -(-gm.N // self.TN)
        self.grid = make_grid(gm.name, self.mt * self.nt * gm.GB, t)
        self.live = "" if self.grid.exact else "live"
        self.vec = c.vec
        self.offb = self.BKs * (self.TM + SH_PAD)  # Bs after As (in f32 elements)
        # PF = 2: the staging buffer in use starts at ``sbo`` (Sh index units)
        self.sb = "sbo + " if c.PF == 2 else ""
        self.bf = c.ST >= 1  # branch-free staging, all reads of a step before its stores
        tabs = [op.table for op in (gm.A, gm.B) if op.table is not None] if c.ST >= 2 else []
        self.table = tabs[0] if tabs else None
        self.tab_len = -(-self.table.length // self.BKs) * self.BKs if self.table else 0

    def head(self, L: list[str], ind: str) -> None:
        gm = self.gm
        L.append(f"{ind}let wg = {self.grid.wg_expr};")
        L.append(f"{ind}let tn = wg % {u(self.nt)};")
        L.append(f"{ind}let tq = wg / {u(self.nt)};")
        L.append(f"{ind}let tm = tq % {u(self.mt)};")
        L.append(f"{ind}let gb = tq / {u(self.mt)};")
        if self.live:
            L.append(f"{ind}let live = gb < {u(gm.GB)};")
            L.append(f"{ind}let gbc = min(gb, {u(gm.GB - 1)});")
        else:
            L.append(f"{ind}let gbc = gb;")
        gm.gb_lines(L, ind)
        L.append(f"{ind}let ls = lid % {u(self.nts)};")
        L.append(f"{ind}let kb = (lid / {u(self.nts)}) * {u(self.cfg.BK)};")
        L.append(f"{ind}let tx = ls % {u(self.TX)};")
        L.append(f"{ind}let ty = ls / {u(self.TX)};")
        L.append(f"{ind}let row0 = tm * {u(self.TM)};")
        L.append(f"{ind}let col0 = tn * {u(self.TN)};")

    def staging_maps(self, L: list[str], ind: str) -> None:
        """What staging needs that is independent of k0, hoisted: each invocation's staged
        rows/columns (and the operand's lets depending on them only) and their validity."""
        gm, nth, BKs = self.gm, self.nth, self.BKs
        self.plan = []
        for which, op, T, lim in (("a", gm.A, self.TM, u(gm.M)),
                                  ("b", gm.B, self.TN, gm.n_bound or u(gm.N))):
            q = 4 if self.quads(op, T) else 1  # elements per staged item
            n_el = T * BKs // q
            for l in range(-(-n_el // nth)):
                e = f"(lid + {u(l * nth)})" if l else "lid"
                rn, kn = f"s{which}r{l}", f"s{which}k{l}"
                if op.k_fast:
                    L.append(f"{ind}let {kn} = {_mul(f'({e} % {u(BKs // q)})', q)};")
                    L.append(f"{ind}let {rn} = {e} / {u(BKs // q)};")
                else:
                    L.append(f"{ind}let {rn} = {_mul(f'({e} % {u(T // q)})', q)};")
                    L.append(f"{ind}let {kn} = {e} / {u(T // q)};")
                tag = f"{which}{l}"
                # a gathered quad: four columns, each with its own hoisted lets
                cols = [(f"{tag}c{i}", f" + {u(i)}") for i in range(4)] if (
                    q == 4 and op.quad is None) else [(tag, "")]
                for ctag, plus in cols:
                    if l and self.bf and op.hoisted and not op.k_fast and \
                            (l * nth) % (T // q) == 0:
                        # this round stages round 0's columns: reuse its lets
                        first = ctag.replace(tag, f"{which}0", 1)
                        for nm in ("g", *op.hoisted, "ok"):
                            L.append(f"{ind}let {nm}{ctag} = {nm}{first};")
                        continue
                    base = "row0" if which == "a" else "col0"
                    L.append(f"{ind}let g{ctag} = {base} + {rn}{plus};")
                    op.hoist(f"g{ctag}", ctag, L, ind)
                    live = " && live" if self.live else ""
                    L.append(f"{ind}let ok{ctag} = g{ctag} < {lim}{live};")
                partial = (l + 1) * nth > n_el  # the last round stages fewer elements
                self.plan.append(_Item(which, l, rn, kn, op, T, partial, n_el, q))

    def quads(self, op: _Operand, T: int) -> bool:
        """Whether ``op`` is staged four elements per item (ST >= 3: vec4 loads; ST = 4 also
        four gathered columns)."""
        if self.cfg.ST < 3:
            return False
        if op.k_fast:
            return op.quad is not None
        return (op.quad is not None or self.cfg.ST == 4) and T % 4 == 0 and self.vec

    def _sh(self, off: int, T: int, k: str, x: str) -> str:
        """Workgroup-memory element (k, x) of a staged operand at f32 offset ``off`` (rows of
        T + SH_PAD elements)."""
        if self.vec:
            return (f"Sh[{self.sb}{u(off // 4)} + {k} * {u((T + SH_PAD) // 4)} + {x} / 4u]"
                    f"[{x} % 4u]")
        return f"Sh[{self.sb}{u(off)} + {k} * {u(T + SH_PAD)} + {x}]"

    def _read_element(self, out: list[str], jj: str, tag: str, k_expr: str, op,
                      check_k: bool, kend: str, declare: bool, extra: str = "",
                      q: int = 1) -> None:
        """``v<tag>`` = the operand element at K index ``k_expr`` (zero outside the tile, the
        K range or the padding); ``declare``: as a new ``var`` (else an existing register).
        Branch-free (ST >= 1): every load is issued (at index 0 where the element is outside)
        and the value selected, so the compiler can put all loads of a step in flight at
        once; ``extra``: one more condition (a partial staging round); ``q`` = 4: the vec4
        of four elements (``_Operand.quad``)."""
        kv = f"k{tag}"
        out.append(f"{jj}let {kv} = {k_expr};")
        if q == 4 and op.quad is None:
            return self._gather(out, jj, tag, kv, op, check_k, kend, declare, extra)
        cond, idx = (op.quad if q == 4 else op.load)(kv, tag, out, jj)
        conds = [f"ok{tag}"] + ([f"{kv} < {kend}"] if check_k else []) + (
            cond.split(" && ") if cond else []) + ([extra] if extra else [])
        if self.bf:
            out.append(f"{jj}let cnd{tag} = {' & '.join(f'({c})' for c in conds)};")
            out.append(f"{jj}let idx{tag} = select(0u, {idx}, cnd{tag});")
            raw = f"{op.binding}[idx{tag}]" if q == 4 else _read(op.binding, f"idx{tag}",
                                                                 op.dtype)
            ty, zero = ("vec4<f32>", "vec4<f32>(0.0)") if q == 4 else ("f32", "0.0")
            val = f"select({zero}, {raw}, cnd{tag})"
            out.append(f"{jj}let v{tag}: {ty} = {val};" if declare else f"{jj}v{tag} = {val};")
            return
        out.append(f"{jj}var v{tag}: f32 = 0.0;" if declare else f"{jj}v{tag} = 0.0;")
        out.append(f"{jj}if ({' && '.join(conds)}) {{")
        out.append(f"{jj}    v{tag} = {_read(op.binding, idx, op.dtype)};")
        out.append(f"{jj}}}")

    def _gather(self, out: list[str], jj: str, tag: str, kv: str, op, check_k: bool,
                kend: str, declare: bool, extra: str) -> None:
        """``v<tag>`` = the vec4 of four columns' elements at K index ``kv`` (branch-free
        scalar loads, one shared table read: ``_Operand.gather``)."""
        cols = [f"{tag}c{i}" for i in range(4)]
        comps = []
        items = op.gather(kv, tag, cols, out, jj) if op.gather else [
            op.load(kv, c, out, jj) for c in cols]  # no shared work: each column's own
        for c, (cond, idx) in zip(cols, items, strict=True):
            conds = [f"ok{c}"] + ([f"{kv} < {kend}"] if check_k else []) + (
                cond.split(" && ") if cond else []) + ([extra] if extra else [])
            out.append(f"{jj}let cnd{c} = {' & '.join(f'({x})' for x in conds)};")
            out.append(f"{jj}let idx{c} = select(0u, {idx}, cnd{c});")
            comps.append(f"select(0.0, {_read(op.binding, f'idx{c}', op.dtype)}, cnd{c})")
        val = f"vec4<f32>({', '.join(comps)})"
        out.append(f"{jj}let v{tag}: vec4<f32> = {val};" if declare else f"{jj}v{tag} = {val};")

    def _stage(self, out: list[str], ii: str, check_k: bool, kend: str) -> None:
        """Copy step k0's slices of both operands into workgroup memory (zero outside)."""
        if self.bf:  # all reads, then all stores
            for which, l, _rn, kn, op, _t, partial, n_el, q in self.plan:
                part = f"lid + {u(l * self.nth)} < {u(n_el)}" if partial else ""
                self._read_element(out, ii, f"{which}{l}", f"k0 + {kn}", op, check_k, kend,
                                   True, part, q)
            self._store_regs(out, ii)
            return
        for which, l, rn, kn, op, T, partial, n_el, _q in self.plan:
            tag, jj = f"{which}{l}", ii
            if partial:
                out.append(f"{ii}if (lid + {u(l * self.nth)} < {u(n_el)}) {{")
                jj = ii + "    "
            self._read_element(out, jj, tag, f"k0 + {kn}", op, check_k, kend, declare=True)
            off = 0 if which == "a" else self.offb
            out.append(f"{jj}{self._sh(off, T, kn, rn)} = v{tag};")
            if partial:
                out.append(f"{ii}}}")

    def fill_table(self, L: list[str], ind: str, kbeg: str) -> None:
        """ST = 2: the workgroup's offset table for K indices kbeg … kbeg + length (all
        invocations, then a barrier); ``kbeg`` the first K index of this workgroup."""
        if self.table is None:
            return
        i2 = ind + "    "
        L.append(f"{ind}for (var tq: u32 = lid; tq < {u(self.tab_len)}; tq = tq + "
                 f"{u(self.nth)}) {{")
        L.append(f"{i2}let tk = {kbeg} + tq;")
        L.append(f"{i2}Kt[tq] = {self.table.entry('tk', L, i2)};")
        L.append(f"{ind}}}")
        L.append(f"{ind}workgroupBarrier();")

    def _mma(self, out: list[str], ii: str) -> None:
        """acc += As·Bs over this invocation's BK-deep slice of the staged step (vec4 reads
        where possible)."""
        jj = ii + "    "
        out.append(f"{ii}for (var kq: u32 = 0u; kq < {u(self.cfg.BK)}; kq = kq + 1u) {{")
        out.append(f"{jj}let kk = kb + kq;")
        for off, R, T, who, th in ((0, self.RM, self.TM, "ra", "ty"),
                                   (self.offb, self.RN, self.TN, "rb", "tx")):
            if self.vec:
                for q in range(R // 4):
                    out.append(f"{jj}let {who}4_{q} = Sh[{self.sb}{u(off // 4)} + kk * "
                               f"{u((T + SH_PAD) // 4)} + "
                               f"{th} * {u(R // 4)} + {u(q)}];")
                for i in range(R):
                    out.append(f"{jj}let {who}{i} = {who}4_{i // 4}.{'xyzw'[i % 4]};")
            else:
                for i in range(R):
                    x = f"{th} * {u(R)} + {u(i)}" if R > 1 else th
                    out.append(f"{jj}let {who}{i} = Sh[{self.sb}{u(off)} + kk * "
                               f"{u(T + SH_PAD)} + {x}];")
        for i in range(self.RM):
            for j in range(self.RN):
                out.append(f"{jj}acc{i}_{j} = fma(ra{i}, rb{j}, acc{i}_{j});")
        out.append(f"{ii}}}")

    def step(self, out: list[str], ii: str, check_k: bool, kend: str) -> None:
        self._stage(out, ii, check_k, kend)
        out.append(f"{ii}workgroupBarrier();")
        self._mma(out, ii)
        out.append(f"{ii}workgroupBarrier();")

    def k_loop(self, L: list[str], ind: str) -> None:
        """Whole steps unguarded in k, then one guarded tail step; the K range is constant,
        or ``kbeg``/``kend`` from ``krange`` (split chunks, phases)."""
        gm, i2, BKs = self.gm, ind + "    ", self.BKs
        if gm.K is not None:
            K = gm.K
            kf = K - K % BKs
            if self.table is not None:
                L.append(f"{ind}let kbeg = 0u;")
                self.fill_table(L, ind, "kbeg")
            if kf:
                L.append(f"{ind}for (var k0: u32 = 0u; k0 < {u(kf)}; k0 = k0 + {u(BKs)}) {{")
                self.step(L, i2, False, u(K))
                L.append(f"{ind}}}")
            if kf != K:
                L.append(f"{ind}{{")
                L.append(f"{i2}let k0 = {u(kf)};")
                self.step(L, i2, True, u(K))
                L.append(f"{ind}}}")
            return
        gm.krange(L, ind)  # defines kbeg, kend (uniform)
        self.fill_table(L, ind, "kbeg")
        L.append(f"{ind}var k0: u32 = kbeg;")
        L.append(f"{ind}loop {{")
        L.append(f"{i2}if (k0 + {u(BKs)} > kend) {{")
        L.append(f"{i2}    break;")
        L.append(f"{i2}}}")
        self.step(L, i2, False, "kend")
        L.append(f"{i2}k0 = k0 + {u(BKs)};")
        L.append(f"{ind}}}")
        L.append(f"{ind}if (k0 < kend) {{")
        self.step(L, i2, True, "kend")
        L.append(f"{ind}}}")

    # -- register prefetch (PF = 1) -----------------------------------------------------------
    def _load_regs(self, out: list[str], ii: str, base: str, check_k: bool, kend: str) -> None:
        """Step ``base``'s elements of both operands into the registers ``v<tag>`` (zero
        outside), each in its own block (the operands' lets may repeat per step)."""
        for which, l, _rn, kn, op, _t, partial, n_el, q in self.plan:
            tag, jj = f"{which}{l}", ii + "    "
            out.append(f"{ii}{{")
            part = f"lid + {u(l * self.nth)} < {u(n_el)}" if partial else ""
            if part and not self.bf:
                out.append(f"{jj}if ({part}) {{")
                jj += "    "
            self._read_element(out, jj, tag, f"{base} + {kn}", op, check_k, kend, False,
                               part if self.bf else "", q)
            if part and not self.bf:
                out.append(f"{ii}    }}")
            out.append(f"{ii}}}")

    def _store_regs(self, out: list[str], ii: str) -> None:
        for which, l, rn, kn, op, T, partial, n_el, q in self.plan:
            off = 0 if which == "a" else self.offb
            v = f"v{which}{l}"
            if q == 1:
                st = f"{self._sh(off, T, kn, rn)} = {v};"
            elif not op.k_fast:  # four columns of one K row: one aligned vec4
                st = (f"Sh[{self.sb}{u(off // 4)} + {kn} * {u((T + SH_PAD) // 4)} + {rn} / 4u]"
                      f" = {v};")
            else:  # four K rows of one column
                st = " ".join(f"{self._sh(off, T, f'({kn} + {u(i)})', rn)} = {v}.{'xyzw'[i]};"
                              for i in range(4))
            if partial:
                out.append(f"{ii}if (lid + {u(l * self.nth)} < {u(n_el)}) {{ {st} }}")
            else:
                out.append(f"{ii}{st}")

    def _load_next(self, out: list[str], ii: str, k1: str, kf: str, kend: str,
                   whole: bool, tail: bool) -> None:
        """Loads of the step at ``k1``: unguarded along K when it is whole (``k1 < kf``),
        guarded when it is the tail; ``whole``/``tail`` say which cases can occur."""
        if whole:
            out.append(f"{ii}if ({k1} < {kf}) {{")
            self._load_regs(out, ii + "    ", k1, False, kend)
            out.append(f"{ii}}}" + (f" else if ({k1} < {kend}) {{" if tail else ""))
        elif tail:
            out.append(f"{ii}if ({k1} < {kend}) {{")
        if tail:
            self._load_regs(out, ii + "    ", k1, True, kend)
            out.append(f"{ii}}}")

    def k_loop_prefetch(self, L: list[str], ind: str) -> None:
        """The K loop with register prefetch: step k's registers go to workgroup memory, then
        step k + BK·KS's global loads are issued before the FMAs on step k, so their latency
        hides behind the arithmetic (the matmul kernel's scheme)."""
        gm, i2, BKs = self.gm, ind + "    ", self.BKs
        L += [f"{ind}var v{it.which}{it.l}: vec4<f32> = vec4<f32>(0.0);" if it.q == 4 else
              f"{ind}var v{it.which}{it.l}: f32 = 0.0;" for it in self.plan]
        if gm.K is not None:
            K = gm.K
            kf, ks = K - K % BKs, -(-K // BKs) * BKs
            L.append(f"{ind}let kbeg = 0u;")
            L.append(f"{ind}let kend = {u(K)};")
            L.append(f"{ind}let kfull = {u(kf)};")
            whole, tail = kf > 0, kf != K
        else:
            gm.krange(L, ind)  # defines kbeg, kend (uniform)
            L.append(f"{ind}let kfull = kend - min(kend, {u(BKs - 1)});")  # k < kfull: whole
            ks, whole, tail = None, True, True
        self.fill_table(L, ind, "kbeg")
        L.append(f"{ind}let kfirst = kbeg;")
        self._load_next(L, ind, "kfirst", "kfull", "kend", whole, tail)
        db = self.cfg.PF == 2
        if db:
            L.append(f"{ind}var sbo: u32 = 0u;")
        L.append(f"{ind}for (var k0: u32 = kbeg; k0 < kend; k0 = k0 + {u(BKs)}) {{"
                 if ks is None else
                 f"{ind}for (var k0: u32 = 0u; k0 < {u(ks)}; k0 = k0 + {u(BKs)}) {{")
        self._store_regs(L, i2)
        L.append(f"{i2}workgroupBarrier();")
        L.append(f"{i2}let k1 = k0 + {u(BKs)};")
        self._load_next(L, i2, "k1", "kfull", "kend", whole and (ks is None or ks > BKs), tail)
        self._mma(L, i2)
        if db:  # the next step stages into the other buffer: every invocation passed this
            # step's barrier after its FMAs on that buffer, so no second barrier is needed
            stage = self.cfg.stage_elems() // (4 if self.vec else 1)
            L.append(f"{i2}sbo = {u(stage)} - sbo;")
        else:
            L.append(f"{i2}workgroupBarrier();")
        L.append(f"{ind}}}")
        if db:
            L.append(f"{ind}workgroupBarrier();")  # Sh is reused after the loop

    def _guard(self, r: str, n: str, mod_m: bool) -> list[str]:
        gm = self.gm
        conds = [f"{r} < {u(gm.M)}"] if mod_m and gm.M % self.TM else []
        if gm.n_bound:
            conds.append(f"{n} < {gm.n_bound}")
        elif gm.N % self.TN:
            conds.append(f"{n} < {u(gm.N)}")
        if self.live:
            conds.append("live")
        return conds

    def stores(self, L: list[str], ind: str, helpers: set) -> None:
        """Each invocation stores its RM×RN block (KS = 1)."""
        if self.cfg.KS > 1:
            return self._reduce_stores(L, ind, helpers)
        for i in range(self.RM):
            L.append(f"{ind}let r{i} = row0 + ty * {u(self.RM)} + {u(i)};")
        for j in range(self.RN):
            L.append(f"{ind}let n{j} = col0 + tx * {u(self.RN)} + {u(j)};")
        for i in range(self.RM):
            for j in range(self.RN):
                conds = self._guard(f"r{i}", f"n{j}", True)
                L.append(f"{ind}if ({' && '.join(conds)}) {{" if conds else f"{ind}{{")
                self.gm.store(L, ind + "    ", f"r{i}", f"n{j}", f"acc{i}_{j}", helpers)
                L.append(f"{ind}}}")

    def _reduce_stores(self, L: list[str], ind: str, helpers: set) -> None:
        """KS > 1: every slice parks its partial tile in workgroup memory, then each
        invocation adds the KS partials of some elements in slice order and stores them."""
        TM, TN, KS, nth = self.TM, self.TN, self.cfg.KS, self.nth
        L.append(f"{ind}let pbase = (kb / {u(self.cfg.BK)}) * {u(TM * TN)};")
        for i in range(self.RM):
            for j in range(self.RN):
                e = f"pbase + (ty * {u(self.RM)} + {u(i)}) * {u(TN)} + tx * {u(self.RN)} + {u(j)}"
                tgt = f"Sh[({e}) / 4u][({e}) % 4u]" if self.vec else f"Sh[{e}]"
                L.append(f"{ind}{tgt} = acc{i}_{j};")
        L.append(f"{ind}workgroupBarrier();")
        i2 = ind + "    "
        for q in range(-(-TM * TN // nth)):
            L.append(f"{ind}{{")
            L.append(f"{i2}let e = lid + {u(q * nth)};")
            L.append(f"{i2}let r = row0 + e / {u(TN)};")
            L.append(f"{i2}let n = col0 + e % {u(TN)};")
            parts = []
            for s in range(KS):
                es = f"e + {u(s * TM * TN)}" if s else "e"
                parts.append(f"Sh[({es}) / 4u][({es}) % 4u]" if self.vec else f"Sh[{es}]")
            acc = parts[0]
            for p in parts[1:]:
                acc = f"({acc} + {p})"
            conds = self._guard("r", "n", True) + (
                [f"e < {u(TM * TN)}"] if (q + 1) * nth > TM * TN else [])
            L.append(f"{i2}if ({' && '.join(conds)}) {{" if conds else f"{i2}{{")
            L.append(f"{i2}    let red: f32 = {acc};")
            self.gm.store(L, i2 + "    ", "r", "n", "red", helpers)
            L.append(f"{i2}}}")
            L.append(f"{ind}}}")


def _emit_gemm(gm: _Gemm, t) -> tuple[list[str], list[str], int, object, set, int, set]:
    ind = "    "
    g = _GemmGen(gm, t)
    L: list[str] = []
    g.head(L, ind)
    g.staging_maps(L, ind)
    for i in range(g.RM):
        for j in range(g.RN):
            L.append(f"{ind}var acc{i}_{j}: f32 = 0.0;")
    if gm.tile.PF:
        g.k_loop_prefetch(L, ind)
    else:
        g.k_loop(L, ind)
    helpers: set[str] = set()
    g.stores(L, ind, helpers)
    nbytes = gm.tile.storage()
    shared = [f"var<workgroup> Sh: array<vec4<f32>, {nbytes // 16}>;" if g.vec
              else f"var<workgroup> Sh: array<f32, {nbytes // 4}>;"]
    if g.table is not None:
        shared.append(f"var<workgroup> Kt: array<u32, {g.tab_len}>;")
        nbytes += 4 * g.tab_len
    check_workgroup_storage(gm.name, nbytes, t)
    check_invocations(gm.name, g.nth, t)
    vec4 = {it.op.binding for it in g.plan if it.q == 4 and it.op.quad is not None}
    return L, shared, nbytes, g.grid, helpers, g.nth, vec4


def _module(name, bd, extra_dts, gemm, t, meta) -> KernelSpec:
    body, shared, nbytes, grid, helpers, nth, vec4 = gemm
    check_bindings(name, bd.n, t)
    uses_f16 = check_dtypes(name, bd.dtypes + list(extra_dts), t)
    # operands read as vec4 (ST >= 3) are declared as arrays of vec4 (``_quad_ok``)
    decls = [ln.replace(": array<f32>;", ": array<vec4<f32>>;")
             if ln.split(" var<storage, read_write> ")[1].split(":")[0] in vec4 else ln
             for ln in bd.decls()]
    lines = module_source(module_header(uses_f16) + decls + shared, helpers, nth, body)
    meta = dict(meta, workgroup_size=nth, workgroup_storage=nbytes,
                binding_dtypes=tuple(bd.dtypes))
    return KernelSpec(name=name, wgsl=lines, n_bindings=bd.n,
                      workgroups=grid.workgroups, meta=meta)


def _range_check(e: str, lo: int, hi: int, size: int) -> str:
    """Condition that i32 coordinate ``e`` (known to lie in [lo, hi]) is inside [0, size)."""
    if lo >= 0 and hi < size:
        return ""
    return f"u32({e}) < {u(size)}"


# ---------------------------------------------------------------------------------------------
# forward


def _input_at(G: ConvGeom, sx, tag: str, eh: str, mh: int, ew: str, mw: int, lead,
              L: list[str], ind: str) -> tuple[str, str]:
    """(bounds condition, index) of the input element at (``ih{tag} + eh·mh``,
    ``iw{tag} + ew·mw``), ``lead`` the (coordinate, stride) of its n or c."""
    sh_, sw_ = G.stride
    dh, dw = G.dilation
    pt, pl = G.pad[0][0], G.pad[1][0]
    ih = _spatial(f"ih{tag}", eh, mh, "+", f"y{tag}", L, ind)
    iw = _spatial(f"iw{tag}", ew, mw, "+", f"z{tag}", L, ind)
    conds = [c for c in (
        _range_check(ih, -pt, (G.oh - 1) * sh_ - pt + (G.kh - 1) * dh, G.h),
        _range_check(iw, -pl, (G.ow - 1) * sw_ - pl + (G.kw - 1) * dw, G.w)) if c]
    idx = _lin([lead, (f"u32({ih})", sx[2]), (f"u32({iw})", sx[3])], f"xb{tag}")
    return " && ".join(conds), idx


def _forward_checks(k: Conv2dKernel, t):
    """The operands' strides (x, w, bias, extra inputs) and the output dtype."""
    name, G = k.name, k.geom
    G.check(name)
    x, w = k.x, k.w
    sx = view4(x, (G.n, G.c, G.h, G.w), "input", name, t)
    sw = view4(w, (G.o, G.cg, G.kh, G.kw), "weight", name, t)
    op_dt = x.dtype
    if w.dtype is not op_dt or not op_dt.is_float:
        raise CodegenError(f"kernel {name!r}: operands must share a float dtype "
                           f"({x.dtype.name}, {w.dtype.name})")
    out_shape = (G.n, G.o, G.oh, G.ow)
    sb = None
    if k.bias is not None:
        if k.bias.shape != (G.o,) or k.bias.dtype is not op_dt:
            raise CodegenError(f"kernel {name!r}: bias must be {op_dt.name}[{G.o}]")
        sb = bcast_strides(k.bias, (G.o,), f"{name} bias")
        check_extent(name, "bias", k.bias, (G.o,), sb, t)
    xs = {}
    for i, s in enumerate(k.extra):
        st = bcast_strides(s, out_shape, f"{name} extra {i}")
        check_extent(name, f"extra input {i}", s, out_shape, st, t)
        xs[i] = st
    for ins in k.epilogue:
        for kind, i in ins.args:
            if kind == "x" and i not in xs:
                raise CodegenError(f"kernel {name!r}: epilogue reads extra input {i} of "
                                   f"{len(k.extra)}")
    out_dt = k.out_dtype or (k.epilogue[-1].dtype if k.epilogue else op_dt)
    check_binding_size(name, "output", max(1, k.split_k) * G.n * G.o * G.oh * G.ow, out_dt, t)
    return sx, sw, sb, xs, op_dt, out_dt


def _forward_operands(k: Conv2dKernel, sx, sw, bd: Bindings, op_dt, table_len: int = 0,
                      quads: bool = False) -> tuple[_Operand, _Operand]:
    """A = the weight (rows o, k = (c, i, j)), B = the input (columns (n, oh, ow));
    ``table_len`` > 0 (ST >= 2): B through an offset table of that many K indices, where it
    fits; ``quads`` (ST >= 3): vec4 loads where aligned."""
    G, x, w = k.geom, k.x, k.w
    sh_, sw_ = G.stride
    pt, pl = G.pad[0][0], G.pad[1][0]
    ohw = G.oh * G.ow
    # K runs contiguously along each weight row (strides of size-1 axes do not matter)
    k_linear = all(s == want or size == 1 for s, want, size in (
        (sw[1], G.kh * G.kw, G.cg), (sw[2], G.kw, G.kh), (sw[3], 1, G.kw)))

    def a_hoist(r, tag, L, ind):
        L.append(f"{ind}let ab{tag} = {_lin([(f'(gi * {u(G.og)} + {r})', sw[0])], w.offset)};")

    def a_load(kv, tag, L, ind):
        if k_linear:
            return "", f"ab{tag} + {kv}"
        c, i, j = _split3(kv, (G.kh, G.kw), f"w{tag}", L, ind)
        return "", _lin([(c, sw[1]), (i, sw[2]), (j, sw[3])], f"ab{tag}")

    def b_hoist(p, tag, L, ind):
        L.append(f"{ind}let pn{tag} = {p} / {u(ohw)};")
        L.append(f"{ind}let pq{tag} = {p} % {u(ohw)};")
        L.append(f"{ind}let ih{tag} = i32((pq{tag} / {u(G.ow)}) * {u(sh_)}) - {i32_lit(pt)};")
        L.append(f"{ind}let iw{tag} = i32((pq{tag} % {u(G.ow)}) * {u(sw_)}) - {i32_lit(pl)};")
        L.append(f"{ind}let xb{tag} = "
                 f"{_lin([(f'pn{tag}', sx[0]), (f'gi * {u(G.cg)}', sx[1])], x.offset)};")

    def b_load(kv, tag, L, ind):
        c, i, j = _split3(kv, (G.kh, G.kw), f"x{tag}", L, ind)
        return _input_at(G, sx, tag, i, G.dilation[0], j, G.dilation[1], (c, sx[1]), L, ind)

    def a_quad(kv, tag, L, ind):
        return "", f"(ab{tag} + {kv}) / 4u"

    def b_quad(kv, tag, L, ind):  # 1×1, stride 1, unpadded: column p at plane offset pq
        return "", f"(xb{tag} + {_mul(kv, sx[1])} + pq{tag}) / 4u"

    K = G.cg * G.kh * G.kw
    a_vec = quads and k_linear and _quad_ok(bd, 1, w, (sw[0], K))
    A = _Operand(bd.name(1), op_dt, not (sw[0] == 1 and G.og > 1), a_hoist, a_load,
                 quad=a_quad if a_vec else None)
    names = ("pn", "pq", "ih", "iw", "xb")
    if table_len and _table_fits(G, sx, table_len):
        return A, _tabled_input(G, sx, bd.name(0), op_dt, b_hoist, names, table_len)
    pointwise = (G.kh, G.kw, G.stride, G.pad) == (1, 1, (1, 1), ((0, 0), (0, 0)))
    b_vec = quads and pointwise and sx[3] == 1 and sx[2] == G.w and _quad_ok(
        bd, 0, x, (sx[0], sx[1], ohw))
    return A, _Operand(bd.name(0), op_dt, False, b_hoist, b_load, names,
                       quad=b_quad if b_vec else None)


def _quad_ok(bd: Bindings, slot: int, v: Strided, multiples) -> bool:
    """vec4 loads of operand ``v`` (binding ``slot``): f32, the offset, the bound range and
    ``multiples`` (strides and extents the quads step by) multiples of 4, and no other slot
    sharing its binding (its declared element type changes)."""
    shared = any(bd.alias[i] == bd.alias[slot] for i in range(len(bd.alias)) if i != slot)
    return (v.dtype is f32 and not shared and v.offset % 4 == 0 and v.extent % 4 == 0
            and all(m % 4 == 0 for m in multiples))


TABLE_MAX = 2048  # entries (8 KiB of workgroup memory)


def _table_fits(G: ConvGeom, sx, length: int) -> bool:
    """Whether the forward's offset table applies: several taps (≤ 32, one mask bit each),
    every offset below 2**27 (5 bits hold the tap) and at most TABLE_MAX entries."""
    khw = G.kh * G.kw
    top = ((G.cg - 1) * sx[1] + (G.kh - 1) * G.dilation[0] * sx[2]
           + (G.kw - 1) * G.dilation[1] * sx[3])
    return 1 < khw <= 32 and top < 2 ** 27 and length <= TABLE_MAX


def _tabled_input(G: ConvGeom, sx, binding: str, op_dt, b_hoist, names, length) -> _Operand:
    """The forward's input operand read through an offset table: entry k = (offset of
    (channel, tap) relative to the column's window corner) << 5 | tap; each staged column
    keeps a bit mask of the taps inside the image (padding reads as zero) and its corner's
    index, so a staged element costs a table read, a mask test and an add."""
    (dh, dw), khw = G.dilation, G.kh * G.kw
    pt, pl = G.pad[0][0], G.pad[1][0]
    sh_, sw_ = G.stride

    def checks(tag):
        rows = [_range_check(f"(ih{tag} + {i32_lit(i * dh)})", i * dh - pt,
                             (G.oh - 1) * sh_ - pt + i * dh, G.h) for i in range(G.kh)]
        cols = [_range_check(f"(iw{tag} + {i32_lit(j * dw)})", j * dw - pl,
                             (G.ow - 1) * sw_ - pl + j * dw, G.w) for j in range(G.kw)]
        return rows, cols

    masked = any(any(c) for c in checks(""))  # some tap can fall into the padding

    def hoist(p, tag, L, ind):
        b_hoist(p, tag, L, ind)
        rows, cols = checks(tag)
        bits = []
        for r in range(khw):
            c = " & ".join(f"({e})" for e in (rows[r // G.kw], cols[r % G.kw]) if e)
            bits.append(f"select(0u, {u(1 << r)}, {c})" if c else u(1 << r))
        L.append(f"{ind}let mk{tag} = {' | '.join(bits)};")
        L.append(f"{ind}let xq{tag} = "
                 f"{_lin([(f'u32(ih{tag})', sx[2]), (f'u32(iw{tag})', sx[3])], f'xb{tag}')};")

    def load(kv, tag, L, ind):
        L.append(f"{ind}let te{tag} = Kt[{kv} - kbeg];")
        cond = f"((mk{tag} >> (te{tag} & 31u)) & 1u) != 0u" if masked else ""
        return cond, f"xq{tag} + (te{tag} >> 5u)"

    def gather(kv, tag, cols, L, ind):  # one table read for four columns
        L.append(f"{ind}let te{tag} = Kt[{kv} - kbeg];")
        L.append(f"{ind}let to{tag} = te{tag} >> 5u;")
        if masked:
            L.append(f"{ind}let tb{tag} = 1u << (te{tag} & 31u);")
        return [(f"(mk{c} & tb{tag}) != 0u" if masked else "", f"xq{c} + to{tag}")
                for c in cols]

    def entry(k, L, ind):
        L.append(f"{ind}let tc = {k} / {u(khw)};")
        L.append(f"{ind}let tr = {k} % {u(khw)};")
        off = _lin([("tc", sx[1]), (f"(tr / {u(G.kw)})", dh * sx[2]),
                    (f"(tr % {u(G.kw)})", dw * sx[3])])
        return f"(({off}) << 5u) | tr"

    return _Operand(binding, op_dt, False, hoist, load, names + ("mk", "xq"),
                    _OffsetTable(length, entry), gather=gather)


def _forward_store(k: Conv2dKernel, bd: Bindings, sb, xs, op_dt, out_dt):
    """Bias, the fused epilogue (extra inputs read at the output element) and the store; a
    split-K partial adds the bias in chunk 0 only and stores at chunk ``si``'s slice."""
    G = k.geom
    ohw = G.oh * G.ow
    n_in = 2 + (k.bias is not None)
    split = k.split_k > 1

    def epilogue(L, ind, helpers):
        conv = "accf" if op_dt is f32 else f"{op_dt.wgsl}(accf)"
        L.append(f"{ind}let accv: {op_dt.wgsl} = {conv};")
        names = {}
        if xs:
            L.append(f"{ind}let soh = sq / {u(G.ow)};")
            L.append(f"{ind}let sow = sq % {u(G.ow)};")
        for i, st in xs.items():
            s = k.extra[i]
            idx = _lin([("sn", st[0]), ("o", st[1]), ("soh", st[2]), ("sow", st[3])], s.offset)
            L.append(f"{ind}let e{i} = {load(bd.name(n_in + i), idx, s.dtype)};")
            names[("x", i)] = (f"e{i}", s.dtype)
        names[("acc", 0)] = ("accv", op_dt)

        def arg(a):
            if a in names:
                return names[a]
            raise CodegenError(f"kernel {k.name!r}: epilogue operand {a!r}")

        return emit_instrs(k.epilogue, arg, "q", L, ind, helpers)[-1]

    def store(L, ind, r, col, acc, helpers):
        L.append(f"{ind}let o = gi * {u(G.og)} + {r};")
        L.append(f"{ind}let sn = {col} / {u(ohw)};")
        L.append(f"{ind}let sq = {col} % {u(ohw)};")
        v = acc
        if sb is not None:
            b = _read(bd.name(2), _lin([('o', sb[0])], k.bias.offset), op_dt)
            v = f"{acc} + select(0.0, {b}, si == 0u)" if split else f"{acc} + {b}"
        L.append(f"{ind}let accf: f32 = {v};")
        val, vdt = epilogue(L, ind, helpers) if k.epilogue else ("accf", f32)
        oidx = _lin([("sn", G.o * ohw), ("o", ohw), ("sq", 1)]
                    + ([("si", G.n * G.o * ohw)] if split else []))
        L.append(f"{ind}{bd.name(n_in + len(k.extra))}[{oidx}] = "
                 f"{store_value(val, vdt, out_dt)};")

    return store


def emit_forward(k: Conv2dKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name, G = k.name, k.geom
    sx, sw, sb, xs, op_dt, out_dt = _forward_checks(k, t)
    bd = Bindings([op_dt, op_dt] + ([op_dt] if k.bias is not None else [])
                  + [s.dtype for s in k.extra] + [out_dt], alias)
    M, N, K = G.og, G.n * G.oh * G.ow, G.cg * G.kh * G.kw
    S = _check_split(name, k.split_k)
    if S > 1 and (k.epilogue or k.extra):
        raise CodegenError(f"kernel {name!r}: a split-K partial (split_k={S}) takes no "
                           f"epilogue; the kernel summing the partials runs it")
    chunk = split_chunk(K, S)
    cfg = _heuristic(k, M, N, chunk, G.groups * S, t)
    # the table where it fits next to the staging buffers (else the div/mod staging)
    room = t.lim("max_compute_workgroup_storage_size") - cfg.storage()
    tab = chunk if cfg.ST >= 2 and 4 * (-(-chunk // (cfg.BK * cfg.KS)) * cfg.BK * cfg.KS) <= \
        room else 0
    A, B = _forward_operands(k, sx, sw, bd, op_dt, tab, cfg.ST >= 3)
    gb_lines, krange = _split_lines(G.groups, S, chunk, K)
    gm = _Gemm(name, M, N, K if S == 1 else None, G.groups * S, cfg, A, B, gb_lines, krange,
               _forward_store(k, bd, sb, xs, op_dt, out_dt))
    return _module(name, bd, [i.dtype for i in k.epilogue], _emit_gemm(gm, t), t,
                   {"archetype": "conv2d", "tile": cfg.tuple(), "split_k": S,
                    "flops": 2 * M * N * K * G.groups})


def _split_lines(groups: int, S: int, chunk: int, K: int):
    """(gb_lines, krange) of a GEMM repeated per group and split-K chunk: workgroup batch
    index -> group ``gi`` and chunk ``si``; chunk ``si`` covers K range [si·chunk, …)."""

    def gb_lines(L, ind):
        if S == 1:
            L.append(f"{ind}let gi = gbc;")
            return
        L.append(f"{ind}let gi = gbc % {u(groups)};")
        L.append(f"{ind}let si = gbc / {u(groups)};")

    def krange(L, ind):
        L.append(f"{ind}let kbeg = si * {u(chunk)};")
        L.append(f"{ind}let kend = min(kbeg + {u(chunk)}, {u(K)});")

    return gb_lines, (krange if S > 1 else None)


# ---------------------------------------------------------------------------------------------
# input gradient


def _grad_setup(k, t, alias, first, second):
    """Strides of the two 4-D operands ((view, shape, what) each), their shared float dtype,
    the output dtype and the bindings (first, second, output)."""
    name = k.name
    k.geom.check(name)
    s1 = view4(*first, name, t)
    s2 = view4(*second, name, t)
    op_dt = first[0].dtype
    if second[0].dtype is not op_dt or not op_dt.is_float:
        raise CodegenError(f"kernel {name!r}: operands must share a float dtype")
    out_dt = k.out_dtype or op_dt
    return s1, s2, op_dt, out_dt, Bindings([op_dt, op_dt, out_dt], alias)


def _weight_rows(G: ConvGeom, sw, w: Strided):
    """The input gradient's A hoist: weight base of staged row (input channel) ``r``."""

    def a_hoist(r, tag, L, ind):
        L.append(f"{ind}let ab{tag} = "
                 f"{_lin([(r, sw[1]), (f'gi * {u(G.og)}', sw[0])], w.offset)};")

    return a_hoist


def _dy_base(G: ConvGeom, sd, dy: Strided, tag: str, L: list[str], ind: str) -> None:
    L.append(f"{ind}let db{tag} = "
             f"{_lin([(f'pn{tag}', sd[0]), (f'gi * {u(G.og)}', sd[1])], dy.offset)};")


def _dy_axis(base, e, d, s, size_out, lo, hi, tag, L, ind):
    """(condition, output coordinate) for t = base - e·d: t % s == 0, 0 <= t/s < size."""
    tv = _spatial(base, e, d, "-", f"u{tag}", L, ind)
    conds = []
    if s == 1:
        c = _range_check(tv, lo, hi, size_out)
        if c:
            conds.append(c)
        return conds, f"u32({tv})"
    if not (lo >= 0 and hi < size_out * s):
        conds.append(f"u32({tv}) < {u(size_out * s)}")
    conds.append(f"u32({tv}) % {u(s)} == 0u")
    return conds, f"(u32({tv}) / {u(s)})"


def emit_input_grad(k: Conv2dInputGradKernel, limits=None, features=None,
                    alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name, G = k.name, k.geom
    dy, w = k.dy, k.w
    sd, sw, op_dt, out_dt, bd = _grad_setup(k, t, alias, (dy, (G.n, G.o, G.oh, G.ow), "dy"),
                                            (w, (G.o, G.cg, G.kh, G.kw), "weight"))
    S = _check_split(name, k.split_k)
    total = G.n * G.c * G.h * G.w
    check_binding_size(name, "output", S * total, out_dt, t)
    sh_, sw_ = G.stride
    dh, dw = G.dilation
    (pt, pb), (pl, pr) = G.pad
    hw = G.h * G.w
    M, N, K = G.cg, G.n * hw, G.og * G.kh * G.kw

    a_hoist = _weight_rows(G, sw, w)

    def a_load(kv, tag, L, ind):
        o, i, j = _split3(kv, (G.kh, G.kw), f"w{tag}", L, ind)
        return "", _lin([(o, sw[0]), (i, sw[2]), (j, sw[3])], f"ab{tag}")

    def b_hoist(p, tag, L, ind):
        L.append(f"{ind}let pn{tag} = {p} / {u(hw)};")
        L.append(f"{ind}let pq{tag} = {p} % {u(hw)};")
        L.append(f"{ind}let th{tag} = i32(pq{tag} / {u(G.w)}) + {i32_lit(pt)};")
        L.append(f"{ind}let tw{tag} = i32(pq{tag} % {u(G.w)}) + {i32_lit(pl)};")
        _dy_base(G, sd, dy, tag, L, ind)

    def b_load(kv, tag, L, ind):
        o, i, j = _split3(kv, (G.kh, G.kw), f"d{tag}", L, ind)
        c1, oh = _dy_axis(f"th{tag}", i, dh, sh_, G.oh, pt - (G.kh - 1) * dh, G.h - 1 + pt,
                      f"h{tag}", L, ind)
        c2, ow = _dy_axis(f"tw{tag}", j, dw, sw_, G.ow, pl - (G.kw - 1) * dw, G.w - 1 + pl,
                      f"w{tag}", L, ind)
        return " && ".join(c1 + c2), _lin([(o, sd[1]), (oh, sd[2]), (ow, sd[3])], f"db{tag}")

    def store(L, ind, r, col, acc, helpers):
        L.append(f"{ind}let sn = {col} / {u(hw)};")
        L.append(f"{ind}let sq = {col} % {u(hw)};")
        oidx = _lin([("sn", G.c * hw), (f"(gi * {u(G.cg)} + {r})", hw), ("sq", 1)]
                    + ([("si", total)] if S > 1 else []))
        L.append(f"{ind}{bd.name(2)}[{oidx}] = {store_value(acc, f32, out_dt)};")

    if (sh_, sw_) != (1, 1) and not k.naive:
        return _input_grad_phases(k, t, sd, sw, out_dt, bd)
    A = _Operand(bd.name(1), op_dt, not (sw[1] == 1 and G.cg > 1), a_hoist, a_load)
    B = _Operand(bd.name(0), op_dt, False, b_hoist, b_load)
    chunk = split_chunk(K, S)
    cfg = _heuristic(k, M, N, chunk, G.groups * S, t)
    gb_lines, krange = _split_lines(G.groups, S, chunk, K)
    gm = _Gemm(name, M, N, K if S == 1 else None, G.groups * S, cfg, A, B, gb_lines, krange,
               store)
    return _module(name, bd, [], _emit_gemm(gm, t), t,
                   {"archetype": "conv2d_input_grad", "tile": cfg.tuple(), "split_k": S,
                    "flops": 2 * M * N * K * G.groups})




def _phase_table(size: int, k: int, s: int, p: int, d: int):
    """Per phase r (input coordinate ≡ r mod s): (positions, first tap, taps, first output
    offset), plus the tap step and the output step per tap.  The taps i with
    (r + p − i·d) ≡ 0 (mod s) form an arithmetic progression i0 + t·s/g (g = gcd(d, s)); tap
    i reads output coordinate q + (r + p − i·d)/s for input coordinate r + s·q."""
    import math

    g = math.gcd(d, s)
    rows = []
    for r in range(s):
        taps = [i for i in range(k) if (r + p - i * d) % s == 0]
        i0 = taps[0] if taps else 0
        rows.append((max(0, -(-(size - r) // s)), i0, len(taps), (r + p - i0 * d) // s))
    return rows, s // g, d // g


def _select(r: str, values, ty: str = "u") -> str:
    """WGSL expression picking ``values[r]`` (r a u32 expression; literal suffix ``ty``)."""
    lit = [f"{int(v)}{ty}" if ty == "i" else u(v) for v in values]
    expr = lit[0]
    for i in range(1, len(lit)):
        if lit[i] != lit[0] or expr != lit[0]:
            expr = f"select({expr}, {lit[i]}, {r} == {u(i)})"
    return expr


def _phase_lines(G: ConvGeom, hrows, wrows, L: list[str], ind: str, S: int = 1) -> None:
    """Workgroup -> (group ``gi``, phase (rh, rw), split-K chunk ``si`` when S > 1) and that
    phase's positions, first tap, tap count and first output offset per axis."""
    L.append(f"{ind}let gi = gbc % {u(G.groups)};")
    if S > 1:
        nph = G.stride[0] * G.stride[1]
        L.append(f"{ind}let ph = (gbc / {u(G.groups)}) % {u(nph)};")
        L.append(f"{ind}let si = gbc / {u(G.groups * nph)};")
    else:
        L.append(f"{ind}let ph = gbc / {u(G.groups)};")
    L.append(f"{ind}let rh = ph / {u(G.stride[1])};")
    L.append(f"{ind}let rw = ph % {u(G.stride[1])};")
    for a, rows, rv in (("h", hrows, "rh"), ("w", wrows, "rw")):
        L.append(f"{ind}let q{a} = {_select(rv, [r[0] for r in rows])};")
        L.append(f"{ind}let i0{a} = {_select(rv, [r[1] for r in rows])};")
        L.append(f"{ind}let nt{a} = {_select(rv, [r[2] for r in rows])};")
        L.append(f"{ind}let d0{a} = {_select(rv, [r[3] for r in rows], 'i')};")
    L.append(f"{ind}let qhw = max(qh * qw, 1u);")
    L.append(f"{ind}let ntap = max(nth * ntw, 1u);")
    L.append(f"{ind}let ncol = {u(G.n)} * qh * qw;")


def _taps(kv: str, p: str, L: list[str], ind: str) -> tuple[str, str, str]:
    """(o, tap along h, tap along w) of K index ``kv`` of a phase."""
    L.append(f"{ind}let {p}o = {kv} / ntap;")
    L.append(f"{ind}let {p}t = {kv} % ntap;")
    L.append(f"{ind}let {p}a = {p}t / max(ntw, 1u);")
    L.append(f"{ind}let {p}b = {p}t % max(ntw, 1u);")
    return f"{p}o", f"{p}a", f"{p}b"


def _phase_dy_operand(G: ConvGeom, sd, dy: Strided, dos, binding: str, op_dt) -> _Operand:
    """The ``dy`` operand of a phase GEMM: column ``p`` is (image, row and column of the
    phase's sub-grid), K runs over (output channel, tap); a tap reads ``dy`` at the sub-grid
    position minus its offset ``dos`` (per axis), zero outside."""
    hdo, wdo = dos

    def b_hoist(p, tag, L, ind):
        L.append(f"{ind}let pn{tag} = {p} / qhw;")
        L.append(f"{ind}let pq{tag} = {p} % qhw;")
        L.append(f"{ind}let oh{tag} = i32(pq{tag} / max(qw, 1u)) + d0h;")
        L.append(f"{ind}let ow{tag} = i32(pq{tag} % max(qw, 1u)) + d0w;")
        _dy_base(G, sd, dy, tag, L, ind)

    def b_load(kv, tag, L, ind):
        o, ta, tb = _taps(kv, f"d{tag}", L, ind)
        L.append(f"{ind}let y{tag} = oh{tag} - i32({_mul(ta, hdo)});")
        L.append(f"{ind}let z{tag} = ow{tag} - i32({_mul(tb, wdo)});")
        cond = f"u32(y{tag}) < {u(G.oh)} && u32(z{tag}) < {u(G.ow)}"
        return cond, _lin([(o, sd[1]), (f"u32(y{tag})", sd[2]), (f"u32(z{tag})", sd[3])],
                          f"db{tag}")

    return _Operand(binding, op_dt, False, b_hoist, b_load)


def _input_grad_phases(k: Conv2dInputGradKernel, t, sd, sw, out_dt, bd) -> KernelSpec:
    """Input gradient of a strided convolution, one GEMM per (group, phase): input positions
    with h ≡ rh (mod sh), w ≡ rw (mod sw) receive only the taps that land on them, so no K
    step reads the zeros a plain transposed convolution would (sh·sw× less work)."""
    name, G = k.name, k.geom
    dy, w = k.dy, k.w
    op_dt = dy.dtype
    sh_, sw_ = G.stride
    (pt, pb), (pl, pr) = G.pad
    hrows, hstep, hdo = _phase_table(G.h, G.kh, sh_, pt, G.dilation[0])
    wrows, wstep, wdo = _phase_table(G.w, G.kw, sw_, pl, G.dilation[1])
    hw = G.h * G.w
    M = G.cg
    N = G.n * max(r[0] for r in hrows) * max(r[0] for r in wrows)
    kmax = G.og * max(r[2] for r in hrows) * max(r[2] for r in wrows)
    S = k.split_k
    ochunk = -(-G.og // S)  # output channels per split-K chunk (K = (o, taps))

    def gb_lines(L, ind):
        _phase_lines(G, hrows, wrows, L, ind, S)

    def krange(L, ind):
        if S == 1:
            L.append(f"{ind}let kbeg = 0u;")
            L.append(f"{ind}let kend = {u(G.og)} * nth * ntw;")
            return
        L.append(f"{ind}let kbeg = si * {u(ochunk)} * nth * ntw;")
        L.append(f"{ind}let kend = min(kbeg + {u(ochunk)} * nth * ntw, {u(G.og)} * nth * ntw);")

    a_hoist = _weight_rows(G, sw, w)

    def a_load(kv, tag, L, ind):
        o, ta, tb = _taps(kv, f"w{tag}", L, ind)
        i, j = f"(i0h + {_mul(ta, hstep)})", f"(i0w + {_mul(tb, wstep)})"
        return "", _lin([(o, sw[0]), (i, sw[2]), (j, sw[3])], f"ab{tag}")

    def store(L, ind, r, col, acc, helpers):
        L.append(f"{ind}let sn = {col} / qhw;")
        L.append(f"{ind}let sq = {col} % qhw;")
        L.append(f"{ind}let sh = rh + {u(sh_)} * (sq / max(qw, 1u));")
        L.append(f"{ind}let sw = rw + {u(sw_)} * (sq % max(qw, 1u));")
        oidx = _lin([("sn", G.c * hw), (f"(gi * {u(G.cg)} + {r})", hw), ("sh", G.w), ("sw", 1)]
                    + ([("si", G.n * G.c * hw)] if S > 1 else []))
        L.append(f"{ind}{bd.name(2)}[{oidx}] = {store_value(acc, f32, out_dt)};")

    A = _Operand(bd.name(1), op_dt, True, a_hoist, a_load)
    B = _phase_dy_operand(G, sd, dy, (hdo, wdo), bd.name(0), op_dt)
    GB = G.groups * sh_ * sw_ * S  # the grid covers every phase (empty ones store zeros)
    cfg = _heuristic(k, M, N, -(-kmax // S), G.groups * _active_phases(hrows, wrows) * S, t)
    gm = _Gemm(name, M, N, None, GB, cfg, A, B, gb_lines, krange, store, n_bound="ncol")
    flops = 2 * M * G.groups * G.n * G.og * sum(
        rh[0] * rw[0] * rh[2] * rw[2] for rh in hrows for rw in wrows)  # taps that land
    return _module(name, bd, [], _emit_gemm(gm, t), t,
                   {"archetype": "conv2d_input_grad", "tile": cfg.tuple(), "phases": sh_ * sw_,
                    "split_k": S, "flops": flops})

# ---------------------------------------------------------------------------------------------
# weight gradient


def emit_weight_grad(k: Conv2dWeightGradKernel, limits=None, features=None,
                     alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name, G = k.name, k.geom
    x, dy = k.x, k.dy
    sx, sd, op_dt, out_dt, bd = _grad_setup(k, t, alias, (x, (G.n, G.c, G.h, G.w), "input"),
                                            (dy, (G.n, G.o, G.oh, G.ow), "dy"))
    S = int(k.split)
    if S < 1:
        raise CodegenError(f"kernel {name!r}: split must be >= 1, got {S}")
    wsize = G.o * G.cg * G.kh * G.kw
    check_binding_size(name, "output", S * wsize, out_dt, t)
    sh_, sw_ = G.stride
    dh, dw = G.dilation
    (pt, pb), (pl, pr) = G.pad
    ohw = G.oh * G.ow
    khw = G.kh * G.kw
    M, N, KT = G.og, G.cg * khw, G.n * ohw
    chunk = -(-KT // S)

    def a_hoist(r, tag, L, ind):
        L.append(f"{ind}let ab{tag} = {_lin([(f'(gi * {u(G.og)} + {r})', sd[1])], dy.offset)};")

    def a_load(kv, tag, L, ind):
        n, oh, ow = _split3(kv, (G.oh, G.ow), f"a{tag}", L, ind)
        return "", _lin([(n, sd[0]), (oh, sd[2]), (ow, sd[3])], f"ab{tag}")

    def b_hoist(q, tag, L, ind):
        c, i, j = _split3(q, (G.kh, G.kw), f"q{tag}", L, ind)
        L.append(f"{ind}let ih{tag} = i32({_mul(i, dh)}) - {i32_lit(pt)};")
        L.append(f"{ind}let iw{tag} = i32({_mul(j, dw)}) - {i32_lit(pl)};")
        L.append(f"{ind}let xb{tag} = "
                 f"{_lin([(f'(gi * {u(G.cg)} + {c})', sx[1])], x.offset)};")

    def b_load(kv, tag, L, ind):
        n, oh, ow = _split3(kv, (G.oh, G.ow), f"b{tag}", L, ind)
        return _input_at(G, sx, tag, oh, sh_, ow, sw_, (n, sx[0]), L, ind)

    def gb_lines(L, ind):
        L.append(f"{ind}let gi = gbc % {u(G.groups)};")
        L.append(f"{ind}let si = gbc / {u(G.groups)};")

    def krange(L, ind):
        L.append(f"{ind}let kbeg = si * {u(chunk)};")
        L.append(f"{ind}let kend = min(kbeg + {u(chunk)}, {u(KT)});")

    def store(L, ind, r, col, acc, helpers):
        oidx = _lin([("si", wsize), (f"(gi * {u(G.og)} + {r})", N), (col, 1)])
        L.append(f"{ind}{bd.name(2)}[{oidx}] = {store_value(acc, f32, out_dt)};")

    # neighbouring invocations walk (n, oh, ow): contiguous rows of dy and x
    A = _Operand(bd.name(1), op_dt, True, a_hoist, a_load)
    B = _Operand(bd.name(0), op_dt, True, b_hoist, b_load)
    cfg = _heuristic(k, M, N, chunk, G.groups * S, t)
    if S == 1:
        gm = _Gemm(name, M, N, KT, G.groups, cfg, A, B, gb_lines, None, store)
    else:
        gm = _Gemm(name, M, N, None, G.groups * S, cfg, A, B, gb_lines, krange, store)
    return _module(name, bd, [], _emit_gemm(gm, t), t,
                   {"archetype": "conv2d_weight_grad", "tile": cfg.tuple(), "split": S,
                    "flops": 2 * M * N * KT * G.groups})


# ---------------------------------------------------------------------------------------------
# registration: graph attrs + strided inputs -> descriptions


def _geom(x_shape, w_shape, y_shape, attrs) -> ConvGeom:
    n, c, h, w = x_shape
    o, _, kh, kw = w_shape
    return ConvGeom(n, c, h, w, o, kh, kw, y_shape[2], y_shape[3], tuple(attrs["stride"]),
                    tuple(tuple(p) for p in attrs["padding"]), tuple(attrs["dilation"]),
                    int(attrs["groups"]))


def _make_forward(attrs, inputs, outputs):
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) == 3 else None
    geom = _geom(x.shape, w.shape, outputs[0].shape, attrs)
    return with_split_k(Conv2dKernel(geom, x, w, bias, out_dtype=outputs[0].dtype))


def _make_input_grad(attrs, inputs, outputs):
    dy, w = inputs
    geom = _geom(outputs[0].shape, w.shape, dy.shape, attrs)
    return with_split_k(Conv2dInputGradKernel(geom, dy, w, out_dtype=outputs[0].dtype))


def with_split_k(k):
    """``k`` (forward or input gradient, unsplit) with the global split-K its GEMM shape asks
    for (``choose_split_k``); the phase-decomposed input gradient splits its output channels."""
    M, N, K, GB = gemm_shape(k)
    pointwise = isinstance(k, Conv2dKernel) and (k.geom.kh, k.geom.kw) == (1, 1)
    S = choose_split_k(M, N, K, GB, SPLIT_K_CHUNK_1X1 if pointwise else SPLIT_K_CHUNK)
    if S > 1 and isinstance(k, Conv2dInputGradKernel) and k.geom.stride != (1, 1):
        S = -(-k.geom.og // -(-k.geom.og // S))  # whole channel chunks, none empty
    return k if S == 1 else dataclasses.replace(k, split_k=S)


def _make_weight_grad(attrs, inputs, outputs):
    x, dy = inputs
    kh, kw = attrs["kernel_size"]
    w_shape = (dy.shape[1], x.shape[1] // attrs["groups"], kh, kw)
    geom = _geom(x.shape, w_shape, dy.shape, attrs)
    return Conv2dWeightGradKernel(geom, x, dy, int(attrs["split"]), out_dtype=outputs[0].dtype)


# epilogue fusion: ReLU/SiLU/residual after a conv run inside the conv kernel
def gemm_shape(k) -> tuple[int, int, int, int]:
    """(M, N, K, GB) of the implicit GEMM a conv description runs (K per split chunk or phase,
    at most), for choosing and enumerating tile configurations."""
    G = k.geom
    khw = G.kh * G.kw
    if isinstance(k, Conv2dKernel):
        S = k.split_k
        return G.og, G.n * G.oh * G.ow, split_chunk(G.cg * khw, S), G.groups * S
    if isinstance(k, Conv2dWeightGradKernel):
        S = max(1, int(k.split))
        return G.og, G.cg * khw, -(-G.n * G.oh * G.ow // S), G.groups * S
    (sh_, sw_), (dh, dw) = G.stride, G.dilation
    S = k.split_k
    if (sh_, sw_) == (1, 1) or k.naive:
        return G.cg, G.n * G.h * G.w, split_chunk(G.og * khw, S), G.groups * S
    hrows = _phase_table(G.h, G.kh, sh_, G.pad[0][0], dh)[0]
    wrows = _phase_table(G.w, G.kw, sw_, G.pad[1][0], dw)[0]
    N = G.n * max(r[0] for r in hrows) * max(r[0] for r in wrows)
    kmax = G.og * max(r[2] for r in hrows) * max(r[2] for r in wrows)
    return G.cg, N, -(-kmax // S), G.groups * _active_phases(hrows, wrows) * S


def _active_phases(hrows, wrows) -> int:
    """Phases that receive any tap (the others only store zeros: a 1×1 stride-2 input gradient
    has one of four), the GEMMs that count when sizing tiles and split-K."""
    return max(1, sum(1 for r in hrows if r[2]) * sum(1 for r in wrows if r[2]))


def conv_candidates(k, target) -> list:
    """The tuner's hook: ``k`` with each tile configuration worth timing (the heuristic's
    first), those the target's workgroup limits allow."""
    M, N, K, GB = gemm_shape(k)
    store = target.lim("max_compute_workgroup_storage_size")
    inv = target.lim("max_compute_invocations_per_workgroup")
    cfgs = [choose_cfg(M, N, K, GB, k.tile)] if k.tile else []
    cfgs += _candidate_cfgs(M, N, K, GB, *staging(k))
    out = []
    for c in cfgs:
        if c.storage() <= store and c.threads <= inv:
            d = dataclasses.replace(k, tile=c.tuple())
            if d not in out:
                out.append(d)
    return out[:8]


register("conv2d", Conv2dKernel, emit_forward, _make_forward, epilogue=conv2d_with_epilogue,
         candidates=conv_candidates)
register("conv2d_input_grad", Conv2dInputGradKernel, emit_input_grad, _make_input_grad,
         candidates=conv_candidates)
register("conv2d_weight_grad", Conv2dWeightGradKernel, emit_weight_grad, _make_weight_grad,
         candidates=conv_candidates)
