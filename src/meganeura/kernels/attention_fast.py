"""The ``precision="fast"`` attention forward: QKᵀ and PV on f16 subgroup matrices (Dawn's
``chromium_experimental_subgroup_matrix``, 16×16×16, f32 accumulation), softmax in f32.

Layout.  A workgroup is ``NSG`` subgroups of 32; subgroup s owns 16 packed rows (the rows of
``attention.py``: (query position, group member) of one kv head) of the block R0 + 16·s.  Q is
staged once (pre-scaled, rounded to f16) and kept as D/16 left fragments.  Per key tile of BK
keys (K and V staged as f16, K read transposed through a column-major load):

1. S = Q·Kᵀ: BK/16 result fragments, stored (f32) into the subgroup's rows of ``Sf``;
2. softmax: lane (r, h) = (lane / 2, lane % 2) owns row r and half h of the tile's columns and of
   the output columns; row maxima are exchanged with the partner lane (``subgroupShuffleXor``),
   the online-softmax rescale and the row sums are f32, P is rounded to f16 into ``Ph``;
3. O_tile = P·V: Dv/16 fresh result fragments, stored (f32) into ``Sf``; each lane adds its
   share to its f32 registers after rescaling them (fragments cannot be scaled per row).

The stores (out = o / l, lse = m + log l), causal/window tile bounds, masks, GQA packing and
split-K chunks are those of the strict kernel.  Workgroup memory: K (max(BQ, BK) rows; it holds
Q while the fragments are loaded) and V as f16, one f32 and one f16 16×max(BK, Dv) / 16×BK
scratch per subgroup."""

from __future__ import annotations

from ..dtypes import f32
from .common import CodegenError, make_grid, u

SG_FEATURE = "meganeura-subgroup-matrix-f16-16x16x16-sg32"
PAD = 8  # f16 elements of padding per staged row (rows stay 16-byte aligned)
# (subgroups per workgroup, keys per tile), heuristic first
FAST_CONFIGS = ((4, 64), (2, 64), (4, 32), (2, 32), (1, 64))
FLT_MAX = "3.4028234663852886e38"


def usable(k, t) -> bool:
    """The fast forward applies: precision fast, forward, head dims multiples of 16, and the
    device has f16 subgroup matrices (subgroups of 32) and subgroup shuffles."""
    D, Dv = k.q.shape[3], k.v.shape[3]
    return (k.precision == "fast" and k.kind == "fwd" and D % 16 == 0 and Dv % 16 == 0
            and k.q.dtype is f32 and SG_FEATURE in t.features
            and ("subgroups" in t.features or "subgroup" in t.features))


def fast_words(cfg, D: int, Dv: int) -> int:
    """Bytes / 4 of workgroup storage of configuration ``cfg``."""
    nsg, bk = cfg
    bq = 16 * nsg
    sw = max(bk, Dv)
    f16_elems = max(bq, bk) * (D + PAD) + bk * (Dv + PAD) + nsg * 16 * bk
    return -(-f16_elems // 2) + nsg * 16 * sw


def fast_config(k, t) -> tuple[int, int]:
    """The configuration: ``k.config`` when it is a fast one, else the first of
    ``FAST_CONFIGS`` that fits and gives the problem enough workgroups."""
    D, Dv = k.q.shape[3], k.v.shape[3]
    fits = [c for c in FAST_CONFIGS
            if 4 * fast_words(c, D, Dv) <= t.lim("max_compute_workgroup_storage_size")
            and 32 * c[0] <= t.lim("max_compute_invocations_per_workgroup")]
    if len(k.config) == 2:
        if tuple(k.config) not in fits:
            raise CodegenError(f"kernel {k.name!r}: fast configuration {k.config} does not fit")
        return tuple(k.config)
    if not fits:
        raise CodegenError(f"kernel {k.name!r}: no fast attention configuration fits")
    B, Hq, Sq, _ = k.q.shape
    rows, items = Sq * (Hq // k.k.shape[1]), B * k.k.shape[1] * max(1, k.splits)
    for c in fits:
        if items * -(-rows // (16 * c[0])) >= 128:
            return c
    return min(fits, key=lambda c: (c[0], -c[1]))


def fast_body(g, t) -> list[str]:
    """The kernel body (``g``: the strict kernel's ``_Gen``, for shapes, bindings, masks)."""
    from .attention import _grid_head, _i

    k = g.k
    nsg, bk = g.fast = fast_config(k, t)
    bq, D, Dv = 16 * nsg, g.D, g.Dv
    qs, vs, sw = D + PAD, Dv + PAD, max(bk, Dv)
    g.wg = 32 * nsg
    g.shared += [f"var<workgroup> Kh: array<f16, {max(bq, bk) * qs}>;",
                 f"var<workgroup> Vh: array<f16, {bk * vs}>;",
                 f"var<workgroup> Ph: array<f16, {nsg * 16 * bk}>;",
                 f"var<workgroup> Sf: array<f32, {nsg * 16 * sw}>;"]
    g.words = fast_words((nsg, bk), D, Dv)
    total = -(-g.rows // bq) * g.B * g.Hkv * g.ns
    grid = g.grid = make_grid(k.name, total, t)
    ind, i2 = "    ", "        "
    L: list[str] = []
    _grid_head(L, ind, grid, total, "blk", -(-g.rows // bq), "hkv", g.Hkv, g)
    L += [f"{ind}let sid = lid / 32u;", f"{ind}let lane = lid % 32u;",
          f"{ind}let hh = lane % 2u;", f"{ind}let R0 = blk * {u(bq)};",
          f"{ind}let Rn = min(R0 + {u(bq)}, {u(g.rows)});",
          f"{ind}let i_first = i32(R0 / {u(g.G)});",
          f"{ind}let i_last = i32((Rn - 1u) / {u(g.G)});",
          f"{ind}var kv_lo: i32 = 0i;", f"{ind}var kv_hi: i32 = {_i(g.Skv)};"]
    if k.causal:
        L.append(f"{ind}kv_hi = min(kv_hi, {_i(k.q_offset)} + i_last + 1i);")
    if k.window:
        L.append(f"{ind}kv_lo = max(0i, {_i(k.q_offset)} + i_first - {_i(k.window)} + 1i);")
    if g.ns > 1:
        ch = -(-g.Skv // g.ns)
        L.append(f"{ind}kv_lo = max(kv_lo, i32(sc) * {_i(ch)});")
        L.append(f"{ind}kv_hi = min(kv_hi, i32(sc) * {_i(ch)} + {_i(ch)});")
    L += [f"{ind}let rw0 = R0 + sid * 16u + lane / 2u;", f"{ind}let rok0 = rw0 < {u(g.rows)};"]
    L += [ind + x for x in g.packed("rw0", "q0")]
    L.append(f"{ind}let pos0 = i32(q0i) + {_i(k.q_offset)};")
    # Q (pre-scaled) into Kh as f16, then into fragments
    pre = lambda rr: [f"let RR = R0 + {rr};"] + g.packed("RR", "s")  # noqa: E731
    _stage_f16(g, L, ind, "Kh", bq, "q", qs, pre, f"RR < {u(g.rows)}",
               lambda c: ["b", "sh", "si", c], k.scale)
    L.append(f"{ind}workgroupBarrier();")
    left = "subgroup_matrix_left<f16, 16, 16>"
    for kk in range(D // 16):
        L.append(f"{ind}let qf{kk} = subgroupMatrixLoad<{left}>(&Kh, sid * {u(16 * qs)} + "
                 f"{u(16 * kk)}, false, {u(qs)});")
    L.append(f"{ind}workgroupBarrier();")
    L += [f"{ind}var m: f32 = -{FLT_MAX};", f"{ind}var l: f32 = 0.0;"]
    L += [f"{ind}var o{c}: f32 = 0.0;" for c in range(Dv // 2)]
    L.append(f"{ind}for (var kt: i32 = kv_lo; kt < kv_hi; kt = kt + {_i(bk)}) {{")
    kpre = lambda rr: [f"let jj = kt + i32({rr});"]  # noqa: E731
    for arr, which, st in (("Kh", "k", qs), ("Vh", "v", vs)):
        _stage_f16(g, L, i2, arr, bk, which, st, kpre, "jj < kv_hi",
                   lambda c: ["b", "hkv", "u32(jj)", c])
    L.append(f"{i2}workgroupBarrier();")
    _scores(g, L, i2, bk, qs, sw, D)
    _softmax(g, L, i2, bk, sw)
    _pv(g, L, i2, bk, vs, sw, Dv)
    L.append(f"{ind}}}")
    _store(g, L, ind, Dv)
    return L


def _stage_f16(g, L, ind, arr, nrows, which, stride, pre, valid, coords, scale=None) -> None:
    """``nrows`` rows of q/k/v (vec4 units when the head dim allows) into f16 array ``arr``."""
    dim = g.Dv if which == "v" else g.D
    w = 4 if dim % 4 == 0 else 1
    units = dim // w
    i2, i3 = ind + "    ", ind + "        "
    L.append(f"{ind}for (var e: u32 = lid; e < {u(nrows * units)}; e = e + {u(g.wg)}) {{")
    L += [f"{i2}let rr = e / {u(units)};", f"{i2}let uu = e % {u(units)};"]
    L += [i2 + x for x in pre("rr")]
    vt = "f32" if w == 1 else f"vec{w}<f32>"
    L.append(f"{i2}var x: {vt} = {vt}(0.0);")
    L.append(f"{i2}if ({valid}) {{")
    L.append(f"{i3}x = {g.unit_value(which, w, coords, scale)};")
    L.append(f"{i2}}}")
    for c in range(w):
        xc = "x" if w == 1 else f"x[{c}]"
        L.append(f"{i2}{arr}[rr * {u(stride)} + uu * {u(w)} + {u(c)}] = f16({xc});")
    L.append(f"{ind}}}")


def _scores(g, L, ind, bk, qs, sw, D) -> None:
    """S = Q·Kᵀ of the tile into the subgroup's rows of ``Sf``; barrier."""
    right, res = "subgroup_matrix_right<f16, 16, 16>", "subgroup_matrix_result<f32, 16, 16>"
    for f in range(bk // 16):
        L.append(f"{ind}{{")
        L.append(f"{ind}    var acc = {res}();")
        for kk in range(D // 16):
            L.append(f"{ind}    let kf{kk} = subgroupMatrixLoad<{right}>(&Kh, "
                     f"{u(16 * f * qs + 16 * kk)}, true, {u(qs)});")
            L.append(f"{ind}    acc = subgroupMatrixMultiplyAccumulate(qf{kk}, kf{kk}, acc);")
        L.append(f"{ind}    subgroupMatrixStore(&Sf, sid * {u(16 * sw)} + {u(16 * f)}, acc, false, "
                 f"{u(sw)});")
        L.append(f"{ind}}}")
    L.append(f"{ind}workgroupBarrier();")


def _softmax(g, L, ind, bk, sw) -> None:
    """Lane (r, hh): masked scores of its half row, row max with the partner lane, rescale of
    its accumulators and row sum, P (f16) into ``Ph``; barrier."""
    k, half, i2 = g.k, bk // 2, ind + "    "
    row = "(sid * 16u + lane / 2u)"
    L.append(f"{ind}var mx: f32 = -{FLT_MAX};")
    L.append(f"{ind}let j0 = hh * {u(half)};")
    for jj in range(half):  # unrolled: the half row stays in registers
        L.append(f"{ind}var x{jj} = Sf[{row} * {u(sw)} + j0 + {u(jj)}];")
        L.append(f"{ind}{{")
        L.append(f"{i2}let kj = kt + i32(j0 + {u(jj)});")
        L.append(f"{i2}let inb = rok0 && kj < kv_hi;")
        if k.mask is not None:
            mv = g.ld("mask", g.midx("b", "q0h", "q0i", "u32(kj)"), k.mask.dtype)
            L.append(f"{i2}if (inb) {{ x{jj} = x{jj} + {mv}; }}")
        L.append(f"{i2}let vis = {' && '.join(['inb'] + g.vis_terms('kj', 'pos0'))};")
        L.append(f"{i2}x{jj} = select(-mn_inf(), x{jj}, vis);")
        L.append(f"{i2}mx = max(mx, x{jj});")
        L.append(f"{ind}}}")
    L.append(f"{ind}let mt = max(m, max(mx, subgroupShuffleXor(mx, 1u)));")
    L.append(f"{ind}let alpha = exp(m - mt);")
    L.append(f"{ind}var ps: f32 = 0.0;")
    for jj in range(half):
        L.append(f"{ind}{{")
        L.append(f"{i2}let p = f16(select(exp(x{jj} - mt), 0.0, x{jj} < -{FLT_MAX}));")
        L.append(f"{i2}ps = ps + f32(p);")
        L.append(f"{i2}Ph[{row} * {u(bk)} + j0 + {u(jj)}] = p;")
        L.append(f"{ind}}}")
    L += [f"{ind}l = l * alpha + ps;", f"{ind}m = mt;"]
    L.append(f"{ind}workgroupBarrier();")


def _pv(g, L, ind, bk, vs, sw, Dv) -> None:
    """O_tile = P·V into ``Sf``; barrier; each lane rescales and adds its half row."""
    left, right = "subgroup_matrix_left<f16, 16, 16>", "subgroup_matrix_right<f16, 16, 16>"
    res = "subgroup_matrix_result<f32, 16, 16>"
    for c in range(Dv // 16):
        L.append(f"{ind}{{")
        L.append(f"{ind}    var acc = {res}();")
        for kk in range(bk // 16):
            L.append(f"{ind}    let pf{kk} = subgroupMatrixLoad<{left}>(&Ph, sid * {u(16 * bk)} + "
                     f"{u(16 * kk)}, false, {u(bk)});")
            L.append(f"{ind}    let vf{kk} = subgroupMatrixLoad<{right}>(&Vh, "
                     f"{u(16 * kk * vs + 16 * c)}, false, {u(vs)});")
            L.append(f"{ind}    acc = subgroupMatrixMultiplyAccumulate(pf{kk}, vf{kk}, acc);")
        L.append(f"{ind}    subgroupMatrixStore(&Sf, sid * {u(16 * sw)} + {u(16 * c)}, acc, false, "
                 f"{u(sw)});")
        L.append(f"{ind}}}")
    L.append(f"{ind}workgroupBarrier();")
    base = f"(sid * 16u + lane / 2u) * {u(sw)} + hh * {u(Dv // 2)}"
    for c in range(Dv // 2):
        L.append(f"{ind}o{c} = o{c} * alpha + Sf[{base} + {u(c)}];")


def _store(g, L, ind, Dv) -> None:
    """out = o / l (0 for rows with no visible key), lse = m + log l, as the strict kernel."""
    k = g.k
    L.append(f"{ind}let lt = l + subgroupShuffleXor(l, 1u);")
    L.append(f"{ind}let inv = select(1.0 / lt, 0.0, lt == 0.0);")
    L.append(f"{ind}if (rok0) {{")
    row = f"(({g.bsplit()} * {u(g.Hq)} + q0h) * {u(g.Sq)} + q0i)"
    L.append(f"{ind}    if (hh == 0u) {{")
    L.append(f"{ind}        {g.bind['lse_out']}[{row}] = select(m + log(lt), -mn_inf(), "
             f"lt == 0.0);")
    L.append(f"{ind}    }}")
    if k.out_bshd:
        row = f"((b * {u(g.Sq)} + q0i) * {u(g.Hq)} + q0h)"
    for c in range(Dv // 2):
        L.append(f"{ind}    {g.bind['out']}[{row} * {u(Dv)} + hh * {u(Dv // 2)} + {u(c)}] = "
                 f"o{c} * inv;")
    L.append(f"{ind}}}")
