"""The combine step of split-K attention (``attention_combine``): the forward kernel with
``splits = n`` wrote, per key chunk c, the chunk's normalized output o_c (n·B, Hq, Sq, Dv) and
log-sum-exp lse_c (n·B, Hq, Sq); this kernel merges them exactly like one online-softmax step:

    m = max_c lse_c,   w_c = exp(lse_c - m),   out = Σ_c w_c·o_c / Σ_c w_c,   lse = m + log Σ_c w_c

summed in chunk order (deterministic).  Chunks with no visible key have lse_c = -inf and weigh
0; a row with none at all outputs 0 and lse = -inf (the forward kernel's convention).  One
invocation per output element; the one at column 0 also writes the row's lse.  Split-K pays off
when (batch, head, row block) work items are few and keys many: decoding over a KV cache (one
query row per head) and batch-1 encoders (Whisper, 1,500 positions).

``attention_grad_sum`` (below) is the backward's counterpart for short problems: one kernel
sums the fused dK/dV kernel's dQ partials and its dK/dV partials over query chunks and group
heads (instead of a reduce and a multi-reduce)."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import f16, f32
from .archetypes import register
from .common import (
    WG,
    Bindings,
    CodegenError,
    check_bindings,
    check_dtypes,
    flat_index,
    make_grid,
    make_target,
    module_header,
    module_source,
    u,
)
from .ir import KernelSpec, Strided

FLT_MAX = "3.4028234663852886e38"
# f32 partials read and the output written by vec4 units (one invocation per 4 elements)
VEC_COMBINE = True


@dataclass(frozen=True)
class AttentionCombineKernel:
    """``part`` (n·B, Hq, Sq, Dv) and ``part_lse`` (n·B, Hq, Sq), contiguous; outputs out
    (B, Hq, Sq, Dv) (or (B, Sq, Hq, Dv) with ``out_bshd``) and lse (B, Hq, Sq)."""

    part: Strided
    part_lse: Strided
    splits: int
    name: str = "attention_combine"
    out_bshd: bool = False


def emit(k: AttentionCombineKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    n = int(k.splits)
    nb, Hq, Sq, Dv = k.part.shape
    if n < 1 or nb % n or k.part_lse.shape != (nb, Hq, Sq):
        raise CodegenError(f"kernel {k.name!r}: partials {k.part.shape} / {k.part_lse.shape} do "
                           f"not split into {k.splits} chunks")
    for s in (k.part, k.part_lse):
        if s.strides != Strided.contiguous(s.dtype, s.shape).strides or s.offset:
            raise CodegenError(f"kernel {k.name!r}: partials must be contiguous")
    dt = k.part.dtype
    if dt not in (f32, f16):
        raise CodegenError(f"kernel {k.name!r}: attention of {dt.name} tensors")
    dts = [dt, k.part_lse.dtype, dt, dt]
    check_bindings(k.name, 4, t)
    uses_f16 = check_dtypes(k.name, dts, t)
    bd = Bindings(dts, alias)
    po, pl, out, lse = (bd.name(i) for i in range(4))
    B = nb // n
    rows = B * Hq * Sq
    # f32 rows of a multiple of 4: one invocation per 4 elements, partials and output as vec4s
    # (H200, Whisper (1, 6, 1500, 64), 3 chunks: see VEC_COMBINE)
    w = 4 if VEC_COMBINE and dt is f32 and Dv % 4 == 0 and len({po, pl, out, lse}) == 4 else 1
    units = Dv // w
    total = rows * units
    grid = make_grid(k.name, -(-total // WG), t)
    vt = f"vec4<{dt.wgsl}>" if w == 4 else "f32"
    ld = (lambda x: x) if dt is f32 else (lambda x: f"f32({x})")
    st = (lambda x: x) if dt is f32 else (lambda x: f"{dt.wgsl}({x})")
    ind, i2 = "    ", "        "
    L = flat_index(grid, total, ind)
    L += [f"{ind}let r = i / {u(units)};", f"{ind}let d = i % {u(units)};",
          f"{ind}var m: f32 = -mn_inf();"]
    L.append(f"{ind}for (var c: u32 = 0u; c < {u(n)}; c = c + 1u) {{")
    L.append(f"{i2}m = max(m, {ld(f'{pl}[c * {u(rows)} + r]')});")
    L.append(f"{ind}}}")
    L += [f"{ind}var s: f32 = 0.0;", f"{ind}var o = {vt}(0.0);",
          f"{ind}let ms = select(m, 0.0, m < -{FLT_MAX});"]
    L.append(f"{ind}for (var c: u32 = 0u; c < {u(n)}; c = c + 1u) {{")
    L.append(f"{i2}let w = exp({ld(f'{pl}[c * {u(rows)} + r]')} - ms);")
    L.append(f"{i2}s = s + w;")
    L.append(f"{i2}o = o + w * {ld(f'{po}[(c * {u(rows)} + r) * {u(units)} + d]')};")
    L.append(f"{ind}}}")
    L.append(f"{ind}let empty = m < -{FLT_MAX};")
    if k.out_bshd:  # r = (b·Hq + h)·Sq + i  ->  ((b·Sq + i)·Hq + h)
        L += [f"{ind}let hi = r % {u(Hq * Sq)};",
              f"{ind}let orow = (r / {u(Hq * Sq)} * {u(Sq)} + hi % {u(Sq)}) * {u(Hq)} + "
              f"hi / {u(Sq)};"]
    else:
        L.append(f"{ind}let orow = r;")
    L.append(f"{ind}{out}[orow * {u(units)} + d] = {st(f'select(o / s, {vt}(0.0), empty)')};")
    L.append(f"{ind}if (d == 0u) {{")
    L.append(f"{i2}{lse}[r] = {st('select(m + log(s), -mn_inf(), empty)')};")
    L.append(f"{ind}}}")
    decls = bd.decls(vec4={po: "f32", out: "f32"} if w == 4 else None)
    src = module_source(module_header(uses_f16) + decls, {"mn_inf"}, WG, L)
    meta = {"archetype": "attention_combine", "workgroup_size": WG, "binding_dtypes": tuple(dts),
            "flops": 0}
    return KernelSpec(k.name, src, bd.n, grid.workgroups, meta=meta)


def _make(attrs, ins, outs):
    return AttentionCombineKernel(ins[0], ins[1], int(attrs["splits"]))


register("attention_combine", AttentionCombineKernel, emit, make=_make, contiguous_inputs=True)


# ------------------------------------------------------------------ attention_grad_sum


@dataclass(frozen=True)
class AttentionGradSumKernel:
    """The sums after a dK/dV kernel with ``dq_block`` in one dispatch: its one flat output
    ``part`` holds dK's partials (splits·B, H, Skv, D), dV's (the same with Dv) — H = Hq per
    query head (``split_heads``) or Hkv — then dQ's partials per key block (nkb·B, Hq, Sq, D);
    outputs dq (B, Hq, Sq, D), dk (B, Hkv, Skv, D), dv (B, Hkv, Skv, Dv), contiguous.

    ``dims`` = (B, Hq, Hkv, Sq, Skv, D, Dv).  Each invocation sums one output element's
    partials in a fixed order (chunks outermost, then the heads of the group; key blocks in
    order), so the result is deterministic.  Used where a problem is small enough to be bound
    by its dispatches (SmolLM2: it replaces the dQ partial sum's reduce and the dK/dV head
    sums' multi-reduce)."""

    part: Strided
    dims: tuple
    splits: int
    split_heads: bool
    dq_block: int
    name: str = "attention_grad_sum"


def grad_sum_sizes(dims, splits: int, split_heads: bool, dq_block: int) -> tuple[int, int, int]:
    """Elements of dK's, dV's and dQ's partials in the flat input (in that order)."""
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    lead = max(1, splits) * B * (Hq if split_heads else Hkv) * Skv
    return lead * D, lead * Dv, -(-Skv // dq_block) * B * Hq * Sq * D


def _sum_terms(src: str, base: int, idx: str, count: int, stride: int, ld) -> list[str]:
    """``acc`` += ``src``[base + idx + c·stride] for c < count, in order (a loop)."""
    return [f"for (var c: u32 = 0u; c < {u(count)}; c = c + 1u) {{",
            f"    acc = acc + {ld(f'{src}[{u(base)} + {idx} + c * {u(stride)}]')};", "}"]


def emit_grad_sum(k: AttentionGradSumKernel, limits=None, features=None,
                  alias=None) -> KernelSpec:
    t = make_target(limits, features)
    B, Hq, Hkv, Sq, Skv, D, Dv = (int(x) for x in k.dims)
    n, blk = int(k.splits), int(k.dq_block)
    if n < 1 or blk < 1 or Hkv < 1 or Hq % Hkv:
        raise CodegenError(f"kernel {k.name!r}: bad partial layout (dims {k.dims}, splits "
                           f"{k.splits}, dq_block {k.dq_block})")
    n_dk, n_dv, n_dq = grad_sum_sizes(k.dims, n, k.split_heads, blk)
    if k.part.shape != (n_dk + n_dv + n_dq,) or k.part.offset or k.part.strides != (1,):
        raise CodegenError(f"kernel {k.name!r}: partials {k.part.shape} are not one contiguous "
                           f"vector of {n_dk + n_dv + n_dq}")
    dt = k.part.dtype
    if dt not in (f32, f16):
        raise CodegenError(f"kernel {k.name!r}: attention of {dt.name} tensors")
    dts = [dt] * 4
    check_bindings(k.name, 4, t)
    uses_f16 = check_dtypes(k.name, dts, t)
    bd = Bindings(dts, alias)
    src, dq, dk, dv = (bd.name(i) for i in range(4))
    oq, okv, okv_v = B * Hq * Sq * D, B * Hkv * Skv * D, B * Hkv * Skv * Dv
    total = oq + okv + okv_v
    grid = make_grid(k.name, -(-total // WG), t)
    ld = (lambda x: x) if dt is f32 else (lambda x: f"f32({x})")
    st = (lambda x: x) if dt is f32 else (lambda x: f"{dt.wgsl}({x})")
    G = Hq // Hkv if k.split_heads else 1
    nkb = -(-Skv // blk)
    ind = "    "
    L = flat_index(grid, total, ind) + [f"{ind}var acc: f32 = 0.0;"]
    L.append(f"{ind}if (i < {u(oq)}) {{")
    L += [ind * 2 + x for x in _sum_terms(src, n_dk + n_dv, "i", nkb, oq, ld)]
    L.append(f"{ind * 2}{dq}[i] = {st('acc')};")
    for j, (lo, base, width, out) in enumerate(((oq, 0, D, dk), (oq + okv, n_dk, Dv, dv))):
        L.append(f"{ind}}} else if (i < {u(lo + (okv if j == 0 else okv_v))}) {{"
                 if j == 0 else f"{ind}}} else {{")
        # e = ((b·Hkv + h)·Skv + s)·width + d -> partial ((c·B + b)·Hkv + h)·G + g, same (s, d)
        L += [f"{ind * 2}let e = i - {u(lo)};",
              f"{ind * 2}let bh = e / {u(Skv * width)};",
              f"{ind * 2}let sd = e % {u(Skv * width)};"]
        L.append(f"{ind * 2}for (var c: u32 = 0u; c < {u(n)}; c = c + 1u) {{")
        L.append(f"{ind * 3}let p0 = ((c * {u(B * Hkv)} + bh) * {u(G)}) * {u(Skv * width)} + sd;")
        L += [ind * 3 + x for x in _sum_terms(src, base, "p0", G, Skv * width, ld)]
        L.append(f"{ind * 2}}}")
        L.append(f"{ind * 2}{out}[e] = {st('acc')};")
    L.append(f"{ind}}}")
    src_text = module_source(module_header(uses_f16) + bd.decls(), set(), WG, L)
    meta = {"archetype": "attention_grad_sum", "workgroup_size": WG,
            "binding_dtypes": tuple(dts), "flops": 0}
    return KernelSpec(k.name, src_text, bd.n, grid.workgroups, meta=meta)


def _make_grad_sum(attrs, ins, outs):
    return AttentionGradSumKernel(ins[0], tuple(attrs["dims"]), int(attrs["splits"]),
                                  bool(attrs["split_heads"]), int(attrs["dq_block"]))


register("attention_grad_sum", AttentionGradSumKernel, emit_grad_sum, make=_make_grad_sum,
         contiguous_inputs=True)
