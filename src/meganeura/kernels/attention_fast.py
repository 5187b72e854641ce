"""The ``precision="fast"`` attention forward: QKᵀ and PV on f16 subgroup matrices (Dawn's
``chromium_experimental_subgroup_matrix``, 16×16×16, f32 accumulation), softmax in f32.

Layout.  A workgroup is ``NSG`` subgroups of 32; subgroup s owns ``ROW_BLOCKS`` blocks of 16
packed rows (the rows of ``attention.py``: (query position, group member) of one kv head): block
r covers rows R0 + 16·(r·NSG + s).  Q is staged once (pre-scaled, rounded to f16, 16·NSG rows
at a time) and kept as D/16 left fragments per block.  Per key tile of BK keys (K and V staged
as f16, K read transposed through a column-major load), each row block in turn through the
subgroup's scratch:

1. S = Q·Kᵀ: BK/16 result fragments, stored (f32) into the subgroup's rows of ``Sf``;
2. softmax: lane (r, h) = (lane / 2, lane % 2) owns row r and the columns of parity h of the
   tile and of the output; row maxima are exchanged with the partner lane
   (``subgroupShuffleXor``), the online-softmax rescale and the row sums are f32, P is rounded
   to f16 into ``Ph``;
3. O_tile = P·V: Dv/16 fresh result fragments (each P fragment loaded once), stored (f32) into
   ``Sf``; each lane adds its share to its f32 registers after rescaling them (fragments cannot
   be scaled per row, and a result fragment rescaled or reset inside the loop came out wrong
   on the H200: docs/rejected-optimizations.md).

``PREFETCH``: tile t + 1's K and V are loaded into registers at the top of tile t and stored
(rounded to f16) after its P·V, so the global loads' latency hides behind the tile's work; the
values must not be touched before then (rounding them at load time, to halve the registers,
made the kernel 1.4x slower on the H200: the conversion waits for the load).

Bank conflicts.  The scalar phases read and write 16 scratch rows at once.  The two lanes of a
row sit on adjacent columns and ``Sf``'s rows are ``SF_PAD`` words longer than their width (64
+ 2: row r starts on bank 2r), so the 32 lanes of every ``Sf`` access hit 32 banks; ``Ph``'s
rows are BK + 8 f16 (16-byte aligned for the fragment loads: at most 2-way).  With the earlier
layout (a lane on half a row, unpadded rows) every such access was a 32-way conflict.

Work per staged tile.  Two row blocks per subgroup (``ROW_BLOCKS``) let every staged K/V tile
serve 128 rows instead of 64 (the staging was the largest cost); a workgroup also walks several
of the description's key chunks in turn (``chunk_group``: Q staged once for all of them), since
the op picks its chunk count for the strict kernel.

``LEAN``: tiles wholly inside the key range take an unmasked copy of the softmax, and scores
are in log2 units (log2 e folded into Q's scale, ``exp2``).  ``O_SHARED`` and
``SPLIT_PREFETCH`` (off) are layouts with fewer registers: the kernel uses all 255 of a
128-invocation workgroup (``bench/pipeline_stats.py``), so 2 workgroups fit on an SM.  On the
H200 neither paid: O in workgroup memory got (4, 32) down to 114 registers (97 with the split
prefetch) but ran 153.3 µs against 106.1; the split prefetch alone 248 registers, 105.7 µs
(docs/rejected-optimizations.md).  ``PACKED`` (on where the device has buffer views) stages
Q/K/V with one 8-byte store per four values: 105.8 against 106.2 µs, neutral.

``VEC_LOADS``: q/k/v bindings declared as ``array<vec4<f32>>`` where every view allows, one
16-byte load per staged unit instead of four scalar loads with a bounds clamp each: 105.9 →
94.4 µs.

H200 (Dawn, (1, 6, 1500, 64), key chunks + combine): 290.0 µs before this design, 132.7 with
the layout, prefetch and single P loads (3 chunks), 117.6 with two row blocks and 32-key tiles,
106.1 with the lean softmax and 64-key tiles (1.83x the strict 193.7), 94.4 with vec4 loads
(2.06x the strict 194.0); tenth session (``LANE_VEC`` 83.0, ``REG_STAGE`` 76.8, ``OUT_VEC``
with ``HOIST_FIRST`` 66.1, the vec4 combine 65.1, ``PACK_F32`` 64.6 µs: 2.98x the strict
192.4); in Whisper's model, at the 3 chunks compile gives it (``compile/fast_attention.py``),
76.7 + 8.8 (combine) against 202.9 + 10.0 strict.  Eleventh session: 64.3–65.2 µs across
runs (2.95–2.99x); Q through the scratch, Q's loads first, three row blocks: all slower
(docs/rejected-optimizations.md).  Twelfth session: a short fourth key chunk in the first
wave's idle slots (``fast_split``) 60.8 µs, 3.16x the strict 192.3.
Where the time goes: docs/benchmarks.md (sixth and seventh sessions).

The stores (out = o / l, lse = (m + log2 l)·ln 2), causal/window tile bounds, masks, GQA
packing and split-K chunks are those of the strict kernel.  Workgroup memory: K (max(16·NSG,
BK) rows; it holds Q while the fragments are loaded) and V as f16, one f32 and one f16 scratch
of 16 rows per subgroup (and O, f32, with ``O_SHARED``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from ..dtypes import f32
from .common import (
    BUFFER_VIEW_FEATURE,
    SG_FEATURE,
    CodegenError,
    make_grid,
    pack_f16x4,
    packed_staging,
    u,
)

PAD = 8  # f16 elements of padding per staged row (rows stay 16-byte aligned)
# (subgroups per workgroup, keys per tile), heuristic first (H200, Whisper, lean softmax, vec4
# loads: (4, 64) 64.6 µs at 3 chunks, 76.6 at 4, 89.9 at 2; (4, 32) 73.5 at 3)
FAST_CONFIGS = ((4, 64), (4, 32), (2, 64), (2, 32), (1, 64))
FLT_MAX = "3.4028234663852886e38"
ROW_BLOCKS = 2  # 16-row blocks per subgroup: each staged K/V tile serves ROW_BLOCKS x 16 rows
# a workgroup walks several of the description's key chunks in turn (Q staged once) until it
# covers about this many keys (the op's chunk count is the strict kernel's: ops/attention.py)
GROUP_KEYS = 512
PREFETCH = True  # K/V of tile t + 1 loaded into registers during tile t (stored after it)
# K of tile t + 1 stored as soon as the tile's scores are done, V of t + 1 loaded only then:
# the two sets of prefetch registers are never live together.  H200: 248 registers at (4, 64)
# (255 without), 105.7 µs against 106.2: neutral, off
SPLIT_PREFETCH = False
# timing only (wrong results): phases of the key loop left out, to see what each one costs
# (bench/attention_bench.py --fast-ab no-<phase>)
# ("qload": Q's global loads only, its stores and fragment loads kept)
ABLATE_PHASES = frozenset({"stage", "scores", "softmax", "pv", "barriers", "qstage", "first",
                           "qload"})
ABLATE: frozenset = frozenset()
SF_PAD = 2  # f32 words after each ``Sf`` row (every access conflict-free)
# tiles wholly inside the key range skip the per-score masks (when the description has no
# causal/window bound and no added mask); scores are kept in log2 units (Q pre-scaled by
# log2 e, exp2 in the softmax)
LEAN = True
# O in workgroup memory instead of registers (one row block per subgroup; each tile's P·V
# loads O's result fragments, accumulates and stores them back; the row max is refreshed only
# when it grows by more than ``O_TAU`` (log2 units: P <= 2^8 in f16), O then rescaled in place
# by its lanes).  H200: 114 registers at (4, 32) but 153.3 µs against 106.1 (the O round trip
# through workgroup memory lengthens every tile more than the extra warps hide); off.
O_SHARED = False
O_TAU = 8.0
# K, V and Q staged with one packed 8-byte store per four values (``vec2<u32>`` of
# ``pack2x16float``) through a buffer view of the workgroup memory, where the device's WGSL
# has ``buffer_view`` (``BUFFER_VIEW_FEATURE``); four 2-byte stores otherwise
PACKED = True
# q/k/v read as vec4<f32> (their bindings declared as arrays of vec4) where every view of the
# binding is row-contiguous and 4-aligned: one 16-byte load per unit instead of four scalar
# loads, each with its own bounds clamp under Dawn's robustness (``attention._Gen.vec_reads``)
VEC_LOADS = True
# one more, shorter key chunk in the idle slots of the first wave (``fast_split``)
TAIL_CHUNK = True
# lane (r, hh) owns the vec4 units 2j + hh of its row (was: the columns 2j + hh), so the
# softmax's score reads, the O update's reads, the P stores and the output stores are one
# 16-byte (8-byte for P) access per four values, through vec4 / vec2<u32> buffer views of the
# scratch where the device has them (``BUFFER_VIEW_FEATURE``), and the output rows are written
# in whole 32-byte sectors; the scratch rows are padded by 8 words (``LANE_PAD``: a row stride
# of 8 or 24 mod 32 words keeps each quarter-warp's 16-byte accesses on distinct banks)
LANE_VEC = True
LANE_PAD = 8
# the row max and row sum of the softmax as pairwise trees (depth log2 of the half row) instead
# of serial chains of BK / 2 dependent operations
TREE_REDUCE = True
# Q's staging and the first K/V tile's through registers: every load of a pass issued before
# its first store (the load-store loop waited one global latency per strided step: 8 steps
# per 64-row pass at 128 invocations); Q's two row blocks in one pass where V's staging array
# holds a block
REG_STAGE = True
HOIST_FIRST = True
# the unmasked tiles' exponentials in f16 (vec4<f16> exp2 of the f32 differences): timing
# experiment, off (the differences rounded to f16 cost P up to 2^-11 relative error more)
EXP_F16 = False
# P rounded to f16 by the packing of its stores (f32 pairs -> one packed word), its row sum
# from the unpacked words: one conversion per two values instead of f32 -> f16 -> f32 -> f16
PACK_F32 = True
# the output rows written one vec4 per four values (the output binding declared as vec4s)
OUT_VEC = True
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453


def _strides(bk: int, Dv: int) -> tuple[int, int]:
    """(``Sf`` row stride in f32, ``Ph`` row stride in f16).  ``Sf`` holds S, and the P·V
    tile too unless O lives in workgroup memory (``O_SHARED``)."""
    return (bk if O_SHARED else max(bk, Dv)) + (LANE_PAD if lane_vec() else SF_PAD), bk + PAD


def lane_vec() -> bool:
    """Lanes own vec4 units of their rows (``LANE_VEC``; not with ``O_SHARED``)."""
    return LANE_VEC and not O_SHARED


def _elem(j: int) -> int:
    """Offset of this lane's ``j``-th value of its row from its row base (which holds the
    lane's parity: ``hh`` columns, or ``4 hh`` with ``LANE_VEC``)."""
    return 8 * (j // 4) + j % 4 if lane_vec() else 2 * j


def row_blocks() -> int:
    """16-row blocks per subgroup (``ROW_BLOCKS``; one with ``O_SHARED``)."""
    return 1 if O_SHARED else ROW_BLOCKS


def _at(name: str, j: int) -> str:
    """This lane's ``j``-th element of its row of scratch ``name`` (``Sf``, ``Ph`` or ``Of``;
    the row base ``sfb`` / ``phb`` / ``ofb`` holds the subgroup's block, the row and the lane's
    parity)."""
    return f"{name}[{_BASES[name]} + {u(_elem(j))}]"


_BASES = {"Sf": "sfb", "Ph": "phb", "Of": "ofb"}


def _ptr(g, name: str, n: int, off: int) -> str:
    """Pointer and offset arguments of a fragment load/store at ``off`` in this subgroup's
    block of scratch ``name``."""
    return f"{_ref(g, name)}, sid * {u(n)} + {u(off)}"


def _col(j: int) -> str:
    """WGSL column of this lane's ``j``-th column: the two lanes of a row alternate."""
    return f"{u(_elem(j))} + {'hh4' if lane_vec() else 'hh'}"


def usable(k, t) -> bool:
    """The fast forward applies: precision fast, forward, head dims multiples of 16, and the
    device has f16 subgroup matrices (subgroups of 32) and subgroup shuffles."""
    D, Dv = k.q.shape[3], k.v.shape[3]
    return (k.precision == "fast" and k.kind == "fwd" and D % 16 == 0 and Dv % 16 == 0
            and k.q.dtype is f32 and SG_FEATURE in t.features
            and ("subgroups" in t.features or "subgroup" in t.features))


# the fast forward pays from this many keys and packed query rows up (H200, Dawn: Whisper's
# (1, 6, 1500, 64) 94.4 µs against 194.0 strict; SmolLM2's 128 keys 12.9 against 10.0, measured
# before the vec4 loads)
FAST_MIN_KEYS = 512
FAST_MIN_ROWS = 64


def pays(k) -> bool:
    """Under ``precision="fast"``: whether forward ``k`` should ask for the tensor-core kernel
    (long key loops over enough query rows; short ones are faster on the strict kernel)."""
    return k.kind == "fwd" and pays_dims(k.q.shape[1], k.k.shape[1], k.q.shape[2],
                                         k.k.shape[2], k.q.shape[3], k.v.shape[3])


def pays_dims(Hq: int, Hkv: int, Sq: int, Skv: int, D: int, Dv: int) -> bool:
    """``pays`` from the problem's dimensions."""
    return (Skv >= FAST_MIN_KEYS and Sq * (Hq // Hkv) >= FAST_MIN_ROWS and D % 16 == 0
            and Dv % 16 == 0)


# key chunks of the tensor-core forward: as many as keep its workgroups within about one wave
# (H200: two resident workgroups per SM at 255 registers, 132 SMs; Whisper (1, 6, 1500, 64) at
# 3 chunks (216 workgroups) 106.1 µs (94.4 with vec4 loads), at the strict kernel's 6 (walked
# in pairs) 127.4 (116.7), at 4 (288) 127.3 (113.8)).  A layout with fewer registers (more
# resident workgroups) wants a larger wave: ``O_SHARED`` (114 registers measured: 4 per SM)
# 512; it ran 153.3 / 153.5 / 179.7 µs at 3 / 4 / 6 chunks.
FAST_WAVE_WGS = 256
FAST_WAVE_WGS_O_SHARED = 512


def _wave(B: int, Hq: int, Hkv: int, Sq: int) -> tuple[int, int]:
    """(workgroups per key chunk of the first fast configuration, the wave's workgroups)."""
    blocks = -(-Sq * (Hq // Hkv) // (16 * FAST_CONFIGS[0][0] * row_blocks()))
    return B * Hkv * blocks, FAST_WAVE_WGS_O_SHARED if O_SHARED else FAST_WAVE_WGS


def fast_chunks(B: int, Hq: int, Hkv: int, Sq: int, Skv: int, n_strict: int) -> int:
    """Key chunks the tensor-core forward wants (at most the strict kernel's ``n_strict``):
    the most that keep ``FAST_WAVE_WGS`` workgroups of the first fast configuration."""
    per_chunk, wave = _wave(B, Hq, Hkv, Sq)
    return max(1, min(n_strict, wave // max(1, per_chunk)))


def fast_split(B: int, Hq: int, Hkv: int, Sq: int, Skv: int, n_strict: int) -> tuple[int, int]:
    """(key chunks, keys per chunk or 0 for an even split) of the tensor-core forward.

    ``fast_chunks``'s n even chunks leave ``F`` of the wave's ``FAST_WAVE_WGS`` slots idle
    when n·P workgroups (P per chunk) do not fill it.  One more chunk of r key tiles, after n of
    t tiles each, uses them: its first F workgroups start at once, the others as those finish
    (dispatch order: the chunk index varies slowest in the grid), so it ends after about
    ``rounds`` · (r + 1) tiles (``rounds`` = ceil(P / F), one tile's worth for the prologue),
    and t is the fewest tiles that keep that within t + 1.  Taken where t is below the even
    split's ceil(T / n) tiles and n + 1 chunks stay within the op's ``n_strict``.  H200,
    Whisper (1, 6, 1500, 64): 3 even chunks of 8 tiles 64.3–64.4 µs (forward + combine), 4
    chunks of 448 keys (7, 7, 7, 2.4 tiles) 60.8–61.1 (docs/benchmarks.md, twelfth session)."""
    n = fast_chunks(B, Hq, Hkv, Sq, Skv, n_strict)
    bk = FAST_CONFIGS[0][1]
    per_chunk, wave = _wave(B, Hq, Hkv, Sq)
    free = wave - n * per_chunk
    if not TAIL_CHUNK or free <= 0 or n + 1 > n_strict:
        return n, 0
    tiles, rounds = Skv / bk, -(-per_chunk // free)
    t = math.ceil((rounds * (tiles + 1) - 1) / (1 + rounds * n))
    ck = t * bk
    if t >= math.ceil(tiles / n) or -(-Skv // ck) != n + 1:
        return n, 0
    return n + 1, ck


def fast_words(cfg, D: int, Dv: int) -> int:
    """Bytes / 4 of workgroup storage of configuration ``cfg``."""
    nsg, bk = cfg
    bq = 16 * nsg  # Q is staged 16 * nsg rows at a time (ROW_BLOCKS passes)
    sst, pst = _strides(bk, Dv)
    f16_elems = max(bq, bk) * (D + PAD) + bk * (Dv + PAD) + nsg * 16 * pst
    o_words = nsg * 16 * (Dv + SF_PAD) if O_SHARED else 0
    return -(-f16_elems // 2) + nsg * 16 * sst + o_words


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
        if items * -(-rows // (16 * c[0] * row_blocks())) >= 128:
            return c
    return min(fits, key=lambda c: (c[0], -c[1]))


def chunk_group(k) -> int:
    """Key chunks one workgroup walks in turn: the largest divisor of ``k.splits`` whose chunks
    together stay within ``GROUP_KEYS`` keys (H200, Whisper's 6 chunks of 250 keys in pairs:
    135.7 against 141.0 µs ungrouped; a real 3-chunk launch runs 117.6)."""
    from .attention import chunk_len

    n = max(1, k.splits)
    chunk = chunk_len(k)
    return max(d for d in range(1, n + 1) if n % d == 0 and (d == 1 or d * chunk <= GROUP_KEYS))


def fast_body(g, t) -> list[str]:
    """The kernel body (``g``: the strict kernel's ``_Gen``, for shapes, bindings, masks)."""
    from .attention import _grid_head

    k = g.k
    nsg, bk = g.fast = fast_config(k, t)
    nrb = row_blocks()
    sq, bq, D, Dv = 16 * nsg, 16 * nsg * nrb, g.D, g.Dv  # rows staged at once / per workgroup
    qs, vs = D + PAD, Dv + PAD
    sw, pst = _strides(bk, Dv)
    g.wg, g.fast_rows = 32 * nsg, bq
    g.fast_packed = PACKED and BUFFER_VIEW_FEATURE in t.features
    if OUT_VEC and lane_vec() and [r for r, v in g.bind.items() if v == g.bind["out"]] == ["out"]:
        g.vec_writes = {g.bind["out"]}  # no other role on the binding: declared as vec4s
    # the scratch through vec views: lanes own vec4 units and the device has buffer views
    g.fast_sv = lane_vec() and BUFFER_VIEW_FEATURE in t.features
    g.fast_views = ({"Kh", "Vh"} if g.fast_packed else set()) | (
        {"Sf", "Ph"} if g.fast_sv else set())
    L: list[str] = []
    for name, n in (("Kh", max(sq, bk) * qs), ("Vh", bk * vs)):
        g.shared += _staging_decl(g, name, n, L)
    g.shared += _scratch_decls(g, nsg * 16 * pst, nsg * 16 * sw, L)
    if O_SHARED:
        g.shared.append(f"var<workgroup> Of: array<f32, {nsg * 16 * (Dv + SF_PAD)}>;")
    g.words = fast_words((nsg, bk), D, Dv)
    cpw = chunk_group(k)
    total = -(-g.rows // bq) * g.B * g.Hkv * (g.ns // cpw)
    grid = g.grid = make_grid(k.name, total, t)
    ind, i2 = "    ", "        "
    par = "hh4" if lane_vec() else "hh"  # the lane's first column in its row
    head: list[str] = []  # the chunk index ``sc`` of the strict head is this workgroup's group
    _grid_head(head, ind, grid, total, "blk", -(-g.rows // bq), "hkv", g.Hkv,
               SimpleNamespace(ns=g.ns // cpw, B=g.B))
    L += [x.replace("let sc = ", "let scg = ") for x in head]
    if g.ns > 1 and g.ns == cpw:  # one group: every chunk in every workgroup
        L.append(f"{ind}let scg = 0u;")
    L += [f"{ind}let sid = lid / 32u;", f"{ind}let lane = lid % 32u;",
          f"{ind}let hh = lane % 2u;", f"{ind}let hh4 = hh * 4u;",
          f"{ind}let R0 = blk * {u(bq)};",
          f"{ind}let sfb = sid * {u(16 * sw)} + lane / 2u * {u(sw)} + {par};",
          f"{ind}let phb = sid * {u(16 * pst)} + lane / 2u * {u(pst)} + {par};",
          f"{ind}let sfv = sfb / 4u;", f"{ind}let phv = phb / 4u;",
          f"{ind}let Rn = min(R0 + {u(bq)}, {u(g.rows)});",
          f"{ind}let i_first = i32(R0 / {u(g.G)});",
          f"{ind}let i_last = i32((Rn - 1u) / {u(g.G)});"]
    if O_SHARED:
        L.append(f"{ind}let ofb = sid * {u(16 * (Dv + SF_PAD))} + lane / 2u * {u(Dv + SF_PAD)} "
                 f"+ hh;")
    # a workgroup with one chunk loads its first K/V tile before staging Q (``HOIST_FIRST``)
    g.fast_hoist = (HOIST_FIRST and REG_STAGE and PREFETCH and cpw == 1
                    and "first" not in ABLATE)
    if g.fast_hoist:
        if g.ns > 1:
            L.append(f"{ind}let sc = scg;")
        _kv_range(g, L, ind)
        _first_tile(g, L, ind, bk, qs, vs, load=True)
    _stage_q(g, L, ind, sq, qs, vs, bk)
    if g.ns > 1:
        L.append(f"{ind}for (var cc: u32 = 0u; cc < {u(cpw)}; cc = cc + 1u) {{")
        L.append(f"{i2}let sc = scg * {u(cpw)} + cc;")
    else:
        L.append(f"{ind}{{")
    _chunk(g, L, i2, bq, bk, qs, vs, sw, pst, D, Dv)
    L.append(f"{ind}}}")
    return L


def _stage_q(g, L, ind, sq, qs, vs, bk) -> None:
    """Each row block's lane row (``rw``, ``rok``, its query coordinates, ``pos``) and Q
    fragments ``qf{rb}_{kk}``: Q pre-scaled, rounded to f16 and staged ``sq`` rows at a time
    in the K (and, where it is large enough, V) staging arrays.  ``REG_STAGE``: a pass's
    loads all issued before its first store (registers), one global latency per pass instead
    of one per strided step of a load-store loop."""
    from .attention import _i

    k, nrb, D = g.k, row_blocks(), g.D
    left = "subgroup_matrix_left<f16, 16, 16>"
    arrays = ["Kh"] + (["Vh"] if REG_STAGE and bk * vs >= sq * qs else [])
    scale = k.scale * (LOG2E if LEAN else 1.0)
    coords = lambda c: ["b", "sh", "si", c]  # noqa: E731
    for rb in range(nrb):
        L += [f"{ind}let rw{rb} = R0 + {u(rb * sq)} + sid * 16u + lane / 2u;",
              f"{ind}let rok{rb} = rw{rb} < {u(g.rows)};"]
        L += [ind + x for x in g.packed(f"rw{rb}", f"q{rb}")]
        L.append(f"{ind}let pos{rb} = i32(q{rb}i) + {_i(k.q_offset)};")
    for p0 in range(0, nrb, len(arrays)):
        group = list(zip(range(p0, min(nrb, p0 + len(arrays))), arrays))

        def pre(rr, rb):
            return [f"let RR = R0 + {u(rb * sq)} + {rr};"] + g.packed("RR", "s")

        if "qstage" in ABLATE:
            pass
        elif REG_STAGE:
            L.append(f"{ind}{{")
            qok = "false" if "qload" in ABLATE else f"RR < {u(g.rows)}"
            for rb, arr in group:
                _prefetch(g, L, ind + "    ", arr, sq, "q", lambda rr, rb=rb: pre(rr, rb), qok,
                          coords, tag=f"Q{rb}", scale=scale)
            for rb, arr in group:
                _prefetch(g, L, ind + "    ", arr, sq, "q", None, None, None, stride=qs,
                          tag=f"Q{rb}")
            L.append(f"{ind}}}")
        else:
            for rb, arr in group:
                _stage_f16(g, L, ind, arr, sq, "q", qs, lambda rr, rb=rb: pre(rr, rb),
                           f"RR < {u(g.rows)}", coords, scale)
        L.append(f"{ind}workgroupBarrier();")
        for rb, arr in group:
            for kk in range(D // 16):
                L.append(f"{ind}let qf{rb}_{kk} = subgroupMatrixLoad<{left}>({_ref(g, arr)}, "
                         f"sid * {u(16 * qs)} + {u(16 * kk)}, false, {u(qs)});")
        L.append(f"{ind}workgroupBarrier();")


def _kv_range(g, L, ind) -> None:
    """``kv_lo`` / ``kv_hi``: the keys of chunk ``sc`` this workgroup's rows see."""
    from .attention import _i

    k = g.k
    L += [f"{ind}var kv_lo: i32 = 0i;", f"{ind}var kv_hi: i32 = {_i(g.Skv)};"]
    if k.causal:
        L.append(f"{ind}kv_hi = min(kv_hi, {_i(k.q_offset)} + i_last + 1i);")
    if k.window:
        L.append(f"{ind}kv_lo = max(0i, {_i(k.q_offset)} + i_first - {_i(k.window)} + 1i);")
    if g.ns > 1:
        ch = g.chunk
        L.append(f"{ind}kv_lo = max(kv_lo, i32(sc) * {_i(ch)});")
        L.append(f"{ind}kv_hi = min(kv_hi, i32(sc) * {_i(ch)} + {_i(ch)});")


def _first_tile(g, L, ind, bk, qs, vs, load: bool) -> None:
    """The chunk's first K/V tile: its loads (``load``) into registers ``rF{Kh,Vh}{i}`` (every
    load issued before any store), or their f16 stores into ``Kh`` / ``Vh``.  Hoisted
    (``g.fast_hoist``) the loads run before Q's staging, so both wait one global latency."""
    pre = lambda rr: [f"let jj = kv_lo + i32({rr});"]  # noqa: E731
    co = lambda c: ["b", "hkv", "u32(jj)", c]  # noqa: E731
    for arr, which, st in (("Kh", "k", qs), ("Vh", "v", vs)):
        if load:
            _prefetch(g, L, ind, arr, bk, which, pre, "jj < kv_hi", co, tag=f"F{arr}")
        else:
            _prefetch(g, L, ind, arr, bk, which, None, None, None, stride=st, tag=f"F{arr}")


def _chunk(g, L, ind, bq, bk, qs, vs, sw, pst, D, Dv) -> None:
    """One key chunk of this workgroup's rows: its key range, fresh softmax state, the key
    loop, the stores."""
    nrb = row_blocks()
    _kv_range(g, L, ind)
    for rb in range(nrb):
        L += [f"{ind}var m{rb}: f32 = -{FLT_MAX};", f"{ind}var l{rb}: f32 = 0.0;"]
        if O_SHARED:  # this lane's half row of O, zeroed (its own words: no barrier)
            L += [f"{ind}{_at('Of', c)} = 0.0;" for c in range(Dv // 2)]
        else:
            L += [f"{ind}var o{rb}_{c}: f32 = 0.0;" for c in range(Dv // 2)]
    _key_loop(g, L, ind, bk, qs, vs, sw, pst, D, Dv)
    for rb in range(nrb):
        L.append(f"{ind}{{")
        _store(g, L, ind + "    ", Dv, rb)
        L.append(f"{ind}}}")


def _key_loop(g, L, ind, bk, qs, vs, sw, pst, D, Dv) -> None:
    """The chunk's key tiles: the first staged before the loop (``PREFETCH``; the next one's
    K/V loaded into registers during each tile and stored after it), then per tile and row
    block the scores, the softmax and P·V."""
    from .attention import _i

    nrb, i2 = row_blocks(), ind + "    "
    kv = (("Kh", "k", qs), ("Vh", "v", vs))
    kpre = lambda rr: [f"let jj = kt + i32({rr});"]  # noqa: E731
    if PREFETCH:  # tile kv_lo staged before the loop, tile t + 1 loaded into registers in it
        L += [f"{ind}{{", f"{i2}let kt = kv_lo;"]
        if "first" in ABLATE:
            pass
        elif REG_STAGE:  # K's and V's loads all issued, then their stores
            if not g.fast_hoist:
                _first_tile(g, L, i2, bk, qs, vs, load=True)
            _first_tile(g, L, i2, bk, qs, vs, load=False)
        else:
            for arr, which, st in kv:
                _stage_f16(g, L, i2, arr, bk, which, st, kpre, "jj < kv_hi",
                           lambda c: ["b", "hkv", "u32(jj)", c])
        L += [f"{ind}}}", f"{ind}workgroupBarrier();"]
    L.append(f"{ind}for (var kt: i32 = kv_lo; kt < kv_hi; kt = kt + {_i(bk)}) {{")
    npre = lambda rr: [f"let jj = kt + {_i(bk)} + i32({rr});"]  # noqa: E731
    nco = lambda c: ["b", "hkv", "u32(jj)", c]  # noqa: E731
    pf = kv if PREFETCH and "stage" not in ABLATE else ()
    split = bool(pf) and SPLIT_PREFETCH
    for arr, which, _ in pf:
        if split and arr == "Vh":
            _prefetch_decl(g, L, i2, arr, bk, which)
        else:
            _prefetch(g, L, i2, arr, bk, which, npre, "jj < kv_hi", nco)
    if not PREFETCH:
        for arr, which, st in kv:
            _stage_f16(g, L, i2, arr, bk, which, st, kpre, "jj < kv_hi",
                       lambda c: ["b", "hkv", "u32(jj)", c])
        L.append(f"{i2}{_barrier()}")
    for rb in range(nrb):  # each row block through the subgroup's scratch in turn
        i3 = i2 + "    "
        L.append(f"{i2}{{")
        _scores(g, L, i3, bk, qs, sw, D, rb)
        if split and rb + 1 == nrb:  # every subgroup is past its last use of Kh this tile
            _prefetch(g, L, i3, "Kh", bk, "k", None, None, None, stride=qs)
            _prefetch(g, L, i3, "Vh", bk, "v", npre, "jj < kv_hi", nco, declared=True)
        _softmax(g, L, i3, bk, sw, pst, rb)
        _pv(g, L, i3, bk, vs, sw, pst, Dv, rb)
        if rb + 1 < nrb:  # its O reads before the next block's S overwrites the scratch
            L.append(f"{i3}{_barrier()}")
        L.append(f"{i2}}}")
    if PREFETCH:  # every subgroup is past its P·V (the barrier in _pv): K/V may be replaced
        for arr, which, st in pf:
            if not (split and arr == "Kh"):
                _prefetch(g, L, i2, arr, bk, which, None, None, None, stride=st)
        L.append(f"{i2}{_barrier()}")
    L.append(f"{ind}}}")


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
    L += _f16_stores(g, i2, arr, stride, w, "x")
    L.append(f"{ind}}}")


def _prefetch(g, L, ind, arr, nrows, which, pre, valid, coords, stride=0,
              declared=False, tag=None, scale=None) -> None:
    """``PREFETCH``: the loads of ``nrows`` rows of q/k/v (times ``scale``) into registers
    ``r{tag}{i}`` (``tag``: ``arr`` unless given; ``pre`` given; unrolled, zeros past
    ``valid``; ``declared``: the registers exist already, see ``_prefetch_decl``), or (``pre``
    None) their f16 stores into ``arr``."""
    w, units, n, vt = _pf_units(g, nrows, which)
    i2 = ind + "    "
    for i in range(-(-n // g.wg)):
        e, r = f"(lid + {u(i * g.wg)})", f"r{tag or arr}{i}"
        guard = f"{e} < {u(n)}" if (i + 1) * g.wg > n else "true"
        if pre is None:
            L += [f"{ind}if ({guard}) {{", f"{i2}let rr = {e} / {u(units)};",
                  f"{i2}let uu = {e} % {u(units)};"]
            L += _f16_stores(g, i2, arr, stride, w, r)
            L.append(f"{ind}}}")
            continue
        L += [f"{ind}{r} = {vt}(0.0);" if declared else f"{ind}var {r}: {vt} = {vt}(0.0);",
              f"{ind}{{", f"{i2}let rr = {e} / {u(units)};", f"{i2}let uu = {e} % {u(units)};"]
        L += [i2 + x for x in pre("rr")]
        L += [f"{i2}if ({guard} && {valid}) {{",
              f"{i2}    {r} = {g.unit_value(which, w, coords, scale)};", f"{i2}}}", f"{ind}}}"]


def _staging_decl(g, name: str, n: int, lets: list[str]) -> list[str]:
    """The workgroup declaration of f16 staging array ``name`` of ``n`` elements; packed
    (``g.fast_packed``): ``common.packed_staging``, its views' lines appended to ``lets``
    (``name`` for the fragment loads, ``Kw`` / ``Vw`` for the stores)."""
    if not g.fast_packed:
        return [f"var<workgroup> {name}: array<f16, {n}>;"]
    decl, views = packed_staging(name, n)
    lets += views
    return [decl]


def _scratch_decls(g, n_ph: int, n_sf: int, lets: list[str]) -> list[str]:
    """Declarations of the subgroups' scratch: ``Ph`` (f16, ``n_ph``) and ``Sf`` (f32,
    ``n_sf``); with ``g.fast_sv`` as workgroup buffers with views (``Ph`` / ``Pw``: f16 /
    vec2<u32>; ``Sf`` / ``SfV``: f32 / vec4<f32>), their lines appended to ``lets``."""
    if not g.fast_sv:
        return [f"var<workgroup> Ph: array<f16, {n_ph}>;",
                f"var<workgroup> Sf: array<f32, {n_sf}>;"]
    decl, views = packed_staging("Ph", n_ph)
    lets += views + [f"    let Sf = bufferView<array<f32, {n_sf}>>(&SfB, 0u);",
                     f"    let SfV = bufferView<array<vec4<f32>, {n_sf // 4}>>(&SfB, 0u);"]
    return [decl, f"var<workgroup> SfB: buffer<{4 * n_sf}>;"]


def _ref(g, name: str) -> str:
    """The pointer argument of a fragment load from staging array ``name`` (with buffer views
    the name already is a pointer)."""
    return name if name in g.fast_views else f"&{name}"


def _f16_stores(g, ind, arr, stride, w, r) -> list[str]:
    """Row ``rr``, unit ``uu`` (``w`` values of register ``r``) rounded to f16 into staging
    array ``arr`` of row stride ``stride``: one packed store with buffer views, else ``w``."""
    if g.fast_packed and w == 4:
        return [f"{ind}{arr[0]}w[rr * {u(stride // 4)} + uu] = {pack_f16x4(r)};"]
    return [f"{ind}{arr}[rr * {u(stride)} + uu * {u(w)} + {u(c)}] = "
            f"f16({r if w == 1 else f'{r}[{c}]'});" for c in range(w)]


def _prefetch_decl(g, L, ind, arr, nrows, which) -> None:
    """The prefetch registers of ``_prefetch`` declared without a value (``SPLIT_PREFETCH``:
    V's are loaded inside the last row block, after the scores, and stored after the loop)."""
    _, _, n, vt = _pf_units(g, nrows, which)
    L += [f"{ind}var r{arr}{i}: {vt};" for i in range(-(-n // g.wg))]


def _pf_units(g, nrows: int, which: str) -> tuple[int, int, int, str]:
    """(vec width, units per row, units of the tile, register type) of a prefetched k/v
    tile of ``nrows`` rows."""
    dim = g.Dv if which == "v" else g.D
    w = 4 if dim % 4 == 0 else 1
    return w, dim // w, nrows * (dim // w), ("f32" if w == 1 else f"vec{w}<f32>")


def _barrier() -> str:
    """A barrier of the key loop (none with ``ABLATE`` "barriers": timing only)."""
    return "" if "barriers" in ABLATE else "workgroupBarrier();"


def _scores(g, L, ind, bk, qs, sw, D, rb) -> None:
    """S = Q·Kᵀ of the tile for row block ``rb`` into the subgroup's rows of ``Sf``; barrier."""
    right, res = "subgroup_matrix_right<f16, 16, 16>", "subgroup_matrix_result<f32, 16, 16>"
    for f in range(bk // 16 if "scores" not in ABLATE else 0):
        L.append(f"{ind}{{")
        L.append(f"{ind}    var acc = {res}();")
        for kk in range(D // 16):
            L.append(f"{ind}    let kf{kk} = subgroupMatrixLoad<{right}>({_ref(g, 'Kh')}, "
                     f"{u(16 * f * qs + 16 * kk)}, true, {u(qs)});")
            L.append(f"{ind}    acc = subgroupMatrixMultiplyAccumulate(qf{rb}_{kk}, kf{kk}, acc);")
        L.append(f"{ind}    subgroupMatrixStore({_ptr(g, 'Sf', 16 * sw, 16 * f)}, acc, false, "
                 f"{u(sw)});")
        L.append(f"{ind}}}")
    L.append(f"{ind}{_barrier()}")


def _softmax(g, L, ind, bk, sw, pst, rb) -> None:
    """Lane (r, hh): masked scores of its half of row r (of row block ``rb``), row max with
    the partner lane, rescale of its accumulators and row sum, P (f16) into ``Ph``; barrier.
    With ``LEAN`` and nothing but the key range to mask, tiles inside the range take an
    unmasked copy of the code (a workgroup-uniform branch)."""
    if "softmax" in ABLATE:
        L += [f"{ind}let alpha = 1.0;", f"{ind}{_barrier()}"]
        return
    from .attention import _i

    L.append(f"{ind}var alpha: f32;")
    k = g.k
    if LEAN and not (k.causal or k.window or k.mask is not None):
        L.append(f"{ind}if (kt + {_i(bk)} <= kv_hi) {{")
        _softmax_body(g, L, ind + "    ", bk, sw, pst, rb, masked=False)
        L.append(f"{ind}}} else {{")
        _softmax_body(g, L, ind + "    ", bk, sw, pst, rb, masked=True)
        L.append(f"{ind}}}")
    else:
        _softmax_body(g, L, ind, bk, sw, pst, rb, masked=True)
    L.append(f"{ind}{_barrier()}")


def _softmax_body(g, L, ind, bk, sw, pst, rb, masked: bool) -> None:
    """The online-softmax step of one row block (``_softmax``); ``masked`` False: every score
    of the tile is visible.  Unrolled: the lane's half row stays in registers; scores read and
    P written four at a time (one vec access each with ``g.fast_sv``)."""
    ex, n = ("exp2" if LEAN else "exp"), bk // 2
    if g.fast_sv:
        L += [f"{ind}let sv{q} = SfV[sfv + {u(2 * q)}];" for q in range(n // 4)]
    for jj in range(n):
        sf = f"sv{jj // 4}[{jj % 4}]" if g.fast_sv else _at("Sf", jj)
        L += _score(g, ind, jj, rb, sf) if masked else [f"{ind}let x{jj} = {sf};"]
    L.append(f"{ind}let mx = {_reduce('max', [f'x{jj}' for jj in range(n)], f'-{FLT_MAX}')};")
    L += _row_max(ind, rb, ex)
    if g.fast_sv and PACK_F32 and not (EXP_F16 and LEAN and not masked):
        _p_packed(g, L, ind, n, ex, masked)
        L += [f"{ind}l{rb} = l{rb} * alpha + ps;", f"{ind}m{rb} = mt;"] + _rescale_o(g, ind)
        return
    for jj in range(n):
        if EXP_F16 and LEAN and not masked and jj % 4 == 0:  # four exponentials in f16
            d = ", ".join(f"x{jj + i} - mt" for i in range(4))
            L.append(f"{ind}let pv{jj // 4} = exp2(vec4<f16>(vec4<f32>({d})));")
        if EXP_F16 and LEAN and not masked:
            L.append(f"{ind}let p{jj} = pv{jj // 4}[{jj % 4}];")
        else:
            e = f"{ex}(x{jj} - mt)"
            e = f"select({e}, 0.0, x{jj} < -{FLT_MAX})" if masked else e
            L.append(f"{ind}let p{jj} = f16({e});")
        if jj % 4 == 3:
            L += _p_store(g, ind, jj // 4)
    L.append(f"{ind}let ps = {_reduce('+', [f'f32(p{jj})' for jj in range(n)], '0.0')};")
    L += [f"{ind}l{rb} = l{rb} * alpha + ps;", f"{ind}m{rb} = mt;"] + _rescale_o(g, ind)


def _p_packed(g, L, ind, n, ex, masked: bool) -> None:
    """``PACK_F32``: P = exp(x - mt) in f32, rounded to f16 two at a time by the packing of
    its ``Pw`` store (no separate f16 values), and ``ps`` the row sum of those rounded values
    (unpacked from the stored words, so l and P·V see the same P)."""
    for jj in range(n):
        e = f"{ex}(x{jj} - mt)"
        L.append(f"{ind}let e{jj} = {f'select({e}, 0.0, x{jj} < -{FLT_MAX})' if masked else e};")
    for q in range(n // 4):
        a, b, c, d = (f"e{4 * q + i}" for i in range(4))
        L += [f"{ind}let w{q} = vec2<u32>(pack2x16float(vec2<f32>({a}, {b})), "
              f"pack2x16float(vec2<f32>({c}, {d})));", f"{ind}Pw[phv + {u(2 * q)}] = w{q};"]
    terms = [f"unpack2x16float(w{q}.{c})" for q in range(n // 4) for c in "xy"]
    L.append(f"{ind}let ps2 = {_reduce('+', terms, 'vec2<f32>(0.0)')};")
    L.append(f"{ind}let ps = ps2.x + ps2.y;")


def _reduce(op: str, terms: list[str], seed: str) -> str:
    """WGSL expression of ``terms`` reduced with ``op`` (``max`` or ``+``): a pairwise tree
    with ``TREE_REDUCE``, else the serial chain from ``seed`` (the order before the trees)."""
    def comb(a: str, b: str) -> str:
        return f"max({a}, {b})" if op == "max" else f"({a} + {b})"

    if not TREE_REDUCE:
        out = seed
        for x in terms:
            out = comb(out, x)
        return out
    while len(terms) > 1:
        terms = [comb(*terms[i:i + 2]) if i + 1 < len(terms) else terms[i]
                 for i in range(0, len(terms), 2)]
    return terms[0]


def _p_store(g, ind, q: int) -> list[str]:
    """The lane's P values ``p{4q}``..``p{4q + 3}`` into ``Ph``: one 8-byte store through the
    ``Pw`` view with ``g.fast_sv``, else four."""
    ps = [f"p{4 * q + i}" for i in range(4)]
    if g.fast_sv:
        v4 = f"vec4<f32>(vec4<f16>({', '.join(ps)}))"  # exact: the values are f16 already
        return [f"{ind}Pw[phv + {u(2 * q)}] = {pack_f16x4(v4)};"]
    return [f"{ind}{_at('Ph', 4 * q + i)} = {p};" for i, p in enumerate(ps)]


def _row_max(ind, rb, ex) -> list[str]:
    """``mt`` (the row's max used from this tile on) and ``alpha`` (the old state's factor).
    With ``O_SHARED`` the max moves only when it grows by more than ``O_TAU``, so O (in
    workgroup memory) is rarely rescaled."""
    mx = f"max(m{rb}, max(mx, subgroupShuffleXor(mx, 1u)))"
    if O_SHARED:
        tau = O_TAU if LEAN else O_TAU * LN2
        out = [f"{ind}let mn = {mx};", f"{ind}let grow = mn > m{rb} + {tau};",
               f"{ind}let mt = select(m{rb}, mn, grow);"]
    else:
        out = [f"{ind}let mt = {mx};"]
    return out + [f"{ind}alpha = {ex}(m{rb} - mt);"]


def _rescale_o(g, ind) -> list[str]:
    """``O_SHARED``: when a row of the subgroup moved its max, every lane scales its half row
    of O in workgroup memory by its ``alpha`` (1 where its row did not move)."""
    if not O_SHARED:
        return []
    i2 = ind + "    "
    return ([f"{ind}if (subgroupAny(grow)) {{"]
            + [f"{i2}{_at('Of', c)} = {_at('Of', c)} * alpha;" for c in range(g.Dv // 2)]
            + [f"{ind}}}"])


def _score(g, ind, jj, rb, sf) -> list[str]:
    """Lines defining ``x{jj}``: this lane's ``jj``-th score of the tile (the value ``sf``),
    masked (added mask, causal/window visibility, keys past the chunk at -inf)."""
    k, i2 = g.k, ind + "    "
    out = [f"{ind}let kj{jj} = kt + i32({_col(jj)});",
           f"{ind}let inb{jj} = rok{rb} && kj{jj} < kv_hi;"]
    terms = [f"inb{jj}"] + g.vis_terms(f"kj{jj}", f"pos{rb}")
    if k.mask is not None:
        mv = g.ld("mask", g.midx("b", f"q{rb}h", f"q{rb}i", f"u32(kj{jj})"), k.mask.dtype)
        mv = f"{mv} * {LOG2E}" if LEAN else mv
        out += [f"{ind}var s{jj} = {sf};", f"{ind}if (inb{jj}) {{", f"{i2}s{jj} = s{jj} + {mv};",
                f"{ind}}}"]
        sf = f"s{jj}"
    out.append(f"{ind}let x{jj} = select(-mn_inf(), {sf}, {' && '.join(terms)});")
    return out


def _pv(g, L, ind, bk, vs, sw, pst, Dv, rb) -> None:
    """O_tile = P·V into ``Sf``; barrier; each lane rescales and adds its half row of row
    block ``rb``.  With ``O_SHARED``: each of O's result fragments is loaded from ``Of``,
    accumulated and stored back (a fresh fragment variable each time); barrier."""
    left, right = "subgroup_matrix_left<f16, 16, 16>", "subgroup_matrix_right<f16, 16, 16>"
    res = "subgroup_matrix_result<f32, 16, 16>"
    ow = Dv + SF_PAD

    def pload(kk: int) -> str:
        return (f"let pf{kk} = subgroupMatrixLoad<{left}>({_ptr(g, 'Ph', 16 * pst, 16 * kk)}, "
                f"false, {u(pst)});")

    def mma(c: int, kk: int, acc: str) -> list[str]:
        return [f"let vf{kk}_{c} = subgroupMatrixLoad<{right}>({_ref(g, 'Vh')}, "
                f"{u(16 * kk * vs + 16 * c)}, false, {u(vs)});",
                f"{acc} = subgroupMatrixMultiplyAccumulate(pf{kk}, vf{kk}_{c}, {acc});"]

    nf, nk = Dv // 16, bk // 16
    if O_SHARED:
        body = [pload(kk) for kk in range(nk)]
        for c in range(nf):
            at = f"{_ptr(g, 'Of', 16 * ow, 16 * c)}"
            body += ["{", f"var acc = subgroupMatrixLoad<{res}>({at}, false, {u(ow)});"]
            for kk in range(nk):
                body += mma(c, kk, "acc")
            body += [f"subgroupMatrixStore({at}, acc, false, {u(ow)});", "}"]
    else:
        body = [f"var acc{c} = {res}();" for c in range(nf)]  # each P fragment loaded once
        for kk in range(nk):
            body.append(pload(kk))
            for c in range(nf):
                body += mma(c, kk, f"acc{c}")
        body += [f"subgroupMatrixStore({_ptr(g, 'Sf', 16 * sw, 16 * c)}, acc{c}, false, "
                 f"{u(sw)});" for c in range(nf)]
    if "pv" in ABLATE:
        body = []
    L.append(f"{ind}{{")
    L += [f"{ind}    {x}" for x in body]
    L.append(f"{ind}}}")
    L.append(f"{ind}{_barrier()}")
    if O_SHARED:
        return
    if g.fast_sv and "pv" not in ABLATE:
        L += [f"{ind}let ov{q} = SfV[sfv + {u(2 * q)}];" for q in range(Dv // 8)]
    for c in range(Dv // 2):
        sf = f"ov{c // 4}[{c % 4}]" if g.fast_sv else _at("Sf", c)
        L.append(f"{ind}o{rb}_{c} = o{rb}_{c} * alpha + {'0.0' if 'pv' in ABLATE else sf};")


def _store(g, L, ind, Dv, rb) -> None:
    """out = o / l (0 for rows with no visible key), lse = m + log l, as the strict kernel,
    for row block ``rb``."""
    k = g.k
    L.append(f"{ind}let lt = l{rb} + subgroupShuffleXor(l{rb}, 1u);")
    L.append(f"{ind}let inv = select(1.0 / lt, 0.0, lt == 0.0);")
    L.append(f"{ind}if (rok{rb}) {{")
    qh, qi = f"q{rb}h", f"q{rb}i"
    row = f"(({g.bsplit()} * {u(g.Hq)} + {qh}) * {u(g.Sq)} + {qi})"
    L.append(f"{ind}    if (hh == 0u) {{")
    lse = f"(m{rb} + log2(lt)) * {LN2}" if LEAN else f"m{rb} + log(lt)"
    L.append(f"{ind}        {g.bind['lse_out']}[{row}] = select({lse}, -mn_inf(), "
             f"lt == 0.0);")
    L.append(f"{ind}    }}")
    if k.out_bshd:
        row = f"((b * {u(g.Sq)} + {qi}) * {u(g.Hq)} + {qh})"
    out = g.bind["out"]
    if out in g.vec_writes:  # lane_vec: the lane's units 2q + hh of its row
        for q in range(Dv // 8):
            o = ", ".join(f"o{rb}_{4 * q + i}" for i in range(4))
            L.append(f"{ind}    {out}[{row} * {u(Dv // 4)} + {u(2 * q)} + hh] = "
                     f"vec4<f32>({o}) * inv;")
    for c in range(Dv // 2 if out not in g.vec_writes else 0):
        o = _at("Of", c) if O_SHARED else f"o{rb}_{c}"
        L.append(f"{ind}    {out}[{row} * {u(Dv)} + {_col(c)}] = {o} * inv;")
    L.append(f"{ind}}}")
