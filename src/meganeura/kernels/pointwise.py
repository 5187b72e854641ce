"""Fused elementwise kernels: one invocation per element, or per four elements (``vec4``).

Inputs are read through their Strided maps (broadcast = stride 0, transposes, slices with
offsets and negative steps); all shapes and strides are baked in as constants and neighbouring
dims that every operand walks contiguously are merged first, so a contiguous same-shape kernel
indexes every operand with the thread id alone.  Grids past 65,535 workgroups wrap into 2-D/3-D.

The vec4 variant exists because one scalar load per invocation left the big optimizer updates
at 40–45 % of the H200's HBM bound (docs/roofline-h200-2026-12-01c.md): each invocation then
moves 16 bytes per operand (SGD update over 134 M elements in place: 487 → 371 µs, 91 % of
4.8 TB/s counting the read and the write of the updated range; docs/benchmarks.md).
It is legal when the innermost merged extent is a multiple of 4 and every input either walks
like the output (``vec``), walks the innermost dim contiguously from a 4-aligned start with
4-aligned outer strides (``row``: a bias over rows), or is broadcast along it (``splat``: one
scalar for the four lanes).  The instructions run per lane on scalars (the same per-element
code as the scalar variant, so results are bit-identical where the driver contracts the same
way: on the H200 and lavapipe they were); only loads and stores are vectors.  Storage arrays
of ``vec4`` need 16-byte aligned element offsets: bindings start at the device's storage
offset alignment (≥ 16 bytes), so an element offset that is a multiple of 4 is enough.
"""

from __future__ import annotations

from ..dtypes import DType, bool_
from .archetypes import kernel_family
from .common import (
    WG,
    Bindings,
    CodegenError,
    Grid,
    bcast_strides,
    check_binding_size,
    check_bindings,
    check_dtypes,
    check_extent,
    check_invocations,
    coords_code,
    emit_instrs,
    flat_index,
    index_code,
    load,
    make_grid,
    make_target,
    merge_dims,
    module_header,
    module_source,
    prod,
    store_type,
    store_value,
    u,
)
from .ir import KernelSpec, PointwiseKernel, contiguous_strides

LANES = 4  # elements per invocation of the vector variant
SCALAR, VEC4 = (1,), (LANES,)  # the configurations (``PointwiseKernel.config``)


def _check(k: PointwiseKernel, shape, t) -> tuple[list[DType], list[int], dict]:
    """Output dtypes, the inputs the instrs read and their strides over ``shape``."""
    name, total = k.name, prod(shape)
    if not k.outputs:
        raise CodegenError(f"kernel {name!r} has no outputs")
    for o in k.outputs:
        if not 0 <= o < len(k.instrs):
            raise CodegenError(f"kernel {name!r}: output refers to instr {o} of {len(k.instrs)}")
    out_dtypes: list[DType] = [k.instrs[o].dtype for o in k.outputs]
    used = sorted({i for ins in k.instrs for kind, i in ins.args if kind == "in"})
    for i in used:
        if i >= len(k.inputs):
            raise CodegenError(f"kernel {name!r} reads input {i} of {len(k.inputs)}")
    strides = {i: bcast_strides(k.inputs[i], shape, f"{name} input {i}") for i in used}
    for i in used:
        check_extent(name, f"input {i}", k.inputs[i], shape, strides[i], t)
    views = _out_views(k, shape, out_dtypes)
    for j, dt in enumerate(out_dtypes):
        if views[j] is None:
            check_binding_size(name, f"output {j}", total, dt, t)
        else:
            check_extent(name, f"output {j}", views[j], shape, views[j].strides, t)
    return out_dtypes, used, strides


def _out_views(k: PointwiseKernel, shape, out_dtypes) -> list:
    """``k.out_views`` checked (``_check``): one entry per output, each None or a Strided of
    the output's dtype over the iteration shape."""
    views = _views(k)
    if len(views) != len(k.outputs):
        raise CodegenError(f"kernel {k.name!r}: {len(views)} output views for "
                           f"{len(k.outputs)} outputs")
    for j, v in enumerate(views):
        if v is not None and (tuple(v.shape) != tuple(shape) or v.dtype != out_dtypes[j]):
            raise CodegenError(f"kernel {k.name!r}: output {j}'s view {v} is not a "
                               f"{out_dtypes[j].name} view over the iteration shape {shape}")
    return views


def _views(k: PointwiseKernel) -> list:
    """Each output's view (None: contiguous), as ``_check`` validated them."""
    return list(k.out_views) if k.out_views else [None] * len(k.outputs)


def _merged(shape, used, strides, views=()) -> tuple[tuple[int, ...], tuple[int, ...], dict,
                                                      list]:
    """The merged iteration shape, the output's strides over it, each used input's and each
    output view's (None for contiguous outputs)."""
    placed = [j for j, v in enumerate(views) if v is not None]
    mshape, mstrides = merge_dims(shape, [contiguous_strides(shape)]
                                  + [strides[i] for i in used]
                                  + [views[j].strides for j in placed])
    n = 1 + len(used)
    out = [None] * len(views)
    for q, j in enumerate(placed):
        out[j] = mstrides[n + q]
    return mshape, mstrides[0], dict(zip(used, mstrides[1:n], strict=False)), out


def vector_modes(k: PointwiseKernel, shape, used, strides, alias=None) -> dict[int, str] | None:
    """How each used input is read by the vec4 variant (``vec``, ``row`` or ``splat``, see the
    module docstring), or None when the variant is not legal: the innermost merged extent is
    not a multiple of 4, an input walks the vector axis with another stride or from an
    unaligned start, or one buffer range is bound both as vectors and as a splat scalar."""
    views = _views(k)
    mshape, out_st, in_st, out_views = _merged(shape, used, strides, views)
    if not mshape or mshape[-1] % LANES:
        return None
    for v, st in zip(views, out_views, strict=True):  # stored as aligned vectors
        if v is not None and (st[-1] != 1 or v.offset % LANES
                              or any(x % LANES for x in st[:-1])):
            return None
    modes: dict[int, str] = {}
    for i in used:
        st, off = in_st[i], k.inputs[i].offset
        if st[-1] == 0:
            modes[i] = "splat"
        elif off % LANES:
            return None
        elif st == out_st:
            modes[i] = "vec"
        elif st[-1] == 1 and all(s % LANES == 0 for s in st[:-1]):
            modes[i] = "row"
        else:
            return None
    n_in = len(k.inputs)
    slots = list(range(n_in + len(k.outputs)))
    alias = tuple(slots) if alias is None else tuple(alias)
    vec = {alias[i] for i in slots if i >= n_in or modes.get(i) in ("vec", "row")}
    if any(alias[i] in vec for i, m in modes.items() if m == "splat"):
        return None
    return modes


def choose_config(modes: dict[int, str] | None, total: int) -> tuple:
    """The heuristic configuration: vec4 wherever legal.  On the H200 it was never slower
    (a 73,728-element multiply 2.4 vs 2.5 µs) and up to 1.31× faster (SGD update over 134 M
    elements); more vec4s per invocation were not faster (docs/rejected-optimizations.md)."""
    return SCALAR if modes is None or total < LANES else VEC4


def _config(k: PointwiseKernel, modes, total: int) -> tuple:
    """``k.config`` checked (an explicit vec4 request that the layout forbids is an error),
    or the heuristic's choice."""
    if not k.config:
        return choose_config(modes, total)
    if tuple(k.config) == SCALAR:
        return SCALAR
    if tuple(k.config) != VEC4:
        raise CodegenError(f"pointwise kernel {k.name!r}: config {k.config!r} is neither "
                           f"{SCALAR} (scalar) nor {VEC4} (vec4)")
    if modes is None:
        raise CodegenError(f"pointwise kernel {k.name!r}: config {k.config!r} asks for vec4 "
                           "but an operand's layout (innermost extent, offset or stride) or "
                           "a binding shared as vector and scalar does not allow it")
    return VEC4


def _scalar_loads(k: PointwiseKernel, shape, used, strides, bd: Bindings, body,
                  ind) -> tuple[dict[int, str], list[str]]:
    """Load every input read at element ``i``; an input that walks like the (contiguous)
    output is indexed by the thread id itself, the others through coordinates.  Returns the
    inputs' names and each output's element index."""
    views = _views(k)
    mshape, out_st, in_strides, out_views = _merged(shape, used, strides, views)
    clines: list[str] = []
    coords = coords_code("i", mshape, "c", clines, ind)
    need_coords = False
    names: dict[int, str] = {}

    def at(st, off: int) -> str:
        nonlocal need_coords
        if st == out_st:
            return "i" if off == 0 else f"i + {u(off)}"
        if not need_coords:
            need_coords = True
            body.extend(clines)
        return index_code(coords, st, off)

    for i in used:
        s = k.inputs[i]
        body.append(f"{ind}let x{i} = {load(bd.name(i), at(in_strides[i], s.offset), s.dtype)};")
        names[i] = f"x{i}"
    return names, ["i" if v is None else at(st, v.offset)
                   for v, st in zip(views, out_views, strict=True)]


def _vector_loads(k: PointwiseKernel, shape, used, strides, modes, bd: Bindings, body,
                  ind) -> tuple[list[dict[int, str]], list[str]]:
    """Load every input read by the four elements of vector ``v``; returns each lane's
    operand expressions and each output's vector index.  Coordinates are taken over the
    shape whose innermost extent counts vectors, so a ``row`` input's (or a strided output's)
    vector index is its element index / 4 term by term."""
    views = _views(k)
    mshape, _, in_st, out_st = _merged(shape, used, strides, views)
    vshape = mshape[:-1] + (mshape[-1] // LANES,)
    clines: list[str] = []
    coords = coords_code("v", vshape, "c", clines, ind)
    if any(m != "vec" for m in modes.values()) or any(v is not None for v in views):
        body += clines
    lanes: list[dict[int, str]] = [{} for _ in range(LANES)]
    for i in used:
        s, st, mode = k.inputs[i], in_st[i], modes[i]
        if mode == "splat":  # one element for the four lanes
            idx = index_code(coords[:-1], st[:-1], s.offset)
            body.append(f"{ind}let x{i} = {load(bd.name(i), idx, s.dtype)};")
            for lane in lanes:
                lane[i] = f"x{i}"
            continue
        if mode == "vec":
            idx = "v" if s.offset == 0 else f"v + {u(s.offset // LANES)}"
        else:
            idx = index_code(coords, [x // LANES for x in st[:-1]] + [1], s.offset // LANES)
        body.append(f"{ind}let x{i} = {bd.name(i)}[{idx}];")
        for c, lane in enumerate(lanes):
            comp = f"x{i}.{'xyzw'[c]}"
            lane[i] = f"({comp} != 0u)" if s.dtype is bool_ else comp
    return lanes, ["v" if v is None else index_code(coords, [x // LANES for x in st[:-1]] + [1],
                                                   v.offset // LANES)
                   for v, st in zip(views, out_st, strict=True)]


def _vector_decls(bd: Bindings, n_in: int, modes: dict[int, str]) -> list[str]:
    """Storage declarations: ``array<vec4<T>>`` for ranges read or written as vectors (outputs,
    ``vec`` and ``row`` inputs), ``array<T>`` for splat-only and unread inputs."""
    vec = {bd.alias[i] for i in range(len(bd.dtypes))
           if i >= n_in or modes.get(i) in ("vec", "row")}
    out = []
    for j, i in enumerate(bd.kept):
        t = store_type(bd.dtypes[i])
        out.append(f"@group(0) @binding({j}) var<storage, read_write> b{i}: "
                   f"array<{f'vec4<{t}>' if i in vec else t}>;")
    return out


def _vector_body(k: PointwiseKernel, shape, used, strides, modes, bd: Bindings,
                 out_dtypes, grid: Grid, helpers: set[str]) -> list[str]:
    """``main``'s body of the vec4 variant: vector ``v`` per invocation, the lanes computed
    one after the other on scalars, then one vector store per output."""
    ind = "    "
    body = [f"{ind}let v = ({grid.wg_expr}) * {u(WG)} + lid;",
            f"{ind}if (v >= {u(prod(shape) // LANES)}) {{", f"{ind}    return;", f"{ind}}}"]
    lanes, where = _vector_loads(k, shape, used, strides, modes, bd, body, ind)
    results = []
    for c, names in enumerate(lanes):
        def arg(a, names=names):
            kind, i = a
            if kind != "in":
                raise CodegenError(f"pointwise kernel {k.name!r}: unknown operand {a!r}")
            return names[i], k.inputs[i].dtype
        results.append(emit_instrs(k.instrs, arg, f"t{c}_", body, ind, helpers))
    n_in = len(k.inputs)
    for j, o in enumerate(k.outputs):
        dt = out_dtypes[j]
        vals = ", ".join(store_value(*res[o], dt) for res in results)
        body.append(f"{ind}{bd.name(n_in + j)}[{where[j]}] = vec4<{store_type(dt)}>({vals});")
    return body


@kernel_family("pointwise", PointwiseKernel)
def emit(k: PointwiseKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    shape = tuple(int(n) for n in k.shape)
    total = prod(shape)
    out_dtypes, used, strides = _check(k, shape, t)
    in_dtypes = [s.dtype for s in k.inputs]
    bd = Bindings(in_dtypes + out_dtypes, alias)
    check_bindings(name, bd.n, t)
    check_invocations(name, WG, t)
    uses_f16 = check_dtypes(name, in_dtypes + out_dtypes + [i.dtype for i in k.instrs], t)
    modes = vector_modes(k, shape, used, strides, bd.alias)
    config = _config(k, modes, total)
    meta = {"archetype": "pointwise", "workgroup_size": WG, "workgroup_storage": 0,
            "binding_dtypes": tuple(bd.dtypes), "elements": total}
    helpers: set[str] = set()
    if config == SCALAR:
        grid = make_grid(name, -(-total // WG), t)
        body = _scalar_body(k, shape, used, strides, bd, out_dtypes, grid, helpers)
        decls = bd.decls()
    else:
        grid = make_grid(name, -(-total // (LANES * WG)), t)
        body = _vector_body(k, shape, used, strides, modes, bd, out_dtypes, grid, helpers)
        decls = _vector_decls(bd, len(k.inputs), modes)
        meta.update(variant=f"pointwise_x{LANES}", label_tag=f"x{LANES}", config=config)
    return KernelSpec(
        name=name,
        wgsl=module_source(module_header(uses_f16) + decls, helpers, WG, body),
        n_bindings=bd.n,
        workgroups=grid.workgroups,
        meta=meta,
    )


def _scalar_body(k: PointwiseKernel, shape, used, strides, bd: Bindings, out_dtypes,
                 grid: Grid, helpers: set[str]) -> list[str]:
    """``main``'s body of the one-element-per-invocation variant."""
    ind = "    "
    body = flat_index(grid, prod(shape), ind)
    names, where = _scalar_loads(k, shape, used, strides, bd, body, ind)

    def arg(a):
        kind, i = a
        if kind != "in":
            raise CodegenError(f"pointwise kernel {k.name!r}: unknown operand {a!r}")
        return names[i], k.inputs[i].dtype

    res = emit_instrs(k.instrs, arg, "t", body, ind, helpers)
    for j, o in enumerate(k.outputs):
        v, dt = res[o]
        body.append(f"{ind}{bd.name(len(k.inputs) + j)}[{where[j]}] = "
                    f"{store_value(v, dt, out_dtypes[j])};")
    return body
