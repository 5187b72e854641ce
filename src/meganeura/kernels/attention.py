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


def _shared(S, name, w, n_units) -> int:
    """Declare workgroup array ``name`` (``n_units`` units of width ``w``); its f32 words."""
    S.append(f"var<workgroup> {name}: array<{_vt(w)}, {max(1, n_units)}>;")
    return n_units * w


def _col(j: int, tpr: int, var: str = "c") -> str:
    """Column ``j`` of an invocation that owns every ``tpr``-th column from ``var``."""
    return f"{var} + {u(j * tpr)}" if j else var


def _pcol(j: int, tpr: int) -> str:
    return f"({_col(j, tpr)})" if j else "c"


def _grid_head(L, ind, grid, total, blk, nblk, head, nh) -> None:
    """Workgroup -> (batch ``b``, head ``head``, block ``blk``)."""
    L.append(f"{ind}let wg = {grid.wg_expr};")
    if not grid.exact:
        L.append(f"{ind}if (wg >= {u(total)}) {{ return; }}")
    L += [f"{ind}let {blk} = wg % {u(nblk)};", f"{ind}let bh = wg / {u(nblk)};",
          f"{ind}let {head} = bh % {u(nh)};", f"{ind}let b = bh / {u(nh)};"]


def _lanes(L, ind, lane, tpr) -> None:
    L += [f"{ind}let {lane} = lid / {u(tpr)};", f"{ind}let c = lid % {u(tpr)};"]


def _row_stats(g: _Gen, L, ind, h: str, i: str, lse: str, delta: str) -> None:
    """``lse`` and ``delta`` of query row (``h``, ``i``)."""
    k = g.k
    li = index_code(["b", h, i], g.lst, k.lse.offset)
    di = index_code(["b", h, i], g.dlst, k.delta.offset)
    L.append(f"{ind}{lse} = {g.ld('lse', li, k.lse.dtype)};")
    L.append(f"{ind}{delta} = {g.ld('delta', di, k.delta.dtype)};")


def _store_acc(g: _Gen, L, ind, target, n_acc, tpr, units, w, dim, rbase, val) -> None:
    """Store accumulators ``val(j)`` (units of width ``w``, columns ``c + j·tpr``) into row
    ``rbase`` (of ``dim`` elements) of output ``target``."""
    i2, i3 = ind + "    ", ind + "        "
    for j in range(n_acc):
        L.append(f"{ind}{{")
        L.append(f"{i2}let cu = {_col(j, tpr)};")
        guard = (j + 1) * tpr > units
        ii = i3 if guard else i2
        if guard:
            L.append(f"{i2}if (cu < {u(units)}) {{")
        L.append(f"{ii}let val = {val(j)};")
        for comp in range(w):
            e = f"val[{comp}]" if w == 4 else "val"
            dst = (f"{rbase} * {u(dim)} + cu * {u(w)} + {u(comp)}" if w == 4 else
                   f"{rbase} * {u(dim)} + cu")
            L.append(f"{ii}{g.bind[target]}[{dst}] = {_store(e, g.dt)};")
        if guard:
            L.append(f"{i2}}}")
        L.append(f"{ind}}}")


# ------------------------------------------------------------------------------ fwd and dQ


def _rows_shared(g: _Gen, t) -> tuple[list[str], int]:
    """Tile configuration (on ``g``) and the workgroup arrays of the rows kernels."""
    storage = t.lim("max_compute_workgroup_storage_size")
    g.BQ, g.TPR, g.BK = rows_config(g.k.kind, g.rows, g.B * g.Hkv, g.D, g.Dv, storage,
                                    g.k.tiles)
    BQ, TPR, BK = g.BQ, g.TPR, g.BK
    g.wg = BQ * TPR
    S: list[str] = []
    words = _shared(S, "Qs", g.wd, BQ * g.dp)
    words += _shared(S, "Ks", g.wd, BK * g.dp + TPR)
    words += _shared(S, "Vs", g.wv, BK * g.vp + TPR)
    words += _shared(S, "Ss", 1, BQ * (BK + 1))
    if g.k.kind == "dq":
        words += _shared(S, "Os", g.wv, BQ * g.vp)
    else:
        words += _shared(S, "Red", 1, g.wg)
    return S, words


def _rows_head(g: _Gen, L, ind, grid, total) -> None:
    """Block of packed rows, the key range it can see, this invocation's row."""
    k, BQ = g.k, g.BQ
    _grid_head(L, ind, grid, total, "blk", -(-g.rows // BQ), "hkv", g.Hkv)
    _lanes(L, ind, "r", g.TPR)
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


def _rows_stage(g: _Gen, L, ind) -> tuple[int, int, int]:
    """Stage Q (pre-scaled) and, for dQ, dO and the row's lse/delta; declare the running
    state and the accumulators.  Returns (accumulators, their width, units per row)."""
    k, i2, BQ = g.k, ind + "    ", g.BQ
    pre = lambda rr: [f"let RR = R0 + {rr};"] + g.packed("RR", "s")  # noqa: E731
    g.stage(L, ind, "Qs", BQ, g.D, g.wd, g.dp, pre, f"RR < {u(g.rows)}",
            lambda dd: g.ld("q", g.qidx("b", "sh", "si", dd), k.q.dtype), k.scale)
    if k.kind == "dq":
        g.stage(L, ind, "Os", BQ, g.Dv, g.wv, g.vp, pre, f"RR < {u(g.rows)}",
                lambda dd: g.ld("dout", index_code(["b", "sh", "si", dd], g.dost, k.dout.offset),
                                k.dout.dtype))
        L.append(f"{ind}var lse_r: f32 = 0.0;")
        L.append(f"{ind}var delta_r: f32 = 0.0;")
        L.append(f"{ind}if (row_ok) {{")
        _row_stats(g, L, i2, "qh", "qi", "lse_r", "delta_r")
        L.append(f"{ind}}}")
        L.append(f"{ind}let row_has = row_ok && !(lse_r < -{FLT_MAX});")
        L.append(f"{ind}let lse_s = select(0.0, lse_r, row_has);")
        n_acc, acc_w, acc_u = -(-g.du // g.TPR), g.wd, g.du
    else:
        L.append(f"{ind}var m: f32 = -{FLT_MAX};")
        L.append(f"{ind}var l: f32 = 0.0;")
        n_acc, acc_w, acc_u = -(-g.vu // g.TPR), g.wv, g.vu
    for j in range(n_acc):
        L.append(f"{ind}var acc{j}: {_vt(acc_w)} = {_vt(acc_w)}(0.0);")
    return n_acc, acc_w, acc_u


def _rows_scores(g: _Gen, L, i2) -> None:
    """This invocation's scores of the key tile (columns c + TPR·n): q·k (and for dQ dO·v),
    masked; fwd keeps them in registers (and their max in ``Red``), dQ stores dS in ``Ss``."""
    k, kind, TPR, i3 = g.k, g.k.kind, g.TPR, i2 + "    "
    NS = g.BK // TPR
    for n in range(NS):
        L.append(f"{i2}var s{n}: f32 = 0.0;")
        if kind == "dq":
            L.append(f"{i2}var p{n}: f32 = 0.0;")
    for acc, w, units, pad, arr, tile, row in (("s", g.wd, g.du, g.dp, "Ks", "Qs", "qv"),
                                                ("p", g.wv, g.vu, g.vp, "Vs", "Os", "ov")):
        if acc == "p" and kind != "dq":
            continue
        L.append(f"{i2}for (var d: u32 = 0u; d < {u(units)}; d = d + 1u) {{")
        L.append(f"{i3}let {row} = {tile}[r * {u(pad)} + d];")
        for n in range(NS):
            col = _pcol(n, TPR)
            L.append(f"{i3}{acc}{n} = {acc}{n} + {_dot(w, row, f'{arr}[{col} * {u(pad)} + d]')};")
        L.append(f"{i2}}}")
    if kind == "fwd":
        L.append(f"{i2}var lm: f32 = -{FLT_MAX};")
    for n in range(NS):
        if kind == "fwd":
            L.append(f"{i2}var x{n}: f32;")
        L.append(f"{i2}{{")
        L.append(f"{i3}let col = {_pcol(n, TPR)};")
        L.append(f"{i3}let j = kt + i32(col);")
        L.append(f"{i3}var x = s{n};")
        L.append(f"{i3}let inb = row_ok && j < kv_hi;")
        if k.mask is not None:
            mv = g.ld("mask", g.midx("b", "qh", "qi", "u32(j)"), k.mask.dtype)
            L.append(f"{i3}if (inb) {{ x = x + {mv}; }}")
        vis = " && ".join(["inb"] + g.vis_terms("j", "pos"))
        if kind == "fwd":
            L.append(f"{i3}x{n} = select(-mn_inf(), x, {vis});")
            L.append(f"{i3}lm = max(lm, x{n});")
        else:
            L.append(f"{i3}let ok = {vis} && row_has && !(x < -{FLT_MAX});")
            L.append(f"{i3}let p = select(0.0, exp(select(0.0, x - lse_s, ok)), ok);")
            L.append(f"{i3}Ss[r * {u(g.BK + 1)} + col] = p * (p{n} - delta_r);")
        L.append(f"{i2}}}")
    if kind == "fwd":
        L.append(f"{i2}Red[lid] = lm;")
    L.append(f"{i2}workgroupBarrier();")


def _rows_softmax_pv(g: _Gen, L, i2, n_acc) -> None:
    """fwd: row max from the per-invocation maxima, then each invocation turns its own scores
    into probabilities (one exp per score); the row sum is taken in the P·V loop."""
    TPR, BKp, i3 = g.TPR, g.BK + 1, i2 + "    "
    L.append(f"{i2}var mt = m;")
    L.append(f"{i2}for (var cc: u32 = 0u; cc < {u(TPR)}; cc = cc + 1u) {{")
    L.append(f"{i3}mt = max(mt, Red[r * {u(TPR)} + cc]);")
    L.append(f"{i2}}}")
    for n in range(g.BK // TPR):
        L.append(f"{i2}Ss[r * {u(BKp)} + {_pcol(n, TPR)}] = select(exp(x{n} - mt), 0.0, "
                 f"x{n} < -{FLT_MAX});")
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{i2}let alpha = exp(m - mt);")
    L.append(f"{i2}l = l * alpha;")
    for j in range(n_acc):
        L.append(f"{i2}acc{j} = acc{j} * alpha;")
    _tile_products(g, L, i2, BKp, "p", ["l = l + p;"], n_acc, "Vs", g.vp)
    L.append(f"{i2}m = mt;")


def _tile_products(g: _Gen, L, i2, BKp, var, extra, n_acc, arr, pad) -> None:
    """acc_j += Ss[r][kk] · arr[kk][c + j·TPR] over the key tile."""
    i3 = i2 + "    "
    L.append(f"{i2}for (var kk: u32 = 0u; kk < {u(g.BK)}; kk = kk + 1u) {{")
    L.append(f"{i3}let {var} = Ss[r * {u(BKp)} + kk];")
    L += [i3 + x for x in extra]
    for j in range(n_acc):
        L.append(f"{i3}acc{j} = acc{j} + {var} * {arr}[kk * {u(pad)} + {_col(j, g.TPR)}];")
    L.append(f"{i2}}}")


def _rows_kernel(g: _Gen, t) -> tuple[list[str], int, object, dict, int]:
    """Forward and dQ: blocks of packed query rows looping over key tiles."""
    k, ind, i2 = g.k, "    ", "        "
    S, words = _rows_shared(g, t)
    total = -(-g.rows // g.BQ) * g.B * g.Hkv
    grid = make_grid(k.name, total, t)
    L: list[str] = []
    _rows_head(g, L, ind, grid, total)
    n_acc, acc_w, acc_u = _rows_stage(g, L, ind)
    # key tiles
    L.append(f"{ind}for (var kt: i32 = kv_lo; kt < kv_hi; kt = kt + {_i(g.BK)}) {{")
    pre_k = lambda rr: [f"let jj = kt + i32({rr});"]  # noqa: E731
    g.stage(L, i2, "Ks", g.BK, g.D, g.wd, g.dp, pre_k, "jj < kv_hi",
            lambda dd: g.ld("k", g.kvidx("k", "b", "hkv", "u32(jj)", dd), k.k.dtype))
    g.stage(L, i2, "Vs", g.BK, g.Dv, g.wv, g.vp, pre_k, "jj < kv_hi",
            lambda dd: g.ld("v", g.kvidx("v", "b", "hkv", "u32(jj)", dd), k.v.dtype))
    L.append(f"{i2}workgroupBarrier();")
    _rows_scores(g, L, i2)
    if k.kind == "fwd":
        _rows_softmax_pv(g, L, i2, n_acc)
    else:
        _tile_products(g, L, i2, g.BK + 1, "x", [], n_acc, "Ks", g.dp)
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")
    _rows_store(g, L, ind, n_acc, acc_u)
    meta = {"tiles": (g.BQ, g.TPR, g.BK), "workgroup_storage": 4 * words}
    return S + L, g.wg, grid, meta, 4 * words


def _rows_store(g: _Gen, L, ind, n_acc, acc_u) -> None:
    k = g.k
    L.append(f"{ind}if (!row_ok) {{ return; }}")
    obase = f"((b * {u(g.Hq)} + qh) * {u(g.Sq)} + qi)"
    rbase = obase  # row of the stored output
    if k.kind == "fwd":
        L.append(f"{ind}let inv = select(1.0 / l, 0.0, l == 0.0);")
        dim, target, w, scale = g.Dv, "out", g.wv, "inv"
        if k.out_bshd:
            rbase = f"((b * {u(g.Sq)} + qi) * {u(g.Hq)} + qh)"
    else:
        dim, target, w, scale = g.D, "dq", g.wd, _f(k.scale)
    _store_acc(g, L, ind, target, n_acc, g.TPR, acc_u, w, dim, rbase,
               lambda j: f"acc{j} * {scale}")
    if k.kind == "fwd":
        L.append(f"{ind}if (c == 0u) {{")
        L.append(f"{ind}    {g.bind['lse_out']}[{obase}] = "
                 f"{_store('select(m + log(l), -mn_inf(), l == 0.0)', g.dt)};")
        L.append(f"{ind}}}")


# ------------------------------------------------------------------------------ dK/dV


def _keys_shared(g: _Gen, t) -> tuple[list[str], int]:
    k = g.k
    storage = t.lim("max_compute_workgroup_storage_size")
    g.NH = g.Hq if k.split_heads else g.Hkv  # heads of the work items
    g.P = 1 if k.split_heads else g.G  # packed rows per query position
    g.BKV, g.TPR, g.BQ = keys_config(g.Sq * g.P, g.Skv, g.B * g.NH, g.D, g.Dv, storage, k.tiles)
    BKV, TPR, BQ = g.BKV, g.TPR, g.BQ
    g.wg = BKV * TPR
    S: list[str] = []
    words = _shared(S, "Ks", g.wd, BKV * g.dp)
    words += _shared(S, "Vs", g.wv, BKV * g.vp)
    words += _shared(S, "Qs", g.wd, BQ * g.dp + TPR)
    words += _shared(S, "Os", g.wv, BQ * g.vp + TPR)
    words += _shared(S, "Ls", 1, BQ)
    words += _shared(S, "Dl", 1, BQ)
    words += _shared(S, "Ps", 1, BKV * (BQ + 1))
    words += _shared(S, "Ds", 1, BKV * (BQ + 1))
    return S, words


def _keys_head(g: _Gen, L, ind, grid, total) -> None:
    """Block of keys, this invocation's key, the packed query rows that can see the block;
    stage K (pre-scaled) and V."""
    k, BKV = g.k, g.BKV
    _grid_head(L, ind, grid, total, "kb", -(-g.Skv // BKV), "hw", g.NH)
    if k.split_heads:
        L.append(f"{ind}let hq_w = hw;")
        L.append(f"{ind}let hkv = hw / {u(g.G)};")
    else:
        L.append(f"{ind}let hkv = hw;")
    _lanes(L, ind, "kr", g.TPR)
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
    L.append(f"{ind}let R_lo = u32(i_lo) * {u(g.P)};")
    L.append(f"{ind}let R_hi = u32(max(i_hi, i_lo)) * {u(g.P)};")
    pre_k = lambda rr: [f"let jj = j0 + {rr};"]  # noqa: E731
    g.stage(L, ind, "Ks", BKV, g.D, g.wd, g.dp, pre_k, f"jj < {u(g.Skv)}",
            lambda dd: g.ld("k", g.kvidx("k", "b", "hkv", "jj", dd), k.k.dtype), k.scale)
    g.stage(L, ind, "Vs", BKV, g.Dv, g.wv, g.vp, pre_k, f"jj < {u(g.Skv)}",
            lambda dd: g.ld("v", g.kvidx("v", "b", "hkv", "jj", dd), k.v.dtype))


def _keys_stage_rows(g: _Gen, L, i2) -> None:
    """Stage a chunk of BQ packed query rows: Q, dO, lse and delta."""
    k, BQ, i3 = g.k, g.BQ, i2 + "    "
    pre = lambda rr: [f"let RR = R0 + {rr};"] + g.packed("RR", "s")  # noqa: E731
    g.stage(L, i2, "Qs", BQ, g.D, g.wd, g.dp, pre, "RR < R_hi",
            lambda dd: g.ld("q", g.qidx("b", "sh", "si", dd), k.q.dtype))
    g.stage(L, i2, "Os", BQ, g.Dv, g.wv, g.vp, pre, "RR < R_hi",
            lambda dd: g.ld("dout", index_code(["b", "sh", "si", dd], g.dost, k.dout.offset),
                            k.dout.dtype))
    L.append(f"{i2}if (lid < {u(BQ)}) {{")
    L.append(f"{i3}let RR = R0 + lid;")
    L += [i3 + x for x in g.packed("RR", "s")]
    L.append(f"{i3}var lv: f32 = 0.0;")
    L.append(f"{i3}var dv_: f32 = 0.0;")
    L.append(f"{i3}if (RR < R_hi) {{")
    _row_stats(g, L, i3 + "    ", "sh", "si", "lv", "dv_")
    L.append(f"{i3}}}")
    L.append(f"{i3}Ls[lid] = lv;")
    L.append(f"{i3}Dl[lid] = dv_;")
    L.append(f"{i2}}}")
    if BQ > g.wg:
        raise CodegenError(f"kernel {k.name!r}: BQ {BQ} > workgroup {g.wg}")
    L.append(f"{i2}workgroupBarrier();")


def _keys_p_ds(g: _Gen, L, i2) -> None:
    """P and dS of this invocation's (key, row) pairs into ``Ps``/``Ds``."""
    k, TPR, BQp, i3 = g.k, g.TPR, g.BQ + 1, i2 + "    "
    dp, vp = g.dp, g.vp
    for n in range(g.BQ // TPR):
        L.append(f"{i2}{{")
        L.append(f"{i3}let qq = {_pcol(n, TPR)};")
        L.append(f"{i3}let RR = R0 + qq;")
        L += [i3 + x for x in g.packed("RR", "s")]
        L.append(f"{i3}let pos = i32(si) + {_i(k.q_offset)};")
        for var, units, w, a, b in (("s", g.du, g.wd, f"Ks[kr * {u(dp)} + d]",
                                     f"Qs[qq * {u(dp)} + d]"),
                                    ("dp_", g.vu, g.wv, f"Vs[kr * {u(vp)} + d]",
                                     f"Os[qq * {u(vp)} + d]")):
            L.append(f"{i3}var {var}: f32 = 0.0;")
            L.append(f"{i3}for (var d: u32 = 0u; d < {u(units)}; d = d + 1u) {{")
            L.append(f"{i3}    {var} = {var} + {_dot(w, a, b)};")
            L.append(f"{i3}}}")
        L.append(f"{i3}let inb = key_ok && RR < R_hi;")
        if k.mask is not None:
            mv = g.ld("mask", g.midx("b", "sh", "si", "jk"), k.mask.dtype)
            L.append(f"{i3}if (inb) {{ s = s + {mv}; }}")
        L.append(f"{i3}let lq = Ls[qq];")
        vis = " && ".join(["inb"] + g.vis_terms("j", "pos")
                          + [f"!(lq < -{FLT_MAX})", f"!(s < -{FLT_MAX})"])
        L.append(f"{i3}let ok = {vis};")
        L.append(f"{i3}let p = select(0.0, exp(select(0.0, s - lq, ok)), ok);")
        L.append(f"{i3}Ps[kr * {u(BQp)} + qq] = p;")
        L.append(f"{i3}Ds[kr * {u(BQp)} + qq] = p * (dp_ - Dl[qq]);")
        L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")


def _keys_kernel(g: _Gen, t):
    """dK/dV: blocks of keys looping over packed query rows."""
    k, ind, i2, i3 = g.k, "    ", "        ", "            "
    S, words = _keys_shared(g, t)
    TPR, BQp = g.TPR, g.BQ + 1
    total = -(-g.Skv // g.BKV) * g.B * g.NH
    grid = make_grid(k.name, total, t)
    L: list[str] = []
    _keys_head(g, L, ind, grid, total)
    n_dk, n_dv = -(-g.du // TPR), -(-g.vu // TPR)
    for j in range(n_dk):
        L.append(f"{ind}var dk{j}: {_vt(g.wd)} = {_vt(g.wd)}(0.0);")
    for j in range(n_dv):
        L.append(f"{ind}var dv{j}: {_vt(g.wv)} = {_vt(g.wv)}(0.0);")
    L.append(f"{ind}for (var R0: u32 = R_lo; R0 < R_hi; R0 = R0 + {u(g.BQ)}) {{")
    L.append(f"{i2}workgroupBarrier();")
    _keys_stage_rows(g, L, i2)
    _keys_p_ds(g, L, i2)
    L.append(f"{i2}for (var qq: u32 = 0u; qq < {u(g.BQ)}; qq = qq + 1u) {{")
    L.append(f"{i3}let p = Ps[kr * {u(BQp)} + qq];")
    L.append(f"{i3}let ds = Ds[kr * {u(BQp)} + qq];")
    for j in range(n_dv):
        L.append(f"{i3}dv{j} = dv{j} + p * Os[qq * {u(g.vp)} + {_col(j, TPR)}];")
    for j in range(n_dk):
        L.append(f"{i3}dk{j} = dk{j} + ds * Qs[qq * {u(g.dp)} + {_col(j, TPR)}];")
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    L.append(f"{ind}if (!key_ok) {{ return; }}")
    obase = f"((b * {u(g.NH)} + hw) * {u(g.Skv)} + jk)"
    scale = _f(k.scale)
    _store_acc(g, L, ind, "dk", n_dk, TPR, g.du, g.wd, g.D, obase, lambda j: f"dk{j} * {scale}")
    _store_acc(g, L, ind, "dv", n_dv, TPR, g.vu, g.wv, g.Dv, obase, lambda j: f"dv{j}")
    meta = {"tiles": (g.BKV, TPR, g.BQ), "workgroup_storage": 4 * words}
    return S + L, g.wg, grid, meta, 4 * words


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
