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
from .common import (
    CodegenError,
    binding_decls,
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
    pow2ceil,
    prod,
    u,
)
from .ir import KernelSpec, Strided

WG = 256
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
    """``update`` is None: out = x[..., s:s+size, ...] (dynamic_slice).  Else out = x with that
    slice replaced by ``update`` (dynamic_update_slice).  ``start``: an int scalar binding."""

    x: Strided
    start: Strided
    axis: int
    size: int
    update: Strided | None = None
    name: str = "dynamic_slice"
    # the output is x's own buffer (a KV cache updated in place): write only the update
    in_place: bool = False


def _ids_check(name, dt):
    if dt not in (i32, u32):
        raise CodegenError(f"kernel {name!r}: ids must be i32 or u32, got {dt.name}")


def _valid(dt: DType, var: str, n: int) -> str:
    if dt is u32:
        return f"{var} < {u(n)}"
    return f"{var} >= 0i && {var} < {n}i"


def _header(uses_f16, dtypes):
    return module_header(uses_f16) + binding_decls(dtypes) + [""]


def _main_sig(wg: int) -> list[str]:
    return [f"@compute @workgroup_size({wg})",
            "fn main(@builtin(workgroup_id) wid: vec3<u32>, "
            "@builtin(local_invocation_index) lid: u32) {"]


# ---------------------------------------------------------------------------------- embedding


def emit_embedding(k: EmbeddingKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    _ids_check(name, k.ids.dtype)
    V, D = k.table.shape
    N = prod(k.ids.shape)
    total = N * D
    dt = k.table.dtype
    check_bindings(name, 3, t)
    uses_f16 = check_dtypes(name, [dt], t)
    check_binding_size(name, "output", total, dt, t)
    grid = make_grid(name, -(-total // WG), t)
    ind = "    "
    L = _header(uses_f16, [k.ids.dtype, dt, dt]) + _main_sig(WG)
    L.append(f"{ind}let i = ({grid.wg_expr}) * {u(WG)} + lid;")
    L.append(f"{ind}if (i >= {u(total)}) {{ return; }}")
    L.append(f"{ind}let d = i % {u(D)};")
    L.append(f"{ind}let n = i / {u(D)};")
    L.append(f"{ind}let id = b0[n + {u(k.ids.offset)}];")
    L.append(f"{ind}var val = {dt.wgsl}(0);")
    L.append(f"{ind}if ({_valid(k.ids.dtype, 'id', V)}) {{")
    L.append(f"{ind}    val = b1[{u(k.table.offset)} + u32(id) * {u(D)} + d];")
    L.append(f"{ind}}}")
    L.append(f"{ind}b2[i] = val;")
    L.append("}")
    return KernelSpec(name, "\n".join(L) + "\n", 3, grid.workgroups,
                      meta={"archetype": "embedding", "workgroup_size": WG})


# ---------------------------------------------------------------------------------- embedding_grad


def grad_config(N: int, D: int) -> tuple[int, int, int]:
    """(invocations per workgroup, positions per chunk, columns per invocation)."""
    wg = max(64, min(256, pow2ceil(-(-D // 16))))
    ch = max(32, min(2048, pow2ceil(N)))
    nc = -(-D // wg)
    return wg, ch, nc


def emit_embedding_grad(k: EmbeddingGradKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    _ids_check(name, k.ids.dtype)
    N = prod(k.ids.shape)
    D = k.dout.shape[-1]
    V = int(k.num_rows)
    dt = k.dout.dtype
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
    nchunks = max(1, -(-N // ch))
    ind, i2, i3, i4 = "    ", "        ", "            ", "                "
    idt = k.ids.dtype.wgsl
    rowv = "i32(row)" if k.ids.dtype is i32 else "row"
    L = _header(uses_f16, [k.ids.dtype, dt, dt])
    L += [f"var<workgroup> bits: array<atomic<u32>, {nw}>;", ""]
    L += _main_sig(wg)
    L.append(f"{ind}let grp = {grid.wg_expr};")
    L.append(f"{ind}if (grp >= {u(ngroups)}) {{ return; }}")
    L.append(f"{ind}for (var row: u32 = grp * {u(rpw)}; row < min(grp * {u(rpw)} + {u(rpw)}, "
             f"{u(V)}); row = row + 1u) {{")
    L0 = L
    L = []
    L.append(f"{ind}let key: {idt} = {rowv};")
    for j in range(nc):
        L.append(f"{ind}var acc{j}: f32 = 0.0;")
    L.append(f"{ind}for (var c0: u32 = 0u; c0 < {u(nchunks * ch)}; c0 = c0 + {u(ch)}) {{")
    L.append(f"{i2}for (var w: u32 = lid; w < {u(nw)}; w = w + {u(wg)}) {{")
    L.append(f"{i3}atomicStore(&bits[w], 0u);")
    L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")
    # mark the matching positions of this chunk (OR is order-independent: deterministic)
    L.append(f"{i2}for (var e: u32 = lid; e < {u(ch)}; e = e + {u(wg)}) {{")
    L.append(f"{i3}let p = c0 + e;")
    L.append(f"{i3}if (p < {u(N)} && b0[p + {u(k.ids.offset)}] == key) {{")
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
        if (j + 1) * wg <= D:
            L.append(f"{i4}acc{j} = acc{j} + f32(b1[base + {col}]);")
        else:
            L.append(f"{i4}if ({col} < {u(D)}) {{ acc{j} = acc{j} + f32(b1[base + {col}]); }}")
    L.append(f"{i3}}}")
    L.append(f"{i2}}}")
    L.append(f"{i2}workgroupBarrier();")
    L.append(f"{ind}}}")
    for j in range(nc):
        col = f"lid + {u(j * wg)}" if j else "lid"
        st = f"b2[row * {u(D)} + {col}] = {dt.wgsl}(acc{j});"
        L.append(f"{ind}{st}" if (j + 1) * wg <= D else f"{ind}if ({col} < {u(D)}) {{ {st} }}")
    L = L0 + ["    " + x for x in L] + ["    }", "}"]
    return KernelSpec(name, "\n".join(L) + "\n", 3, grid.workgroups,
                      meta={"archetype": "embedding_grad", "workgroup_size": wg,
                            "workgroup_storage": 4 * nw})


# ---------------------------------------------------------------------------------- dynamic slices


def emit_dynamic_slice(k: DynamicSliceKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    x, ax = k.x, k.axis
    dt = x.dtype
    sdt = k.start.dtype
    _ids_check(name, sdt)
    upd = k.update
    n_ax = x.shape[ax]
    size = k.size if upd is None else upd.shape[ax]
    if upd is None:
        shape = tuple(size if d == ax else n for d, n in enumerate(x.shape))
    elif k.in_place:
        shape = tuple(upd.shape)  # threads over the update only; the rest stays as it is
    else:
        shape = tuple(x.shape)
    total = prod(shape)
    dts = [dt, sdt, dt] if upd is None else [dt, dt, sdt, dt]
    nb = len(dts)
    check_bindings(name, nb, t)
    uses_f16 = check_dtypes(name, [dt], t)
    check_binding_size(name, "output", total, dt, t)
    grid = make_grid(name, -(-max(total, 1) // WG), t)
    ind = "    "
    sb = "b1" if upd is None else "b2"
    L = _header(uses_f16, dts) + _main_sig(WG)
    L.append(f"{ind}let i = ({grid.wg_expr}) * {u(WG)} + lid;")
    L.append(f"{ind}if (i >= {u(total)}) {{ return; }}")
    sv = f"{sb}[{u(k.start.offset)}]"
    hi = n_ax - size
    if sdt is i32:
        L.append(f"{ind}let st = u32(clamp({sv}, 0i, {hi}i));")
    else:
        L.append(f"{ind}let st = min({sv}, {u(hi)});")
    coords = coords_code("i", shape, "c", L, ind)
    if len(shape) == 1:
        coords = ["i"]
    if upd is None:
        xc = [f"(c{ax} + st)" if d == ax else c for d, c in enumerate(coords)]
        if len(shape) == 1:
            xc = ["(i + st)"]
        L.append(f"{ind}b2[i] = b0[{index_code(xc, x.strides, x.offset)}];")
    elif k.in_place:
        out_strides = Strided.contiguous(dt, x.shape).strides
        xc = [f"({c} + st)" if d == ax else c for d, c in enumerate(coords)]
        if len(shape) == 1:
            xc = ["(i + st)"]
        L.append(f"{ind}b3[{index_code(xc, out_strides, 0)}] = "
                 f"b1[{index_code(coords, upd.strides, upd.offset)}];")
    else:
        ca = coords[ax]
        uc = [f"({ca} - st)" if d == ax else c for d, c in enumerate(coords)]
        L.append(f"{ind}if ({ca} >= st && {ca} < st + {u(size)}) {{")
        L.append(f"{ind}    b3[i] = b1[{index_code(uc, upd.strides, upd.offset)}];")
        L.append(f"{ind}}} else {{")
        L.append(f"{ind}    b3[i] = b0[{index_code(coords, x.strides, x.offset)}];")
        L.append(f"{ind}}}")
    L.append("}")
    return KernelSpec(name, "\n".join(L) + "\n", nb, grid.workgroups,
                      meta={"archetype": name, "workgroup_size": WG})


# ---------------------------------------------------------------------------------- registration


def _in_place_variant(d: DynamicSliceKernel) -> DynamicSliceKernel | None:
    """dynamic_update_slice writing only the update into x's own (contiguous) buffer."""
    if d.update is None or d.x.offset or \
            d.x.strides != Strided.contiguous(d.x.dtype, d.x.shape).strides:
        return None
    return replace(d, in_place=True)


def _register() -> None:
    from .archetypes import register_archetype

    register_archetype("embedding", EmbeddingKernel,
                       lambda a, ins, outs: EmbeddingKernel(ins[0], ins[1]), emit_embedding,
                       contiguous_inputs=True)
    register_archetype("embedding_grad", EmbeddingGradKernel,
                       lambda a, ins, outs: EmbeddingGradKernel(ins[0], ins[1], a["num_rows"]),
                       emit_embedding_grad, contiguous_inputs=True)

    def make_ds(a, ins, outs):
        return DynamicSliceKernel(ins[0], ins[1], a["axis"], a["size"])

    def make_dus(a, ins, outs):
        return DynamicSliceKernel(ins[0], ins[2], a["axis"], ins[1].shape[a["axis"]], ins[1],
                                  name="dynamic_update_slice")

    register_archetype("dynamic_slice", DynamicSliceKernel, make_ds, emit_dynamic_slice)
    # one description type serves both ops (the emitter branches on ``update``)
    register_archetype("dynamic_update_slice", DynamicSliceKernel, make_dus, emit_dynamic_slice,
                       in_place=_in_place_variant)


_register()
