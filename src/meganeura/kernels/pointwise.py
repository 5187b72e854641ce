"""Fused elementwise kernels: one invocation per element of the iteration shape.

Inputs are read through their Strided maps (broadcast = stride 0, transposes, slices with
offsets and negative steps); all shapes and strides are baked in as constants and neighbouring
dims that every operand walks contiguously are merged first, so a contiguous same-shape kernel
indexes every operand with the thread id alone.  Grids past 65,535 workgroups wrap into 2-D/3-D.
"""

from __future__ import annotations

from ..dtypes import DType
from .archetypes import kernel_family
from .common import (
    WG,
    Bindings,
    CodegenError,
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
    store_value,
    u,
)
from .ir import KernelSpec, PointwiseKernel, contiguous_strides


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
    for j, dt in enumerate(out_dtypes):
        check_binding_size(name, f"output {j}", total, dt, t)
    return out_dtypes, used, strides


def _loads(k: PointwiseKernel, shape, used, strides, bd: Bindings, body, ind) -> dict[int, str]:
    """Load every input read at element ``i``; an input that walks like the (contiguous)
    output is indexed by the thread id itself, the others through coordinates."""
    mshape, mstrides = merge_dims(shape, [contiguous_strides(shape)]
                                  + [strides[i] for i in used])
    in_strides = dict(zip(used, mstrides[1:], strict=False))
    clines: list[str] = []
    coords = coords_code("i", mshape, "c", clines, ind)
    need_coords = False
    names: dict[int, str] = {}
    for i in used:
        s = k.inputs[i]
        if in_strides[i] == mstrides[0]:
            idx = "i" if s.offset == 0 else f"i + {u(s.offset)}"
        else:
            idx = index_code(coords, in_strides[i], s.offset)
            if not need_coords:
                need_coords = True
                body += clines
        body.append(f"{ind}let x{i} = {load(bd.name(i), idx, s.dtype)};")
        names[i] = f"x{i}"
    return names


@kernel_family("pointwise", PointwiseKernel)
def emit(k: PointwiseKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    shape = tuple(int(n) for n in k.shape)
    total = prod(shape)
    out_dtypes, used, strides = _check(k, shape, t)
    in_dtypes = [s.dtype for s in k.inputs]
    bd = Bindings(in_dtypes + out_dtypes, alias)
    check_bindings(name, len(bd.dtypes), t)
    check_invocations(name, WG, t)
    uses_f16 = check_dtypes(name, in_dtypes + out_dtypes + [i.dtype for i in k.instrs], t)

    grid = make_grid(name, -(-total // WG), t)
    ind = "    "
    body = flat_index(grid, total, ind)
    names = _loads(k, shape, used, strides, bd, body, ind)

    def arg(a):
        kind, i = a
        if kind != "in":
            raise CodegenError(f"pointwise kernel {name!r}: unknown operand {a!r}")
        return names[i], k.inputs[i].dtype

    helpers: set[str] = set()
    res = emit_instrs(k.instrs, arg, "t", body, ind, helpers)
    for j, o in enumerate(k.outputs):
        v, dt = res[o]
        body.append(f"{ind}{bd.name(len(k.inputs) + j)}[i] = {store_value(v, dt, out_dtypes[j])};")

    return KernelSpec(
        name=name,
        wgsl=module_source(module_header(uses_f16) + bd.decls(), helpers, WG, body),
        n_bindings=bd.n,
        workgroups=grid.workgroups,
        meta={
            "archetype": "pointwise",
            "workgroup_size": WG,
            "workgroup_storage": 0,
            "binding_dtypes": tuple(bd.dtypes),
            "elements": total,
        },
    )
