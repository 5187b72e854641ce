"""Index-remapping copy kernels that strides cannot express: concat and pad_slice (the adjoint
of slice: the slice region filled from the input, zeros elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DType, f16
from .archetypes import kernel_family
from .common import WG, Bindings
from .ir import KernelSpec, Strided


@dataclass(frozen=True)
class ConcatKernel:
    """Writes ``inputs`` (joined along ``axis``, together of shape ``shape``) into the output of
    shape ``out_shape`` starting at index ``axis_start`` of the axis: a concat with more inputs
    than a stage may bind is several such kernels filling one output."""

    shape: tuple[int, ...]
    axis: int
    inputs: tuple[Strided, ...]
    dtype: DType
    out_shape: tuple[int, ...] = ()
    axis_start: int = 0
    name: str = "concat"


@dataclass(frozen=True)
class PadSliceKernel:
    shape: tuple[int, ...]
    starts: tuple[int, ...]
    steps: tuple[int, ...]
    input: Strided
    dtype: DType
    name: str = "pad_slice"


def _header(dt: DType, bd: Bindings) -> str:
    return "\n".join((["enable f16;"] if dt is f16 else []) + bd.decls())


def _grid(total: int) -> tuple[tuple[int, int, int], int]:
    groups = max(1, -(-total // WG))
    gx = min(groups, 65535)
    gy = -(-groups // gx)
    return (gx, gy, 1), gx


def _coords(shape) -> list[str]:
    """WGSL lines computing c0..c{n-1} from the linear index i (row-major)."""
    lines, rem = [], "i"
    for d in range(len(shape) - 1, -1, -1):
        lines.append(f"  let c{d} = ({rem}) % {shape[d]}u;")
        rem = f"({rem}) / {shape[d]}u"
    return lines


def _addr(s: Strided, coord: list[str]) -> str:
    terms = [f"{s.offset}"] + [f"i32({c}) * {st}" for c, st in zip(coord, s.strides) if st]
    return "u32(" + " + ".join(terms) + ")"


def _main(total: int, gx: int, body: list[str]) -> str:
    return "\n".join([
        f"@compute @workgroup_size({WG})",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, "
        "@builtin(local_invocation_index) lid: u32) {",
        f"  let i = (wid.y * {gx}u + wid.x) * {WG}u + lid;",
        f"  if (i >= {total}u) {{ return; }}",
        *body,
        "}",
    ])


@kernel_family("concat", ConcatKernel)
def emit_concat(k: ConcatKernel, limits=None, features=None, alias=None) -> KernelSpec:
    total = max(1, _size(k.shape))
    grid, gx = _grid(total)
    n = len(k.inputs)
    bd = Bindings([k.dtype] * (n + 1), alias)
    body = _coords(k.shape)
    out_shape = k.out_shape or k.shape
    out_strides = Strided.contiguous(k.dtype, out_shape).strides
    terms = [f"(c{a}{f' + {k.axis_start}u' if a == k.axis and k.axis_start else ''}) * {st}u"
             for a, st in enumerate(out_strides)]
    body.append(f"  let o = {' + '.join(terms) or '0u'};")
    start = 0
    for j, s in enumerate(k.inputs):
        d = s.shape[k.axis]
        coord = [f"c{a}" if a != k.axis else f"(c{a} - {start}u)" for a in range(len(k.shape))]
        cond = f"c{k.axis} < {start + d}u"
        kw = "if" if j == 0 else "else if"
        if j == n - 1:
            copy = f"{bd.name(n)}[o] = {bd.name(j)}[{_addr(s, coord)}];"
            body.append(f"  else {{ {copy} }}" if n > 1 else f"  {copy}")
        else:
            body.append(f"  {kw} ({cond}) {{ {bd.name(n)}[o] = {bd.name(j)}[{_addr(s, coord)}]; }}")
        start += d
    src = _header(k.dtype, bd) + "\n" + _main(total, gx, body)
    return KernelSpec(k.name, src, bd.n, grid)


@kernel_family("pad_slice", PadSliceKernel)
def emit_pad_slice(k: PadSliceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    bd = Bindings([k.dtype, k.dtype], alias)
    total = max(1, _size(k.shape))
    grid, gx = _grid(total)
    body = _coords(k.shape)
    conds, coord = [], []
    for a, (st, step, n) in enumerate(zip(k.starts, k.steps, k.input.shape)):
        conds.append(f"c{a} >= {st}u && (c{a} - {st}u) % {step}u == 0u && "
                     f"(c{a} - {st}u) / {step}u < {n}u")
        coord.append(f"((c{a} - {st}u) / {step}u)")
    zero = "0u" if k.dtype.name == "bool" else f"{k.dtype.wgsl}(0)"
    cond = " && ".join(f"({c})" for c in conds) or "true"
    out, src = bd.name(1), bd.name(0)
    body.append(f"  if ({cond}) {{ {out}[i] = {src}[{_addr(k.input, coord)}]; }} "
                f"else {{ {out}[i] = {zero}; }}")
    return KernelSpec(k.name, _header(k.dtype, bd) + "\n" + _main(total, gx, body), bd.n, grid)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
