"""One-hot rows: ``out[..., c] = (labels[...] == c)`` in ``out_dtype``; labels outside
``[0, num_classes)`` (negative ones included) give all-zero rows."""

from __future__ import annotations

from ..dtypes import bool_, i32, u32
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
    index_code,
    make_grid,
    make_target,
    merge_dims,
    module_header,
    prod,
    u,
)
from .ir import KernelSpec, OneHotKernel

WORKGROUP = 256


def emit(k: OneHotKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    lab = k.labels
    if lab.dtype not in (i32, u32):
        raise CodegenError(f"kernel {name!r}: labels must be i32 or u32, got {lab.dtype.name}")
    C = int(k.num_classes)
    if C < 1:
        raise CodegenError(f"kernel {name!r}: num_classes must be ≥ 1, got {C}")
    shape = tuple(int(n) for n in lab.shape)
    L = prod(shape)
    total = L * C
    out_dt = k.out_dtype
    check_bindings(name, 2, t)
    check_invocations(name, WORKGROUP, t)
    uses_f16 = check_dtypes(name, [lab.dtype, out_dt], t)
    st = bcast_strides(lab, shape, f"{name} labels")
    check_extent(name, "labels", lab, shape, st, t)
    check_binding_size(name, "output", total, out_dt, t)
    contig, acc = [], 1
    for n in reversed(shape):
        contig.append(acc)
        acc *= n
    mshape, (_, mst) = merge_dims(shape, [tuple(reversed(contig)), st])
    grid = make_grid(name, -(-total // WORKGROUP), t)

    ind = "    "
    body = [f"{ind}let i = ({grid.wg_expr}) * {u(WORKGROUP)} + lid;"]
    body += [f"{ind}if (i >= {u(total)}) {{", f"{ind}    return;", f"{ind}}}"]
    body.append(f"{ind}let cls = i % {u(C)};")
    body.append(f"{ind}let l = i / {u(C)};")
    coords = coords_code("l", mshape, "c", body, ind)
    body.append(f"{ind}let y = b0[{index_code(coords, mst, lab.offset)}];")
    cmp = "u32(y) == cls" if lab.dtype is u32 else "y >= 0i && u32(y) == cls"
    body.append(f"{ind}let hit = {cmp};")
    if out_dt is bool_:
        val = "select(0u, 1u, hit)"
    else:
        val = f"select({out_dt.wgsl}(0), {out_dt.wgsl}(1), hit)"
    body.append(f"{ind}b1[i] = {val};")

    lines = module_header(uses_f16) + binding_decls([lab.dtype, out_dt]) + [""]
    lines.append(f"@compute @workgroup_size({WORKGROUP})")
    lines.append(
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, "
        "@builtin(local_invocation_index) lid: u32) {"
    )
    lines += body
    lines.append("}")
    return KernelSpec(
        name=name,
        wgsl="\n".join(lines) + "\n",
        n_bindings=2,
        workgroups=grid.workgroups,
        meta={
            "archetype": "one_hot",
            "workgroup_size": WORKGROUP,
            "workgroup_storage": 0,
            "binding_dtypes": (lab.dtype, out_dt),
        },
    )
