"""The tensor-core matmul tile (``Cfg`` kind "sgmat", precision "fast"): Dawn's f16 subgroup
matrices (16x16x16, f32 accumulation), called from ``matmul.emit``.

A workgroup of ``rm`` x ``rn`` subgroups (32 invocations each) computes a ``tm`` x ``tn`` tile
of C; each subgroup owns a block of (tm / rm / 16) x (tn / rn / 16) accumulator fragments, so
every A and B fragment it loads from workgroup memory feeds several multiply-accumulates.  The
operands are read from global memory as f32 (vec4 where the view allows: ``vl``), rounded to
f16 while staged into padded workgroup rows (the padding keeps fragment rows on distinct banks)
and prefetched into registers one K step ahead (f16 operands: vec4<f16> loads, no conversion).
Where the device's WGSL has buffer views (``PACKED``), flat layouts store each vec4 register
as one ``vec2<u32>``: H200, 4096³ with f16 operands 244 TFLOP/s against 187 with four f16
stores; with f32 operands 219 either way.
``vr`` holds option bits:

* ``DB`` — two workgroup buffers per operand: step k + 1's tiles are stored while step k is
  multiplied, so one barrier per K step instead of two;
* ``UNROLL`` (with ``DB``) — the K loop does two steps per iteration, so the buffer offsets
  of every workgroup access are constants;
* ``HALF`` — f32 operands are rounded to f16 as they are loaded (vec4 loads only), so the
  prefetch registers hold half the bits (register pressure binds the big tiles);
* ``LEAN`` — each A fragment is loaded right before its row of products (one live at a time);
* ``BSTREAM`` — a slice's A fragments are loaded, then B's one at a time, each right before
  its column of products: FM + 1 fragments live instead of FM + FN (the register file is what
  the 128x256 tile runs out of: 254 registers);
* ``EARLY`` (single buffer) — step k + 1's global loads are issued right after step k's
  registers are stored, before the barrier, so they are in flight while the workgroup waits
  (a driver is free to sink loads past the products, not past a barrier);
* ``PF2`` (single buffer) — two sets of staging registers, used in turn (the K loop does two
  steps per iteration): step k issues step k + 2's loads, so two steps of products cover
  their latency instead of one (the ``noload`` ablation puts 23 % of the 4096³ time on it).
* ``TOUCH`` (single buffer, vector loads) — L1 prefetch: every K step also issues one small
  "touch" load per 32-byte sector of step k + ``TOUCH_AHEAD``'s tiles (``FAR``: two steps
  further), consumed two steps later (the K loop does two steps per iteration, so two touch
  sets live), so when that step's real loads are issued they hit L1.  The idea: the staging
  registers bound how many bytes are in flight (two sets do not fit, ``PF2``), a touch holds
  one register per sector instead of four per 32 bytes.  Where K < 2 BK or an operand loads
  scalars, the plain single-buffer loop;
* ``SWZ`` — grouped rasterization: consecutive workgroups walk ``SWZ_ROWS`` tile rows column by
  column, so the operand tiles a wave of workgroups shares stay in L2;
* ``CONST`` — constant fragment offsets: the workgroup tiles are arrays of 16-row (A) / 16-column
  (B) blocks and every ``subgroupMatrixLoad`` gets a pointer to one block and a compile-time
  offset and stride.  Dawn's robustness transform wraps a matrix load whose offset is not a
  constant in a bounds test and a branch (Tint ``PredicateSubgroupMatrixCall``); with a constant
  offset and stride into a fixed-size block it proves the load in bounds and emits nothing,
  and the block index is an ordinary array index (a ``min`` at worst).  B is stored as
  16-column strips of ``BS_ROW``-element rows (``BS_PAD`` between strips).  H200, 4096³:
  256x128 198.5 TFLOP/s against 82-105 without it, but 128x256 82 against 219 (188 with
  robustness off): docs/benchmarks.md.  With buffer views the blocks are views of the same
  workgroup ``buffer``s and stage packed like the flat layouts (H100, 4096³ f16: 128x128
  247.1 against 250.7 flat; docs/rejected-optimizations.md, eighteenth session);
* ``BT`` — B stored transposed and loaded column-major: flat, TN rows of BK + 8 like A's (a
  K-contiguous B, e.g. a weight stored (N, K), then stages with A's packed stores: the
  heuristic sets it for such a B, ``matmul.with_b_layout``; H200 4096³ 163.8 -> 217.5 TFLOP/s
  at 128x256); with ``CONST``, 16-column blocks of K-contiguous rows padded like A's.
* ``GLOBAL`` (f16 operands, whole tiles, K a multiple of 16, BK 16; with ``SWZ`` / nothing
  else) — no workgroup memory: every subgroup loads its fragments straight from the operand
  bindings (L1/L2 serve the reuse between subgroups), one 16-deep slice ahead of its products,
  so there is no staging, no barrier and no f32 to f16 conversion in the loop.  H200, 4096³:
  45-75 TFLOP/s against 187 staged (kept selectable for re-measurement, not a candidate);
* ``ILV`` — A's staged rows interleaved within groups of eight (``_Operand.interleave_rows``),
  so a subgroup's packed stores hit each bank twice, not one bank three times (H100, 4096³
  f16: 245.8 against 250.7, neutral; kept selectable).

Results go straight from the fragments to C (``subgroupMatrixStore``) where a tile lies inside
C and there is no epilogue; otherwise each fragment goes through a per-subgroup f32 scratch so
every invocation applies the epilogue to its share of elements with ordinary bounds checks (any
shape, stride and epilogue works).
"""

from __future__ import annotations

from ..dtypes import f16
from .common import BUFFER_VIEW_FEATURE, CodegenError, index_code, make_grid, packed_staging, u

DB, SWZ, UNROLL, HALF, LEAN, CONST, BT, GLOBAL, BSTREAM, EARLY, PF2, TOUCH, FAR, ILV = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # Cfg.vr bits
TOUCH_AHEAD = 3  # ``TOUCH``: steps ahead of the products a touch load reads (``FAR``: + 2)
SECTOR = 32  # bytes the memory system moves per request (a touch load per sector)
SWZ_ROWS = 8  # tile rows per rasterization group
SG_PAD = 8  # f16 elements of padding per workgroup-memory row (keeps rows 16-byte aligned)
BS_ROW = 16 + SG_PAD  # ``CONST`` B strips: row stride (rows of a fragment on distinct banks)
BS_PAD = 16  # ``CONST`` B strips: padding after each strip (strips start on different banks)
# flat layouts stage each vec4 register with one packed 8-byte store (``vec2<u32>``) through a
# buffer view of the workgroup tiles where the device's WGSL has ``buffer_view``
# (``BUFFER_VIEW_FEATURE``); four 2-byte f16 stores otherwise
PACKED = True
# with packed staging, f16 operands load eight elements at once (one 16-byte ``vec4<u32>``,
# A along K, B along N) and store them as they are (one 16-byte store).  Off: slower on the
# H200 (4096³ f16, 128x256 k32: 230.4 TFLOP/s against 243.0 with four per load;
# docs/rejected-optimizations.md); kept selectable for re-measurement
WIDE = False
FRAG_L = "subgroup_matrix_left<f16, 16, 16>"
FRAG_R = "subgroup_matrix_right<f16, 16, 16>"
FRAG_C = "subgroup_matrix_result<f32, 16, 16>"


def sgmat(c, t, g):
    """Emit the tile for configuration ``g`` (see the module docstring); returns what
    ``matmul.emit`` expects: (body, (shared decls, bytes), workgroup size, grid, helpers, ops)."""
    from .matmul import _operands

    if g.vr & GLOBAL:
        return _global_fragments(c, t, g)
    TM, TN, BK, nsg = g.tm, g.tn, g.bk, g.rm * g.rn
    nthreads, db = 32 * nsg, bool(g.vr & DB)
    FM, FN = TM // g.rm // 16, TN // g.rn // 16  # fragments per subgroup
    lay = _Layout(g, FM, FN, PACKED and BUFFER_VIEW_FEATURE in t.features)
    ind = "    "
    L: list[str] = lay.view_lets(2 if db else 1) + [
                    f"{ind}let sid = lid / 32u;", f"{ind}let lane = lid % 32u;",
                    f"{ind}let fr = sid / {u(g.rn)} * {u(FM * 16)};",  # first row in the tile
                    f"{ind}let fc = sid % {u(g.rn)} * {u(FN * 16)};"]
    if lay.blk:  # the first A / B fragment block of this subgroup
        L += [f"{ind}let fb = sid / {u(g.rn)} * {u(FM)};",
              f"{ind}let fcb = sid % {u(g.rn)} * {u(FN)};"]
    grid, live_check, full_m, full_n = _tile_start(c, t, g, L, ind)
    L += [f"{ind}var c{i}_{j} = {FRAG_C}();" for i in range(FM) for j in range(FN)]
    ops = _operands(c, L, ind, TM, TN, BK, nthreads, bool(g.vl), f16_vec=True,
                    rt16=bool(g.vr & HALF), wide=WIDE and lay.packed,
                    sets="rq" if g.vr & PF2 else "r",
                    interleave=(("a", "b") if lay.bt else ("a",)) if g.vr & ILV else ())

    edges = not (full_m and full_n) or live_check
    if g.vr & PF2:
        _k_loop_pf2(c, L, ind, BK, edges, live_check, ops, lay)
    elif g.vr & TOUCH and c.K >= 2 * BK and all(o.w > 1 for o in ops):
        ahead = TOUCH_AHEAD + (2 if g.vr & FAR else 0)
        _k_loop_touch(c, L, ind, BK, edges, live_check, ops, lay, _Toucher(c, ops, nthreads,
                                                                            ahead))
    elif db:
        _k_loop_db(c, L, ind, BK, edges, live_check, ops, lay, bool(g.vr & UNROLL))
    else:
        _k_loop_single(c, L, ind, BK, edges, live_check, ops, lay, bool(g.vr & EARLY))
    helpers: set[str] = set()
    direct = _direct_ok(c)
    scratch = _stores(c, L, g, FM, FN, (full_m, full_n, live_check), direct, helpers)
    decls, nbytes = lay.decls(2 if db else 1)
    if scratch:
        decls.append(f"var<workgroup> Cs: array<f32, {256 * nsg}>;")
        nbytes += 4 * 256 * nsg
    return L, (decls, nbytes), nthreads, grid, helpers, ops


def _global_fragments(c, t, g):
    """``GLOBAL``: the K loop loads each subgroup's fragments from the operand bindings (one
    16-deep slice ahead of the products); raises ``CodegenError`` where it does not apply."""
    FM, FN, nsg, ind = g.tm // g.rm // 16, g.tn // g.rn // 16, g.rm * g.rn, "    "
    L: list[str] = [f"{ind}let sid = lid / 32u;", f"{ind}let lane = lid % 32u;",
                    f"{ind}let fr = sid / {u(g.rn)} * {u(FM * 16)};",
                    f"{ind}let fc = sid % {u(g.rn)} * {u(FN * 16)};"]
    grid, live_check, full_m, full_n = _tile_start(c, t, g, L, ind)
    views = [_global_view(c, "a"), _global_view(c, "b")]
    if (c.op_dt is not f16 or not (full_m and full_n) or live_check or c.K % 16
            or None in views):
        raise CodegenError(f"kernel {c.name!r}: fragments from global memory (option bit "
                           f"{GLOBAL}) need f16 operands, whole {g.tm}x{g.tn} tiles, K a "
                           "multiple of 16 and each operand row- or column-major with "
                           "16-byte aligned rows")

    def frag(which: str, n: int, k: str) -> str:
        """Fragment ``n`` of operand ``which`` at depth ``k``: A's rows fr + 16n, B's columns
        fc + 16n, column-major where A's rows / B's K are the contiguous axis."""
        s_x, s_k = views[0 if which == "a" else 1]
        slot, base, origin, kind = ((0, "abase", "row0 + fr", FRAG_L) if which == "a"
                                    else (1, "bbase", "col0 + fc", FRAG_R))
        binding = c.bd.name(slot)
        off = f"{base} + ({origin} + {u(16 * n)}) * {u(s_x)} + {k} * {u(s_k)}"
        col = (which == "a") == (s_x == 1)  # A: rows contiguous; B: K contiguous
        return (f"subgroupMatrixLoad<{kind}>(&{binding}, {off}, {str(col).lower()}, "
                f"{u(s_k if s_x == 1 else s_x)})")

    L += [f"{ind}var c{i}_{j} = {FRAG_C}();" for i in range(FM) for j in range(FN)]
    # fragment registers xa/xb (this slice) and ya/yb (the next; the bindings are b0, b1, ...)
    L += [f"{ind}var xa{i} = {frag('a', i, '0u')};" for i in range(FM)]
    L += [f"{ind}var xb{j} = {frag('b', j, '0u')};" for j in range(FN)]
    i2 = ind + "    "
    L += [f"{ind}for (var k0: u32 = 0u; k0 < {u(c.K)}; k0 = k0 + 16u) {{",
          f"{i2}let kn = min(k0 + 16u, {u(c.K - 16)});"]  # the last slice reloads itself
    L += [f"{i2}let ya{i} = {frag('a', i, 'kn')};" for i in range(FM)]
    L += [f"{i2}let yb{j} = {frag('b', j, 'kn')};" for j in range(FN)]
    L += [f"{i2}c{i}_{j} = subgroupMatrixMultiplyAccumulate(xa{i}, xb{j}, c{i}_{j});"
          for i in range(FM) for j in range(FN)]
    L += [f"{i2}xa{i} = ya{i};" for i in range(FM)] + [f"{i2}xb{j} = yb{j};" for j in range(FN)]
    L.append(f"{ind}}}")
    helpers: set[str] = set()
    scratch = _stores(c, L, g, FM, FN, (True, True, False), _direct_ok(c), helpers)
    decls = [f"var<workgroup> Cs: array<f32, {256 * nsg}>;"] if scratch else []
    return L, (decls, 1024 * nsg if scratch else 0), 32 * nsg, grid, helpers, []


def _global_view(c, which: str):
    """(stride along the tile's rows-or-columns, stride along K) of an operand a fragment can
    load from global memory directly: one of them 1, the other (the fragment stride: at least
    16, what a 16-wide row needs) and the offsets multiples of 8 (16-byte aligned fragment
    rows); None otherwise."""
    v = c.a if which == "a" else c.b
    sb, s_x, s_k = c.sa if which == "a" else (c.sb[0], c.sb[2], c.sb[1])
    if 1 not in (s_x, s_k) or (s_x * s_k) % 8 or s_x * s_k < 16 or sb % 8 or v.offset % 8:
        return None
    return s_x, s_k


class _Layout:
    """Where the staged tiles live in workgroup memory and how fragments load from them: flat
    padded rows (A: TM rows of BK + pad, B: BK rows of TN + pad) or, with ``CONST``, arrays of
    fragment blocks so every matrix load has a constant offset (module docstring).  ``units``:
    one buffer's size in what a buffer offset counts (elements, or blocks with ``CONST``).
    ``packed`` (flat layouts only): the tiles are workgroup ``buffer``s read through
    ``array<f16>`` views ``As`` / ``Bs`` and written through ``vec2<u32>`` views ``Aw`` / ``Bw``."""

    def __init__(self, g, FM: int, FN: int, packed: bool = False):
        self.g, self.FM, self.FN = g, FM, FN
        self.blk, self.bt = bool(g.vr & CONST), bool(g.vr & BT)
        self.packed = packed
        self.amp = "" if self.packed else "&"  # views already are pointers
        self.astr = g.bk + SG_PAD  # A's row stride (and transposed B's), f16 elements
        if not self.blk:  # flat B: BK rows of TN (or, ``BT``, TN rows of BK like A's)
            self.bstr = self.astr if self.bt else g.tn + SG_PAD
            self.units = (g.tm * self.astr, (g.tn if self.bt else g.bk) * self.bstr)
        else:
            self.bsz = 16 * self.astr if self.bt else g.bk * BS_ROW + BS_PAD  # one B block
            self.units = (g.tm // 16, g.tn // 16)

    def view_lets(self, nb: int) -> list[str]:
        """``packed``: the body's first lines, the f16 and packed views of the ``nb``-buffer
        tiles (``CONST``: the f16 views are arrays of fragment blocks)."""
        if not self.packed:
            return []
        views = ("w", "q") if WIDE else ("w",)
        return [ln for (arr, n), f16_view in zip(self._arrays(nb), self._block_views(nb))
                for ln in packed_staging(arr, n, views, f16_view=f16_view)[1]]

    def _block_views(self, nb: int) -> tuple:
        """``CONST``: the f16 view type of each tile (A: blocks of 16 rows, B: blocks of 16
        columns, ``_Layout.decls``' shapes); flat layouts: (None, None), plain arrays."""
        if not self.blk:
            return (None, None)
        return (f"array<array<f16, {16 * self.astr}>, {nb * self.units[0]}>",
                f"array<array<f16, {self.bsz}>, {nb * self.units[1]}>")

    def _arrays(self, nb: int) -> tuple[tuple[str, int], ...]:
        """(name, f16 elements) of the two tiles for ``nb`` buffers."""
        if self.blk:
            return (("As", nb * self.units[0] * 16 * self.astr),
                    ("Bs", nb * self.units[1] * self.bsz))
        return (("As", nb * self.units[0]), ("Bs", nb * self.units[1]))

    def decls(self, nb: int) -> tuple[list[str], int]:
        """The workgroup arrays for ``nb`` buffers and their bytes."""
        if self.packed:
            return ([packed_staging(arr, n)[0] for arr, n in self._arrays(nb)],
                    2 * sum(n for _, n in self._arrays(nb)))
        if not self.blk:
            a, b = nb * self.units[0], nb * self.units[1]
            return ([f"var<workgroup> As: array<f16, {a}>;",
                     f"var<workgroup> Bs: array<f16, {b}>;"], 2 * (a + b))
        na, nbb = nb * self.units[0], nb * self.units[1]
        return ([f"var<workgroup> As: array<array<f16, {16 * self.astr}>, {na}>;",
                 f"var<workgroup> Bs: array<array<f16, {self.bsz}>, {nbb}>;"],
                2 * (na * 16 * self.astr + nbb * self.bsz))

    def sh(self, off: str):
        """Where a staged element (tile row-or-column ``x``, depth ``kx``) lives, in the buffer
        ``off`` (a WGSL prefix such as ``"ca + "``) points to."""
        astr = self.astr

        def f(arr, kx, x, vec):
            if vec:
                return None
            if not self.blk:
                return (f"{arr}[{off}({x}) * {u(astr)} + {kx}]" if arr == "As" or self.bt
                        else f"Bs[{off}({kx}) * {u(self.bstr)} + {x}]")
            if arr == "As" or self.bt:
                return f"{arr}[{off}({x}) / 16u][({x}) % 16u * {u(astr)} + {kx}]"
            return f"Bs[{off}({x}) / 16u][{kx} * {u(BS_ROW)} + ({x}) % 16u]"
        return f

    def pk(self, off: str):
        """``packed``: the ``vec2<u32>`` of four staged elements from (``x``, ``kx``) on along
        K (``along_k``) or the tile's rows/columns, where they are adjacent (A along K, B along
        N; the first element's index / 4: rows are multiples of four long); else None."""
        if not self.packed:
            return None

        def f(arr, kx, x, along_k: bool, w: int = 4):
            view = f"{arr[0]}{'q' if w == 8 else 'w'}"  # vec4<u32> / vec2<u32> elements
            if self.blk:
                return _block_packed(self, view, arr, off, kx, x, along_k, w)
            if arr == "As" or self.bt:  # rows of A (and of transposed B) are K-contiguous
                return (f"{view}[({off}({x}) * {u(self.astr)} + {kx}) / {u(w)}]" if along_k
                        else None)
            return (None if along_k else
                    f"{view}[({off}({kx}) * {u(self.bstr)} + {x}) / {u(w)}]")
        return f

    def _block(self, arr: str) -> str:
        """``CONST``: the start of a pointer to one block of tile ``arr`` (a view is already a
        pointer, so its block is ``&(*As)[b]``; an array's ``&As[b]``)."""
        return f"&(*{arr})[" if self.packed else f"&{arr}["

    def _frag(self, which: str, off: str, i: int, kk: int) -> str:
        """The arguments of one fragment load (pointer, offset, column-major, stride)."""
        astr = self.astr
        if which == "a":
            if not self.blk:
                return (f"{self.amp}As, {off}(fr + {u(16 * i)}) * {u(astr)} + {u(kk)}, false, "
                        f"{u(astr)}")
            return f"{self._block('As')}{off}fb + {u(i)}], {u(kk)}, false, {u(astr)}"
        if not self.blk and self.bt:
            return (f"{self.amp}Bs, {off}(fc + {u(16 * i)}) * {u(astr)} + {u(kk)}, true, "
                    f"{u(astr)}")
        if not self.blk:
            return (f"{self.amp}Bs, {off}{u(kk * self.bstr)} + fc + {u(16 * i)}, false, "
                    f"{u(self.bstr)}")
        if self.bt:
            return f"{self._block('Bs')}{off}fcb + {u(i)}], {u(kk)}, true, {u(astr)}"
        return f"{self._block('Bs')}{off}fcb + {u(i)}], {u(kk * BS_ROW)}, false, {u(BS_ROW)}"

    def compute(self, out: list[str], ii: str, aoff: str, boff: str) -> None:
        """One BK-deep step, per 16-deep slice: the B fragments, then the A fragments and the
        products (``LEAN``: each A fragment right before its row of products, so one is live
        at a time; ``BSTREAM``: the A fragments, then each B fragment before its column)."""
        g, FM, FN = self.g, self.FM, self.FN

        def a_load(i: int, kk: int) -> str:
            return (f"{ii}let a{i}_{kk} = subgroupMatrixLoad<{FRAG_L}>("
                    f"{self._frag('a', aoff, i, kk)});")

        def row(i: int, kk: int) -> list[str]:
            return [f"{ii}c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}_{kk}, b{j}_{kk}, "
                    f"c{i}_{j});" for j in range(FN)]

        def b_load(j: int, kk: int) -> str:
            return (f"{ii}let b{j}_{kk} = subgroupMatrixLoad<{FRAG_R}>("
                    f"{self._frag('b', boff, j, kk)});")

        for kk in range(0, g.bk, 16):
            if not g.vr & LEAN:
                out += [a_load(i, kk) for i in range(FM)]
            if g.vr & BSTREAM:
                for j in range(FN):
                    out += [b_load(j, kk)] + [
                        f"{ii}c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}_{kk}, "
                        f"b{j}_{kk}, c{i}_{j});" for i in range(FM)]
                continue
            out += [b_load(j, kk) for j in range(FN)]
            for i in range(FM):
                out += ([a_load(i, kk)] if g.vr & LEAN else []) + row(i, kk)


def _block_packed(lay, view: str, arr: str, off: str, kx: str, x: str, along_k: bool,
                  w: int):
    """``CONST`` with packed staging: the packed element holding ``w`` staged elements from
    (``x``, ``kx``) on, where they are adjacent in a block (A and transposed B along K, B's
    column strips along N); None otherwise.  ``off`` counts blocks (``_Layout.units``)."""
    blk = f"({off}({x}) / 16u)"
    if arr == "As" or lay.bt:
        if not along_k:
            return None
        flat = f"{blk} * {u(16 * lay.astr)} + ({x}) % 16u * {u(lay.astr)} + {kx}"
    else:
        if along_k:
            return None
        flat = f"{blk} * {u(lay.bsz)} + {kx} * {u(BS_ROW)} + ({x}) % 16u"
    return f"{view}[({flat}) / {u(w)}]"


def _tile_start(c, t, g, L: list[str], ind: str):
    """Lines mapping the workgroup to (batch ``bi``, tile origin ``row0``/``col0``), row-major
    over the tile grid or (``SWZ``) in groups of ``SWZ_ROWS`` tile rows walked column by
    column; the uniform ``interior`` test and the operands' batch bases.  Returns (grid,
    live_check, full_m, full_n) like ``matmul._tile_start``."""
    from .matmul import tile_bounds

    B, M, N, TM, TN = c.B, c.M, c.N, g.tm, g.tn
    mt, nt = -(-M // TM), -(-N // TN)
    grid = make_grid(c.name, mt * nt * B, t)
    L += [f"{ind}let wg = {grid.wg_expr};", f"{ind}let ti = wg % {u(mt * nt)};",
          f"{ind}let bi = wg / {u(mt * nt)};"]
    if g.vr & SWZ and mt > SWZ_ROWS:
        span = SWZ_ROWS * nt
        L += [f"{ind}let gm = ti / {u(span)} * {u(SWZ_ROWS)};",
              f"{ind}let gs = min({u(mt)} - gm, {u(SWZ_ROWS)});",
              f"{ind}let gr = ti % {u(span)};",
              f"{ind}let tm = gm + gr % gs;", f"{ind}let tn = gr / gs;"]
    else:
        L += [f"{ind}let tn = ti % {u(nt)};", f"{ind}let tm = ti / {u(nt)};"]
    L += [f"{ind}let row0 = tm * {u(TM)};", f"{ind}let col0 = tn * {u(TN)};"]
    return tile_bounds(c, grid, TM, TN, L, ind)


def _loader(c, L: list[str], edges: bool, live_check: bool, ops):
    """``load(indent, check_k)``: step ``kb``'s global loads into the staging registers (edge
    tiles check rows/columns, interior ones not; ``check_k`` zero-fills a K tail)."""
    from .matmul import _load_items

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
    return load


def _next_loads(c, L: list[str], ii: str, bk: int, load) -> None:
    """The loads of step ``kb`` (already defined): whole steps unguarded along K, the K tail
    zero-filled, nothing past it."""
    kf, K = c.K - c.K % bk, c.K
    if kf > 0:
        L.append(f"{ii}if (kb < {u(kf)}) {{")
        load(ii + "    ", False)
        L.append(f"{ii}}}")
    if kf != K:
        L.append(f"{ii}if (kb == {u(kf)}) {{")
        load(ii + "    ", True)
        L.append(f"{ii}}}")


def _k_loop_single(c, L, ind, bk, edges, live_check, ops, lay, early: bool = False) -> None:
    """One workgroup buffer per operand: store step k's registers, barrier, issue step
    k + 1's loads, multiply step k, barrier (``early``: the loads before the first barrier)."""
    from .matmul import _store_items

    i2, compute = ind + "    ", lay.compute
    load = _loader(c, L, edges, live_check, ops)
    ks = -(-c.K // bk) * bk
    L += [f"{ind}{{", f"{i2}let kb = 0u;"]
    load(i2, c.K < bk)
    L += [f"{ind}}}", f"{ind}for (var k0: u32 = 0u; k0 < {u(ks)}; k0 = k0 + {u(bk)}) {{"]
    for o in ops:
        _store_items(L, i2, o, lay.sh(""), lambda v: f"f16({v})", lay.pk(""))
    if early:
        L.append(f"{i2}let kb = k0 + {u(bk)};")
        _next_loads(c, L, i2, bk, load)
        L.append(f"{i2}workgroupBarrier();")
    else:
        L += [f"{i2}workgroupBarrier();", f"{i2}let kb = k0 + {u(bk)};"]
        _next_loads(c, L, i2, bk, load)
    compute(L, i2, "", "")
    L += [f"{i2}workgroupBarrier();", f"{ind}}}"]


class _Toucher:
    """``TOUCH``: the touch loads of both operands, one per ``SECTOR`` bytes of a step's tiles,
    spread over the invocations (module docstring); every touch's first element is summed
    into ``tacc``, which goes to a dead workgroup element after the loop so the loads stay."""

    def __init__(self, c, ops, nthreads: int, ahead: int):
        self.c, self.ops, self.nthreads, self.ahead = c, ops, nthreads, ahead

    def _plan(self, o) -> tuple[int, int, int]:
        """(items per touch, touches per step, touches per invocation) of operand ``o``."""
        item_bytes = o.w * (2 if o.elem == "f16" else 4)
        along = (o.bk if o.k_fast else o.T) // o.w
        s = max(1, min(SECTOR // item_bytes, along))
        while along % s:
            s -= 1
        n_t = o.items // s
        return s, n_t, -(-n_t // self.nthreads)

    def decls(self, L: list[str], ind: str) -> None:
        L.append(f"{ind}var tacc = 0.0;")
        for o in self.ops:
            t = f"vec4<{o.bt}>"
            L += [f"{ind}var t{st}{o.p}{m}: {t};" for st in "xy"
                  for m in range(self._plan(o)[2])]

    def issue(self, L: list[str], ii: str, k: str, st: str) -> None:
        """Set ``st``'s touches of step ``k`` + ``ahead`` (clamped to the last whole step)."""
        c, kf = self.c, self.c.K - self.c.K % self.ops[0].bk
        bk = self.ops[0].bk
        L.append(f"{ii}let kt{st} = min({k} + {u(self.ahead * bk)}, {u(kf - bk)});")
        for o in self.ops:
            s, n_t, per = self._plan(o)
            along = (o.bk if o.k_fast else o.T) // o.w
            origin = "row0" if o.which == "a" else "col0"
            for m in range(per):
                e = f"(min(lid + {u(m * self.nthreads)}, {u(n_t - 1)}) * {u(s)})"
                fast, slow = f"({e} % {u(along)} * {u(o.w)})", f"({e} / {u(along)})"
                x, kx = (slow, fast) if o.k_fast else (fast, slow)
                idx = f"{o.p}base + " + index_code(
                    [f"min({origin} + {x}, {u(o.dim - 1)})", f"(kt{st} + {kx})"],
                    [o.s_x, o.s_k])
                L.append(f"{ii}t{st}{o.p}{m} = {c.bd.name(o.slot)}[({idx}) / {u(o.w)}];")

    def consume(self, L: list[str], ii: str, st: str) -> None:
        for o in self.ops:
            L += [f"{ii}tacc = tacc + f32(t{st}{o.p}{m}.x);" for m in range(self._plan(o)[2])]

    def finish(self, L: list[str], ind: str, lay) -> None:
        tm = self.ops[0].T
        L.append(f"{ind}{lay.sh('')('As', '0u', f'(lid % {u(tm)})', False)} = f16(tacc);")


def _k_loop_touch(c, L, ind, bk, edges, live_check, ops, lay, touch: _Toucher) -> None:
    """``TOUCH``: ``_k_loop_single``'s steps, two per iteration; step k issues touch set x
    (even steps) or y (odd) after its real loads and consumes the other set (issued the step
    before) after its products."""
    from .matmul import _store_items

    i2, i3 = ind + "    ", ind + "        "
    load = _loader(c, L, edges, live_check, ops)
    nsteps = -(-c.K // bk)
    ks = nsteps * bk
    touch.decls(L, ind)
    L += [f"{ind}{{", f"{i2}let kb = 0u;"]
    load(i2, c.K < bk)
    L.append(f"{ind}}}")

    def step(ii: str, k: str, st: str, other: str) -> None:
        for o in ops:
            _store_items(L, ii, o, lay.sh(""), lambda v: f"f16({v})", lay.pk(""))
        L.extend([f"{ii}workgroupBarrier();", f"{ii}let kb = {k} + {u(bk)};"])
        _next_loads(c, L, ii, bk, load)
        touch.issue(L, ii, k, st)
        lay.compute(L, ii, "", "")
        touch.consume(L, ii, other)
        L.append(f"{ii}workgroupBarrier();")

    L += [f"{ind}for (var k0: u32 = 0u; k0 < {u(ks)}; k0 = k0 + {u(2 * bk)}) {{", f"{i2}{{"]
    step(i3, "k0", "x", "y")
    L += [f"{i2}}}", f"{i2}let k1 = k0 + {u(bk)};"]
    L.append(f"{i2}if (k1 < {u(ks)}) {{" if nsteps % 2 else f"{i2}{{")
    step(i3, "k1", "y", "x")
    L += [f"{i2}}}", f"{ind}}}"]
    touch.finish(L, ind, lay)


def _with_set(ops, reg: str, emit) -> None:
    """Run ``emit()`` with every operand's staging registers switched to set ``reg``."""
    for o in ops:
        o.reg = reg
    try:
        emit()
    finally:
        for o in ops:
            o.reg = "r"


def _k_loop_pf2(c, L, ind, bk, edges, live_check, ops, lay) -> None:
    """``PF2``: one workgroup buffer, registers ``r`` for even steps and ``q`` for odd ones.
    Step k stores its set, barrier, issues step k + 2's loads into the same set, multiplies,
    barrier; two steps per iteration keep the set names constant."""
    from .matmul import _store_items

    i2, i3 = ind + "    ", ind + "        "
    load = _loader(c, L, edges, live_check, ops)
    nsteps = -(-c.K // bk)
    ks = nsteps * bk
    for reg, k in (("r", 0), ("q", bk)):
        if k < ks:
            L += [f"{ind}{{", f"{i2}let kb = {u(k)};"]
            _with_set(ops, reg, lambda: load(i2, c.K < k + bk))
            L.append(f"{ind}}}")

    def step(ii: str, k: str, reg: str) -> None:
        def body() -> None:
            for o in ops:
                _store_items(L, ii, o, lay.sh(""), lambda v: f"f16({v})", lay.pk(""))
            L.extend([f"{ii}workgroupBarrier();", f"{ii}let kb = {k} + {u(2 * bk)};"])
            _next_loads(c, L, ii, bk, load)
        _with_set(ops, reg, body)
        lay.compute(L, ii, "", "")
        L.append(f"{ii}workgroupBarrier();")

    L += [f"{ind}for (var k0: u32 = 0u; k0 < {u(ks)}; k0 = k0 + {u(2 * bk)}) {{", f"{i2}{{"]
    step(i3, "k0", "r")
    L += [f"{i2}}}", f"{i2}let k1 = k0 + {u(bk)};"]
    L.append(f"{i2}if (k1 < {u(ks)}) {{" if nsteps % 2 else f"{i2}{{")
    step(i3, "k1", "q")
    L += [f"{i2}}}", f"{ind}}}"]


def _k_loop_db(c, L, ind, bk, edges, live_check, ops, lay, unroll: bool = False) -> None:
    """Two workgroup buffers per operand, one barrier per K step: step k stores the registers
    (step k + 1's tiles) into the other buffer, issues step k + 2's loads, multiplies step k.
    The other buffer was last read before the previous step's barrier, so no second one.
    ``unroll``: two steps per iteration, so every buffer offset is a constant."""
    from .matmul import _store_items

    i2, sh, compute = ind + "    ", lay.sh, lay.compute
    asz, bsz = lay.units
    conv = lambda v: f"f16({v})"  # noqa: E731
    load = _loader(c, L, edges, live_check, ops)
    nsteps = -(-c.K // bk)
    ks = nsteps * bk
    L += [f"{ind}{{", f"{i2}let kb = 0u;"]
    load(i2, c.K < bk)
    for o in ops:
        _store_items(L, i2, o, sh(""), conv, lay.pk(""))
    L += [f"{ind}}}", f"{ind}{{", f"{i2}let kb = {u(bk)};"]
    _next_loads(c, L, i2, bk, load)
    L += [f"{ind}}}", f"{ind}workgroupBarrier();"]

    def step(ii: str, k: str, cur) -> None:
        """One K step at ``k`` on buffer ``cur`` (0/1, or a WGSL expression)."""
        i3 = ii + "    "
        if isinstance(cur, int):
            offs = [u(cur * asz), u(cur * bsz), u((1 - cur) * asz), u((1 - cur) * bsz)]
        else:
            L.extend([f"{ii}let ca = {cur} * {u(asz)};", f"{ii}let cb = {cur} * {u(bsz)};",
                      f"{ii}let na = {u(asz)} - ca;", f"{ii}let nb = {u(bsz)} - cb;"])
            offs = ["ca", "cb", "na", "nb"]
        L.append(f"{ii}if ({k} + {u(bk)} < {u(ks)}) {{")
        for o in ops:
            off = f"{offs[2] if o.which == 'a' else offs[3]} + "
            _store_items(L, i3, o, sh(off), conv, lay.pk(off))
        L.extend([f"{ii}}}", f"{ii}let kb = {k} + {u(2 * bk)};"])
        _next_loads(c, L, ii, bk, load)
        compute(L, ii, f"{offs[0]} + ", f"{offs[1]} + ")
        L.append(f"{ii}workgroupBarrier();")

    if not unroll:
        L.append(f"{ind}for (var k0: u32 = 0u; k0 < {u(ks)}; k0 = k0 + {u(bk)}) {{")
        step(i2, "k0", f"((k0 / {u(bk)}) & 1u)")
        L.append(f"{ind}}}")
        return
    L += [f"{ind}for (var k0: u32 = 0u; k0 < {u(ks)}; k0 = k0 + {u(2 * bk)}) {{", f"{i2}{{"]
    step(i2 + "    ", "k0", 0)
    L += [f"{i2}}}", f"{i2}let k1 = k0 + {u(bk)};"]
    L.append(f"{i2}if (k1 < {u(ks)}) {{" if nsteps % 2 else f"{i2}{{")
    step(i2 + "    ", "k1", 1)
    L += [f"{i2}}}", f"{ind}}}"]


def _direct_ok(c) -> bool:
    """Fragments can go straight to C: no epilogue, an f32 result, an output binding no
    operand shares (its declaration stays ``array<f32>``), and rows of C a matrix store may
    stride over: Dawn wants ≥ 64 bytes (N ≥ 16: an output of 10 classes failed to compile on
    the H200), and 16-byte aligned rows keep every fragment row aligned (N % 4 == 0)."""
    from ..dtypes import f32

    alias = c.bd.alias
    out = c.n_in
    shared = any(alias[i] == alias[out] for i in range(len(alias)) if i != out)
    return not c.k.epilogue and c.out_dt is f32 and not shared and c.N >= 16 and c.N % 4 == 0


def _stores(c, L: list[str], g, FM: int, FN: int, fit, direct: bool, helpers) -> bool:
    """The result fragments into C: directly where the tile is interior and ``direct``,
    through the scratch otherwise.  Returns whether the scratch ``Cs`` is used."""
    full_m, full_n, live_check = fit
    ind, i2 = "    ", "        "
    guard = ([] if full_m else [f"r < {u(c.M)}"]) + ([] if full_n else [f"n < {u(c.N)}"])
    guard += ["live"] if live_check else []
    edges = bool(guard)
    if not direct:
        _scratch_stores(c, L, ind, FM, FN, guard, helpers)
        return True
    tgt = i2 if edges else ind
    if edges:
        L.append(f"{ind}if (interior) {{")
    out = c.bd.name(c.n_in)
    for i in range(FM):
        for j in range(FN):
            L.append(f"{tgt}subgroupMatrixStore(&{out}, bi * {u(c.M * c.N)} + (row0 + fr + "
                     f"{u(16 * i)}) * {u(c.N)} + col0 + fc + {u(16 * j)}, c{i}_{j}, false, "
                     f"{u(c.N)});")
    if not edges:
        return False
    L.append(f"{ind}}} else {{")
    _scratch_stores(c, L, i2, FM, FN, guard, helpers)
    L.append(f"{ind}}}")
    return True


def _scratch_stores(c, L: list[str], ind: str, FM: int, FN: int, guard: list[str],
                    helpers) -> None:
    """Each fragment through this subgroup's 16x16 f32 scratch in workgroup memory, then 8
    elements per invocation through the ordinary (bounds-checked) epilogue and store."""
    i2, i3 = ind + "    ", ind + "        "
    for i in range(FM):
        for j in range(FN):
            L += [f"{ind}subgroupMatrixStore(&Cs, sid * 256u, c{i}_{j}, false, 16u);",
                  f"{ind}workgroupBarrier();",
                  f"{ind}for (var q: u32 = 0u; q < 8u; q = q + 1u) {{",
                  f"{i2}let e = lane + q * 32u;",
                  f"{i2}let r = row0 + fr + {u(16 * i)} + e / 16u;",
                  f"{i2}let n = col0 + fc + {u(16 * j)} + e % 16u;",
                  f"{i2}let v = Cs[sid * 256u + e];"]
            if guard:
                L.append(f"{i2}if ({' && '.join(guard)}) {{")
                c.store(L, i3, "bi", "r", "n", "v", helpers)
                L.append(f"{i2}}}")
            else:
                c.store(L, i2, "bi", "r", "n", "v", helpers)
            L += [f"{ind}}}", f"{ind}workgroupBarrier();"]
