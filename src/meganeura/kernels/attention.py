"""Flash-attention kernels (forward, and the two backward kernels), register-tiled like a
matmul, registered as archetypes.

Semantics are those of ``ops/attention.py``: score = scale·q·k + mask; a key is hidden by the
causal/window rules or by a -inf score; a row with no visible key outputs 0 and lse = -inf.

Rows.  For the forward and dQ kernels the rows of a block are *packed* (query position, group
member) pairs of one kv head: packed row R of kv head h is query position R // G of query head
h·G + R % G (G = Hq / Hkv).  Grouped-query heads therefore share every K/V tile a workgroup loads,
and decoding (Sq = 1) still fills G rows.

Register tiling.  A workgroup is a TR × TC grid of invocations (``config`` = (TR, TC, RM, RN)).
Each kernel has an *own* dimension (query rows for fwd/dQ, keys for dK/dV; a block of TR·RM
of them per workgroup) and a *loop* dimension (keys for fwd/dQ, query rows for dK/dV; walked in
tiles of TC·RN staged through workgroup memory).  Invocation (tr, tc) owns the RM own-indices
tr + i·TR and, in each tile, the RN loop-indices tc + j·TC: it computes that RM × RN block of
scores (and of dP) from the staged tiles like a tiled matmul (vec4 dot products over the head
dim), keeps it in registers, and writes the RM values of each of its loop-indices as one vector
into a transposed probability tile.  The second product (P·V, dS·K, Pᵀ·dO, dSᵀ·Q) is again an
outer product: the invocation owns RM rows × the output columns tc + c·TC (vec4 units) and
reads one RM-vector of P and one vec4 of the staged operand per step.  Strided ownership keeps
the reads of a subgroup on distinct banks (rows padded by one unit).  The loop tiles are
prefetched: each invocation loads its units of tile t+1 into registers right after tile t is in
workgroup memory, so the global loads overlap tile t's arithmetic (H200, Whisper: 1.4-1.7x).

``attention_fwd`` — online softmax: per key tile, each invocation's row maxima go through a
small table (``Red``), the new row max rescales the accumulators and the invocation's partial
row sums (l is summed over the TC invocations of a row once, at the end).  Writes out and
lse = m + log l.  Causal/window bounds skip whole key tiles.

``attention_grad_dq`` — per key tile: S = Q·Kᵀ, dP = dO·Vᵀ, P = exp(S - lse), dS = P·(dP - δ)
(registers), dSᵀ to workgroup memory, dQ += dS·K; dQ·scale stored at the end.

``attention_grad_dkdv`` — one workgroup per (batch, kv head, block of keys); K (pre-scaled) and
V stay in workgroup memory; the loop walks the packed query rows that can see the block (all G
query heads of the group: dK/dV of a kv head are complete sums, no atomics) in tiles: Q, dO, lse
and δ are staged, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ in registers, P and dS to workgroup memory, then
dV += Pᵀ·dO and dK += dSᵀ·Q.

With ``dq_block`` the dK/dV kernel also produces dQ: after each tile's dS is in workgroup
memory it multiplies dSᵀ by the block's (pre-scaled) K and stores the tile rows' partial dQ of
this key block (zeros for rows the causal/window rules hide the block from); graph ops sum the
blocks' partials in order.  dK, dV and the partials share one flat output (7 storage buffers
at most).  One kernel instead of two: S and dP are computed once per (key, row) pair, not twice
(Whisper's backward 803 → 509 µs of kernels + a 60 µs sum, H200).

Split-K (``splits``): fwd walks one chunk of the keys per workgroup and stores that chunk's
normalized output and lse (merged by ``attention_combine.py``); dQ walks one chunk of the keys
and dK/dV one chunk of the query positions, storing partial sums (summed by graph ops).
The op's expansion chooses the count (``ops/attention.py``, ``split_count``): decoding over a
long cache, batch-1 encoders (Whisper fwd 308 → 257 µs, dK/dV 507 → 409 µs with 4 chunks on
the H200).  ``precision="fast"``
forwards run ``attention_fast.py`` (tensor cores) where the device has f16 subgroup matrices.

``delta = rowsum(dO·O)`` is an ordinary fused reduce kernel (built by the op's expansion), or,
for short problems (``delta_out``), computed by the dK/dV kernel from the O tile it loads beside
each dO tile (per-unit products in ``Dx``, summed per row in order into ``Dl``).  All sums
are in a fixed order (deterministic).  Inputs are read in place through their strides (views of
(B, S, H, D) projections need no copy); the mask is read through broadcast strides.  The tile
configuration is chosen from the device's workgroup-storage and invocation limits and the
problem size (``choose_config``); ``candidates`` lists the ones worth timing for the tuner.

Long forwards on the tiles of ``FWD_UNROLL`` declare the staged tiles as arrays of rows and
unroll both products (constant unit indices: no per-read index clamp or address arithmetic).

Short loops (fewer than ``SHORT_LOOP`` keys, or query positions for dK/dV) are latency-bound:
their own block is staged through registers (every load before the first store), fwd/dQ load
K/V tile 0 before staging Q, and a forward with too few workgroups takes 64-key tiles
(``SHORT_FWD_FIRST``).  Long loops (Whisper) are untouched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..dtypes import DType, f16, f32
from . import attention_fast as AF
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
MIN_WORKGROUPS = 128  # prefer the largest tiles that still give a problem this many workgroups
MIN_OWN_BLOCK = 16  # ...but no fewer rows (keys) per workgroup than this unless the problem is

# (TR, TC, RM, RN) in order of preference, measured on the H200 (Dawn, bench/attention_bench.py
# --all): the heuristic takes the first that fits the device and gives enough workgroups.  RM = 4
# with TR = 16 spills registers there (3-4x slower), so those come last (the tuner may try them)
CONFIGS = (
    (8, 16, 4, 2),  # 32 own × 32 loop, 128 invocations: Whisper fwd 308 µs, dQ 392, dK/dV 507
    (8, 8, 4, 2),  # 32 × 16, 64: D = 128 fwd (the above does not fit 48 KiB)
    (16, 8, 1, 4),  # 16 × 32, 128: SmolLM2 (128 positions) fwd 11.0 µs, dQ 13.9, dK/dV 16.9
    (8, 8, 2, 2),  # 16 × 16, 64: D = 128 dQ and dK/dV
    (16, 16, 1, 2),  # 16 × 32, 256
    (16, 8, 2, 4),  # 32 × 32, 128
    (16, 16, 2, 2),  # 32 × 32, 256
    (8, 8, 1, 2),  # 8 × 16, 64
    (32, 8, 2, 4),  # 64 × 32, 256
    (8, 8, 2, 4),  # 16 × 32, 64
    (8, 8, 4, 4),  # 32 × 32, 64
    (16, 16, 4, 2),  # 64 × 32, 256
    (16, 8, 4, 4),  # 64 × 32, 128
    (4, 8, 2, 2),  # 8 × 16, 32
    (4, 8, 1, 2),  # 4 × 16, 32 (decoding: a few rows)
    (1, 32, 1, 1),  # 1 × 32, 32
    (1, 8, 1, 1),  # 1 × 8, 8 (last resort for tiny workgroup storage)
    # few invocations per row (TC = 4: a 4-entry row-max table), 8 loop indices each
    (8, 4, 4, 8),  # 32 × 32, 32
    (16, 4, 2, 8),  # 32 × 32, 64
    (16, 4, 4, 8),  # 64 × 32, 64
    (32, 4, 2, 8),  # 64 × 32, 128
    # half-height loop tiles: less workgroup storage per block (more workgroups per SM)
    (16, 8, 4, 2),  # 64 × 16, 128
    (8, 16, 4, 1),  # 32 × 16, 128
)


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
    # tile configuration (TR, TC, RM, RN) (see the module docstring); () = heuristic
    config: tuple = ()
    # fwd only: store the output as (B, Sq, Hq, Dv) instead of (B, Hq, Sq, Dv), the layout the
    # output projection reads (the planner then needs no transposing copy)
    out_bshd: bool = False
    # split-K: fwd splits the keys into ``splits`` chunks of ceil(Skv / splits) and writes each
    # chunk's normalized output and lse ((splits·B, Hq, Sq, ·), combined by the
    # ``attention_combine`` family); dkdv splits the query positions the same way and writes
    # (splits·B, ·, Skv, ·) partial sums (summed by the caller).  More workgroups for problems
    # with few (batch, head, block) items: decoding, batch-1 encoders.
    splits: int = 1
    # "fast": QKᵀ and PV on f16 subgroup matrices (f32 accumulation and softmax) where the
    # device has them (``attention_fast``); elsewhere exactly the strict kernel
    precision: str = "strict"
    # dkdv only: also write dQ's partial sums per block of ``dq_block`` keys ((n_blocks·B, Hq,
    # Sq, D), summed by the caller; zeros for rows the causal/window rules hide the block from)
    # from the dS tile the kernel already has, so no separate dQ kernel recomputes S and dP;
    # the own block must be ``dq_block``.  The three outputs are packed into one flat tensor
    # (``packed_sizes``): 6 storage buffers (7 with a mask), within WebGPU's default 8
    dq_block: int = 0
    # dkdv only: the ``delta`` operand is the forward's output O (B, Hq, Sq, Dv), not δ: the
    # kernel computes δ = rowsum(dO·O) of each staged row tile itself from the dO tile it loads
    # anyway and O's units loaded beside it (no reduce kernel, no δ buffer; a short problem is
    # bound by its dispatches, H200 SmolLM2: ~8 µs per dispatch in a profiled step)
    delta_out: bool = False
    # fwd with ``splits`` > 1 only: keys per chunk (0: ceil(Skv / splits)); the last chunk has
    # the rest.  Uneven chunks let the tensor-core forward's short last chunk run in the tail
    # of the first wave (``attention_fast.fast_split``)
    chunk_keys: int = 0


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
    return "f32" if w == 1 else f"vec{w}<f32>"


def _vec(exprs: list[str]) -> str:
    return exprs[0] if len(exprs) == 1 else f"vec{len(exprs)}<f32>({', '.join(exprs)})"


def _comp(v: str, i: int, n: int) -> str:
    return v if n == 1 else f"{v}[{i}]"


# Explicit fma: score dot products as one fma chain into the accumulator (4 fma per vec4 unit)
# instead of acc + dot(a, b) (a multiply, 3 fma and an add: the add is not contracted, since
# that would reassociate), and fma(p, o, acc) in the outer products instead of acc + p * o
# (contracted or not at the driver's choice); False restores the old forms (kept for
# before/after timings in one process)
FMA = True

# dK/dV: the first query-row tile's loads are issued before K and V are staged (their global
# latencies overlap; a workgroup whose key block no row sees stages nothing); False restores
# the old order (kept for before/after timings in one process: bench/attention_bench.py
# --short).  H200 (2026-12-01): Whisper's dK/dV 508.5 -> 505.5 µs.  The same for the forward
# (K/V tile 0 before Q) is done for short loops only (``SHORT_EARLY_KV`` below)
EARLY_LOADS = True

# q/k/v read as vec4<f32> by the strict kernels too (their bindings declared as arrays of vec4
# where ``_Gen.vec_bindings`` allows): the same values, one 16-byte load per unit instead of
# four scalar loads with a robustness clamp each.  The tensor-core forward gained 11 % from it
# on the H200 (attention_fast.VEC_LOADS: 105.9 -> 94.4 µs).  The strict kernels lose: H200,
# Dawn, 2026-12-02 (bench/attention_bench.py dawn --kvariants after,vec_loads --op): Whisper
# forward 193.6 -> 201.7 µs, backward 557.3 -> 777.8, D = 128 forward 557.6 -> 888.1; off
# (docs/rejected-optimizations.md)
STRICT_VEC_LOADS = False

# Short loops: a kernel whose loop dimension (keys for fwd/dQ, query positions for dK/dV) is
# shorter than SHORT_LOOP walks a few tiles (SmolLM2's 128 positions: at most 4), so it is
# bound by the latency of its first loads rather than by its loop (Whisper's 1,500 positions
# are not short: its kernels stay as they are, WGSL byte-identical).  For those:
# SHORT_REG_STAGE: the own block (fwd/dQ: Q, dO; dK/dV: K, V) is staged through registers,
# every load issued before the first store (one global latency instead of one per pass of
# the staging loop; matters where the data is cold, as in the backward of a whole step);
# SHORT_EARLY_KV: fwd/dQ issue K/V tile 0's loads before staging Q (nil alone, kept as part
# of the measured combination);
# SHORT_FWD_FIRST: configurations a short forward tries first when the usual tiles give it
# fewer than MIN_WORKGROUPS workgroups: 64-key tiles (half the serial tiles of a causal row
# block; 44 KiB at D = 64, so 32-KiB devices take the 16 × 32 one), 256 invocations.
# H200, SmolLM2's whole step (2026-12-01): dK/dV 27.1 -> 25.1 µs, forward 17.8 -> 15.8 µs
# (16 × 32: 16.5), attention share 10.36 -> 9.65 %.  False / () restore the old kernels (kept
# for before/after timings in one process: bench/attention_bench.py --roof)
SHORT_LOOP = 512
SHORT_EARLY_KV = True
SHORT_REG_STAGE = True
SHORT_FWD_FIRST: tuple = ((16, 16, 1, 4), (16, 16, 1, 2))

# Long forwards (not short loops) on these tiles: the staged tiles as arrays of rows
# (``Qs[row][unit]``) and both products unrolled, so every workgroup-memory read has a constant
# unit index (no robustness clamp or address arithmetic per read).  H200, Whisper, 6 key
# chunks (2026-12-01): (16, 16, 4, 2) 209.2 -> 193.5 µs, but (16, 8, 4, 4) 208.4 -> 231.9 (not
# listed).  () restores the old kernels (kept for before/after timings in one process)
FWD_UNROLL: tuple = ((16, 16, 4, 2),)


def _acc_dot(w: int, acc: str, a: str, b: str) -> str:
    """``acc`` plus the dot product of units ``a`` and ``b`` (width ``w``)."""
    if w == 1:
        return f"fma({a}, {b}, {acc})" if FMA else f"{acc} + ({a} * {b})"
    if not FMA:
        return f"{acc} + dot({a}, {b})"
    e = acc
    for c in "xyzw":
        e = f"fma({a}.{c}, {b}.{c}, {e})"
    return e


def _acc_axpy(w: int, acc: str, p: str, o: str) -> str:
    """``acc + p · o`` (``p`` a scalar, ``o`` and ``acc`` of width ``w``)."""
    if not FMA:
        return f"{acc} + {p} * {o}"
    return f"fma({_vt(w)}({p}), {o}, {acc})" if w > 1 else f"fma({p}, {o}, {acc})"


# ------------------------------------------------------------------------------ configurations


def _units(d: int) -> tuple[int, int]:
    """(vector width, units per row) of a head dim."""
    w = 4 if d % 4 == 0 else 1
    return w, d // w


def _pad(units: int, tc: int) -> int:
    """Row stride (units) of a staged tile: room for every column an invocation reads
    (tc + c·TC) plus one unit against bank conflicts."""
    return max(units, -(-units // tc) * tc) + 1


def config_words(kind: str, cfg, D: int, Dv: int, delta_out: bool = False) -> int:
    """f32 words of workgroup storage configuration ``cfg`` needs (``delta_out``: dK/dV's
    per-unit dO·O products of a row tile, ``Dx``)."""
    TR, TC, RM, RN = cfg
    own, loop = TR * RM, TC * RN
    (wd, du), (wv, vu) = _units(D), _units(Dv)
    dp, vp = _pad(du, TC) * wd, _pad(vu, TC) * wv
    if kind == "fwd":
        return own * dp + loop * (dp + vp) + loop * TR * RM + TC * TR * RM
    if kind == "dq":
        return (own + loop) * (dp + vp) + loop * TR * RM
    dx = loop * vu if delta_out else 0
    return (own + loop) * (dp + vp) + 2 * loop * TR * RM + 2 * loop + dx


def config_fits(kind: str, cfg, D: int, Dv: int, t, delta_out: bool = False) -> bool:
    TR, TC, RM, RN = cfg
    return (RM in (1, 2, 4) and TR * TC <= t.lim("max_compute_invocations_per_workgroup")
            and 4 * config_words(kind, cfg, D, Dv, delta_out)
            <= t.lim("max_compute_workgroup_storage_size"))


# Forwards split into key chunks (batch-1 encoders) try these first: 64 rows × 32 keys per
# workgroup on 256 invocations (4 rows × 2 keys each), unrolled (``FWD_UNROLL``): Whisper
# 193.5 µs with the combine against 208.4 for (16, 8, 4, 4) (either rolled: 209.2 / 208.4;
# (16, 8, 4, 4) unrolled: 231.9) and 255 for (8, 16, 4, 2), 6 chunks (H200, 2026-12-01)
SPLIT_FWD_FIRST = ((16, 16, 4, 2),)


def choose_config(kind: str, own_n: int, n_bh: int, D: int, Dv: int, t, own: int = 0,
                  first: tuple = (), delta_out: bool = False) -> tuple:
    """The heuristic configuration: the first of ``CONFIGS`` that fits the device, whose own
    block is not (much) larger than the problem nor smaller than ``MIN_OWN_BLOCK`` (tiny blocks
    re-stage every K/V tile for a few rows), and that gives ``MIN_WORKGROUPS`` workgroups; with
    fewer possible, the threshold halves (small problems take smaller blocks)."""
    order = list(first) + [c for c in CONFIGS if c not in first]
    fit = [c for c in order if config_fits(kind, c, D, Dv, t, delta_out)
           and own in (0, c[0] * c[2])]
    if not fit:
        raise CodegenError(f"attention {kind}: no tile configuration fits the device's "
                           f"workgroup storage (D={D}, Dv={Dv}, own block {own or 'any'})")
    if own:  # the block is fixed (dK/dV with dQ partials): the first in order of preference
        return fit[0]
    cap = pow2ceil(own_n)
    floor = min(MIN_OWN_BLOCK, cap)
    small = [c for c in fit if floor <= c[0] * c[2] <= cap]
    if not small:  # the device fits only smaller blocks: the largest of them
        below = [c for c in fit if c[0] * c[2] <= cap] or [min(fit, key=lambda c: c[0] * c[2])]
        top = max(c[0] * c[2] for c in below)
        small = [c for c in below if c[0] * c[2] == top]
    need = MIN_WORKGROUPS
    while need >= 1:
        for c in small:
            if n_bh * -(-own_n // (c[0] * c[2])) >= need:
                return c
        need //= 2
    return small[-1]


def packed_sizes(k: AttentionKernel) -> tuple[int, int, int]:
    """Elements of dK, dV and dQ's partials in the one output of a dK/dV kernel with
    ``dq_block`` (in that order, each contiguous: (splits·B, H, Skv, D), the same with Dv,
    (key blocks·B, Hq, Sq, D))."""
    B, Hq, Sq, D = k.q.shape
    Hkv, Skv, Dv = k.k.shape[1], k.k.shape[2], k.v.shape[3]
    lead = max(1, int(k.splits)) * B * (Hq if k.split_heads else Hkv) * Skv
    return lead * D, lead * Dv, -(-Skv // k.dq_block) * B * Hq * Sq * D


def _problem(k: AttentionKernel) -> tuple[int, int]:
    """(own-dimension extent, work items per block index) of a description."""
    B, Hq, Sq, _ = k.q.shape
    Hkv, Skv = k.k.shape[1], k.k.shape[2]
    ns = max(1, int(k.splits))
    if k.kind == "dkdv":
        return Skv, ns * B * (Hq if k.split_heads else Hkv)
    return Sq * (Hq // Hkv), ns * B * Hkv


def is_short(k: AttentionKernel) -> bool:
    """Whether the kernel's loop dimension (keys for fwd/dQ, query positions for dK/dV) is
    shorter than ``SHORT_LOOP`` (latency-bound: see ``SHORT_EARLY_KV``)."""
    return (k.q.shape[2] if k.kind == "dkdv" else k.k.shape[2]) < SHORT_LOOP


def resolve_config(k: AttentionKernel, t) -> tuple:
    D, Dv = k.q.shape[3], k.v.shape[3]
    if k.config:
        cfg = tuple(int(x) for x in k.config)
        if len(cfg) != 4 or not config_fits(k.kind, cfg, D, Dv, t, k.delta_out):
            raise CodegenError(f"kernel {k.name!r}: tile configuration {k.config} does not fit "
                               "the device (TR, TC, RM, RN with RM in 1, 2, 4)")
        if k.dq_block and cfg[0] * cfg[2] != k.dq_block:
            raise CodegenError(f"kernel {k.name!r}: tile configuration {k.config} has a key "
                               f"block of {cfg[0] * cfg[2]}, dq_block is {k.dq_block}")
        return cfg
    own_n, n_bh = _problem(k)
    first = SPLIT_FWD_FIRST if k.kind == "fwd" and k.splits > 1 else ()
    cfg = choose_config(k.kind, own_n, n_bh, D, Dv, t, k.dq_block, first, k.delta_out)
    if (k.kind == "fwd" and k.splits == 1 and SHORT_FWD_FIRST and is_short(k)
            and n_bh * -(-own_n // (cfg[0] * cfg[2])) < MIN_WORKGROUPS):
        # too small to fill the GPU with the usual tiles: latency-bound, see SHORT_FWD_FIRST
        cfg = choose_config(k.kind, own_n, n_bh, D, Dv, t, 0, SHORT_FWD_FIRST)
    return cfg


def candidates(k: AttentionKernel, target) -> list:
    """The heuristic configuration first, then up to 7 others that fit (largest blocks first,
    skipping blocks far larger than the problem)."""
    t = make_target(target) if isinstance(target, dict) else target
    first = resolve_config(dataclasses.replace(k, config=()), t)
    own_n, _ = _problem(k)
    D, Dv = k.q.shape[3], k.v.shape[3]
    rest = [c for c in CONFIGS if c != first and config_fits(k.kind, c, D, Dv, t, k.delta_out)
            and c[0] * c[2] <= pow2ceil(own_n) and k.dq_block in (0, c[0] * c[2])]
    return [dataclasses.replace(k, config=c) for c in [first] + rest[:7]]


# ------------------------------------------------------------------------------ emission


class _Gen:
    """Shapes, bindings and emission helpers of one attention kernel."""

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
            if k.delta_out and k.kind != "dkdv":
                raise CodegenError(f"kernel {k.name!r}: delta_out is for dK/dV kernels")
            self.dlst = bcast_strides(k.delta, (self.B, self.Hq, self.Sq) + (
                (self.Dv,) if k.delta_out else ()), "out" if k.delta_out else "delta")
        outs = {"fwd": ["out", "lse_out"], "dq": ["dq"], "dkdv": ["dk", "dv"]}[k.kind]
        self.base = {}  # first element of each output in its binding
        if k.dq_block:  # dK, dV and dQ's partials packed in one binding (<= 8 storage buffers)
            if k.kind != "dkdv":
                raise CodegenError(f"kernel {k.name!r}: dq_block is for dK/dV kernels")
            n_dk, n_dv, _ = packed_sizes(k)
            self.base = {"dk": 0, "dv": n_dk, "dqp": n_dk + n_dv}
            outs = ["dkdvq"]
        self.dts = dts + [self.dt] * len(outs)
        self.bd = Bindings(self.dts, alias)
        self.bind = {n: self.bd.name(i) for i, n in enumerate(names + outs)}
        for n in self.base:
            self.bind[n] = self.bind["dkdvq"]
        self.wd, self.du = _units(self.D)
        self.wv, self.vu = _units(self.Dv)
        self.TR, self.TC, self.RM, self.RN = resolve_config(k, t)
        self.wg = self.TR * self.TC
        self.own, self.loop = self.TR * self.RM, self.TC * self.RN
        self.dp, self.vp = _pad(self.du, self.TC), _pad(self.vu, self.TC)
        self.shared: list[str] = []
        # binding variables declared as array<vec4<f32>> and read one unit at a time
        # (``unit_value``; chosen by ``emit``: ``vec_bindings`` where ``attention_fast.VEC_LOADS``
        # / ``STRICT_VEC_LOADS`` say so)
        self.vec_reads: set[str] = set()
        self.vec_writes: set[str] = set()  # bindings written by vec4 units (fast forward)
        self.widths: dict[str, int] = {}
        self.words = 0
        self.ns = int(k.splits)
        short = is_short(k)
        self.reg_stage = SHORT_REG_STAGE and short  # see SHORT_LOOP
        self.kv_early = SHORT_EARLY_KV and short and k.kind in ("fwd", "dq")
        self.unroll = (not short and k.kind == "fwd"  # see FWD_UNROLL
                       and (self.TR, self.TC, self.RM, self.RN) in FWD_UNROLL)
        self.rows2d: set[str] = set()  # arrays declared as arrays of rows
        if self.ns < 1 or (self.ns > 1 and k.out_bshd):
            raise CodegenError(f"kernel {k.name!r}: splits={k.splits} (>= 1, not with "
                               "out_bshd)")
        self.chunk = chunk_len(k)

    def at(self, target: str) -> str:
        """Offset prefix of output ``target`` in its (packed) binding."""
        n = self.base.get(target, 0)
        return f"{u(n)} + " if n else ""

    def bsplit(self) -> str:
        """Batch index of an output row: (chunk, batch) when split."""
        return "b" if self.ns == 1 else f"(sc * {u(self.B)} + b)"

    # -- element access --------------------------------------------------------------------
    def ld(self, name: str, idx: str, dt: DType) -> str:
        x = f"{self.bind[name]}[{idx}]"
        return x if dt is f32 else f"f32({x})"

    def read_view(self, name: str) -> tuple[Strided, tuple[int, ...]]:
        """(view, element strides the kernel reads it with) of q/k/v/dout/out (delta_out: O)."""
        k = self.k
        s = {"q": k.q, "k": k.k, "v": k.v, "dout": k.dout, "out": k.delta}[name]
        if name in ("dout", "out"):
            return s, self.dost if name == "dout" else self.dlst
        return s, s.strides

    def src(self, name: str, coords: list[str]) -> str:
        """Load of element ``coords`` (4 u32 expressions) of q/k/v/dout."""
        s, strides = self.read_view(name)
        name = "delta" if name == "out" else name  # delta_out: O in the delta binding
        return self.ld(name, index_code([f"({c})" for c in coords], strides, s.offset), s.dtype)

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

    def packed(self, R: str, prefix: str) -> list[str]:
        """Lines: query position ``{prefix}i`` and query head ``{prefix}h`` of packed row R."""
        G = self.G
        if self.k.split_heads:
            return [f"let {prefix}i = {R};", f"let {prefix}h = hq_w;"]
        if G == 1:
            return [f"let {prefix}i = {R};", f"let {prefix}h = hkv;"]
        return [f"let {prefix}i = {R} / {u(G)};", f"let {prefix}h = hkv * {u(G)} + {R} % {u(G)};"]

    def array(self, name: str, w: int, n_units: int, rows: int = 0) -> None:
        """Declare workgroup array ``name`` of ``n_units`` units of width ``w`` (with
        ``rows``: as that many rows of ``n_units // rows`` units, indexed ``name[r][c]``)."""
        if rows:
            self.shared.append(f"var<workgroup> {name}: array<array<{_vt(w)}, "
                               f"{n_units // rows}>, {rows}>;")
            self.rows2d.add(name)
        else:
            self.shared.append(f"var<workgroup> {name}: array<{_vt(w)}, {max(1, n_units)}>;")
        self.widths[name] = w
        self.words += max(1, n_units) * w

    def stage(self, L, ind, arr, nrows, which, w, pad, pre, valid, coords, scale=None):
        """Copy ``nrows`` rows of ``which`` (one vec unit per step) into workgroup array
        ``arr`` (row stride ``pad`` units).  ``pre(rr)``: lines deriving coordinates from local
        row ``rr``; ``valid``: condition; ``coords(col)``: the element's 4 coordinates.
        With ``reg_stage`` (short loops) through registers ``g{arr}{m}``: every load issued
        before the first store, not one load-store pass after another."""
        if self.reg_stage:
            tag = f"g{arr}"
            self.prefetch_decl(L, ind, tag, nrows, which)
            self.prefetch_load(L, ind, tag, nrows, which, pre, valid, coords, scale)
            self.prefetch_store(L, ind, tag, arr, nrows, which, pad)
            return
        dim = self.Dv if which in ("v", "dout") else self.D
        units = dim // w
        i2, i3 = ind + "    ", ind + "        "
        L.append(f"{ind}for (var e: u32 = lid; e < {u(nrows * units)}; e = e + {u(self.wg)}) {{")
        L.append(f"{i2}let rr = e / {u(units)};")
        L.append(f"{i2}let uu = e % {u(units)};")
        L += [i2 + x for x in pre("rr")]
        L.append(f"{i2}var x: {_vt(w)} = {_vt(w)}(0.0);")
        L.append(f"{i2}if ({valid}) {{")
        L.append(f"{i3}x = {self.unit_value(which, w, coords, scale)};")
        L.append(f"{i2}}}")
        L.append(f"{i2}{arr}[rr][uu] = x;" if arr in self.rows2d else
                 f"{i2}{arr}[rr * {u(pad)} + uu] = x;")
        L.append(f"{ind}}}")

    VEC_ROLES = ("q", "k", "v", "dout")  # the roles ``unit_value`` reads by vec units

    def vec_bindings(self) -> set[str]:
        """Binding variables of q/k/v/dout that may be declared as ``array<vec4<f32>>``
        (``vec_reads``): every role bound to the variable is one of ``VEC_ROLES``, and each
        such view holds f32, is read with unit stride along its head dim (a multiple of 4:
        every read of it is a vec4 unit) and 4-aligned other strides, offset and extent (a
        unit's first element index is a multiple of 4)."""
        roles = [r for r in self.VEC_ROLES if r in self.bind and (r != "dout" or self.k.dout)]

        def ok(r: str) -> bool:
            s, st = self.read_view(r)
            return (s.dtype is f32 and st[3] == 1 and s.shape[-1] % 4 == 0
                    and all(x % 4 == 0 for x in st[:3]) and s.offset % 4 == 0
                    and s.extent % 4 == 0)

        out = set()
        for var in {self.bind[r] for r in roles}:
            bound = [r for r, v in self.bind.items() if v == var]
            if all(r in roles and ok(r) for r in bound):
                out.add(var)
        return out

    def unit_value(self, which, w, coords, scale=None) -> str:
        """The vec unit ``uu`` of the row addressed by ``coords`` (times ``scale``): one vec4
        load where the binding is declared as vec4s (``vec_reads``), else ``w`` loads."""
        cols = ["uu"] if w == 1 else [f"uu * 4u + {u(c)}" for c in range(w)]
        if w == 4 and which in self.VEC_ROLES and self.bind[which] in self.vec_reads:
            s, strides = self.read_view(which)
            idx = index_code([f"({c})" for c in coords("uu * 4u")], strides, s.offset)
            val = f"{self.bind[which]}[({idx}) / 4u]"
        else:
            val = _vec([self.src(which, coords(c)) for c in cols])
        return val if scale is None else f"{val} * {_f(scale)}"

    def prefetch_units(self, which, nrows) -> tuple[int, int, int]:
        """(vec width, units per row, registers per invocation) of a prefetched tile."""
        w = self.wv if which in ("v", "dout", "out") else self.wd
        units = (self.Dv if which in ("v", "dout", "out") else self.D) // w
        return w, units, -(-nrows * units // self.wg)

    def prefetch_load(self, L, ind, tag, nrows, which, pre, valid, coords, scale=None):
        """Load this invocation's units of the next tile into registers ``{tag}{m}`` (declared
        by ``prefetch_decl``) so the global loads overlap the current tile's arithmetic."""
        w, units, n = self.prefetch_units(which, nrows)
        i2, i3 = ind + "    ", ind + "        "
        for m in range(n):
            L.append(f"{ind}{{")
            L.append(f"{i2}let e = lid + {u(m * self.wg)};")
            L.append(f"{i2}let rr = e / {u(units)};")
            L.append(f"{i2}let uu = e % {u(units)};")
            L += [i2 + x for x in pre("rr")]
            cond = valid if (m + 1) * self.wg <= nrows * units else \
                f"e < {u(nrows * units)} && {valid}"
            L.append(f"{i2}{tag}{m} = {_vt(w)}(0.0);")
            L.append(f"{i2}if ({cond}) {{")
            L.append(f"{i3}{tag}{m} = {self.unit_value(which, w, coords, scale)};")
            L.append(f"{i2}}}")
            L.append(f"{ind}}}")

    def prefetch_decl(self, L, ind, tag, nrows, which) -> None:
        w, _, n = self.prefetch_units(which, nrows)
        L += [f"{ind}var {tag}{m}: {_vt(w)};" for m in range(n)]

    def prefetch_store(self, L, ind, tag, arr, nrows, which, pad) -> None:
        """Registers ``{tag}{m}`` into workgroup array ``arr`` (row stride ``pad``)."""
        _, units, n = self.prefetch_units(which, nrows)
        for m in range(n):
            e = f"(lid + {u(m * self.wg)})"
            line = (f"{arr}[{e} / {u(units)}][{e} % {u(units)}] = {tag}{m};" if arr in self.rows2d
                    else f"{arr}[{e} / {u(units)} * {u(pad)} + {e} % {u(units)}] = {tag}{m};")
            if (m + 1) * self.wg <= nrows * units:
                L.append(f"{ind}{line}")
            else:
                L.append(f"{ind}if ({e} < {u(nrows * units)}) {{ {line} }}")

    # -- register tiles --------------------------------------------------------------------
    def dots(self, L, ind, acc, own_arr, loop_arr, w, units, pad) -> None:
        """acc{i}_{j} = own_arr[tr + i·TR] · loop_arr[tc + j·TC] over ``units`` vec units."""
        TR, TC, RM, RN, i2 = self.TR, self.TC, self.RM, self.RN, ind + "    "
        for i in range(RM):
            for j in range(RN):
                L.append(f"{ind}var {acc}{i}_{j}: f32 = 0.0;")
        if own_arr in self.rows2d:  # unrolled: constant unit indices (FWD_UNROLL)
            for d in range(units):
                L.append(f"{ind}{{")
                L += [f"{i2}let a{i} = {own_arr}[tr + {u(i * TR)}][{u(d)}];" for i in range(RM)]
                L += [f"{i2}let b{j} = {loop_arr}[tc + {u(j * TC)}][{u(d)}];" for j in range(RN)]
                L += [f"{i2}{acc}{i}_{j} = {_acc_dot(w, f'{acc}{i}_{j}', f'a{i}', f'b{j}')};"
                      for i in range(RM) for j in range(RN)]
                L.append(f"{ind}}}")
            return
        L.append(f"{ind}for (var d: u32 = 0u; d < {u(units)}; d = d + 1u) {{")
        for i in range(RM):
            L.append(f"{i2}let a{i} = {own_arr}[(tr + {u(i * TR)}) * {u(pad)} + d];")
        for j in range(RN):
            L.append(f"{i2}let b{j} = {loop_arr}[(tc + {u(j * TC)}) * {u(pad)} + d];")
        for i in range(RM):
            for j in range(RN):
                L.append(f"{i2}{acc}{i}_{j} = {_acc_dot(w, f'{acc}{i}_{j}', f'a{i}', f'b{j}')};")
        L.append(f"{ind}}}")

    def acc_decl(self, L, ind, acc, w, units) -> int:
        """Accumulators {acc}{i}_{c} (RM rows × columns tc + c·TC); returns their count c."""
        nc = -(-units // self.TC)
        for i in range(self.RM):
            for c in range(nc):
                L.append(f"{ind}var {acc}{i}_{c}: {_vt(w)} = {_vt(w)}(0.0);")
        return nc

    def outer(self, L, ind, n_loop, terms) -> None:
        """For each step kk of the loop tile: acc{i}_{c} += vec[kk][i] · arr[kk][tc + c·TC] for
        each (acc, vec, arr, pad, nc) of ``terms`` (unrolled for arrays of rows:
        ``FWD_UNROLL``)."""
        if all(t[1] in self.rows2d for t in terms):
            for n in range(n_loop):
                L.append(f"{ind}{{")
                self.outer_step(L, ind + "    ", u(n), terms)
                L.append(f"{ind}}}")
            return
        L.append(f"{ind}for (var kk: u32 = 0u; kk < {u(n_loop)}; kk = kk + 1u) {{")
        self.outer_step(L, ind + "    ", "kk", terms)
        L.append(f"{ind}}}")

    def outer_step(self, L, ind, kk, terms) -> None:
        """The body of ``outer`` for step ``kk`` (the loop variable or a constant)."""
        TC, RM = self.TC, self.RM
        for acc, vec, arr, pad, nc in terms:
            two = vec in self.rows2d
            L.append(f"{ind}let p_{acc} = {vec}[{kk}][tr];" if two else
                     f"{ind}let p_{acc} = {vec}[kk * {u(self.TR)} + tr];")
            for c in range(nc):
                L.append(f"{ind}let o_{acc}{c} = {arr}[{kk}][tc + {u(c * TC)}];" if two else
                         f"{ind}let o_{acc}{c} = {arr}[kk * {u(pad)} + tc + {u(c * TC)}];")
                for i in range(RM):
                    L.append(f"{ind}{acc}{i}_{c} = " + _acc_axpy(
                        self.widths[arr], f"{acc}{i}_{c}", _comp('p_' + acc, i, RM), f"o_{acc}{c}")
                        + ";")

    def put_tile(self, L, ind, arr, val) -> None:
        """arr[(tc + j·TC)·TR + tr] = (val(0, j), …, val(RM-1, j)) for each j."""
        for j in range(self.RN):
            vals = [val(i, j) for i in range(self.RM)]
            at = (f"{arr}[tc + {u(j * self.TC)}][tr]" if arr in self.rows2d
                  else f"{arr}[(tc + {u(j * self.TC)}) * {u(self.TR)} + tr]")
            L.append(f"{ind}{at} = {_vec(vals)};")

    def store_rows(self, L, ind, target, acc, nc, w, units, dim, rbase, ok, scale) -> None:
        """Store accumulator row i (columns tc + c·TC < units) · ``scale(i)`` into row
        ``rbase(i)`` (of ``dim`` elements) of ``target`` when ``ok(i)``."""
        i2, i3 = ind + "    ", ind + "        "
        for i in range(self.RM):
            L.append(f"{ind}if ({ok(i)}) {{")
            for c in range(nc):
                L.append(f"{i2}let cu{c} = tc + {u(c * self.TC)};")
                guard = (c + 1) * self.TC > units
                ii = i3 if guard else i2
                if guard:
                    L.append(f"{i2}if (cu{c} < {u(units)}) {{")
                L.append(f"{ii}let val{c} = {acc}{i}_{c} * {scale(i)};")
                for comp in range(w):
                    e = f"val{c}[{comp}]" if w == 4 else f"val{c}"
                    dst = (f"{rbase(i)} * {u(dim)} + cu{c} * {u(w)} + {u(comp)}" if w == 4
                           else f"{rbase(i)} * {u(dim)} + cu{c}")
                    L.append(f"{ii}{self.bind[target]}[{self.at(target)}{dst}] = "
                             f"{_store(e, self.dt)};")
                if guard:
                    L.append(f"{i2}}}")
            L.append(f"{ind}}}")


def _grid_head(L, ind, grid, total, blk, nblk, head, nh, g=None) -> None:
    """Workgroup -> (split chunk ``sc``, batch ``b``, head ``head``, block ``blk``)."""
    L.append(f"{ind}let wg = {grid.wg_expr};")
    if not grid.exact:
        L.append(f"{ind}if (wg >= {u(total)}) {{ return; }}")
    L += [f"{ind}let {blk} = wg % {u(nblk)};", f"{ind}let bh = wg / {u(nblk)};",
          f"{ind}let {head} = bh % {u(nh)};"]
    if g is not None and g.ns > 1:
        L += [f"{ind}let b = bh / {u(nh)} % {u(g.B)};", f"{ind}let sc = bh / {u(nh * g.B)};"]
    else:
        L.append(f"{ind}let b = bh / {u(nh)};")


def _lanes(g: _Gen, L, ind) -> None:
    L += [f"{ind}let tr = lid / {u(g.TC)};", f"{ind}let tc = lid % {u(g.TC)};"]


def chunk_len(k: AttentionKernel) -> int:
    """Keys per chunk of a split forward / dQ kernel: ``chunk_keys`` (forwards only) or an
    even split; ``CodegenError`` where ``chunk_keys`` does not give exactly ``splits``
    chunks."""
    n, skv = max(1, k.splits), k.k.shape[2]
    if not k.chunk_keys:
        return -(-skv // n)
    if k.kind != "fwd" or n < 2 or not (k.chunk_keys * (n - 1) < skv <= k.chunk_keys * n):
        raise CodegenError(f"kernel {k.name!r}: chunk_keys={k.chunk_keys} does not split "
                           f"{skv} keys into {n} chunks of a {k.kind} kernel")
    return int(k.chunk_keys)


def _store(e: str, dt: DType) -> str:
    return e if dt is f32 else f"{dt.wgsl}({e})"


# ------------------------------------------------------------------------------ fwd and dQ


def _rows_head(g: _Gen, L, ind, grid, total) -> None:
    """Block of packed rows, the key range it can see, this invocation's rows (packed row,
    query position, head, absolute position, in range)."""
    k, BQ = g.k, g.own
    _grid_head(L, ind, grid, total, "blk", -(-g.rows // BQ), "hkv", g.Hkv, g)
    _lanes(g, L, ind)
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
    if g.ns > 1:  # this workgroup's chunk of the keys
        ch = g.chunk
        L.append(f"{ind}kv_lo = max(kv_lo, i32(sc) * {_i(ch)});")
        L.append(f"{ind}kv_hi = min(kv_hi, i32(sc) * {_i(ch)} + {_i(ch)});")
    for i in range(g.RM):
        L.append(f"{ind}let rw{i} = R0 + tr + {u(i * g.TR)};")
        L.append(f"{ind}let rok{i} = rw{i} < {u(g.rows)};")
        L += [ind + x for x in g.packed(f"rw{i}", f"q{i}")]
        L.append(f"{ind}let pos{i} = i32(q{i}i) + {_i(k.q_offset)};")


def _rows_stage_q(g: _Gen, L, ind) -> None:
    """Stage the block's Q rows (pre-scaled) and, for dQ, its dO rows."""
    k = g.k
    pre = lambda rr: [f"let RR = R0 + {rr};"] + g.packed("RR", "s")  # noqa: E731
    valid = f"RR < {u(g.rows)}"
    g.stage(L, ind, "Qs", g.own, "q", g.wd, g.dp, pre, valid,
            lambda c: ["b", "sh", "si", c], k.scale)
    if k.kind == "dq":
        g.stage(L, ind, "Os", g.own, "dout", g.wv, g.vp, pre, valid,
                lambda c: ["b", "sh", "si", c])


def _kv_first(g: _Gen, L, ind) -> None:
    """Registers for the K/V prefetch and the first tile's loads issued."""
    for tag, which in (("pk", "k"), ("pv", "v")):
        g.prefetch_decl(L, ind, tag, g.loop, which)
    _kv_load(g, L, ind, "kv_lo")


def _kv_tiles(g: _Gen, L, ind) -> None:
    """The key-tile loop's head: K/V of the first tile prefetched into registers (here, or
    with ``kv_early`` before the rows were staged), then per tile: registers to ``Ks``/``Vs``
    (keys past ``kv_hi`` as zeros), barrier, and the next tile's loads issued (they land while
    this tile is computed)."""
    i2 = ind + "    "
    if not g.kv_early:
        _kv_first(g, L, ind)
    L.append(f"{ind}for (var kt: i32 = kv_lo; kt < kv_hi; kt = kt + {_i(g.loop)}) {{")
    g.prefetch_store(L, i2, "pk", "Ks", g.loop, "k", g.dp)
    g.prefetch_store(L, i2, "pv", "Vs", g.loop, "v", g.vp)
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{i2}if (kt + {_i(g.loop)} < kv_hi) {{")
    _kv_load(g, L, i2 + "    ", f"kt + {_i(g.loop)}")
    L.append(f"{i2}}}")


def _kv_load(g: _Gen, L, ind, start: str) -> None:
    pre = lambda rr: [f"let jj = {start} + i32({rr});"]  # noqa: E731
    for tag, which in (("pk", "k"), ("pv", "v")):
        g.prefetch_load(L, ind, tag, g.loop, which, pre, "jj < kv_hi",
                        lambda c: ["b", "hkv", "u32(jj)", c])


def _rows_score(g: _Gen, i: int, j: int, x: str) -> list[str]:
    """Lines: key ``kj{j}`` of the tile and ``vis`` (visible, in range) for score (i, j);
    the mask is added to ``x``."""
    k = g.k
    out = [f"let kj = kt + i32(tc + {u(j * g.TC)});", f"let inb = rok{i} && kj < kv_hi;"]
    if k.mask is not None:
        mv = g.ld("mask", g.midx("b", f"q{i}h", f"q{i}i", "u32(kj)"), k.mask.dtype)
        out.append(f"if (inb) {{ {x} = {x} + {mv}; }}")
    out.append(f"let vis = {' && '.join(['inb'] + g.vis_terms('kj', f'pos{i}'))};")
    return out


def _fwd_softmax(g: _Gen, L, ind) -> None:
    """Scores -> probabilities of the tile with the running max/sum updated; P to ``Ps``."""
    RM, RN, TR, TC, i2 = g.RM, g.RN, g.TR, g.TC, ind + "    "
    for i in range(RM):
        L.append(f"{ind}var mx{i}: f32 = -{FLT_MAX};")
        for j in range(RN):
            L.append(f"{ind}{{")
            L += [i2 + x for x in _rows_score(g, i, j, f"s{i}_{j}")]
            L.append(f"{i2}s{i}_{j} = select(-mn_inf(), s{i}_{j}, vis);")
            L.append(f"{i2}mx{i} = max(mx{i}, s{i}_{j});")
            L.append(f"{ind}}}")
    L.append(f"{ind}Red[tc * {u(TR)} + tr] = {_vec([f'mx{i}' for i in range(RM)])};")
    L.append(f"{ind}workgroupBarrier();")
    L.append(f"{ind}var mt = m;")
    L.append(f"{ind}for (var cc: u32 = 0u; cc < {u(TC)}; cc = cc + 1u) {{")
    L.append(f"{i2}mt = max(mt, Red[cc * {u(TR)} + tr]);")
    L.append(f"{ind}}}")
    for i in range(RM):
        for j in range(RN):
            mi = _comp("mt", i, RM)
            L.append(f"{ind}let p{i}_{j} = select(exp(s{i}_{j} - {mi}), 0.0, "
                     f"s{i}_{j} < -{FLT_MAX});")
    L.append(f"{ind}let alpha = exp(m - mt);")
    sums = [" + ".join(f"p{i}_{j}" for j in range(RN)) for i in range(RM)]
    L.append(f"{ind}l = l * alpha + {_vec(sums)};")
    L.append(f"{ind}m = mt;")
    for i in range(RM):
        for c in range(g.nc):
            L.append(f"{ind}o{i}_{c} = o{i}_{c} * {_comp('alpha', i, RM)};")
    g.put_tile(L, ind, "Ps", lambda i, j: f"p{i}_{j}")
    L.append(f"{ind}workgroupBarrier();")


def _fwd_kernel(g: _Gen, t):
    k, ind, i2 = g.k, "    ", "        "
    RM, TR, TC = g.RM, g.TR, g.TC
    rows = g.unroll  # arrays of rows (FWD_UNROLL)
    g.array("Qs", g.wd, g.own * g.dp, g.own if rows else 0)
    g.array("Ks", g.wd, g.loop * g.dp, g.loop if rows else 0)
    g.array("Vs", g.wv, g.loop * g.vp, g.loop if rows else 0)
    g.array("Ps", RM, g.loop * TR, g.loop if rows else 0)
    g.array("Red", RM, TC * TR)
    total = -(-g.rows // g.own) * g.B * g.Hkv * g.ns
    grid = g.grid = make_grid(k.name, total, t)
    L: list[str] = []
    _rows_head(g, L, ind, grid, total)
    if g.kv_early:
        _kv_first(g, L, ind)
    _rows_stage_q(g, L, ind)
    L.append(f"{ind}var m: {_vt(RM)} = {_vt(RM)}(-{FLT_MAX});")
    L.append(f"{ind}var l: {_vt(RM)} = {_vt(RM)}(0.0);")
    g.nc = g.acc_decl(L, ind, "o", g.wv, g.vu)
    _kv_tiles(g, L, ind)
    g.dots(L, i2, "s", "Qs", "Ks", g.wd, g.du, g.dp)
    _fwd_softmax(g, L, i2)
    g.outer(L, i2, g.loop, [("o", "Ps", "Vs", g.vp, g.nc)])
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")
    # the row sums: partial per invocation, summed over the TC invocations of a row
    L.append(f"{ind}Red[tc * {u(TR)} + tr] = l;")
    L.append(f"{ind}workgroupBarrier();")
    L.append(f"{ind}var lt = {_vt(RM)}(0.0);")
    L.append(f"{ind}for (var cc: u32 = 0u; cc < {u(TC)}; cc = cc + 1u) {{")
    L.append(f"{i2}lt = lt + Red[cc * {u(TR)} + tr];")
    L.append(f"{ind}}}")
    _fwd_store(g, L, ind)
    return L


def _fwd_store(g: _Gen, L, ind) -> None:
    k, RM = g.k, g.RM
    for i in range(RM):
        li, mi = _comp("lt", i, RM), _comp("m", i, RM)
        L.append(f"{ind}let inv{i} = select(1.0 / {li}, 0.0, {li} == 0.0);")
        L.append(f"{ind}if (rok{i} && tc == 0u) {{")
        obase = f"(({g.bsplit()} * {u(g.Hq)} + q{i}h) * {u(g.Sq)} + q{i}i)"
        L.append(f"{ind}    {g.bind['lse_out']}[{obase}] = "
                 f"{_store(f'select({mi} + log({li}), -mn_inf(), {li} == 0.0)', g.dt)};")
        L.append(f"{ind}}}")
    if k.out_bshd:
        rbase = lambda i: f"((b * {u(g.Sq)} + q{i}i) * {u(g.Hq)} + q{i}h)"  # noqa: E731
    else:
        rbase = lambda i: f"(({g.bsplit()} * {u(g.Hq)} + q{i}h) * {u(g.Sq)} + q{i}i)"  # noqa: E731
    g.store_rows(L, ind, "out", "o", g.nc, g.wv, g.vu, g.Dv, rbase, lambda i: f"rok{i}",
                 lambda i: f"inv{i}")


def _dq_row_stats(g: _Gen, L, ind) -> None:
    """lse and delta of this invocation's rows (lse_s: 0 for rows with no visible key)."""
    k = g.k
    for i in range(g.RM):
        L.append(f"{ind}var lse{i}: f32 = 0.0;")
        L.append(f"{ind}var dl{i}: f32 = 0.0;")
        L.append(f"{ind}if (rok{i}) {{")
        li = index_code(["b", f"q{i}h", f"q{i}i"], g.lst, k.lse.offset)
        di = index_code(["b", f"q{i}h", f"q{i}i"], g.dlst, k.delta.offset)
        L.append(f"{ind}    lse{i} = {g.ld('lse', li, k.lse.dtype)};")
        L.append(f"{ind}    dl{i} = {g.ld('delta', di, k.delta.dtype)};")
        L.append(f"{ind}}}")
        L.append(f"{ind}let has{i} = rok{i} && !(lse{i} < -{FLT_MAX});")
        L.append(f"{ind}let lss{i} = select(0.0, lse{i}, has{i});")


def _dq_ds(g: _Gen, L, ind) -> None:
    """dS of the tile (registers) to ``Ps``."""
    i2 = ind + "    "
    for i in range(g.RM):
        for j in range(g.RN):
            L.append(f"{ind}var ds{i}_{j}: f32;")
            L.append(f"{ind}{{")
            L += [i2 + x for x in _rows_score(g, i, j, f"s{i}_{j}")]
            L.append(f"{i2}let ok = vis && has{i} && !(s{i}_{j} < -{FLT_MAX});")
            L.append(f"{i2}let p = select(0.0, exp(select(0.0, s{i}_{j} - lss{i}, ok)), ok);")
            L.append(f"{i2}ds{i}_{j} = p * (t{i}_{j} - dl{i});")
            L.append(f"{ind}}}")
    g.put_tile(L, ind, "Ps", lambda i, j: f"ds{i}_{j}")
    L.append(f"{ind}workgroupBarrier();")


def _dq_kernel(g: _Gen, t):
    k, ind, i2 = g.k, "    ", "        "
    g.array("Qs", g.wd, g.own * g.dp)
    g.array("Os", g.wv, g.own * g.vp)
    g.array("Ks", g.wd, g.loop * g.dp)
    g.array("Vs", g.wv, g.loop * g.vp)
    g.array("Ps", g.RM, g.loop * g.TR)
    total = -(-g.rows // g.own) * g.B * g.Hkv * g.ns
    grid = g.grid = make_grid(k.name, total, t)
    L: list[str] = []
    _rows_head(g, L, ind, grid, total)
    if g.kv_early:
        _kv_first(g, L, ind)
    _rows_stage_q(g, L, ind)
    _dq_row_stats(g, L, ind)
    nc = g.acc_decl(L, ind, "o", g.wd, g.du)
    _kv_tiles(g, L, ind)
    g.dots(L, i2, "s", "Qs", "Ks", g.wd, g.du, g.dp)
    g.dots(L, i2, "t", "Os", "Vs", g.wv, g.vu, g.vp)
    _dq_ds(g, L, i2)
    g.outer(L, i2, g.loop, [("o", "Ps", "Ks", g.dp, nc)])
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")
    g.store_rows(L, ind, "dq", "o", nc, g.wd, g.du, g.D,
                 lambda i: f"(({g.bsplit()} * {u(g.Hq)} + q{i}h) * {u(g.Sq)} + q{i}i)",
                 lambda i: f"rok{i}", lambda i: _f(k.scale))
    return L


# ------------------------------------------------------------------------------ dK/dV


def _keys_head(g: _Gen, L, ind, grid, total) -> None:
    """Block of keys, this invocation's keys, the packed query rows that can see the block."""
    k, BKV = g.k, g.own
    _grid_head(L, ind, grid, total, "kb", -(-g.Skv // BKV), "hw", g.NH, g)
    if k.split_heads:
        L.append(f"{ind}let hq_w = hw;")
        L.append(f"{ind}let hkv = hw / {u(g.G)};")
    else:
        L.append(f"{ind}let hkv = hw;")
    _lanes(g, L, ind)
    L.append(f"{ind}let j0 = kb * {u(BKV)};")
    L.append(f"{ind}let j1 = min(j0 + {u(BKV)}, {u(g.Skv)});")
    for i in range(g.RM):
        L.append(f"{ind}let jk{i} = j0 + tr + {u(i * g.TR)};")
        L.append(f"{ind}let kok{i} = jk{i} < {u(g.Skv)};")
    L.append(f"{ind}var i_lo: i32 = 0i;")
    L.append(f"{ind}var i_hi: i32 = {_i(g.Sq)};")
    if k.causal:
        L.append(f"{ind}i_lo = clamp(i32(j0) - {_i(k.q_offset)}, 0i, {_i(g.Sq)});")
    if k.window:
        L.append(f"{ind}i_hi = clamp(i32(j1) - 1i + {_i(k.window)} - {_i(k.q_offset)}, 0i, "
                 f"{_i(g.Sq)});")
    L.append(f"{ind}var c_lo: i32 = 0i;")
    L.append(f"{ind}var c_hi: i32 = {_i(g.Sq)};")
    if g.ns > 1:  # this workgroup's chunk of the query positions
        ch = -(-g.Sq // g.ns)
        L.append(f"{ind}c_lo = i32(sc) * {_i(ch)};")
        L.append(f"{ind}c_hi = min(c_lo + {_i(ch)}, {_i(g.Sq)});")
        L.append(f"{ind}i_lo = max(i_lo, c_lo);")
        L.append(f"{ind}i_hi = min(i_hi, c_hi);")
    L.append(f"{ind}let R_lo = u32(i_lo) * {u(g.P)};")
    L.append(f"{ind}let R_hi = u32(max(i_hi, i_lo)) * {u(g.P)};")


def _stage_kv(g: _Gen, L, ind) -> None:
    """Stage the block's K (pre-scaled) and V (after the first row tile's loads are issued:
    the two global latencies overlap)."""
    k, BKV = g.k, g.own
    pre = lambda rr: [f"let jj = j0 + {rr};"]  # noqa: E731
    i2 = ind + "    " if EARLY_LOADS else ind
    if EARLY_LOADS:
        L.append(f"{ind}if (R_lo < R_hi) {{  // a block no row sees (causal, chunks): no loads")
    for arr, which, w, pad, sc in (("Ks", "k", g.wd, g.dp, k.scale), ("Vs", "v", g.wv, g.vp,
                                                                       None)):
        g.stage(L, i2, arr, BKV, which, w, pad, pre, f"jj < {u(g.Skv)}",
                lambda c: ["b", "hkv", "jj", c], sc)
    if EARLY_LOADS:
        L.append(f"{ind}}}")


def _keys_rows(g: _Gen, L, ind) -> None:
    """The query-row loop's head: Q, dO, lse and delta of the first tile prefetched (then K and
    V staged), then per tile: registers to ``Qs``/``Os``/``Ls``/``Dl``, barrier, the next
    tile's loads issued."""
    i2, BQ = ind + "    ", g.loop
    dout = g.k.delta_out
    g.prefetch_decl(L, ind, "pq", BQ, "q")
    g.prefetch_decl(L, ind, "po", BQ, "dout")
    if dout:
        g.prefetch_decl(L, ind, "pz", BQ, "out")
    n = -(-BQ // g.wg)
    L += [f"{ind}var pl{m}: f32;" + ("" if dout else f"\n{ind}var pd{m}: f32;")
          for m in range(n)]
    if EARLY_LOADS:
        _rows_load(g, L, ind, "R_lo")
    _stage_kv(g, L, ind)
    if not EARLY_LOADS:
        _rows_load(g, L, ind, "R_lo")
    L.append(f"{ind}for (var R0: u32 = R_lo; R0 < R_hi; R0 = R0 + {u(BQ)}) {{")
    g.prefetch_store(L, i2, "pq", "Qs", BQ, "q", g.dp)
    g.prefetch_store(L, i2, "po", "Os", BQ, "dout", g.vp)
    if dout:
        _delta_products(g, L, i2)
    for m in range(n):
        e = f"lid + {u(m * g.wg)}"
        line = f"Ls[{e}] = pl{m};" + ("" if dout else f" Dl[{e}] = pd{m};")
        L.append(f"{i2}{line}" if (m + 1) * g.wg <= BQ else f"{i2}if ({e} < {u(BQ)}) {{ {line} }}")
    L.append(f"{i2}workgroupBarrier();")
    if dout:
        _delta_rows(g, L, i2)
    L.append(f"{i2}if (R0 + {u(BQ)} < R_hi) {{")
    _rows_load(g, L, i2 + "    ", f"R0 + {u(BQ)}")
    L.append(f"{i2}}}")


def _delta_products(g: _Gen, L, ind) -> None:
    """``delta_out``: the dot product of each prefetched dO unit with the O unit loaded beside
    it (the same element of the tile) into ``Dx`` (row-major, ``vu`` units per row)."""
    _, units, n = g.prefetch_units("dout", g.loop)
    for m in range(n):
        e = f"(lid + {u(m * g.wg)})"
        dot = f"dot(po{m}, pz{m})" if g.wv > 1 else f"po{m} * pz{m}"
        line = f"Dx[{e}] = {dot};"
        L.append(f"{ind}{line}" if (m + 1) * g.wg <= g.loop * units
                 else f"{ind}if ({e} < {u(g.loop * units)}) {{ {line} }}")


def _delta_rows(g: _Gen, L, ind) -> None:
    """``delta_out``: δ of each row of the tile, its units' products summed in order, to
    ``Dl`` (read after the barrier that ``_keys_p_ds`` is preceded by)."""
    i2 = ind + "    "
    L.append(f"{ind}for (var r: u32 = lid; r < {u(g.loop)}; r = r + {u(g.wg)}) {{")
    L.append(f"{i2}var dsum: f32 = 0.0;")
    L.append(f"{i2}for (var uu: u32 = 0u; uu < {u(g.vu)}; uu = uu + 1u) {{")
    L.append(f"{i2}    dsum = dsum + Dx[r * {u(g.vu)} + uu];")
    L.append(f"{i2}}}")
    L.append(f"{i2}Dl[r] = dsum;")
    L.append(f"{ind}}}")


def _rows_load(g: _Gen, L, ind, start: str) -> None:
    """Issue the loads of the query-row tile starting at packed row ``start``."""
    k, BQ, i2 = g.k, g.loop, ind + "    "
    pre = lambda rr: [f"let RR = {start} + {rr};"] + g.packed("RR", "s")  # noqa: E731
    coords = lambda c: ["b", "sh", "si", c]  # noqa: E731
    g.prefetch_load(L, ind, "pq", BQ, "q", pre, "RR < R_hi", coords)
    g.prefetch_load(L, ind, "po", BQ, "dout", pre, "RR < R_hi", coords)
    if k.delta_out:
        g.prefetch_load(L, ind, "pz", BQ, "out", pre, "RR < R_hi", coords)
    li = index_code(["b", "sh", "si"], g.lst, k.lse.offset)
    di = None if k.delta_out else index_code(["b", "sh", "si"], g.dlst, k.delta.offset)
    for m in range(-(-BQ // g.wg)):
        L.append(f"{ind}{{")
        L.append(f"{i2}let RR = {start} + lid + {u(m * g.wg)};")
        L += [i2 + x for x in g.packed("RR", "s")]
        L.append(f"{i2}pl{m} = -mn_inf();")
        if di:
            L.append(f"{i2}pd{m} = 0.0;")
        L.append(f"{i2}if (RR < R_hi && lid + {u(m * g.wg)} < {u(BQ)}) {{")
        L.append(f"{i2}    pl{m} = {g.ld('lse', li, k.lse.dtype)};")
        if di:
            L.append(f"{i2}    pd{m} = {g.ld('delta', di, k.delta.dtype)};")
        L.append(f"{i2}}}")
        L.append(f"{ind}}}")


def _keys_p_ds(g: _Gen, L, ind) -> None:
    """P and dS of the invocation's (key, row) pairs to ``Ps``/``Ds``."""
    k, i2 = g.k, ind + "    "
    for j in range(g.RN):
        L.append(f"{ind}let qq{j} = tc + {u(j * g.TC)};")
        L.append(f"{ind}let RR{j} = R0 + qq{j};")
        L += [ind + x for x in g.packed(f"RR{j}", f"s{j}")]
        L.append(f"{ind}let pq{j} = i32(s{j}i) + {_i(k.q_offset)};")
        L.append(f"{ind}let lq{j} = Ls[qq{j}];")
        L.append(f"{ind}let dq{j} = Dl[qq{j}];")
        L.append(f"{ind}let rin{j} = RR{j} < R_hi && !(lq{j} < -{FLT_MAX});")
    for i in range(g.RM):
        for j in range(g.RN):
            x = f"s{i}_{j}"
            L.append(f"{ind}var p{i}_{j}: f32;")
            L.append(f"{ind}var ds{i}_{j}: f32;")
            L.append(f"{ind}{{")
            L.append(f"{i2}let kj = i32(jk{i});")
            L.append(f"{i2}let inb = kok{i} && rin{j};")
            if k.mask is not None:
                mv = g.ld("mask", g.midx("b", f"s{j}h", f"s{j}i", f"jk{i}"), k.mask.dtype)
                L.append(f"{i2}if (inb) {{ {x} = {x} + {mv}; }}")
            vis = " && ".join(["inb"] + g.vis_terms("kj", f"pq{j}") + [f"!({x} < -{FLT_MAX})"])
            L.append(f"{i2}let ok = {vis};")
            L.append(f"{i2}p{i}_{j} = select(0.0, exp(select(0.0, {x} - lq{j}, ok)), ok);")
            L.append(f"{i2}ds{i}_{j} = p{i}_{j} * (t{i}_{j} - dq{j});")
            L.append(f"{ind}}}")
    g.put_tile(L, ind, "Ps", lambda i, j: f"p{i}_{j}")
    g.put_tile(L, ind, "Ds", lambda i, j: f"ds{i}_{j}")
    L.append(f"{ind}workgroupBarrier();")


def _dkdv_kernel(g: _Gen, t):
    k, ind, i2 = g.k, "    ", "        "
    g.NH = g.Hq if k.split_heads else g.Hkv  # heads of the work items
    g.P = 1 if k.split_heads else g.G  # packed rows per query position
    for name, w, n in (("Ks", g.wd, g.own * g.dp), ("Vs", g.wv, g.own * g.vp),
                       ("Qs", g.wd, g.loop * g.dp), ("Os", g.wv, g.loop * g.vp),
                       ("Ps", g.RM, g.loop * g.TR), ("Ds", g.RM, g.loop * g.TR),
                       ("Ls", 1, g.loop), ("Dl", 1, g.loop)):
        g.array(name, w, n)
    if k.delta_out:
        g.array("Dx", 1, g.loop * g.vu)
    total = -(-g.Skv // g.own) * g.B * g.NH * g.ns
    grid = g.grid = make_grid(k.name, total, t)
    L: list[str] = []
    _keys_head(g, L, ind, grid, total)
    nk = g.acc_decl(L, ind, "ak", g.wd, g.du)
    nv = g.acc_decl(L, ind, "av", g.wv, g.vu)
    _keys_rows(g, L, ind)
    g.dots(L, i2, "s", "Ks", "Qs", g.wd, g.du, g.dp)
    g.dots(L, i2, "t", "Vs", "Os", g.wv, g.vu, g.vp)
    if k.delta_out:  # Dl (written after the tile's first barrier) is read below
        L.append(f"{i2}workgroupBarrier();")
    _keys_p_ds(g, L, i2)
    g.outer(L, i2, g.loop, [("av", "Ps", "Os", g.vp, nv), ("ak", "Ds", "Qs", g.dp, nk)])
    if k.dq_block:
        _dq_partial(g, L, i2)
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")
    if k.dq_block and (k.causal or k.window):
        _dq_partial_zeros(g, L, ind)
    obase = lambda i: f"(({g.bsplit()} * {u(g.NH)} + hw) * {u(g.Skv)} + jk{i})"  # noqa: E731
    ok = lambda i: f"kok{i}"  # noqa: E731
    g.store_rows(L, ind, "dk", "ak", nk, g.wd, g.du, g.D, obase, ok, lambda i: _f(k.scale))
    g.store_rows(L, ind, "dv", "av", nv, g.wv, g.vu, g.Dv, obase, ok, lambda i: "1.0")
    return L


def _dq_partial(g: _Gen, L, ind) -> None:
    """dQ's partial sum over this key block for the tile's query rows: dS (``Ds``, keys tr' +
    i·TR of row r at r·TR + tr') times K·scale (``Ks``); invocation (tr, tc) computes rows tr +
    m·TR × units tc + c·TC and stores them (each (key block, row) once: no accumulation)."""
    TR, TC, RM, w, i2 = g.TR, g.TC, g.RM, g.wd, ind + "    "
    nm, nc = -(-g.loop // TR), -(-g.du // TC)
    for m in range(nm):
        for c in range(nc):
            L.append(f"{ind}var dqa{m}_{c}: {_vt(w)} = {_vt(w)}(0.0);")
    L.append(f"{ind}for (var t2: u32 = 0u; t2 < {u(TR)}; t2 = t2 + 1u) {{")
    for c in range(nc):
        for i in range(RM):
            L.append(f"{i2}let kq{i}_{c} = Ks[(t2 + {u(i * TR)}) * {u(g.dp)} + tc + {u(c * TC)}];")
    for m in range(nm):
        row = f"tr + {u(m * TR)}"
        guard = (m + 1) * TR > g.loop
        L.append(f"{i2}let dsq{m} = Ds[min({row}, {u(g.loop - 1)}) * {u(TR)} + t2];" if guard
                 else f"{i2}let dsq{m} = Ds[({row}) * {u(TR)} + t2];")
        for c in range(nc):
            for i in range(RM):
                L.append(f"{i2}dqa{m}_{c} = "
                         f"{_acc_axpy(w, f'dqa{m}_{c}', _comp(f'dsq{m}', i, RM), f'kq{i}_{c}')};")
    L.append(f"{ind}}}")
    for m in range(nm):
        L.append(f"{ind}{{")
        L.append(f"{i2}let RRq = R0 + tr + {u(m * TR)};")
        cond = "RRq < R_hi" + (f" && tr + {u(m * TR)} < {u(g.loop)}" if (m + 1) * TR > g.loop
                                 else "")
        L += [i2 + x for x in g.packed("RRq", "w")]
        L.append(f"{i2}let qrow = (((kb * {u(g.B)} + b) * {u(g.Hq)} + wh) * {u(g.Sq)} + wi) * "
                 f"{u(g.D)};")
        for c in range(nc):
            cu = f"tc + {u(c * TC)}"
            full = f"{cond} && {cu} < {u(g.du)}" if (c + 1) * TC > g.du else cond
            L.append(f"{i2}if ({full}) {{")
            for comp in range(w):
                e = f"dqa{m}_{c}[{comp}]" if w == 4 else f"dqa{m}_{c}"
                L.append(f"{i2}    {g.bind['dqp']}[{g.at('dqp')}qrow + ({cu}) * {u(w)} + "
                         f"{u(comp)}] = "
                         f"{_store(e, g.dt)};")
            L.append(f"{i2}}}")
        L.append(f"{ind}}}")


def _dq_partial_zeros(g: _Gen, L, ind) -> None:
    """Zeros into this key block's dQ partials of the rows of the workgroup's chunk that the
    causal/window rules hide the block from (the loop never visits them; the caller sums every
    block's partials)."""
    i2 = ind + "    "
    P, D = u(g.P), u(g.D)
    L.append(f"{ind}let zc_lo = u32(c_lo) * {P};")
    L.append(f"{ind}let zc_hi = u32(c_hi) * {P};")
    L.append(f"{ind}let zv_lo = clamp(R_lo, zc_lo, zc_hi);")
    L.append(f"{ind}let zv_hi = clamp(R_hi, zv_lo, zc_hi);")
    L.append(f"{ind}let z_n = (zv_lo - zc_lo + zc_hi - zv_hi) * {D};")
    L.append(f"{ind}for (var e: u32 = lid; e < z_n; e = e + {u(g.wg)}) {{")
    L.append(f"{i2}let rr = e / {D};")
    L.append(f"{i2}let RRz = select(zv_hi + rr - (zv_lo - zc_lo), zc_lo + rr, "
             "rr < zv_lo - zc_lo);")
    L += [i2 + x for x in g.packed("RRz", "z")]
    L.append(f"{i2}{g.bind['dqp']}[{g.at('dqp')}(((kb * {u(g.B)} + b) * {u(g.Hq)} + zh) * "
             f"{u(g.Sq)} + zi) * "
             f"{D} + e % {D}] = {_store('0.0', g.dt)};")
    L.append(f"{ind}}}")


def emit(k: AttentionKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    fast = AF.usable(k, t)
    if not fast and len(k.config) == 2:  # a fast configuration where the strict kernel runs
        k = dataclasses.replace(k, config=())
    g = _Gen(dataclasses.replace(k, config=()) if fast else k, t, alias)
    g.k = k
    if g.dt not in (f32, f16):
        raise CodegenError(f"kernel {k.name!r}: attention of {g.dt.name} tensors")
    check_bindings(k.name, g.bd.n, t)
    uses_f16 = check_dtypes(k.name, g.dts, t) or fast
    body = {"fwd": AF.fast_body if fast else _fwd_kernel, "dq": _dq_kernel,
            "dkdv": _dkdv_kernel}.get(k.kind)
    if body is None:
        raise CodegenError(f"unknown attention kernel kind {k.kind!r}")
    if AF.VEC_LOADS if fast else STRICT_VEC_LOADS:
        g.vec_reads = g.vec_bindings()
    lines = body(g, t)
    check_invocations(k.name, g.wg, t)
    check_workgroup_storage(k.name, 4 * g.words, t)
    head = module_header(uses_f16)
    if fast:  # per-subgroup fragment offsets (lid / 32) are not uniform across the workgroup
        head[-1:-1] = ["enable subgroups;", "enable chromium_experimental_subgroup_matrix;",
                       "diagnostic(off, chromium.subgroup_matrix_uniformity);",
                       "diagnostic(off, subgroup_uniformity);"]
        if g.fast_packed:  # staging through buffer views (attention_fast.PACKED)
            head.insert(0, "requires buffer_view;")
    decls = g.bd.decls(vec4={v: "f32" for v in g.vec_reads | g.vec_writes})
    src = module_source(head + decls + g.shared, {"mn_inf"}, g.wg, lines)
    B, Hq, Sq, Skv, D, Dv = g.B, g.Hq, g.Sq, g.Skv, g.D, g.Dv
    flops = 2 * B * Hq * Sq * Skv * (D + Dv) * (1 if k.kind == "fwd" else 2)
    flops += 2 * B * Hq * Sq * Skv * D if k.dq_block else 0  # the dQ partials' product
    cfg, tiles = (g.fast, (g.fast_rows, g.fast[1])) if fast else \
        ((g.TR, g.TC, g.RM, g.RN), (g.own, g.loop))
    meta = {"tiles": tiles, "config": cfg, "precision": "fast" if fast else "strict",
            # on tensor cores: an ``sgmat*`` variant, like the matmul's (reports, roofline peak)
            **({"variant": f"sgmat_attention_{k.kind}_{cfg[0]}x{cfg[1]}"} if fast else {}),
            "workgroup_storage": 4 * g.words, "archetype": f"attention_{k.kind}",
            "workgroup_size": g.wg, "binding_dtypes": tuple(g.dts), "flops": flops}
    return KernelSpec(k.name, src, g.bd.n, g.grid.workgroups, meta=meta)


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
                                split_heads=bool(attrs.get("split_heads", False)),
                                splits=int(attrs.get("splits", 1)),
                                dq_block=int(attrs.get("dq_block", 0)),
                                delta_out=bool(attrs.get("delta_out", False)),
                                chunk_keys=int(attrs.get("chunk_keys", 0)))

    return make


for _kind, _family in (("fwd", "attention_fwd"), ("dq", "attention_grad_dq"),
                      ("dkdv", "attention_grad_dkdv")):
    register(_family, KIND_TYPES[_kind], emit, make=_make(_kind), candidates=candidates)
