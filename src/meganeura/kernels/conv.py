"""Convolution kernels (NCHW) as implicit GEMMs: forward (bias and an optional pointwise
epilogue fused), input gradient and weight gradient — one tiled kernel template, three ways of
addressing its operands.  No im2col buffer is built: each K step stages a BK-deep slice of both
GEMM operands into workgroup memory straight from the tensors (padding reads as zero), then
every invocation accumulates a (TM/16)×(TN/16) block of the output tile in registers.

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

from collections.abc import Callable
from dataclasses import dataclass

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
    pow2ceil,
    store_value,
    u,
    view4,
)
from .ir import Instr, KernelSpec, Strided

THREADS = 16  # 16 x 16 invocations per workgroup
BK = 16  # K step staged per barrier
TILE_SIZES = (16, 32, 64)


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
                        out_dtype, desc.tile, name="conv2d_ep")


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


@dataclass
class _Gemm:
    name: str
    M: int
    N: int
    K: int | None  # None: the K range comes from kbeg/kend lines (split chunks)
    GB: int  # independent GEMMs (groups × splits)
    tile: tuple[int, int]
    A: _Operand
    B: _Operand
    gb_lines: Callable  # (lines, ind) -> decompose ``gb`` into the kernel's own indices
    krange: Callable | None  # (lines, ind) -> defines kbeg, kend (runtime, uniform)
    store: Callable  # (lines, ind, r, col, acc, helpers)
    # Runtime (workgroup-uniform) column count, a WGSL expression defined by gb_lines; ``N`` is
    # then its maximum (for the grid).
    n_bound: str | None = None


def choose_tile(M: int, N: int, forced=()) -> tuple[int, int]:
    """(TM, TN): 8 rows when M ≤ 8 (threads 8 × 32), else 16–64; columns up to 64 (128 for
    8-row tiles).  ``forced`` overrides (any pair from ``TILES``)."""
    if forced:
        forced = tuple(forced)
        if forced not in TILES:
            raise CodegenError(f"conv tile must be one of {sorted(TILES)}, got {forced}")
        return forced
    if M <= 8:
        return 8, 32 * min(4, pow2ceil(-(-N // 32)))
    return (16 * min(4, pow2ceil(-(-M // 16))), 16 * min(4, pow2ceil(-(-N // 16))))


# (TM, TN) -> invocation rows TY (columns TX = 256 / TY); each invocation computes
# (TM / TY) × (TN / TX) results: contiguous rows and columns, read from workgroup memory as vec4
# where that count is a multiple of 4.
TILES = {(8, 32): 8, (8, 64): 8, (8, 128): 8}
TILES.update({(tm, tn): 16 for tm in TILE_SIZES for tn in TILE_SIZES})


class _GemmGen:
    """The implicit-GEMM kernel of ``gm`` in steps: tile head, hoisted staging maps, K steps
    (stage both operands, multiply-accumulate from workgroup memory), K loop, stores."""

    def __init__(self, gm: _Gemm, t):
        self.gm = gm
        self.TM, self.TN = gm.tile
        self.nth = THREADS * THREADS
        self.TY = TILES[(self.TM, self.TN)]
        self.TX = self.nth // self.TY
        self.RM, self.RN = self.TM // self.TY, self.TN // self.TX
        self.mt, self.nt = -(-gm.M // self.TM), -(-gm.N // self.TN)
        self.grid = make_grid(gm.name, self.mt * self.nt * gm.GB, t)
        self.live = "" if self.grid.exact else "live"
        self.vec_a, self.vec_b = self.RM % 4 == 0, self.RN % 4 == 0

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
        L.append(f"{ind}let tx = lid % {u(self.TX)};")
        L.append(f"{ind}let ty = lid / {u(self.TX)};")
        L.append(f"{ind}let row0 = tm * {u(self.TM)};")
        L.append(f"{ind}let col0 = tn * {u(self.TN)};")

    def staging_maps(self, L: list[str], ind: str) -> None:
        """What staging needs that is independent of k0, hoisted: each invocation's staged
        rows/columns (and the operand's lets depending on them only) and their validity."""
        gm, nth = self.gm, self.nth
        self.plan = []
        for which, op, T, lim in (("a", gm.A, self.TM, u(gm.M)),
                                  ("b", gm.B, self.TN, gm.n_bound or u(gm.N))):
            n_el = T * BK
            for l in range(-(-n_el // nth)):
                e = f"(lid + {u(l * nth)})" if l else "lid"
                rn, kn = f"s{which}r{l}", f"s{which}k{l}"
                if op.k_fast:
                    L.append(f"{ind}let {kn} = {e} % {u(BK)};")
                    L.append(f"{ind}let {rn} = {e} / {u(BK)};")
                else:
                    L.append(f"{ind}let {rn} = {e} % {u(T)};")
                    L.append(f"{ind}let {kn} = {e} / {u(T)};")
                tag = f"{which}{l}"
                L.append(f"{ind}let g{tag} = {'row0' if which == 'a' else 'col0'} + {rn};")
                op.hoist(f"g{tag}", tag, L, ind)
                L.append(f"{ind}let ok{tag} = g{tag} < {lim}{' && live' if self.live else ''};")
                partial = (l + 1) * nth > n_el  # the last round stages fewer elements
                self.plan.append((which, l, rn, kn, op, T, partial, n_el))

    @staticmethod
    def _sh(arr: str, T: int, vec: bool, k: str, x: str) -> str:
        if vec:
            return f"{arr}[{k} * {u(T // 4)} + {x} / 4u][{x} % 4u]"
        return f"{arr}[{k} * {u(T)} + {x}]"

    def _stage(self, out: list[str], ii: str, check_k: bool, kend: str) -> None:
        """Copy step k0's slices of both operands into workgroup memory (zero outside)."""
        for which, l, rn, kn, op, T, partial, n_el in self.plan:
            tag, jj = f"{which}{l}", ii
            kv = f"k{tag}"
            if partial:
                out.append(f"{ii}if (lid + {u(l * self.nth)} < {u(n_el)}) {{")
                jj = ii + "    "
            out.append(f"{jj}let {kv} = k0 + {kn};")
            cond, idx = op.load(kv, tag, out, jj)
            conds = [f"ok{tag}"] + ([f"{kv} < {kend}"] if check_k else []) + (
                [cond] if cond else [])
            out.append(f"{jj}var v{tag}: f32 = 0.0;")
            out.append(f"{jj}if ({' && '.join(conds)}) {{")
            out.append(f"{jj}    v{tag} = {_read(op.binding, idx, op.dtype)};")
            out.append(f"{jj}}}")
            arr, vec = ("As", self.vec_a) if which == "a" else ("Bs", self.vec_b)
            out.append(f"{jj}{self._sh(arr, T, vec, kn, rn)} = v{tag};")
            if partial:
                out.append(f"{ii}}}")

    def _mma(self, out: list[str], ii: str) -> None:
        """acc += As·Bs over the staged BK-deep slices (vec4 reads where possible)."""
        jj = ii + "    "
        out.append(f"{ii}for (var kk: u32 = 0u; kk < {u(BK)}; kk = kk + 1u) {{")
        for arr, R, T, vec, who, th in (("As", self.RM, self.TM, self.vec_a, "ra", "ty"),
                                        ("Bs", self.RN, self.TN, self.vec_b, "rb", "tx")):
            if vec:
                for q in range(R // 4):
                    out.append(f"{jj}let {who}4_{q} = {arr}[kk * {u(T // 4)} + {th} * "
                               f"{u(R // 4)} + {u(q)}];")
                for i in range(R):
                    out.append(f"{jj}let {who}{i} = {who}4_{i // 4}.{'xyzw'[i % 4]};")
            else:
                for i in range(R):
                    off = f"{th} * {u(R)} + {u(i)}" if R > 1 else th
                    out.append(f"{jj}let {who}{i} = {arr}[kk * {u(T)} + {off}];")
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
        """Whole BK steps unguarded in k, then one guarded tail step; the K range is
        constant, or ``kbeg``/``kend`` from ``krange`` (split chunks, phases)."""
        gm, i2 = self.gm, ind + "    "
        if gm.K is not None:
            K = gm.K
            kf = K - K % BK
            if kf:
                L.append(f"{ind}for (var k0: u32 = 0u; k0 < {u(kf)}; k0 = k0 + {u(BK)}) {{")
                self.step(L, i2, False, u(K))
                L.append(f"{ind}}}")
            if kf != K:
                L.append(f"{ind}{{")
                L.append(f"{i2}let k0 = {u(kf)};")
                self.step(L, i2, True, u(K))
                L.append(f"{ind}}}")
            return
        gm.krange(L, ind)  # defines kbeg, kend (uniform)
        L.append(f"{ind}var k0: u32 = kbeg;")
        L.append(f"{ind}loop {{")
        L.append(f"{i2}if (k0 + {u(BK)} > kend) {{")
        L.append(f"{i2}    break;")
        L.append(f"{i2}}}")
        self.step(L, i2, False, "kend")
        L.append(f"{i2}k0 = k0 + {u(BK)};")
        L.append(f"{ind}}}")
        L.append(f"{ind}if (k0 < kend) {{")
        self.step(L, i2, True, "kend")
        L.append(f"{ind}}}")

    def stores(self, L: list[str], ind: str, helpers: set) -> None:
        gm = self.gm
        for i in range(self.RM):
            L.append(f"{ind}let r{i} = row0 + ty * {u(self.RM)} + {u(i)};")
        for j in range(self.RN):
            L.append(f"{ind}let n{j} = col0 + tx * {u(self.RN)} + {u(j)};")
        for i in range(self.RM):
            for j in range(self.RN):
                conds = [f"r{i} < {u(gm.M)}"] if gm.M % self.TM else []
                if gm.n_bound:
                    conds.append(f"n{j} < {gm.n_bound}")
                elif gm.N % self.TN:
                    conds.append(f"n{j} < {u(gm.N)}")
                if self.live:
                    conds.append("live")
                L.append(f"{ind}if ({' && '.join(conds)}) {{" if conds else f"{ind}{{")
                gm.store(L, ind + "    ", f"r{i}", f"n{j}", f"acc{i}_{j}", helpers)
                L.append(f"{ind}}}")


def _emit_gemm(gm: _Gemm, t) -> tuple[list[str], list[str], int, object, set]:
    ind = "    "
    g = _GemmGen(gm, t)
    L: list[str] = []
    g.head(L, ind)
    g.staging_maps(L, ind)
    for i in range(g.RM):
        for j in range(g.RN):
            L.append(f"{ind}var acc{i}_{j}: f32 = 0.0;")
    g.k_loop(L, ind)
    helpers: set[str] = set()
    g.stores(L, ind, helpers)
    TM, TN = gm.tile
    ta = f"array<vec4<f32>, {BK * TM // 4}>" if g.vec_a else f"array<f32, {BK * TM}>"
    tb = f"array<vec4<f32>, {BK * TN // 4}>" if g.vec_b else f"array<f32, {BK * TN}>"
    shared = [f"var<workgroup> As: {ta};", f"var<workgroup> Bs: {tb};"]
    nbytes = 4 * BK * (TM + TN)
    check_workgroup_storage(gm.name, nbytes, t)
    check_invocations(gm.name, g.nth, t)
    return L, shared, nbytes, g.grid, helpers


def _module(name, bd, extra_dts, body, shared, nbytes, grid, helpers, t, meta) -> KernelSpec:
    check_bindings(name, len(bd.dtypes), t)
    uses_f16 = check_dtypes(name, bd.dtypes + list(extra_dts), t)
    lines = module_source(module_header(uses_f16) + bd.decls() + shared, helpers,
                          THREADS * THREADS, body)
    meta = dict(meta, workgroup_size=THREADS * THREADS, workgroup_storage=nbytes,
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
    check_binding_size(name, "output", G.n * G.o * G.oh * G.ow, out_dt, t)
    return sx, sw, sb, xs, op_dt, out_dt


def _forward_operands(k: Conv2dKernel, sx, sw, bd: Bindings, op_dt) -> tuple[_Operand, _Operand]:
    """A = the weight (rows o, k = (c, i, j)), B = the input (columns (n, oh, ow))."""
    G, x, w = k.geom, k.x, k.w
    sh_, sw_ = G.stride
    pt, pl = G.pad[0][0], G.pad[1][0]
    ohw = G.oh * G.ow
    k_linear = (sw[1], sw[2], sw[3]) == (G.kh * G.kw, G.kw, 1)

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

    return (_Operand(bd.name(1), op_dt, not (sw[0] == 1 and G.og > 1), a_hoist, a_load),
            _Operand(bd.name(0), op_dt, False, b_hoist, b_load))


def _forward_store(k: Conv2dKernel, bd: Bindings, sb, xs, op_dt, out_dt):
    """Bias, the fused epilogue (extra inputs read at the output element) and the store."""
    G = k.geom
    ohw = G.oh * G.ow
    n_in = 2 + (k.bias is not None)

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
            v = f"{acc} + {_read(bd.name(2), _lin([('o', sb[0])], k.bias.offset), op_dt)}"
        L.append(f"{ind}let accf: f32 = {v};")
        val, vdt = epilogue(L, ind, helpers) if k.epilogue else ("accf", f32)
        oidx = _lin([("sn", G.o * ohw), ("o", ohw), ("sq", 1)])
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

    def gb_lines(L, ind):
        L.append(f"{ind}let gi = gbc;")

    A, B = _forward_operands(k, sx, sw, bd, op_dt)
    tile = choose_tile(M, N, k.tile)
    gm = _Gemm(name, M, N, K, G.groups, tile, A, B, gb_lines, None,
               _forward_store(k, bd, sb, xs, op_dt, out_dt))
    body, shared, nbytes, grid, helpers = _emit_gemm(gm, t)
    return _module(name, bd, [i.dtype for i in k.epilogue], body, shared, nbytes, grid,
                   helpers, t, {"archetype": "conv2d", "tile": tile,
                                "flops": 2 * M * N * K * G.groups})


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
    check_binding_size(name, "output", G.n * G.c * G.h * G.w, out_dt, t)
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

    def gb_lines(L, ind):
        L.append(f"{ind}let gi = gbc;")

    def store(L, ind, r, col, acc, helpers):
        L.append(f"{ind}let sn = {col} / {u(hw)};")
        L.append(f"{ind}let sq = {col} % {u(hw)};")
        oidx = _lin([("sn", G.c * hw), (f"(gi * {u(G.cg)} + {r})", hw), ("sq", 1)])
        L.append(f"{ind}{bd.name(2)}[{oidx}] = {store_value(acc, f32, out_dt)};")

    if (sh_, sw_) != (1, 1) and not k.naive:
        return _input_grad_phases(k, t, sd, sw, out_dt, bd)
    A = _Operand(bd.name(1), op_dt, not (sw[1] == 1 and G.cg > 1), a_hoist, a_load)
    B = _Operand(bd.name(0), op_dt, False, b_hoist, b_load)
    tile = choose_tile(M, N, k.tile)
    gm = _Gemm(name, M, N, K, G.groups, tile, A, B, gb_lines, None, store)
    body, shared, nbytes, grid, helpers = _emit_gemm(gm, t)
    return _module(name, bd, [], body, shared, nbytes, grid, helpers, t,
                   {"archetype": "conv2d_input_grad", "tile": tile,
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


def _phase_lines(G: ConvGeom, hrows, wrows, L: list[str], ind: str) -> None:
    """Workgroup -> (group ``gi``, phase (rh, rw)) and that phase's positions, first tap, tap
    count and first output offset per axis."""
    L.append(f"{ind}let gi = gbc % {u(G.groups)};")
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

    def gb_lines(L, ind):
        _phase_lines(G, hrows, wrows, L, ind)

    def krange(L, ind):
        L.append(f"{ind}let kbeg = 0u;")
        L.append(f"{ind}let kend = {u(G.og)} * nth * ntw;")

    a_hoist = _weight_rows(G, sw, w)

    def a_load(kv, tag, L, ind):
        o, ta, tb = _taps(kv, f"w{tag}", L, ind)
        i, j = f"(i0h + {_mul(ta, hstep)})", f"(i0w + {_mul(tb, wstep)})"
        return "", _lin([(o, sw[0]), (i, sw[2]), (j, sw[3])], f"ab{tag}")

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

    def store(L, ind, r, col, acc, helpers):
        L.append(f"{ind}let sn = {col} / qhw;")
        L.append(f"{ind}let sq = {col} % qhw;")
        L.append(f"{ind}let sh = rh + {u(sh_)} * (sq / max(qw, 1u));")
        L.append(f"{ind}let sw = rw + {u(sw_)} * (sq % max(qw, 1u));")
        oidx = _lin([("sn", G.c * hw), (f"(gi * {u(G.cg)} + {r})", hw), ("sh", G.w), ("sw", 1)])
        L.append(f"{ind}{bd.name(2)}[{oidx}] = {store_value(acc, f32, out_dt)};")

    A = _Operand(bd.name(1), op_dt, True, a_hoist, a_load)
    B = _Operand(bd.name(0), op_dt, False, b_hoist, b_load)
    tile = choose_tile(M, N, k.tile)
    gm = _Gemm(name, M, N, None, G.groups * sh_ * sw_, tile, A, B, gb_lines, krange, store,
               n_bound="ncol")
    body, shared, nbytes, grid, helpers = _emit_gemm(gm, t)
    return _module(name, bd, [], body, shared, nbytes, grid, helpers, t,
                   {"archetype": "conv2d_input_grad", "tile": tile, "phases": sh_ * sw_,
                    "flops": 2 * M * N * kmax * G.groups * sh_ * sw_})

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
    tile = choose_tile(M, N, k.tile)
    if S == 1:
        gm = _Gemm(name, M, N, KT, G.groups, tile, A, B, gb_lines, None, store)
    else:
        gm = _Gemm(name, M, N, None, G.groups * S, tile, A, B, gb_lines, krange, store)
    body, shared, nbytes, grid, helpers = _emit_gemm(gm, t)
    return _module(name, bd, [], body, shared, nbytes, grid, helpers, t,
                   {"archetype": "conv2d_weight_grad", "tile": tile, "split": S,
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
    return Conv2dKernel(geom, x, w, bias, out_dtype=outputs[0].dtype)


def _make_input_grad(attrs, inputs, outputs):
    dy, w = inputs
    geom = _geom(outputs[0].shape, w.shape, dy.shape, attrs)
    return Conv2dInputGradKernel(geom, dy, w, out_dtype=outputs[0].dtype)


def _make_weight_grad(attrs, inputs, outputs):
    x, dy = inputs
    kh, kw = attrs["kernel_size"]
    w_shape = (dy.shape[1], x.shape[1] // attrs["groups"], kh, kw)
    geom = _geom(x.shape, w_shape, dy.shape, attrs)
    return Conv2dWeightGradKernel(geom, x, dy, int(attrs["split"]), out_dtype=outputs[0].dtype)


# epilogue fusion: ReLU/SiLU/residual after a conv run inside the conv kernel
register("conv2d", Conv2dKernel, emit_forward, _make_forward, epilogue=conv2d_with_epilogue)
register("conv2d_input_grad", Conv2dInputGradKernel, emit_input_grad, _make_input_grad)
register("conv2d_weight_grad", Conv2dWeightGradKernel, emit_weight_grad, _make_weight_grad)
