"""Flash-attention kernels (forward, and the two backward kernels), registered as archetypes.

Semantics are those of ``ops/attention.py``: score = scale·q·k + mask; a key is hidden by the
causal/window rules or by a -inf score; a row with no visible key outputs 0 and lse = -inf.

Rows.  For the forward and dQ kernels the rows of a tile are *packed* (query position, group
member) pairs of one kv head: packed row R of kv head h is query position R // G of query head
h·G + R % G (G = Hq / Hkv).  Grouped-query heads therefore share every K/V tile a workgroup loads,
and decoding (Sq = 1) still fills G rows.

``attention_fwd`` — one workgroup per (batch, kv head, block of BQ packed rows); TPR invocations
per row.  Q (pre-scaled) is staged once; the loop walks the key range the block can see (causal
and window bounds skip whole tiles) in tiles of BK keys: K and V tiles are staged through
workgroup memory, each invocation computes BK/TPR scores of its row into a score tile, then every
invocation of a row reads the row's scores, updates the running max m and sum l (online
softmax) and accumulates P·V for its own output columns.  Writes out and lse = m + log l.

``attention_grad_dq`` — same tiling as the forward: per key tile, P = exp(s - lse), dP = dO·Vᵀ,
dS = P·(dP - delta) into the score tile, dQ += dS·K in registers; dQ·scale stored at the end.

``attention_grad_dkdv`` — one workgroup per (batch, kv head, block of BKV keys), TPR invocations
per key.  K (pre-scaled) and V stay in workgroup memory; the loop walks the packed query rows that
can see the block (all G query heads of the group: dK/dV of a kv head are complete sums, no
atomics) in chunks of BQ rows: Q, dO, lse and delta are staged, each invocation computes P and dS
for BQ/TPR (key, row) pairs into tiles, then dV += Pᵀ·dO and dK += dSᵀ·Q for its own columns.

``delta = rowsum(dO·O)`` is an ordinary fused reduce kernel (built by the op's VJP).  All sums are
in a fixed order (deterministic).  Inputs are read in place through their strides (views of
(B, S, H, D) projections need no copy); the mask is read through broadcast strides.  Head dims
divisible by 4 use vec4 workgroup tiles; rows of every tile are padded by one unit against bank
conflicts.  Tile sizes are chosen from the device's workgroup-storage limit (32 KiB on lavapipe,
48 KiB on the H200: BQ = 32, BK = 32 for D = 64) and shrink for small problems (decode) so that
enough workgroups exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DType, f16, f32
from .archetypes import register
from .common import (
    Bindings,
    CodegenError,
    bcast_strides,
    check_bindings,
    check_dtypes,
    check_extent,
    check_invocations,
    check_workgroup_storage,
    index_code,
    make_grid,
    make_target,
    module_header,
    module_source,
    pow2ceil,
    u,
)
from .ir import KernelSpec, Strided

FLT_MAX = "3.4028234663852886e38"
MIN_WORKGROUPS = 256  # shrink tiles (down to a floor) until a problem has this many workgroups


@dataclass(frozen=True)
class AttentionKernel:
    kind: str  # "fwd" | "dq" | "dkdv"
    q: Strided
    k: Strided
    v: Strided
    mask: Strided | None
    dout: Strided | None
    lse: Strided | None
    delta: Strided | None
    causal: bool
    scale: float
    window: int
    q_offset: int
    name: str = "attention"
    # dkdv only: one work item per query head (outputs (B, Hq, Skv, ·), summed by the caller)
    split_heads: bool = False
    # force a tile configuration (tests): (rows per block, keys per tile / chunk)
    tiles: tuple[int, int] = (0, 0)
    # fwd only: store the output as (B, Sq, Hq, Dv) instead of (B, Hq, Sq, Dv), the layout the
    # output projection reads (the planner then needs no transposing copy)
    out_bshd: bool = False


# One description type per family (the registry maps types to families); ``kind`` still says
# which kernel, so a plain ``AttentionKernel`` emits through ``attention.emit`` as well.
class AttentionFwdKernel(AttentionKernel):
    pass


class AttentionGradDqKernel(AttentionKernel):
    pass


class AttentionGradDkdvKernel(AttentionKernel):
    pass


KIND_TYPES = {"fwd": AttentionFwdKernel, "dq": AttentionGradDqKernel,
              "dkdv": AttentionGradDkdvKernel}


def _f(x: float) -> str:
    return f"{float(x):.9e}f"


def _i(n: int) -> str:
    return f"({int(n)}i)"


def _vt(w: int) -> str:
    return "vec4<f32>" if w == 4 else "f32"


def _dot(w: int, a: str, b: str) -> str:
    return f"dot({a}, {b})" if w == 4 else f"({a} * {b})"


def _cell(arr: str, w: int, unit_idx: str, comp: str) -> str:
    return f"{arr}[{unit_idx}][{comp}]" if w == 4 else f"{arr}[{unit_idx}]"


# ------------------------------------------------------------------------------ tile choice


def _units(d: int) -> tuple[int, int, int]:
    """(vector width, units per row, padded units per row)."""
    w = 4 if d % 4 == 0 else 1
    return w, d // w, d // w + 1


def _tpr(rows_per_block: int) -> int:
    """Invocations per row: 8 (4+ scores and 2+ output vec4 each at D = 64), more for blocks
    of very few rows (decoding) so a workgroup still has 32-64 invocations."""
    return max(8, min(32, 64 // max(rows_per_block, 1)))


def rows_config(kind: str, rows: int, n_bh: int, D: int, Dv: int, storage: int,
                forced=(0, 0)) -> tuple[int, int, int]:
    """(BQ rows per block, TPR invocations per row, BK keys per tile) for fwd/dq."""
    wd, _, dp = _units(D)
    wv, _, vp = _units(Dv)
    dpf, vpf = dp * wd, vp * wv  # padded row lengths in floats

    def floats(bq, bk):
        n = bq * dpf + bk * dpf + bk * vpf + bq * (bk + 1) + 4 * 32
        n += bq * vpf if kind == "dq" else 256
        return n

    bq_max = 32 if kind == "fwd" else 16
    bq = forced[0] or min(bq_max, pow2ceil(rows))
    if not forced[0]:
        while bq > 8 and n_bh * -(-rows // bq) < MIN_WORKGROUPS:
            bq //= 2
    while True:
        tpr = _tpr(bq)
        for bk in ((forced[1],) if forced[1] else (64, 32, 16, 8)):
            t = min(tpr, bk)
            if 4 * floats(bq, bk) <= storage:
                return bq, t, bk
        if bq == 1 or forced[0]:
            raise CodegenError(f"attention {kind}: no tile configuration fits {storage} bytes of "
                               f"workgroup storage (D={D}, Dv={Dv})")
        bq //= 2


def keys_config(rows: int, skv: int, n_bh: int, D: int, Dv: int, storage: int,
                forced=(0, 0)) -> tuple[int, int, int]:
    """(BKV keys per block, TPR invocations per key, BQ packed query rows per chunk) for dkdv."""
    wd, _, dp = _units(D)
    wv, _, vp = _units(Dv)
    dpf, vpf = dp * wd, vp * wv

    def floats(bkv, bq):
        return bkv * (dpf + vpf) + bq * (dpf + vpf) + 2 * bq + 2 * bkv * (bq + 1) + 4 * 32

    bkv = forced[0] or min(32, pow2ceil(skv))
    if not forced[0]:
        while bkv > 16 and n_bh * -(-skv // bkv) < MIN_WORKGROUPS:
            bkv //= 2
    while True:
        tpr = _tpr(bkv)
        for bq in ((forced[1],) if forced[1] else (32, 16, 8, 4, 2, 1)):
            bq = min(bq, pow2ceil(rows)) if not forced[1] else bq
            t = min(tpr, bq)
            if 4 * floats(bkv, bq) <= storage:
                return bkv, t, bq
        if bkv == 1 or forced[0]:
            raise CodegenError(f"attention dkdv: no tile configuration fits {storage} bytes of "
                               f"workgroup storage (D={D}, Dv={Dv})")
        bkv //= 2


# ------------------------------------------------------------------------------ emission


class _Gen:
    def __init__(self, k: AttentionKernel, t, alias=None):
        self.k, self.t = k, t
        q, kk, v = k.q, k.k, k.v
        if len(q.shape) != 4 or len(kk.shape) != 4 or len(v.shape) != 4:
            raise CodegenError(f"kernel {k.name!r}: q, k, v must be rank-4 views")
        self.B, self.Hq, self.Sq, self.D = q.shape
        _, self.Hkv, self.Skv, _ = kk.shape
        self.Dv = v.shape[3]
        self.G = self.Hq // self.Hkv
        self.rows = self.G * self.Sq
        self.dt: DType = q.dtype
        for s, what, shape in ((q, "q", q.shape), (kk, "k", kk.shape), (v, "v", v.shape)):
            check_extent(k.name, what, s, shape, s.strides, t)
        full = (self.B, self.Hq, self.Sq, self.Skv)
        self.mst = bcast_strides(k.mask, full, f"{k.name} mask") if k.mask is not None else None
        if k.mask is not None:
            check_extent(k.name, "mask", k.mask, full, self.mst, t)
        names = ["q", "k", "v"] + (["mask"] if k.mask is not None else [])
        dts = [q.dtype, kk.dtype, v.dtype] + ([k.mask.dtype] if k.mask is not None else [])
        if k.kind != "fwd":
            for s, what in ((k.dout, "dout"), (k.lse, "lse"), (k.delta, "delta")):
                names.append(what)
                dts.append(s.dtype)
            self.dost = bcast_strides(k.dout, (self.B, self.Hq, self.Sq, self.Dv), "dout")
            self.lst = bcast_strides(k.lse, (self.B, self.Hq, self.Sq), "lse")
            self.dlst = bcast_strides(k.delta, (self.B, self.Hq, self.Sq), "delta")
        outs = {"fwd": ["out", "lse_out"], "dq": ["dq"], "dkdv": ["dk", "dv"]}[k.kind]
        self.dts = dts + [self.dt] * len(outs)
        self.bd = Bindings(self.dts, alias)
        self.bind = {n: self.bd.name(i) for i, n in enumerate(names + outs)}
        self.wd, self.du, self.dp = _units(self.D)
        self.wv, self.vu, self.vp = _units(self.Dv)

    # -- element access --------------------------------------------------------------------
    def ld(self, name: str, idx: str, dt: DType) -> str:
        x = f"{self.bind[name]}[{idx}]"
        return x if dt is f32 else f"f32({x})"

    def qidx(self, b, h, i, d):
        s = self.k.q
        return index_code([b, h, i, d], s.strides, s.offset)

    def kvidx(self, which, b, h, j, d):
        s = self.k.k if which == "k" else self.k.v
        return index_code([b, h, j, d], s.strides, s.offset)

    def midx(self, b, h, i, j):
        return index_code([b, h, i, j], self.mst, self.k.mask.offset)

    def vis_terms(self, j: str, pos: str) -> list[str]:
        """Causal/window visibility of key ``j`` (i32) from absolute query position ``pos``."""
        out = []
        if self.k.causal:
            out.append(f"{j} <= {pos}")
        if self.k.window:
            out.append(f"{j} > {pos} - {_i(self.k.window)}")
        return out

    def stage(self, L, ind, arr, nrows, dim, w, rs, pre, valid, src, scale=None):
        """Copy ``nrows`` x ``dim`` elements into workgroup array ``arr`` (row stride ``rs``
        units of width ``w``).  ``pre(rr)``: lines deriving coordinates from local row ``rr``;
        ``valid``: condition; ``src(dd)``: value expression (f32)."""
        wg = self.wg
        total = nrows * dim
        i2, i3 = ind + "    ", ind + "        "
        L.append(f"{ind}for (var e: u32 = lid; e < {u(total)}; e = e + {u(wg)}) {{")
        L.append(f"{i2}let rr = e / {u(dim)};")
        L.append(f"{i2}let dd = e % {u(dim)};")
        L += [i2 + x for x in pre("rr")]
        L.append(f"{i2}var x: f32 = 0.0;")
        L.append(f"{i2}if ({valid}) {{")
        val = src("dd")
        if scale is not None:
            val = f"{val} * {_f(scale)}"
        L.append(f"{i3}x = {val};")
        L.append(f"{i2}}}")
        unit = f"rr * {u(rs)} + dd / {u(w)}" if w == 4 else f"rr * {u(rs)} + dd"
        L.append(f"{i2}{_cell(arr, w, unit, 'dd % 4u')} = x;")
        L.append(f"{ind}}}")

    def packed(self, R: str, prefix: str) -> list[str]:
        """Lines: query position ``{prefix}i`` and query head ``{prefix}h`` of packed row R."""
        G = self.G
        if self.k.split_heads:
            return [f"let {prefix}i = {R};", f"let {prefix}h = hq_w;"]
        if G == 1:
            return [f"let {prefix}i = {R};", f"let {prefix}h = hkv;"]
        return [f"let {prefix}i = {R} / {u(G)};", f"let {prefix}h = hkv * {u(G)} + {R} % {u(G)};"]


def _shared(L, name, w, n_units):
    L.append(f"var<workgroup> {name}: array<{_vt(w)}, {max(1, n_units)}>;")


def _rows_kernel(g: _Gen, t) -> tuple[list[str], int, object, dict]:
    """Forward and dQ: blocks of packed query rows looping over key tiles."""
    k = g.k
    kind = k.kind
    storage = t.lim("max_compute_workgroup_storage_size")
    BQ, TPR, BK = rows_config(kind, g.rows, g.B * g.Hkv, g.D, g.Dv, storage, k.tiles)
    g.wg = WG = BQ * TPR
    NB = -(-g.rows // BQ)
    total = NB * g.B * g.Hkv
    grid = make_grid(k.name, total, t)
    wd, du, dp = g.wd, g.du, g.dp
    wv, vu, vp = g.wv, g.vu, g.vp
    BKp = BK + 1
    NS = BK // TPR
    S = []
    _shared(S, "Qs", wd, BQ * dp)
    _shared(S, "Ks", wd, BK * dp + TPR)
    _shared(S, "Vs", wv, BK * vp + TPR)
    _shared(S, "Ss", 1, BQ * BKp)
    if kind == "dq":
        _shared(S, "Os", wv, BQ * vp)
    else:
        _shared(S, "Red", 1, WG)
    words = BQ * dp * wd + (BK * dp + TPR) * wd + (BK * vp + TPR) * wv + BQ * BKp
    words += BQ * vp * wv if kind == "dq" else WG
    ind, i2, i3 = "    ", "        ", "            "
    L = []
    L.append(f"{ind}let wg = {grid.wg_expr};")
    if not grid.exact:
        L.append(f"{ind}if (wg >= {u(total)}) {{ return; }}")
    L.append(f"{ind}let blk = wg % {u(NB)};")
    L.append(f"{ind}let bh = wg / {u(NB)};")
    L.append(f"{ind}let hkv = bh % {u(g.Hkv)};")
    L.append(f"{ind}let b = bh / {u(g.Hkv)};")
    L.append(f"{ind}let r = lid / {u(TPR)};")
    L.append(f"{ind}let c = lid % {u(TPR)};")
    L.append(f"{ind}let R0 = blk * {u(BQ)};")
    L.append(f"{ind}let Rn = min(R0 + {u(BQ)}, {u(g.rows)});")
    L.append(f"{ind}let i_first = i32(R0 / {u(g.G)});")
    L.append(f"{ind}let i_last = i32((Rn - 1u) / {u(g.G)});")
    L.append(f"{ind}var kv_lo: i32 = 0i;")
    L.append(f"{ind}var kv_hi: i32 = {_i(g.Skv)};")
    if k.causal:
        L.append(f"{ind}kv_hi = min(kv_hi, {_i(k.q_offset)} + i_last + 1i);")
    if k.window:
        L.append(f"{ind}kv_lo = max(0i, {_i(k.q_offset)} + i_first - {_i(k.window)} + 1i);")
    L.append(f"{ind}let R = R0 + r;")
    L.append(f"{ind}let row_ok = R < {u(g.rows)};")
    L += [ind + x for x in g.packed("R", "q")]
    L.append(f"{ind}let pos = i32(qi) + {_i(k.q_offset)};")
    # stage Q (pre-scaled) and, for dQ, dO
    pre = lambda rr: [f"let RR = R0 + {rr};"] + g.packed("RR", "s")  # noqa: E731
    g.stage(L, ind, "Qs", BQ, g.D, wd, dp, pre, f"RR < {u(g.rows)}",
            lambda dd: g.ld("q", g.qidx("b", "sh", "si", dd), k.q.dtype), k.scale)
    if kind == "dq":
        g.stage(L, ind, "Os", BQ, g.Dv, wv, vp, pre, f"RR < {u(g.rows)}",
                lambda dd: g.ld("dout", index_code(["b", "sh", "si", dd], g.dost, k.dout.offset),
                                k.dout.dtype))
        L.append(f"{ind}var lse_r: f32 = 0.0;")
        L.append(f"{ind}var delta_r: f32 = 0.0;")
        L.append(f"{ind}if (row_ok) {{")
        L.append(f"{i2}lse_r = {g.ld('lse', index_code(['b', 'qh', 'qi'], g.lst, k.lse.offset), k.lse.dtype)};")  # noqa: E501
        L.append(f"{i2}delta_r = {g.ld('delta', index_code(['b', 'qh', 'qi'], g.dlst, k.delta.offset), k.delta.dtype)};")  # noqa: E501
        L.append(f"{ind}}}")
        L.append(f"{ind}let row_has = row_ok && !(lse_r < -{FLT_MAX});")
        L.append(f"{ind}let lse_s = select(0.0, lse_r, row_has);")
        n_acc, acc_w, acc_u = -(-du // TPR), wd, du
    else:
        L.append(f"{ind}var m: f32 = -{FLT_MAX};")
        L.append(f"{ind}var l: f32 = 0.0;")
        n_acc, acc_w, acc_u = -(-vu // TPR), wv, vu
    for j in range(n_acc):
        L.append(f"{ind}var acc{j}: {_vt(acc_w)} = {_vt(acc_w)}(0.0);")
    # key tiles
    L.append(f"{ind}for (var kt: i32 = kv_lo; kt < kv_hi; kt = kt + {_i(BK)}) {{")
    pre_k = lambda rr: [f"let jj = kt + i32({rr});"]  # noqa: E731
    g.stage(L, i2, "Ks", BK, g.D, wd, dp, pre_k, "jj < kv_hi",
            lambda dd: g.ld("k", g.kvidx("k", "b", "hkv", "u32(jj)", dd), k.k.dtype))
    g.stage(L, i2, "Vs", BK, g.Dv, wv, vp, pre_k, "jj < kv_hi",
            lambda dd: g.ld("v", g.kvidx("v", "b", "hkv", "u32(jj)", dd), k.v.dtype))
    L.append(f"{i2}workgroupBarrier();")
    # scores for this invocation's columns c + TPR * n
    for n in range(NS):
        L.append(f"{i2}var s{n}: f32 = 0.0;")
        if kind == "dq":
            L.append(f"{i2}var p{n}: f32 = 0.0;")
    L.append(f"{i2}for (var d: u32 = 0u; d < {u(du)}; d = d + 1u) {{")
    L.append(f"{i3}let qv = Qs[r * {u(dp)} + d];")
    for n in range(NS):
        col = f"(c + {u(n * TPR)})" if n else "c"
        L.append(f"{i3}s{n} = s{n} + {g_dot(wd, 'qv', f'Ks[{col} * {u(dp)} + d]')};")
    L.append(f"{i2}}}")
    if kind == "dq":
        L.append(f"{i2}for (var d: u32 = 0u; d < {u(vu)}; d = d + 1u) {{")
        L.append(f"{i3}let ov = Os[r * {u(vp)} + d];")
        for n in range(NS):
            col = f"(c + {u(n * TPR)})" if n else "c"
            L.append(f"{i3}p{n} = p{n} + {g_dot(wv, 'ov', f'Vs[{col} * {u(vp)} + d]')};")
        L.append(f"{i2}}}")
    if kind == "fwd":
        L.append(f"{i2}var lm: f32 = -{FLT_MAX};")
    for n in range(NS):
        if kind == "fwd":
            L.append(f"{i2}var x{n}: f32;")
        L.append(f"{i2}{{")
        col = f"(c + {u(n * TPR)})" if n else "c"
        L.append(f"{i3}let col = {col};")
        L.append(f"{i3}let j = kt + i32(col);")
        L.append(f"{i3}var x = s{n};")
        L.append(f"{i3}let inb = row_ok && j < kv_hi;")
        if k.mask is not None:
            L.append(f"{i3}if (inb) {{ x = x + {g.ld('mask', g.midx('b', 'qh', 'qi', 'u32(j)'), k.mask.dtype)}; }}")  # noqa: E501
        vis = " && ".join(["inb"] + g.vis_terms("j", "pos"))
        if kind == "fwd":
            L.append(f"{i3}x{n} = select(-mn_inf(), x, {vis});")
            L.append(f"{i3}lm = max(lm, x{n});")
        else:
            L.append(f"{i3}let ok = {vis} && row_has && !(x < -{FLT_MAX});")
            L.append(f"{i3}let p = select(0.0, exp(select(0.0, x - lse_s, ok)), ok);")
            L.append(f"{i3}Ss[r * {u(BKp)} + col] = p * (p{n} - delta_r);")
        L.append(f"{i2}}}")
    if kind == "fwd":
        L.append(f"{i2}Red[lid] = lm;")
    L.append(f"{i2}workgroupBarrier();")
    if kind == "fwd":
        # row max from the per-invocation maxima, then each invocation turns its own scores
        # into probabilities (one exp per score); the row sum is taken in the P·V loop
        L.append(f"{i2}var mt = m;")
        L.append(f"{i2}for (var cc: u32 = 0u; cc < {u(TPR)}; cc = cc + 1u) {{")
        L.append(f"{i3}mt = max(mt, Red[r * {u(TPR)} + cc]);")
        L.append(f"{i2}}}")
        for n in range(NS):
            col = f"(c + {u(n * TPR)})" if n else "c"
            L.append(f"{i2}Ss[r * {u(BKp)} + {col}] = select(exp(x{n} - mt), 0.0, "
                     f"x{n} < -{FLT_MAX});")
        L.append(f"{i2}workgroupBarrier();")
        L.append(f"{i2}let alpha = exp(m - mt);")
        L.append(f"{i2}l = l * alpha;")
        for j in range(n_acc):
            L.append(f"{i2}acc{j} = acc{j} * alpha;")
        L.append(f"{i2}for (var kk: u32 = 0u; kk < {u(BK)}; kk = kk + 1u) {{")
        L.append(f"{i3}let p = Ss[r * {u(BKp)} + kk];")
        L.append(f"{i3}l = l + p;")
        for j in range(n_acc):
            col = f"c + {u(j * TPR)}" if j else "c"
            L.append(f"{i3}acc{j} = acc{j} + p * Vs[kk * {u(vp)} + {col}];")
        L.append(f"{i2}}}")
        L.append(f"{i2}m = mt;")
    else:
        L.append(f"{i2}for (var kk: u32 = 0u; kk < {u(BK)}; kk = kk + 1u) {{")
        L.append(f"{i3}let x = Ss[r * {u(BKp)} + kk];")
        for j in range(n_acc):
            col = f"c + {u(j * TPR)}" if j else "c"
            L.append(f"{i3}acc{j} = acc{j} + x * Ks[kk * {u(dp)} + {col}];")
        L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")
    # store
    L.append(f"{ind}if (!row_ok) {{ return; }}")
    obase = f"((b * {u(g.Hq)} + qh) * {u(g.Sq)} + qi)"
    rbase = obase  # row of the stored output
    if kind == "fwd":
        L.append(f"{ind}let inv = select(1.0 / l, 0.0, l == 0.0);")
        dim, target, w, scale = g.Dv, "out", wv, "inv"
        if k.out_bshd:
            rbase = f"((b * {u(g.Sq)} + qi) * {u(g.Hq)} + qh)"
    else:
        dim, target, w, scale = g.D, "dq", wd, _f(k.scale)
    for j in range(n_acc):
        col = f"c + {u(j * TPR)}" if j else "c"
        L.append(f"{ind}{{")
        L.append(f"{i2}let cu = {col};")
        guard = (j + 1) * TPR > acc_u
        ii = i3 if guard else i2
        if guard:
            L.append(f"{i2}if (cu < {u(acc_u)}) {{")
        L.append(f"{ii}let val = acc{j} * {scale};")
        for comp in range(w):
            e = f"val[{comp}]" if w == 4 else "val"
            dst = f"{rbase} * {u(dim)} + cu * {u(w)} + {u(comp)}" if w == 4 else \
                f"{rbase} * {u(dim)} + cu"
            L.append(f"{ii}{g.bind[target]}[{dst}] = {_store(e, g.dt)};")
        if guard:
            L.append(f"{i2}}}")
        L.append(f"{ind}}}")
    if kind == "fwd":
        L.append(f"{ind}if (c == 0u) {{")
        L.append(f"{i2}{g.bind['lse_out']}[{obase}] = "
                 f"{_store('select(m + log(l), -mn_inf(), l == 0.0)', g.dt)};")
        L.append(f"{ind}}}")
    meta = {"tiles": (BQ, TPR, BK), "workgroup_storage": 4 * words}
    return S + L, WG, grid, meta, 4 * words


def _keys_kernel(g: _Gen, t):
    """dK/dV: blocks of keys looping over packed query rows."""
    k = g.k
    storage = t.lim("max_compute_workgroup_storage_size")
    split = k.split_heads
    NH = g.Hq if split else g.Hkv  # heads of the work items
    P = 1 if split else g.G  # packed rows per query position
    BKV, TPR, BQ = keys_config(g.Sq * P, g.Skv, g.B * NH, g.D, g.Dv, storage, k.tiles)
    g.wg = WG = BKV * TPR
    NKB = -(-g.Skv // BKV)
    total = NKB * g.B * NH
    grid = make_grid(k.name, total, t)
    wd, du, dp = g.wd, g.du, g.dp
    wv, vu, vp = g.wv, g.vu, g.vp
    BQp = BQ + 1
    NSQ = BQ // TPR
    S = []
    _shared(S, "Ks", wd, BKV * dp)
    _shared(S, "Vs", wv, BKV * vp)
    _shared(S, "Qs", wd, BQ * dp + TPR)
    _shared(S, "Os", wv, BQ * vp + TPR)
    _shared(S, "Ls", 1, BQ)
    _shared(S, "Dl", 1, BQ)
    _shared(S, "Ps", 1, BKV * BQp)
    _shared(S, "Ds", 1, BKV * BQp)
    words = (BKV * dp * wd + BKV * vp * wv + (BQ * dp + TPR) * wd + (BQ * vp + TPR) * wv
             + 2 * BQ + 2 * BKV * BQp)
    ind, i2, i3 = "    ", "        ", "            "
    L = []
    L.append(f"{ind}let wg = {grid.wg_expr};")
    if not grid.exact:
        L.append(f"{ind}if (wg >= {u(total)}) {{ return; }}")
    L.append(f"{ind}let kb = wg % {u(NKB)};")
    L.append(f"{ind}let bh = wg / {u(NKB)};")
    L.append(f"{ind}let hw = bh % {u(NH)};")
    L.append(f"{ind}let b = bh / {u(NH)};")
    if split:
        L.append(f"{ind}let hq_w = hw;")
        L.append(f"{ind}let hkv = hw / {u(g.G)};")
    else:
        L.append(f"{ind}let hkv = hw;")
    L.append(f"{ind}let kr = lid / {u(TPR)};")
    L.append(f"{ind}let c = lid % {u(TPR)};")
    L.append(f"{ind}let j0 = kb * {u(BKV)};")
    L.append(f"{ind}let j1 = min(j0 + {u(BKV)}, {u(g.Skv)});")
    L.append(f"{ind}let jk = j0 + kr;")
    L.append(f"{ind}let key_ok = jk < {u(g.Skv)};")
    L.append(f"{ind}let j = i32(jk);")
    L.append(f"{ind}var i_lo: i32 = 0i;")
    L.append(f"{ind}var i_hi: i32 = {_i(g.Sq)};")
    if k.causal:
        L.append(f"{ind}i_lo = clamp(i32(j0) - {_i(k.q_offset)}, 0i, {_i(g.Sq)});")
    if k.window:
        L.append(f"{ind}i_hi = clamp(i32(j1) - 1i + {_i(k.window)} - {_i(k.q_offset)}, 0i, "
                 f"{_i(g.Sq)});")
    L.append(f"{ind}let R_lo = u32(i_lo) * {u(P)};")
    L.append(f"{ind}let R_hi = u32(max(i_hi, i_lo)) * {u(P)};")
    pre_k = lambda rr: [f"let jj = j0 + {rr};"]  # noqa: E731
    g.stage(L, ind, "Ks", BKV, g.D, wd, dp, pre_k, f"jj < {u(g.Skv)}",
            lambda dd: g.ld("k", g.kvidx("k", "b", "hkv", "jj", dd), k.k.dtype), k.scale)
    g.stage(L, ind, "Vs", BKV, g.Dv, wv, vp, pre_k, f"jj < {u(g.Skv)}",
            lambda dd: g.ld("v", g.kvidx("v", "b", "hkv", "jj", dd), k.v.dtype))
    n_dk, n_dv = -(-du // TPR), -(-vu // TPR)
    for j in range(n_dk):
        L.append(f"{ind}var dk{j}: {_vt(wd)} = {_vt(wd)}(0.0);")
    for j in range(n_dv):
        L.append(f"{ind}var dv{j}: {_vt(wv)} = {_vt(wv)}(0.0);")
    L.append(f"{ind}for (var R0: u32 = R_lo; R0 < R_hi; R0 = R0 + {u(BQ)}) {{")
    L.append(f"{i2}workgroupBarrier();")
    pre = lambda rr: [f"let RR = R0 + {rr};"] + g.packed("RR", "s")  # noqa: E731
    g.stage(L, i2, "Qs", BQ, g.D, wd, dp, pre, "RR < R_hi",
            lambda dd: g.ld("q", g.qidx("b", "sh", "si", dd), k.q.dtype))
    g.stage(L, i2, "Os", BQ, g.Dv, wv, vp, pre, "RR < R_hi",
            lambda dd: g.ld("dout", index_code(["b", "sh", "si", dd], g.dost, k.dout.offset),
                            k.dout.dtype))
    L.append(f"{i2}if (lid < {u(BQ)}) {{")
    L.append(f"{i3}let RR = R0 + lid;")
    L += [i3 + x for x in g.packed("RR", "s")]
    L.append(f"{i3}var lv: f32 = 0.0;")
    L.append(f"{i3}var dv_: f32 = 0.0;")
    L.append(f"{i3}if (RR < R_hi) {{")
    L.append(f"{i3}    lv = {g.ld('lse', index_code(['b', 'sh', 'si'], g.lst, k.lse.offset), k.lse.dtype)};")  # noqa: E501
    L.append(f"{i3}    dv_ = {g.ld('delta', index_code(['b', 'sh', 'si'], g.dlst, k.delta.offset), k.delta.dtype)};")  # noqa: E501
    L.append(f"{i3}}}")
    L.append(f"{i3}Ls[lid] = lv;")
    L.append(f"{i3}Dl[lid] = dv_;")
    L.append(f"{i2}}}")
    if BQ > WG:
        raise CodegenError(f"kernel {k.name!r}: BQ {BQ} > workgroup {WG}")
    L.append(f"{i2}workgroupBarrier();")
    for n in range(NSQ):
        qq = f"(c + {u(n * TPR)})" if n else "c"
        L.append(f"{i2}{{")
        L.append(f"{i3}let qq = {qq};")
        L.append(f"{i3}let RR = R0 + qq;")
        L += [i3 + x for x in g.packed("RR", "s")]
        L.append(f"{i3}let pos = i32(si) + {_i(k.q_offset)};")
        L.append(f"{i3}var s: f32 = 0.0;")
        L.append(f"{i3}for (var d: u32 = 0u; d < {u(du)}; d = d + 1u) {{")
        L.append(f"{i3}    s = s + {g_dot(wd, f'Ks[kr * {u(dp)} + d]', f'Qs[qq * {u(dp)} + d]')};")
        L.append(f"{i3}}}")
        L.append(f"{i3}var dp_: f32 = 0.0;")
        L.append(f"{i3}for (var d: u32 = 0u; d < {u(vu)}; d = d + 1u) {{")
        L.append(f"{i3}    dp_ = dp_ + {g_dot(wv, f'Vs[kr * {u(vp)} + d]', f'Os[qq * {u(vp)} + d]')};")  # noqa: E501
        L.append(f"{i3}}}")
        L.append(f"{i3}let inb = key_ok && RR < R_hi;")
        if k.mask is not None:
            L.append(f"{i3}if (inb) {{ s = s + {g.ld('mask', g.midx('b', 'sh', 'si', 'jk'), k.mask.dtype)}; }}")  # noqa: E501
        L.append(f"{i3}let lq = Ls[qq];")
        vis = " && ".join(["inb"] + g.vis_terms("j", "pos")
                          + [f"!(lq < -{FLT_MAX})", f"!(s < -{FLT_MAX})"])
        L.append(f"{i3}let ok = {vis};")
        L.append(f"{i3}let p = select(0.0, exp(select(0.0, s - lq, ok)), ok);")
        L.append(f"{i3}Ps[kr * {u(BQp)} + qq] = p;")
        L.append(f"{i3}Ds[kr * {u(BQp)} + qq] = p * (dp_ - Dl[qq]);")
        L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{i2}for (var qq: u32 = 0u; qq < {u(BQ)}; qq = qq + 1u) {{")
    L.append(f"{i3}let p = Ps[kr * {u(BQp)} + qq];")
    L.append(f"{i3}let ds = Ds[kr * {u(BQp)} + qq];")
    for j in range(n_dv):
        col = f"c + {u(j * TPR)}" if j else "c"
        L.append(f"{i3}dv{j} = dv{j} + p * Os[qq * {u(vp)} + {col}];")
    for j in range(n_dk):
        col = f"c + {u(j * TPR)}" if j else "c"
        L.append(f"{i3}dk{j} = dk{j} + ds * Qs[qq * {u(dp)} + {col}];")
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    L.append(f"{ind}if (!key_ok) {{ return; }}")
    obase = f"((b * {u(NH)} + hw) * {u(g.Skv)} + jk)"
    for name, n_acc, w, units, dim, acc, scale in (
            ("dk", n_dk, wd, du, g.D, "dk", _f(k.scale)), ("dv", n_dv, wv, vu, g.Dv, "dv", None)):
        for j in range(n_acc):
            col = f"c + {u(j * TPR)}" if j else "c"
            L.append(f"{ind}{{")
            L.append(f"{i2}let cu = {col};")
            guard = (j + 1) * TPR > units
            ii = i3 if guard else i2
            if guard:
                L.append(f"{i2}if (cu < {u(units)}) {{")
            L.append(f"{ii}let val = {acc}{j}" + (f" * {scale};" if scale else ";"))
            for comp in range(w):
                e = f"val[{comp}]" if w == 4 else "val"
                dst = f"{obase} * {u(dim)} + cu * {u(w)} + {u(comp)}" if w == 4 else \
                    f"{obase} * {u(dim)} + cu"
                L.append(f"{ii}{g.bind[name]}[{dst}] = {_store(e, g.dt)};")
            if guard:
                L.append(f"{i2}}}")
            L.append(f"{ind}}}")
    meta = {"tiles": (BKV, TPR, BQ), "workgroup_storage": 4 * words}
    return S + L, WG, grid, meta, 4 * words


def g_dot(w, a, b):
    return _dot(w, a, b)


def _store(e: str, dt: DType) -> str:
    return e if dt is f32 else f"{dt.wgsl}({e})"


def emit(k: AttentionKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    g = _Gen(k, t, alias)
    if g.dt not in (f32, f16):
        raise CodegenError(f"kernel {k.name!r}: attention of {g.dt.name} tensors")
    n_bind = len(g.dts)
    check_bindings(k.name, n_bind, t)
    uses_f16 = check_dtypes(k.name, g.dts, t)
    if k.kind == "dkdv":
        lines, wg, grid, meta, words = _keys_kernel(g, t)
    elif k.kind in ("fwd", "dq"):
        lines, wg, grid, meta, words = _rows_kernel(g, t)
    else:
        raise CodegenError(f"unknown attention kernel kind {k.kind!r}")
    check_invocations(k.name, wg, t)
    check_workgroup_storage(k.name, words, t)
    shared = [x for x in lines if x.startswith("var<workgroup>")]
    body = [x for x in lines if not x.startswith("var<workgroup>")]
    src = module_source(module_header(uses_f16) + g.bd.decls() + shared, {"mn_inf"},
                        wg, body)
    B, Hq, Sq, Skv, D, Dv = g.B, g.Hq, g.Sq, g.Skv, g.D, g.Dv
    flops = 2 * B * Hq * Sq * Skv * (D + Dv) * (1 if k.kind == "fwd" else 2)
    meta.update({"archetype": f"attention_{k.kind}", "workgroup_size": wg,
                 "binding_dtypes": tuple(g.dts), "flops": flops})
    return KernelSpec(k.name, src, g.bd.n, grid.workgroups, meta=meta)


# ------------------------------------------------------------------------------ registration


def _make(kind):
    def make(attrs, ins, outs):
        has_mask = attrs["has_mask"]
        q, kk, v = ins[:3]
        mask = ins[3] if has_mask else None
        rest = ins[3 + int(has_mask):]
        dout, lse, delta = rest if kind != "fwd" else (None, None, None)
        return KIND_TYPES[kind](kind, q, kk, v, mask, dout, lse, delta, attrs["causal"],
                                attrs["scale"], attrs["window"], attrs["q_offset"],
                                name=f"attention_{kind}",
                                split_heads=bool(attrs.get("split_heads", False)))

    return make


for _kind, _family in (("fwd", "attention_fwd"), ("dq", "attention_grad_dq"),
                      ("dkdv", "attention_grad_dkdv")):
    register(_family, KIND_TYPES[_kind], emit, make=_make(_kind))
