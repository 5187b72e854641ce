"""Pooling kernels (NCHW, floor mode), one invocation per output element (forward) or per
input element (gradients: a gather over the windows that cover the element, in a fixed order —
deterministic, no atomics).

* ``max_pool2d``: the window maximum and its argmax (``ih * W + iw``); the scan is row by row,
  left to right, and a later element wins only when strictly greater (or NaN): the first
  maximal element wins ties, as in PyTorch.  Padding is never selected.
* ``max_pool2d_grad``: dx[ih, iw] = Σ dy over the covering windows whose argmax is (ih, iw).
* ``avg_pool2d`` / ``avg_pool2d_grad``: window sum / divisor (the full window with
  ``count_include_pad``, else its in-bounds part) and the transposed gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DType, f32, i32
from .common import (
    CodegenError,
    bcast_strides,
    binding_decls,
    check_binding_size,
    check_bindings,
    check_dtypes,
    check_extent,
    load,
    make_grid,
    make_target,
    module_header,
    store_value,
    u,
)
from .ir import KernelSpec, Strided

WORKGROUP = 256


@dataclass(frozen=True)
class PoolGeom:
    """Input (n, c, h, w), window (kh, kw), output (oh, ow); ``pad`` (top, left)."""

    n: int
    c: int
    h: int
    w: int
    kh: int
    kw: int
    oh: int
    ow: int
    stride: tuple[int, int]
    pad: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)


@dataclass(frozen=True)
class MaxPoolKernel:
    geom: PoolGeom
    x: Strided
    out_dtype: DType
    name: str = "max_pool2d"


@dataclass(frozen=True)
class MaxPoolGradKernel:
    geom: PoolGeom
    dy: Strided
    idx: Strided
    out_dtype: DType
    name: str = "max_pool2d_grad"


@dataclass(frozen=True)
class AvgPoolKernel:
    geom: PoolGeom
    x: Strided
    count_include_pad: bool
    out_dtype: DType
    name: str = "avg_pool2d"


@dataclass(frozen=True)
class AvgPoolGradKernel:
    geom: PoolGeom
    dy: Strided
    count_include_pad: bool
    out_dtype: DType
    name: str = "avg_pool2d_grad"


def _coords(shape, names, L, ind):
    """Decompose the linear index ``i`` over row-major ``shape`` into ``names``."""
    rem = "i"
    for d in range(len(shape) - 1, 0, -1):
        L.append(f"{ind}let {names[d]} = {rem} % {u(shape[d])};")
        L.append(f"{ind}let q{d} = {rem} / {u(shape[d])};")
        rem = f"q{d}"
    L.append(f"{ind}let {names[0]} = {rem};")


def _idx(terms, offset=0) -> str:
    out = [u(offset)] if offset else []
    out += [e if st == 1 else f"{e} * {u(st)}" for e, st in terms if st != 0]
    return " + ".join(out) or "0u"


def _view(s: Strided, shape, what, name, t):
    if len(s.shape) != 4:
        raise CodegenError(f"kernel {name!r}: {what} must be a 4-D view, got {s.shape}")
    st = bcast_strides(s, shape, f"{name} {what}")
    check_extent(name, what, s, shape, st, t)
    return st


def _module(name, dts, total, body, t, meta) -> KernelSpec:
    check_bindings(name, len(dts), t)
    uses_f16 = check_dtypes(name, dts, t)
    grid = make_grid(name, -(-total // WORKGROUP), t)
    L = module_header(uses_f16) + binding_decls(dts) + [""]
    L.append(f"@compute @workgroup_size({WORKGROUP})")
    L.append("fn main(@builtin(workgroup_id) wid: vec3<u32>, "
             "@builtin(local_invocation_index) lid: u32) {")
    L.append(f"    let i = ({grid.wg_expr}) * {u(WORKGROUP)} + lid;")
    L.append(f"    if (i >= {u(total)}) {{")
    L.append("        return;")
    L.append("    }")
    L += body
    L.append("}")
    return KernelSpec(name=name, wgsl="\n".join(L) + "\n", n_bindings=len(dts),
                      workgroups=grid.workgroups,
                      meta=dict(meta, workgroup_size=WORKGROUP, workgroup_storage=0,
                                binding_dtypes=tuple(dts)))


def _f(v: str, dt: DType) -> str:
    return v if dt is f32 else f"f32({v})"


def _window_range(G: PoolGeom, axis: int, coord: str, L, ind) -> tuple[str, str]:
    """[lo, hi] (inclusive, i32 lets) of the output positions whose window covers input
    coordinate ``coord`` along ``axis`` (0: height, 1: width)."""
    k = (G.kh, G.kw)[axis]
    s, p, d = G.stride[axis], G.pad[axis], G.dilation[axis]
    out = (G.oh, G.ow)[axis]
    a = "hw"[axis]
    L.append(f"{ind}let t{a} = i32({coord}) + {p}i;")
    L.append(f"{ind}let e{a} = t{a} - {d * (k - 1)}i;")
    L.append(f"{ind}let lo{a} = select(0i, (e{a} + {s - 1}i) / {s}i, e{a} > 0i);")
    L.append(f"{ind}let hi{a} = min({out - 1}i, t{a} / {s}i);")
    return f"lo{a}", f"hi{a}"


# ---------------------------------------------------------------------------------------------


def emit_max_pool(k: MaxPoolKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    sx = _view(k.x, (G.n, G.c, G.h, G.w), "input", name, t)
    total = G.n * G.c * G.oh * G.ow
    check_binding_size(name, "output", total, k.out_dtype, t)
    ind, i2, i3 = "    ", "        ", "            "
    L: list[str] = []
    _coords((G.n, G.c, G.oh, G.ow), ["n", "c", "oh", "ow"], L, ind)
    L.append(f"{ind}let base = {_idx([('n', sx[0]), ('c', sx[1])], k.x.offset)};")
    L.append(f"{ind}let h0 = i32(oh * {u(G.stride[0])}) - {G.pad[0]}i;")
    L.append(f"{ind}let w0 = i32(ow * {u(G.stride[1])}) - {G.pad[1]}i;")
    L.append(f"{ind}var best: f32 = 0.0;")
    L.append(f"{ind}var bi: i32 = -1i;")
    L.append(f"{ind}for (var a: u32 = 0u; a < {u(G.kh)}; a = a + 1u) {{")
    L.append(f"{i2}let ih = h0 + i32(a * {u(G.dilation[0])});")
    L.append(f"{i2}if (u32(ih) >= {u(G.h)}) {{")
    L.append(f"{i2}    continue;")
    L.append(f"{i2}}}")
    L.append(f"{i2}for (var b: u32 = 0u; b < {u(G.kw)}; b = b + 1u) {{")
    L.append(f"{i3}let iw = w0 + i32(b * {u(G.dilation[1])});")
    L.append(f"{i3}if (u32(iw) >= {u(G.w)}) {{")
    L.append(f"{i3}    continue;")
    L.append(f"{i3}}}")
    idx = _idx([("u32(ih)", sx[2]), ("u32(iw)", sx[3])])
    L.append(f"{i3}let v = {_f(load('b0', f'base + {idx}', k.x.dtype), k.x.dtype)};")
    L.append(f"{i3}if (bi < 0i || v > best || v != v) {{")
    L.append(f"{i3}    best = v;")
    L.append(f"{i3}    bi = ih * {G.w}i + iw;")
    L.append(f"{i3}}}")
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    L.append(f"{ind}b1[i] = {store_value('best', f32, k.out_dtype)};")
    L.append(f"{ind}b2[i] = bi;")
    return _module(name, [k.x.dtype, k.out_dtype, i32], total, L, t,
                   {"archetype": "max_pool2d"})


def emit_max_pool_grad(k: MaxPoolGradKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    oshape = (G.n, G.c, G.oh, G.ow)
    sd = _view(k.dy, oshape, "dy", name, t)
    si = _view(k.idx, oshape, "indices", name, t)
    if k.idx.dtype is not i32:
        raise CodegenError(f"kernel {name!r}: indices must be i32")
    total = G.n * G.c * G.h * G.w
    check_binding_size(name, "output", total, k.out_dtype, t)
    ind, i2, i3 = "    ", "        ", "            "
    L: list[str] = []
    _coords((G.n, G.c, G.h, G.w), ["n", "c", "ih", "iw"], L, ind)
    loh, hih = _window_range(G, 0, "ih", L, ind)
    low, hiw = _window_range(G, 1, "iw", L, ind)
    L.append(f"{ind}let me = i32(ih * {u(G.w)} + iw);")
    L.append(f"{ind}let db = {_idx([('n', sd[0]), ('c', sd[1])], k.dy.offset)};")
    L.append(f"{ind}let ib = {_idx([('n', si[0]), ('c', si[1])], k.idx.offset)};")
    L.append(f"{ind}var acc: f32 = 0.0;")
    L.append(f"{ind}for (var oh: i32 = {loh}; oh <= {hih}; oh = oh + 1i) {{")
    L.append(f"{i2}for (var ow: i32 = {low}; ow <= {hiw}; ow = ow + 1i) {{")
    L.append(f"{i3}let j = ib + {_idx([('u32(oh)', si[2]), ('u32(ow)', si[3])])};")
    L.append(f"{i3}if (b1[j] == me) {{")
    dyi = f"db + {_idx([('u32(oh)', sd[2]), ('u32(ow)', sd[3])])}"
    L.append(f"{i3}    acc = acc + {_f(load('b0', dyi, k.dy.dtype), k.dy.dtype)};")
    L.append(f"{i3}}}")
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    L.append(f"{ind}b2[i] = {store_value('acc', f32, k.out_dtype)};")
    return _module(name, [k.dy.dtype, i32, k.out_dtype], total, L, t,
                   {"archetype": "max_pool2d_grad"})


def _divisor(G: PoolGeom, cip: bool, oh: str, ow: str, L, ind) -> str:
    if cip:
        return f"{float(G.kh * G.kw)!r}"
    for a, o, k, size, s, p in (("h", oh, G.kh, G.h, G.stride[0], G.pad[0]),
                                ("w", ow, G.kw, G.w, G.stride[1], G.pad[1])):
        L.append(f"{ind}let s{a} = i32({o}) * {s}i - {p}i;")
        L.append(f"{ind}let n{a} = min(s{a} + {k}i, {size}i) - max(s{a}, 0i);")
    return "f32(nh * nw)"


def emit_avg_pool(k: AvgPoolKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    if G.dilation != (1, 1):
        raise CodegenError(f"kernel {name!r}: avg_pool2d has no dilation")
    sx = _view(k.x, (G.n, G.c, G.h, G.w), "input", name, t)
    total = G.n * G.c * G.oh * G.ow
    check_binding_size(name, "output", total, k.out_dtype, t)
    ind, i2, i3 = "    ", "        ", "            "
    L: list[str] = []
    _coords((G.n, G.c, G.oh, G.ow), ["n", "c", "oh", "ow"], L, ind)
    L.append(f"{ind}let base = {_idx([('n', sx[0]), ('c', sx[1])], k.x.offset)};")
    L.append(f"{ind}let h0 = i32(oh * {u(G.stride[0])}) - {G.pad[0]}i;")
    L.append(f"{ind}let w0 = i32(ow * {u(G.stride[1])}) - {G.pad[1]}i;")
    L.append(f"{ind}var acc: f32 = 0.0;")
    L.append(f"{ind}for (var a: u32 = 0u; a < {u(G.kh)}; a = a + 1u) {{")
    L.append(f"{i2}let ih = h0 + i32(a);")
    L.append(f"{i2}if (u32(ih) >= {u(G.h)}) {{")
    L.append(f"{i2}    continue;")
    L.append(f"{i2}}}")
    L.append(f"{i2}for (var b: u32 = 0u; b < {u(G.kw)}; b = b + 1u) {{")
    L.append(f"{i3}let iw = w0 + i32(b);")
    L.append(f"{i3}if (u32(iw) < {u(G.w)}) {{")
    idx = _idx([("u32(ih)", sx[2]), ("u32(iw)", sx[3])])
    L.append(f"{i3}    acc = acc + {_f(load('b0', f'base + {idx}', k.x.dtype), k.x.dtype)};")
    L.append(f"{i3}}}")
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    div = _divisor(G, k.count_include_pad, "oh", "ow", L, ind)
    L.append(f"{ind}b1[i] = {store_value(f'(acc / {div})', f32, k.out_dtype)};")
    return _module(name, [k.x.dtype, k.out_dtype], total, L, t, {"archetype": "avg_pool2d"})


def emit_avg_pool_grad(k: AvgPoolGradKernel, limits=None, features=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    sd = _view(k.dy, (G.n, G.c, G.oh, G.ow), "dy", name, t)
    total = G.n * G.c * G.h * G.w
    check_binding_size(name, "output", total, k.out_dtype, t)
    ind, i2, i3 = "    ", "        ", "            "
    L: list[str] = []
    _coords((G.n, G.c, G.h, G.w), ["n", "c", "ih", "iw"], L, ind)
    loh, hih = _window_range(G, 0, "ih", L, ind)
    low, hiw = _window_range(G, 1, "iw", L, ind)
    L.append(f"{ind}let db = {_idx([('n', sd[0]), ('c', sd[1])], k.dy.offset)};")
    L.append(f"{ind}var acc: f32 = 0.0;")
    L.append(f"{ind}for (var oh: i32 = {loh}; oh <= {hih}; oh = oh + 1i) {{")
    L.append(f"{i2}for (var ow: i32 = {low}; ow <= {hiw}; ow = ow + 1i) {{")
    inner: list[str] = []
    div = _divisor(G, k.count_include_pad, "oh", "ow", inner, i3)
    L += inner
    dyi = f"db + {_idx([('u32(oh)', sd[2]), ('u32(ow)', sd[3])])}"
    L.append(f"{i3}acc = acc + {_f(load('b0', dyi, k.dy.dtype), k.dy.dtype)} / {div};")
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    L.append(f"{ind}b1[i] = {store_value('acc', f32, k.out_dtype)};")
    return _module(name, [k.dy.dtype, k.out_dtype], total, L, t,
                   {"archetype": "avg_pool2d_grad"})


# ---------------------------------------------------------------------------------------------


def _geom(x_shape, y_shape, attrs) -> PoolGeom:
    n, c, h, w = x_shape
    kh, kw = attrs["kernel_size"]
    pad = attrs["padding"]
    return PoolGeom(n, c, h, w, kh, kw, y_shape[2], y_shape[3], tuple(attrs["stride"]),
                    (pad[0][0], pad[1][0]), tuple(attrs.get("dilation", (1, 1))))


def _make_max(attrs, inputs, outputs):
    return MaxPoolKernel(_geom(inputs[0].shape, outputs[0].shape, attrs), inputs[0],
                         outputs[0].dtype)


def _make_max_grad(attrs, inputs, outputs):
    dy, idx = inputs
    x_shape = dy.shape[:2] + tuple(attrs["input_size"])
    return MaxPoolGradKernel(_geom(x_shape, dy.shape, attrs), dy, idx, outputs[0].dtype)


def _make_avg(attrs, inputs, outputs):
    return AvgPoolKernel(_geom(inputs[0].shape, outputs[0].shape, attrs), inputs[0],
                         bool(attrs["count_include_pad"]), outputs[0].dtype)


def _make_avg_grad(attrs, inputs, outputs):
    (dy,) = inputs
    x_shape = dy.shape[:2] + tuple(attrs["input_size"])
    return AvgPoolGradKernel(_geom(x_shape, dy.shape, attrs), dy,
                             bool(attrs["count_include_pad"]), outputs[0].dtype)


def _register() -> None:
    from .archetypes import register_archetype

    register_archetype("max_pool2d", MaxPoolKernel, _make_max, emit_max_pool)
    register_archetype("max_pool2d_grad", MaxPoolGradKernel, _make_max_grad, emit_max_pool_grad)
    register_archetype("avg_pool2d", AvgPoolKernel, _make_avg, emit_avg_pool)
    register_archetype("avg_pool2d_grad", AvgPoolGradKernel, _make_avg_grad, emit_avg_pool_grad)


_register()
