"""Fused elementwise kernels: one invocation per element of the iteration shape.

Inputs are read through their Strided maps (broadcast = stride 0, transposes, slices with
offsets and negative steps); all shapes and strides are baked in as constants and neighbouring
dims that every operand walks contiguously are merged first, so a contiguous same-shape kernel
indexes every operand with the thread id alone.  Grids past 65,535 workgroups wrap into 2-D/3-D.
"""

from __future__ import annotations

from ..dtypes import DType
from .common import (
    CodegenError,
    bcast_strides,
    binding_decls,
    check_binding_size,
    check_bindings,
    check_dtypes,
    check_extent,
    check_invocations,
    coords_code,
    emit_instrs,
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
from .ir import KernelSpec, PointwiseKernel

WORKGROUP = 256


def emit(k: PointwiseKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    shape = tuple(int(n) for n in k.shape)
    total = prod(shape)
    if not k.outputs:
        raise CodegenError(f"kernel {name!r} has no outputs")
    for o in k.outputs:
        if not 0 <= o < len(k.instrs):
            raise CodegenError(f"kernel {name!r}: output refers to instr {o} of {len(k.instrs)}")
    out_dtypes: list[DType] = [k.instrs[o].dtype for o in k.outputs]
    in_dtypes = [s.dtype for s in k.inputs]
    n_bind = len(k.inputs) + len(k.outputs)
    check_bindings(name, n_bind, t)
    check_invocations(name, WORKGROUP, t)
    uses_f16 = check_dtypes(name, in_dtypes + out_dtypes + [i.dtype for i in k.instrs], t)

    used = sorted({i for ins in k.instrs for kind, i in ins.args if kind == "in"})
    for i in used:
        if i >= len(k.inputs):
            raise CodegenError(f"kernel {name!r} reads input {i} of {len(k.inputs)}")
    strides = {i: bcast_strides(k.inputs[i], shape, f"{name} input {i}") for i in used}
    for i in used:
        check_extent(name, f"input {i}", k.inputs[i], shape, strides[i], t)
    for j, dt in enumerate(out_dtypes):
        check_binding_size(name, f"output {j}", total, dt, t)

    contiguous = []
    acc = 1
    for n in reversed(shape):
        contiguous.append(acc)
        acc *= n
    contiguous = tuple(reversed(contiguous))
    mshape, mstrides = merge_dims(shape, [contiguous] + [strides[i] for i in used])
    in_strides = dict(zip(used, mstrides[1:], strict=False))

    grid = make_grid(name, -(-total // WORKGROUP), t)
    lines = module_header(uses_f16)
    lines += binding_decls(in_dtypes + out_dtypes)
    body: list[str] = []
    ind = "    "
    body.append(f"{ind}let i = ({grid.wg_expr}) * {u(WORKGROUP)} + lid;")
    body.append(f"{ind}if (i >= {u(total)}) {{")
    body.append(f"{ind}    return;")
    body.append(f"{ind}}}")
    clines: list[str] = []
    coords = coords_code("i", mshape, "c", clines, ind)
    need_coords = False
    names: dict[int, str] = {}
    for i in used:
        s = k.inputs[i]
        if in_strides[i] == mstrides[0]:  # walks like the output: the thread id is the index
            idx = "i" if s.offset == 0 else f"i + {u(s.offset)}"
        else:
            idx = index_code(coords, in_strides[i], s.offset)
            if not need_coords:
                need_coords = True
                body += clines
        body.append(f"{ind}let x{i} = {load(f'b{i}', idx, s.dtype)};")
        names[i] = f"x{i}"

    def arg(a):
        kind, i = a
        if kind != "in":
            raise CodegenError(f"pointwise kernel {name!r}: unknown operand {a!r}")
        return names[i], k.inputs[i].dtype

    helpers: set[str] = set()
    res = emit_instrs(k.instrs, arg, "t", body, ind, helpers)
    for j, o in enumerate(k.outputs):
        v, dt = res[o]
        body.append(f"{ind}b{len(k.inputs) + j}[i] = {store_value(v, dt, out_dtypes[j])};")

    return KernelSpec(
        name=name,
        wgsl=module_source(lines, helpers, WORKGROUP, body),
        n_bindings=n_bind,
        workgroups=grid.workgroups,
        meta={
            "archetype": "pointwise",
            "workgroup_size": WORKGROUP,
            "workgroup_storage": 0,
            "binding_dtypes": tuple(in_dtypes + out_dtypes),
            "elements": total,
        },
    )
