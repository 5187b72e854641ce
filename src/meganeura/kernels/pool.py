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
from .archetypes import register
from .common import (
    WG,
    Bindings,
    CodegenError,
    check_binding_size,
    check_bindings,
    check_dtypes,
    flat_index,
    load,
    make_grid,
    make_target,
    module_header,
    module_source,
    store_value,
    u,
    view4,
)
from .ir import KernelSpec, Strided


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


def _module(name, bd: Bindings, total, body, t, meta) -> KernelSpec:
    check_bindings(name, bd.n, t)
    uses_f16 = check_dtypes(name, bd.dtypes, t)
    grid = make_grid(name, -(-total // WG), t)
    body = flat_index(grid, total) + body
    return KernelSpec(name=name, wgsl=module_source(module_header(uses_f16) + bd.decls(), (), WG,
                                                    body),
                      n_bindings=bd.n, workgroups=grid.workgroups,
                      meta=dict(meta, workgroup_size=WG, workgroup_storage=0,
                                binding_dtypes=tuple(bd.dtypes)))


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


def _forward(G: PoolGeom, x: Strided, sx, src: str, acc: list[str], inner,
             dilated: bool) -> list[str]:
    """One invocation per output element: declare ``acc``, then scan the window row by row;
    rows outside the input are skipped, ``inner(lines, ind, value)`` folds element ``(ih, iw)``
    (its own bounds check on ``iw``)."""
    ind, i2, i3 = "    ", "        ", "            "
    L: list[str] = []
    _coords((G.n, G.c, G.oh, G.ow), ["n", "c", "oh", "ow"], L, ind)
    L.append(f"{ind}let base = {_idx([('n', sx[0]), ('c', sx[1])], x.offset)};")
    L.append(f"{ind}let h0 = i32(oh * {u(G.stride[0])}) - {G.pad[0]}i;")
    L.append(f"{ind}let w0 = i32(ow * {u(G.stride[1])}) - {G.pad[1]}i;")
    L += [ind + a for a in acc]
    dh, dw = (f" * {u(G.dilation[0])}", f" * {u(G.dilation[1])}") if dilated else ("", "")
    L.append(f"{ind}for (var a: u32 = 0u; a < {u(G.kh)}; a = a + 1u) {{")
    L.append(f"{i2}let ih = h0 + i32(a{dh});")
    L.append(f"{i2}if (u32(ih) >= {u(G.h)}) {{")
    L.append(f"{i2}    continue;")
    L.append(f"{i2}}}")
    L.append(f"{i2}for (var b: u32 = 0u; b < {u(G.kw)}; b = b + 1u) {{")
    L.append(f"{i3}let iw = w0 + i32(b{dw});")
    idx = _idx([("u32(ih)", sx[2]), ("u32(iw)", sx[3])])
    inner(L, i3, _f(load(src, f"base + {idx}", x.dtype), x.dtype))
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    return L


def _gather(G: PoolGeom, dy: Strided, sd, src: str, inner, before=(), after=()) -> list[str]:
    """One invocation per input element: ``acc`` sums over the output positions whose window
    covers it (in a fixed order); ``before``/``after``: lines around the lets of dy's base,
    ``inner(lines, ind, dy_value)`` the term of output ``(oh, ow)``."""
    ind, i2, i3 = "    ", "        ", "            "
    L: list[str] = []
    _coords((G.n, G.c, G.h, G.w), ["n", "c", "ih", "iw"], L, ind)
    loh, hih = _window_range(G, 0, "ih", L, ind)
    low, hiw = _window_range(G, 1, "iw", L, ind)
    L += [ind + x for x in before]
    L.append(f"{ind}let db = {_idx([('n', sd[0]), ('c', sd[1])], dy.offset)};")
    L += [ind + x for x in after]
    L.append(f"{ind}var acc: f32 = 0.0;")
    L.append(f"{ind}for (var oh: i32 = {loh}; oh <= {hih}; oh = oh + 1i) {{")
    L.append(f"{i2}for (var ow: i32 = {low}; ow <= {hiw}; ow = ow + 1i) {{")
    dyi = f"db + {_idx([('u32(oh)', sd[2]), ('u32(ow)', sd[3])])}"
    inner(L, i3, _f(load(src, dyi, dy.dtype), dy.dtype))
    L.append(f"{i2}}}")
    L.append(f"{ind}}}")
    return L


# ---------------------------------------------------------------------------------------------


def emit_max_pool(k: MaxPoolKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    bd = Bindings([k.x.dtype, k.out_dtype, i32], alias)
    sx = view4(k.x, (G.n, G.c, G.h, G.w), "input", name, t)
    total = G.n * G.c * G.oh * G.ow
    check_binding_size(name, "output", total, k.out_dtype, t)

    def inner(L, ind, v):
        L.append(f"{ind}if (u32(iw) >= {u(G.w)}) {{")
        L.append(f"{ind}    continue;")
        L.append(f"{ind}}}")
        L.append(f"{ind}let v = {v};")
        L.append(f"{ind}if (bi < 0i || v > best || v != v) {{")
        L.append(f"{ind}    best = v;")
        L.append(f"{ind}    bi = ih * {G.w}i + iw;")
        L.append(f"{ind}}}")

    L = _forward(G, k.x, sx, bd.name(0), ["var best: f32 = 0.0;", "var bi: i32 = -1i;"], inner,
                 True)
    L.append(f"    {bd.name(1)}[i] = {store_value('best', f32, k.out_dtype)};")
    L.append(f"    {bd.name(2)}[i] = bi;")
    return _module(name, bd, total, L, t, {"archetype": "max_pool2d"})


def emit_max_pool_grad(k: MaxPoolGradKernel, limits=None, features=None,
                       alias=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    bd = Bindings([k.dy.dtype, i32, k.out_dtype], alias)
    oshape = (G.n, G.c, G.oh, G.ow)
    sd = view4(k.dy, oshape, "dy", name, t)
    si = view4(k.idx, oshape, "indices", name, t)
    if k.idx.dtype is not i32:
        raise CodegenError(f"kernel {name!r}: indices must be i32")
    total = G.n * G.c * G.h * G.w
    check_binding_size(name, "output", total, k.out_dtype, t)

    def inner(L, ind, dy):
        L.append(f"{ind}let j = ib + {_idx([('u32(oh)', si[2]), ('u32(ow)', si[3])])};")
        L.append(f"{ind}if ({bd.name(1)}[j] == me) {{")
        L.append(f"{ind}    acc = acc + {dy};")
        L.append(f"{ind}}}")

    L = _gather(G, k.dy, sd, bd.name(0), inner, [f"let me = i32(ih * {u(G.w)} + iw);"],
                [f"let ib = {_idx([('n', si[0]), ('c', si[1])], k.idx.offset)};"])
    L.append(f"    {bd.name(2)}[i] = {store_value('acc', f32, k.out_dtype)};")
    return _module(name, bd, total, L, t, {"archetype": "max_pool2d_grad"})


def _divisor(G: PoolGeom, cip: bool, oh: str, ow: str, L, ind) -> str:
    if cip:
        return f"{float(G.kh * G.kw)!r}"
    for a, o, k, size, s, p in (("h", oh, G.kh, G.h, G.stride[0], G.pad[0]),
                                ("w", ow, G.kw, G.w, G.stride[1], G.pad[1])):
        L.append(f"{ind}let s{a} = i32({o}) * {s}i - {p}i;")
        L.append(f"{ind}let n{a} = min(s{a} + {k}i, {size}i) - max(s{a}, 0i);")
    return "f32(nh * nw)"


def emit_avg_pool(k: AvgPoolKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    if G.dilation != (1, 1):
        raise CodegenError(f"kernel {name!r}: avg_pool2d has no dilation")
    bd = Bindings([k.x.dtype, k.out_dtype], alias)
    sx = view4(k.x, (G.n, G.c, G.h, G.w), "input", name, t)
    total = G.n * G.c * G.oh * G.ow
    check_binding_size(name, "output", total, k.out_dtype, t)

    def inner(L, ind, v):
        L.append(f"{ind}if (u32(iw) < {u(G.w)}) {{")
        L.append(f"{ind}    acc = acc + {v};")
        L.append(f"{ind}}}")

    L = _forward(G, k.x, sx, bd.name(0), ["var acc: f32 = 0.0;"], inner, False)
    div = _divisor(G, k.count_include_pad, "oh", "ow", L, "    ")
    L.append(f"    {bd.name(1)}[i] = {store_value(f'(acc / {div})', f32, k.out_dtype)};")
    return _module(name, bd, total, L, t, {"archetype": "avg_pool2d"})


def emit_avg_pool_grad(k: AvgPoolGradKernel, limits=None, features=None,
                       alias=None) -> KernelSpec:
    t = make_target(limits, features)
    G, name = k.geom, k.name
    bd = Bindings([k.dy.dtype, k.out_dtype], alias)
    sd = view4(k.dy, (G.n, G.c, G.oh, G.ow), "dy", name, t)
    total = G.n * G.c * G.h * G.w
    check_binding_size(name, "output", total, k.out_dtype, t)

    def inner(L, ind, dy):
        div = _divisor(G, k.count_include_pad, "oh", "ow", L, ind)
        L.append(f"{ind}acc = acc + {dy} / {div};")

    L = _gather(G, k.dy, sd, bd.name(0), inner)
    L.append(f"    {bd.name(1)}[i] = {store_value('acc', f32, k.out_dtype)};")
    return _module(name, bd, total, L, t, {"archetype": "avg_pool2d_grad"})


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


register("max_pool2d", MaxPoolKernel, emit_max_pool, _make_max)
register("max_pool2d_grad", MaxPoolGradKernel, emit_max_pool_grad, _make_max_grad)
register("avg_pool2d", AvgPoolKernel, emit_avg_pool, _make_avg)
register("avg_pool2d_grad", AvgPoolGradKernel, emit_avg_pool_grad, _make_avg_grad)
