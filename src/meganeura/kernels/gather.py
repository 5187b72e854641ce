"""Index kernels: ``embedding`` (gather rows), ``embedding_grad`` (deterministic scatter-add of
rows, no atomics), ``dynamic_slice`` and ``dynamic_update_slice`` (runtime start position).

embedding_grad: one workgroup per table row r.  The ids are scanned in chunks of up to 2048
positions: the invocations mark the positions whose id equals r in a bitmask in workgroup memory
(integer ``atomicOr``: the resulting bits do not depend on the order, so this is deterministic);
then every invocation walks the set bits in position order and adds those rows of ``dout`` for
its own columns.  Every output element is therefore a sum in position order (identical from run
to run and to the reference's ``np.add.at``), and a row with no occurrence stores exact zeros.
No float atomics; three barriers per chunk.  Cost per row: one coalesced pass over the ids plus
the matching rows; for V = 49152, N = 128, D = 576 that is 6.3 M id reads (L2-resident) and the
28 M-element output write.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dtypes import DType, i32, u32
from .archetypes import register
from .common import (
    WG,
    Bindings,
    CodegenError,
    check_binding_size,
    check_bindings,
    check_dtypes,
    check_invocations,
    check_workgroup_storage,
    coords_code,
    index_code,
    make_grid,
    make_target,
    module_header,
    module_source,
    pow2ceil,
    prod,
    u,
)
from .ir import KernelSpec, Strided

MAX_GRAD_WORKGROUPS = 4096  # embedding_grad: beyond this, a workgroup handles several rows


@dataclass(frozen=True)
class EmbeddingKernel:
    ids: Strided  # contiguous (N,) ids
    table: Strided  # contiguous (V, D)
    name: str = "embedding"


@dataclass(frozen=True)
class EmbeddingGradKernel:
    ids: Strided  # contiguous, N ids
    dout: Strided  # contiguous (N, D)
    num_rows: int
    name: str = "embedding_grad"


@dataclass(frozen=True)
class DynamicSliceKernel:
    """out = x[..., s:s+size, ...] with ``s`` read at run time from the int scalar binding
    ``start`` (clamped so the slice stays inside x)."""

    x: Strided
    start: Strided
    axis: int
    size: int
    update: Strided | None = None  # set by DynamicUpdateSliceKernel
    name: str = "dynamic_slice"
    in_place: bool = False


@dataclass(frozen=True)
class DynamicUpdateSliceKernel(DynamicSliceKernel):
    """out = x with the slice at the run-time ``start`` replaced by ``update``.  Its own type
    (the emitter is shared) so that the registry maps it to its own family; ``in_place``: the
    output is x's own buffer (a KV cache updated in place), only the update is written."""

    name: str = "dynamic_update_slice"


def _ids_check(name, dt):
    if dt not in (i32, u32):
        raise CodegenError(f"kernel {name!r}: ids must be i32 or u32, got {dt.name}")


def _valid(dt: DType, var: str, n: int) -> str:
    if dt is u32:
        return f"{var} < {u(n)}"
    return f"{var} >= 0i && {var} < {n}i"


def _spec(name, bd: Bindings, uses_f16, body, wg, grid, meta, shared=()) -> KernelSpec:
    lines = module_header(uses_f16) + bd.decls() + (["", *shared] if shared else [])
    return KernelSpec(name, module_source(lines, (), wg, body), bd.n, grid.workgroups,
                      meta=dict(meta, workgroup_size=wg))


# ---------------------------------------------------------------------------------- embedding


def emit_embedding(k: EmbeddingKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    _ids_check(name, k.ids.dtype)
    V, D = k.table.shape
    N = prod(k.ids.shape)
    total = N * D
    dt = k.table.dtype
    bd = Bindings([k.ids.dtype, dt, dt], alias)
    check_bindings(name, 3, t)
    uses_f16 = check_dtypes(name, [dt], t)
    check_binding_size(name, "output", total, dt, t)
    grid = make_grid(name, -(-total // WG), t)
    ind = "    "
    L = [f"{ind}let i = ({grid.wg_expr}) * {u(WG)} + lid;",
         f"{ind}if (i >= {u(total)}) {{ return; }}"]
    L.append(f"{ind}let d = i % {u(D)};")
    L.append(f"{ind}let n = i / {u(D)};")
    L.append(f"{ind}let id = {bd.name(0)}[n + {u(k.ids.offset)}];")
    L.append(f"{ind}var val = {dt.wgsl}(0);")
    L.append(f"{ind}if ({_valid(k.ids.dtype, 'id', V)}) {{")
    L.append(f"{ind}    val = {bd.name(1)}[{u(k.table.offset)} + u32(id) * {u(D)} + d];")
    L.append(f"{ind}}}")
    L.append(f"{ind}{bd.name(2)}[i] = val;")
    return _spec(name, bd, uses_f16, L, WG, grid, {"archetype": "embedding"})


# ---------------------------------------------------------------------------------- embedding_grad


def grad_config(N: int, D: int) -> tuple[int, int, int]:
    """(invocations per workgroup, positions per chunk, columns per invocation)."""
    wg = max(64, min(256, pow2ceil(-(-D // 16))))
    ch = max(32, min(2048, pow2ceil(N)))
    nc = -(-D // wg)
    return wg, ch, nc


def _grad_chunk(k: EmbeddingGradKernel, bd: Bindings, N, D, wg, ch, nc) -> list[str]:
    """The chunk loop of one row: mark the matching positions, then add their rows."""
    ind, i2, i3, i4 = "    ", "        ", "            ", "                "
    nw = ch // 32
    nchunks = max(1, -(-N // ch))
    L = [f"{ind}for (var c0: u32 = 0u; c0 < {u(nchunks * ch)}; c0 = c0 + {u(ch)}) {{"]
    L.append(f"{i2}for (var w: u32 = lid; w < {u(nw)}; w = w + {u(wg)}) {{")
    L.append(f"{i3}atomicStore(&bits[w], 0u);")
    L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")
    # mark the matching positions of this chunk (OR is order-independent: deterministic)
    L.append(f"{i2}for (var e: u32 = lid; e < {u(ch)}; e = e + {u(wg)}) {{")
    L.append(f"{i3}let p = c0 + e;")
    L.append(f"{i3}if (p < {u(N)} && {bd.name(0)}[p + {u(k.ids.offset)}] == key) {{")
    L.append(f"{i4}atomicOr(&bits[e / 32u], 1u << (e % 32u));")
    L.append(f"{i3}}}")
    L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")
    # every invocation walks the set bits in position order for its own columns
    L.append(f"{i2}for (var w: u32 = 0u; w < {u(nw)}; w = w + 1u) {{")
    L.append(f"{i3}var word = atomicLoad(&bits[w]);")
    L.append(f"{i3}loop {{")
    L.append(f"{i4}if (word == 0u) {{ break; }}")
    L.append(f"{i4}let p = c0 + w * 32u + firstTrailingBit(word);")
    L.append(f"{i4}word = word & (word - 1u);")
    L.append(f"{i4}let base = {u(k.dout.offset)} + p * {u(D)};")
    for j in range(nc):
        col = f"lid + {u(j * wg)}" if j else "lid"
        add = f"acc{j} = acc{j} + f32({bd.name(1)}[base + {col}]);"
        L.append(f"{i4}{add}" if (j + 1) * wg <= D else f"{i4}if ({col} < {u(D)}) {{ {add} }}")
    L.append(f"{i3}}}")
    L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")
    return L


def emit_embedding_grad(k: EmbeddingGradKernel, limits=None, features=None,
                        alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    _ids_check(name, k.ids.dtype)
    N = prod(k.ids.shape)
    D = k.dout.shape[-1]
    V = int(k.num_rows)
    dt = k.dout.dtype
    bd = Bindings([k.ids.dtype, dt, dt], alias)
    check_bindings(name, 3, t)
    uses_f16 = check_dtypes(name, [dt], t)
    check_binding_size(name, "output", V * D, dt, t)
    wg, ch, nc = grad_config(N, D)
    nw = ch // 32
    check_invocations(name, wg, t)
    check_workgroup_storage(name, 4 * nw, t)
    rpw = max(1, -(-V // MAX_GRAD_WORKGROUPS))  # rows per workgroup
    ngroups = -(-V // rpw)
    grid = make_grid(name, ngroups, t)
    ind = "    "
    rowv = "i32(row)" if k.ids.dtype is i32 else "row"
    L = [f"{ind}let key: {k.ids.dtype.wgsl} = {rowv};"]
    L += [f"{ind}var acc{j}: f32 = 0.0;" for j in range(nc)]
    L += _grad_chunk(k, bd, N, D, wg, ch, nc)
    for j in range(nc):
        col = f"lid + {u(j * wg)}" if j else "lid"
        st = f"{bd.name(2)}[row * {u(D)} + {col}] = {dt.wgsl}(acc{j});"
        L.append(f"{ind}{st}" if (j + 1) * wg <= D else f"{ind}if ({col} < {u(D)}) {{ {st} }}")
    body = [f"{ind}let grp = {grid.wg_expr};", f"{ind}if (grp >= {u(ngroups)}) {{ return; }}",
            f"{ind}for (var row: u32 = grp * {u(rpw)}; row < min(grp * {u(rpw)} + {u(rpw)}, "
            f"{u(V)}); row = row + 1u) {{"]
    body += [ind + x for x in L] + [f"{ind}}}"]
    return _spec(name, bd, uses_f16, body, wg, grid,
                 {"archetype": "embedding_grad", "workgroup_storage": 4 * nw},
                 [f"var<workgroup> bits: array<atomic<u32>, {nw}>;"])


# ---------------------------------------------------------------------------------- dynamic slices


def _slice_copy(k: DynamicSliceKernel, bd: Bindings, coords, L, ind) -> None:
    """The copy of element ``i`` (``coords`` over ``shape``) given the clamped start ``st``."""
    x, ax, upd = k.x, k.axis, k.update
    xb, ub, ob = bd.name(0), bd.name(1), bd.name(len(bd.dtypes) - 1)
    shifted = [f"({c} + st)" if d == ax else c for d, c in enumerate(coords)]
    if upd is None:
        L.append(f"{ind}{ob}[i] = {xb}[{index_code(shifted, x.strides, x.offset)}];")
    elif k.in_place:
        out_strides = Strided.contiguous(x.dtype, x.shape).strides
        L.append(f"{ind}{ob}[{index_code(shifted, out_strides, 0)}] = "
                 f"{ub}[{index_code(coords, upd.strides, upd.offset)}];")
    else:
        ca = coords[ax]
        uc = [f"({ca} - st)" if d == ax else c for d, c in enumerate(coords)]
        L.append(f"{ind}if ({ca} >= st && {ca} < st + {u(upd.shape[ax])}) {{")
        L.append(f"{ind}    {ob}[i] = {ub}[{index_code(uc, upd.strides, upd.offset)}];")
        L.append(f"{ind}}} else {{")
        L.append(f"{ind}    {ob}[i] = {xb}[{index_code(coords, x.strides, x.offset)}];")
        L.append(f"{ind}}}")


def emit_dynamic_slice(k: DynamicSliceKernel, limits=None, features=None,
                       alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    x, ax = k.x, k.axis
    dt = x.dtype
    sdt = k.start.dtype
    _ids_check(name, sdt)
    upd = k.update
    size = k.size if upd is None else upd.shape[ax]
    if upd is None:
        shape = tuple(size if d == ax else n for d, n in enumerate(x.shape))
    elif k.in_place:
        shape = tuple(upd.shape)  # threads over the update only; the rest stays as it is
    else:
        shape = tuple(x.shape)
    total = prod(shape)
    bd = Bindings([dt, sdt, dt] if upd is None else [dt, dt, sdt, dt], alias)
    check_bindings(name, bd.n, t)
    uses_f16 = check_dtypes(name, [dt], t)
    check_binding_size(name, "output", total, dt, t)
    grid = make_grid(name, -(-max(total, 1) // WG), t)
    ind = "    "
    L = [f"{ind}let i = ({grid.wg_expr}) * {u(WG)} + lid;",
         f"{ind}if (i >= {u(total)}) {{ return; }}"]
    sv = f"{bd.name(1 if upd is None else 2)}[{u(k.start.offset)}]"
    hi = x.shape[ax] - size
    if sdt is i32:
        L.append(f"{ind}let st = u32(clamp({sv}, 0i, {hi}i));")
    else:
        L.append(f"{ind}let st = min({sv}, {u(hi)});")
    coords = coords_code("i", shape, "c", L, ind)
    _slice_copy(k, bd, coords, L, ind)
    return _spec(name, bd, uses_f16, L, WG, grid, {"archetype": name})


# ---------------------------------------------------------------------------------- registration


def _in_place_variant(d: DynamicUpdateSliceKernel) -> DynamicUpdateSliceKernel | None:
    """dynamic_update_slice writing only the update into x's own (contiguous) buffer."""
    if d.x.offset or d.x.strides != Strided.contiguous(d.x.dtype, d.x.shape).strides:
        return None
    return replace(d, in_place=True)


register("embedding", EmbeddingKernel, emit_embedding, contiguous_inputs=True,
         make=lambda a, ins, outs: EmbeddingKernel(ins[0], ins[1]))
register("embedding_grad", EmbeddingGradKernel, emit_embedding_grad, contiguous_inputs=True,
         make=lambda a, ins, outs: EmbeddingGradKernel(ins[0], ins[1], a["num_rows"]))
register("dynamic_slice", DynamicSliceKernel, emit_dynamic_slice,
         make=lambda a, ins, outs: DynamicSliceKernel(ins[0], ins[1], a["axis"], a["size"]))
register("dynamic_update_slice", DynamicUpdateSliceKernel, emit_dynamic_slice,
         make=lambda a, ins, outs: DynamicUpdateSliceKernel(
             ins[0], ins[2], a["axis"], ins[1].shape[a["axis"]], ins[1]),
         in_place=_in_place_variant)
