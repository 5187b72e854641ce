"""One-hot rows: ``out[..., c] = (labels[...] == c)`` in ``out_dtype``; labels outside
``[0, num_classes)`` (negative ones included) give all-zero rows.  Registered as the
``one_hot`` family (``ops/nn.py`` lowers to it)."""

from __future__ import annotations

from ..dtypes import bool_, i32, u32
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
    flat_index,
    index_code,
    make_grid,
    make_target,
    merge_dims,
    module_header,
    module_source,
    prod,
    u,
)
from .ir import KernelSpec, OneHotKernel, contiguous_strides


def _make(attrs, inputs, outputs):
    return OneHotKernel(inputs[0], attrs["num_classes"], attrs["dtype"])


@kernel_family("one_hot", OneHotKernel, make=_make)
def emit(k: OneHotKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    lab = k.labels
    if lab.dtype not in (i32, u32):
        raise CodegenError(f"kernel {name!r}: labels must be i32 or u32, got {lab.dtype.name}")
    C = int(k.num_classes)
    if C < 1:
        raise CodegenError(f"kernel {name!r}: num_classes must be ≥ 1, got {C}")
    shape = tuple(int(n) for n in lab.shape)
    total = prod(shape) * C
    out_dt = k.out_dtype
    bd = Bindings([lab.dtype, out_dt], alias)
    check_bindings(name, 2, t)
    check_invocations(name, WG, t)
    uses_f16 = check_dtypes(name, [lab.dtype, out_dt], t)
    st = bcast_strides(lab, shape, f"{name} labels")
    check_extent(name, "labels", lab, shape, st, t)
    check_binding_size(name, "output", total, out_dt, t)
    mshape, (_, mst) = merge_dims(shape, [contiguous_strides(shape), st])
    grid = make_grid(name, -(-total // WG), t)

    ind = "    "
    body = flat_index(grid, total, ind)
    body.append(f"{ind}let cls = i % {u(C)};")
    body.append(f"{ind}let l = i / {u(C)};")
    coords = coords_code("l", mshape, "c", body, ind)
    body.append(f"{ind}let y = {bd.name(0)}[{index_code(coords, mst, lab.offset)}];")
    cmp = "u32(y) == cls" if lab.dtype is u32 else "y >= 0i && u32(y) == cls"
    body.append(f"{ind}let hit = {cmp};")
    if out_dt is bool_:
        val = "select(0u, 1u, hit)"
    else:
        val = f"select({out_dt.wgsl}(0), {out_dt.wgsl}(1), hit)"
    body.append(f"{ind}{bd.name(1)}[i] = {val};")
    return KernelSpec(
        name=name,
        wgsl=module_source(module_header(uses_f16) + bd.decls(), (), WG, body),
        n_bindings=bd.n,
        workgroups=grid.workgroups,
        meta={
            "archetype": "one_hot",
            "workgroup_size": WG,
            "workgroup_storage": 0,
            "binding_dtypes": (lab.dtype, out_dt),
        },
    )
