"""Shared pieces of the WGSL emitters: limits, dtypes, index arithmetic, grids, pointwise DAGs."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..dtypes import DType, bool_, f16, f32, i32, u32
from ..errors import DeviceError, LimitError, MeganeuraError
from .ir import Instr, Strided
from .wgsl_helpers import HELPERS, helper_source, resolve

# WebGPU's guaranteed minimums: what an emitter assumes when it is given no limits.
DEFAULT_LIMITS = {
    "max_storage_buffer_binding_size": 134217728,
    "max_buffer_size": 268435456,
    "max_compute_workgroup_storage_size": 16384,
    "max_storage_buffers_per_shader_stage": 8,
    "max_compute_workgroups_per_dimension": 65535,
    "max_compute_invocations_per_workgroup": 256,
    "max_compute_workgroup_size_x": 256,
    "max_compute_workgroup_size_y": 256,
    "max_compute_workgroup_size_z": 64,
    "min_storage_buffer_offset_alignment": 256,
    "min_uniform_buffer_offset_alignment": 256,
    "max_uniform_buffer_binding_size": 65536,
    "max_uniform_buffers_per_shader_stage": 12,
    "max_bind_groups": 4,
    "max_bindings_per_bind_group": 1000,
    "max_immediate_size": 0,
}


WG = 256  # invocations per workgroup of the one-invocation-per-element kernels


# Pseudo-feature: the device's WGSL has the ``buffer_view`` language extension (Dawn from
# Chrome 153 on), so a workgroup ``buffer`` can be written through a packed ``vec2<u32>`` view
# and read as ``array<f16>`` (subgroup-matrix loads included): one 8-byte store per four f16
# instead of four 2-byte stores.  Detected by compiling a probe module (runtime/device.py).
BUFFER_VIEW_FEATURE = "meganeura-wgsl-buffer-view"
# Pseudo-feature the tensor-core kernels key on: 16x16x16 f16 subgroup matrices with f32
# accumulation at subgroup size 32 (runtime/device.py derives it from Dawn's adapter configs)
SG_FEATURE = "meganeura-subgroup-matrix-f16-16x16x16-sg32"
# packed views of a staging buffer: suffix -> (element type, f16 elements per element)
_PACKED_VIEWS = {"w": ("vec2<u32>", 4), "q": ("vec4<u32>", 8)}


def packed_staging(name: str, n: int, views: Sequence[str] = ("w",),
                   ind: str = "    ", f16_view: str | None = None) -> tuple[str, list[str]]:
    """An f16 staging array ``name`` of ``n`` elements written packed (``BUFFER_VIEW_FEATURE``):
    its workgroup ``buffer`` declaration and the body's first lines, the views ``name``
    (``array<f16, n>``, or ``f16_view``, a type of the same size such as an array of
    fragment blocks; what fragment loads take: already a pointer) and, per suffix of
    ``views``, ``name[0] + suffix`` (``w``: ``vec2<u32>``, four f16 each; ``q``:
    ``vec4<u32>``, eight)."""
    lets = [f"{ind}let {name} = bufferView<{f16_view or f'array<f16, {n}>'}>(&{name}B, 0u);"]
    for v in views:
        t, per = _PACKED_VIEWS[v]
        lets.append(f"{ind}let {name[0]}{v} = bufferView<array<{t}, {n // per}>>(&{name}B, 0u);")
    return f"var<workgroup> {name}B: buffer<{2 * n}>;", lets


def pack_f16x4(reg: str, f16_reg: bool = False) -> str:
    """The ``vec2<u32>`` of vec4 register ``reg`` rounded to f16 (a bitcast if it holds f16)."""
    if f16_reg:
        return f"bitcast<vec2<u32>>({reg})"
    return f"vec2<u32>(pack2x16float({reg}.xy), pack2x16float({reg}.zw))"


class CodegenError(MeganeuraError, ValueError):
    """A kernel description is inconsistent (a bug in the planner or an op's lowering)."""


# ---------------------------------------------------------------------------------------------
# target: limits + features


@dataclass(frozen=True)
class Target:
    """What an emitter may use: the device's limits (underscore names) and features."""

    limits: dict
    features: frozenset

    def lim(self, name: str) -> int:
        return int(self.limits.get(name, DEFAULT_LIMITS[name]))

    @property
    def has_f16(self) -> bool:
        return "shader-f16" in self.features


def make_target(limits=None, features=None) -> Target:
    """``limits``: a dict (hyphen or underscore names), a ``Device`` (its limits and features
    are used), or None for WebGPU's defaults.  ``features``: names such as ``shader-f16``."""
    feats = features
    if limits is not None and hasattr(limits, "limits") and hasattr(limits, "features"):
        if feats is None:
            feats = limits.features
        limits = limits.limits
    lim = dict(DEFAULT_LIMITS)
    if limits:
        for k, v in dict(limits).items():
            if k == "features":
                if feats is None:
                    feats = v
                continue
            lim[k.replace("-", "_")] = v
    return Target(lim, frozenset(feats or ()))


def _check_limit(t: Target, limit: str, n: int, message) -> None:
    """LimitError ``message(device's value)`` when ``n`` exceeds ``limit``."""
    if n > t.lim(limit):
        raise LimitError(message(t.lim(limit)))


def check_workgroup_storage(name: str, nbytes: int, t: Target) -> None:
    _check_limit(t, "max_compute_workgroup_storage_size", nbytes, lambda m: (
        f"kernel {name!r} needs {nbytes} bytes of workgroup storage; the device allows "
        f"{m} (max_compute_workgroup_storage_size)"))


def check_bindings(name: str, n: int, t: Target) -> None:
    _check_limit(t, "max_storage_buffers_per_shader_stage", n, lambda m: (
        f"kernel {name!r} needs {n} storage buffers; the device allows {m} per shader "
        f"stage (max_storage_buffers_per_shader_stage): split the fused kernel"))


def check_invocations(name: str, n: int, t: Target) -> None:
    _check_limit(t, "max_compute_invocations_per_workgroup", n, lambda m: (
        f"kernel {name!r} uses workgroups of {n} invocations; the device allows {m}"))


def check_binding_size(name: str, what: str, n_elems: int, dt: DType, t: Target) -> None:
    nbytes = n_elems * dt.gpu_itemsize
    maxb = t.lim("max_storage_buffer_binding_size")
    if nbytes > maxb:
        raise LimitError(
            f"kernel {name!r}: {what} binds {nbytes} bytes ({n_elems} × {dt.name}); the device "
            f"allows {maxb} bytes per storage binding (max_storage_buffer_binding_size)"
        )
    if n_elems >= 2**32:
        raise LimitError(f"kernel {name!r}: {what} has {n_elems} elements (u32 indexing)")


def check_dtypes(name: str, dtypes, t: Target) -> bool:
    """True when f16 is used (then the module needs ``enable f16;``); errors if unsupported."""
    uses_f16 = any(d is f16 for d in dtypes)
    if uses_f16 and not t.has_f16:
        raise DeviceError(
            f"kernel {name!r} uses f16 but the target has no 'shader-f16' feature (pass the "
            f"device, or features=device.features, to codegen.emit)"
        )
    return uses_f16


# ---------------------------------------------------------------------------------------------
# dtypes and literals


def reg_type(dt: DType) -> str:
    """WGSL type of a value in registers (bool is ``bool``)."""
    return "bool" if dt is bool_ else dt.wgsl


def store_type(dt: DType) -> str:
    """WGSL element type in a buffer (bool is stored as ``u32``)."""
    return dt.wgsl


def u(n: int) -> str:
    """A u32 literal; negative numbers wrap (u32 arithmetic is modular, so negative strides
    work as long as the final index is in range)."""
    return f"{int(n) % (1 << 32)}u"


def load(binding: str, index: str, dt: DType) -> str:
    """Expression reading one element as its register type."""
    if dt is bool_:
        return f"({binding}[{index}] != 0u)"
    return f"{binding}[{index}]"


def store_value(value: str, src: DType, dst: DType) -> str:
    """Expression converting a register value of ``src`` to the stored type of ``dst``."""
    if dst is bool_:
        if src is bool_:
            return f"select(0u, 1u, {value})"
        return f"select(0u, 1u, {value} != {reg_type(src)}(0))"
    if src is bool_:
        return f"{dst.wgsl}(select(0u, 1u, {value}))"
    if src is dst:
        return value
    return f"{dst.wgsl}({value})"


def convert(value: str, src: DType, dst: DType) -> str:
    """Register-to-register conversion."""
    if src is dst:
        return value
    if dst is bool_:
        return f"({value} != {reg_type(src)}(0))"
    return f"{reg_type(dst)}({value})"


_SPECIAL = re.compile(r"\b(f32|f16)\(\s*([+-]?)\s*(inf|nan)\s*\)")


def sanitize(expr: str) -> str:
    """Turn ``f32(inf)``/``f32(-inf)``/``f32(nan)`` (from Python's float repr) into calls of the
    ``mn_inf``/``mn_nan`` helpers: WGSL has no literal for them, and Tint rejects constant
    expressions that evaluate to them."""

    def rep(m):
        ty, sign, what = m.group(1), m.group(2), m.group(3)
        v = "mn_nan()" if what == "nan" else ("(-mn_inf())" if sign == "-" else "mn_inf()")
        return v if ty == "f32" else f"f16({v})"

    return _SPECIAL.sub(rep, expr)


_HELPER_CALL = re.compile(r"\b(mn_\w+)\s*\(")
_PLACEHOLDER = re.compile(r"\{(\d+)\}")


def substitute(expr: str, args: Sequence[str]) -> str:
    def rep(m):
        i = int(m.group(1))
        if i >= len(args):
            raise CodegenError(f"expression {expr!r} uses operand {{{i}}} but has {len(args)}")
        return args[i]

    return _PLACEHOLDER.sub(rep, expr)


# ---------------------------------------------------------------------------------------------
# strided views


def bcast_strides(s: Strided, shape: Sequence[int], what: str = "input") -> tuple[int, ...]:
    """Strides of ``s`` broadcast to ``shape`` (numpy rules, right-aligned; size-1 dims read
    with stride 0)."""
    shape = tuple(shape)
    if len(s.shape) != len(s.strides):
        raise CodegenError(f"{what}: shape {s.shape} and strides {s.strides} differ in rank")
    if len(s.shape) > len(shape):
        raise CodegenError(f"{what}: shape {s.shape} has more dims than the iteration {shape}")
    pad = len(shape) - len(s.shape)
    out = [0] * pad
    for d, (n, st) in enumerate(zip(s.shape, s.strides, strict=False)):
        target = shape[pad + d]
        if n == target:
            out.append(st if target != 1 else 0)
        elif n == 1:
            out.append(0)
        else:
            raise CodegenError(f"{what}: shape {s.shape} does not broadcast to {shape}")
    return tuple(out)


def check_extent(name: str, what: str, s: Strided, shape, strides, t: Target) -> None:
    """The view stays inside its bound range (when ``extent`` is known) and binding limits."""
    if any(n == 0 for n in shape):
        return
    lo = s.offset + sum((n - 1) * st for n, st in zip(shape, strides, strict=False) if st < 0)
    hi = s.offset + sum((n - 1) * st for n, st in zip(shape, strides, strict=False) if st > 0)
    if lo < 0:
        raise CodegenError(f"kernel {name!r}: {what} reads at element {lo} < 0 ({s})")
    if s.extent and hi >= s.extent:
        raise CodegenError(
            f"kernel {name!r}: {what} reads element {hi} but its binding holds {s.extent} ({s})"
        )
    check_binding_size(name, what, max(s.extent, hi + 1), s.dtype, t)


def view4(s: Strided, shape, what: str, name: str, t: Target) -> tuple[int, ...]:
    """Strides of the 4-D view ``s`` broadcast to ``shape``, checked against its binding."""
    if len(s.shape) != 4:
        raise CodegenError(f"kernel {name!r}: {what} must be a 4-D view, got shape {s.shape}")
    st = bcast_strides(s, shape, f"{name} {what}")
    check_extent(name, what, s, shape, st, t)
    return st


def merge_dims(shape: Sequence[int], stride_lists: Sequence[Sequence[int]]):
    """Drop size-1 dims and merge neighbours that every stride list walks contiguously.
    Returns (shape, [strides…]) with the same index map."""
    dims = [d for d, n in enumerate(shape) if n != 1]
    mshape: list[int] = []
    mstrides: list[list[int]] = [[] for _ in stride_lists]
    for d in dims:
        n = shape[d]
        pairs = list(zip(mstrides, stride_lists, strict=True))
        if mshape and all(sl[-1] == st[d] * n for sl, st in pairs):
            mshape[-1] *= n
            for sl, st in zip(mstrides, stride_lists, strict=False):
                sl[-1] = st[d]
            continue
        mshape.append(n)
        for sl, st in zip(mstrides, stride_lists, strict=False):
            sl.append(st[d])
    return tuple(mshape), [tuple(sl) for sl in mstrides]


def coords_code(
    lin: str, shape: Sequence[int], prefix: str, lines: list[str], ind: str
) -> list[str]:
    """Emit code decomposing linear index ``lin`` over row-major ``shape`` into coordinate
    variables; returns their names (one per dim)."""
    q = len(shape)
    if q == 0:
        return []
    if q == 1:
        return [lin]
    names = [f"{prefix}{d}" for d in range(q)]
    rem = lin
    for d in range(q - 1, 0, -1):
        lines.append(f"{ind}let {names[d]} = {rem} % {u(shape[d])};")
        nxt = f"{prefix}q{d}"
        lines.append(f"{ind}let {nxt} = {rem} / {u(shape[d])};")
        rem = nxt
    names[0] = rem
    return names


def index_code(coords: Sequence[str], strides: Sequence[int], offset: int = 0) -> str:
    """``offset + Σ coord·stride`` as a u32 expression."""
    terms = [] if offset == 0 else [u(offset)]
    for c, st in zip(coords, strides, strict=False):
        if st == 0:
            continue
        terms.append(c if st == 1 else f"{c} * {u(st)}")
    return " + ".join(terms) if terms else "0u"


# ---------------------------------------------------------------------------------------------
# grids


@dataclass(frozen=True)
class Grid:
    """``total`` workgroups laid out within the per-dimension limit (1-D grids larger than the
    limit wrap into 2-D, then 3-D).  ``wg_expr`` is the linear workgroup id in WGSL."""

    total: int
    workgroups: tuple[int, int, int]

    @property
    def wg_expr(self) -> str:
        gx, gy, gz = self.workgroups
        e = "wid.x"
        if gy > 1 or gz > 1:
            e += f" + wid.y * {u(gx)}"
        if gz > 1:
            e += f" + wid.z * {u(gx * gy)}"
        return e

    @property
    def exact(self) -> bool:
        gx, gy, gz = self.workgroups
        return gx * gy * gz == self.total


def make_grid(name: str, total: int, t: Target) -> Grid:
    total = max(1, int(total))
    m = t.lim("max_compute_workgroups_per_dimension")
    if total <= m:
        return Grid(total, (total, 1, 1))
    gy = -(-total // m)
    if gy <= m:
        gx = -(-total // gy)
        return Grid(total, (gx, gy, 1))
    gz = -(-total // (m * m))
    if gz > m:
        raise LimitError(
            f"kernel {name!r} needs {total} workgroups; more than {m}³ (the device allows {m} "
            f"per dimension)"
        )
    return Grid(total, (m, m, gz))


def pow2ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def i32_lit(n: int) -> str:
    """An i32 literal."""
    return f"{int(n)}i"


def prod(xs) -> int:
    return math.prod(int(x) for x in xs)


# ---------------------------------------------------------------------------------------------
# pointwise instruction lists


def emit_instrs(
    instrs: Sequence[Instr],
    arg: Callable[[tuple[str, int]], tuple[str, DType]],
    tag: str,
    lines: list[str],
    ind: str,
    helpers: set[str],
) -> list[tuple[str, DType]]:
    """Emit ``let`` bindings for ``instrs``; ``arg(("in", i))`` etc. returns the WGSL name and
    dtype of an operand (``("t", j)`` is handled here).  Returns (name, dtype) per instr."""
    res: list[tuple[str, DType]] = []
    for j, ins in enumerate(instrs):
        ops = []
        for a in ins.args:
            kind, idx = a
            if kind == "t":
                if not 0 <= idx < j:
                    raise CodegenError(
                        f"instr {j} ({ins.expr!r}) reads result {idx} before it exists"
                    )
                ops.append(res[idx])
            else:
                ops.append(arg(a))
        expr = sanitize(ins.expr)
        if ins.helpers and (ins.dtype is f16 or any(dt is f16 for _, dt in ops)):
            # Helpers are f32 functions: compute through f32, round back to f16.
            text = substitute(expr, [f"f32({n})" if dt is f16 else n for n, dt in ops])
            if ins.dtype is f16:
                text = f"f16({text})"
        else:
            text = substitute(expr, [n for n, _ in ops])
        helpers.update(ins.helpers)
        # helpers an expression calls but forgot to declare
        helpers.update(h for h in _HELPER_CALL.findall(expr) if h in HELPERS)
        name = f"{tag}{j}"
        lines.append(f"{ind}let {name}: {reg_type(ins.dtype)} = {text};")
        res.append((name, ins.dtype))
    return res


def module_header(uses_f16: bool) -> list[str]:
    return ["enable f16;", ""] if uses_f16 else []


class Bindings:
    """The storage bindings of one kernel, slot ``i`` holding ``dtypes[i]``.  ``alias[i]`` is
    the first slot bound to the same buffer range as slot ``i`` (``binding_aliases``; None: no
    sharing).  WebGPU forbids binding one range twice as writable storage (Dawn validates it),
    so only canonical slots (``alias[i] == i``) are declared, numbered densely in slot order,
    and an aliased slot reads and writes through its canonical slot's variable ``b{alias[i]}``
    (variables keep their slot number; only ``@binding`` is renumbered)."""

    def __init__(self, dtypes: Sequence[DType], alias=None):
        self.dtypes = list(dtypes)
        n = len(self.dtypes)
        self.alias = tuple(range(n)) if alias is None else tuple(int(a) for a in alias)
        if len(self.alias) != n or any(
                not 0 <= a <= i or self.alias[a] != a for i, a in enumerate(self.alias)):
            raise CodegenError(f"binding alias {self.alias} does not fit {n} bindings (each "
                               "entry: the first slot of its range, at or before its own)")
        self.kept = [i for i, a in enumerate(self.alias) if a == i]

    def name(self, i: int) -> str:
        """WGSL variable of slot ``i``."""
        return f"b{self.alias[i]}"

    @property
    def n(self) -> int:
        """Bindings the pipeline layout has (canonical slots)."""
        return len(self.kept)

    def decls(self, vec4: dict[str, str] | None = None) -> list[str]:
        """The declarations; ``vec4`` maps variables read by 16-byte units to the vec4's
        element type (``array<vec4<T>>`` instead of the slot's scalar array)."""
        vec4 = vec4 or {}

        def elem(i: int) -> str:
            v = f"b{i}"
            return f"vec4<{vec4[v]}>" if v in vec4 else store_type(self.dtypes[i])
        return [f"@group(0) @binding({j}) var<storage, read_write> b{i}: array<{elem(i)}>;"
                for j, i in enumerate(self.kept)]


def binding_aliases(binds: Sequence) -> tuple[int, ...]:
    """For each element of ``binds`` the index of its first equal element (the ``alias``
    argument of ``emit`` for a kernel whose slots are bound to ``binds``)."""
    first: dict = {}
    return tuple(first.setdefault(b, i) for i, b in enumerate(binds))


def flat_index(grid: Grid, total: int, ind: str = "    ") -> list[str]:
    """Body lines of a one-invocation-per-element kernel: linear index ``i``, and return past
    ``total``."""
    return [f"{ind}let i = ({grid.wg_expr}) * {u(WG)} + lid;", f"{ind}if (i >= {u(total)}) {{",
            f"{ind}    return;", f"{ind}}}"]


def module_source(lines: list[str], helpers, workgroup_size, body: list[str]) -> str:
    """The WGSL module: declarations ``lines``, helper functions, then ``main`` around ``body``
    (every archetype's entry point has the same signature)."""
    out = list(lines) + [""] + helpers_code(helpers)
    out.append(f"@compute @workgroup_size({workgroup_size})")
    out.append("fn main(@builtin(workgroup_id) wid: vec3<u32>, "
               "@builtin(local_invocation_index) lid: u32) {")
    return "\n".join(out + list(body) + ["}"]) + "\n"


def helpers_code(names) -> list[str]:
    names = resolve(sorted(names))
    return [helper_source(names)] if names else []


# Identity elements and combiners of reductions, by accumulator type.
_F32_INF = "mn_inf()"  # needs helper "mn_inf"
_F32_NINF = "(-mn_inf())"


def acc_dtype(dt: DType) -> DType:
    """Type reductions accumulate in: f32 for floats (also f16), u32 for bool."""
    if dt.is_float:
        return f32
    if dt is bool_:
        return u32
    return dt


def identity(kind: str, acc: DType) -> str:
    if kind == "sum":
        return {f32: "0.0", i32: "0i", u32: "0u"}[acc]
    if kind == "max":
        return {f32: _F32_NINF, i32: "bitcast<i32>(0x80000000u)", u32: "0u"}[acc]
    if kind == "min":
        return {f32: _F32_INF, i32: "2147483647i", u32: "0xffffffffu"}[acc]
    raise CodegenError(f"unknown reduction kind {kind!r}; expected sum, max or min")


def combine(kind: str, a: str, b: str) -> str:
    if kind == "sum":
        return f"({a} + {b})"
    return f"{kind}({a}, {b})"
