"""Small helpers shared by the op families: registration, broadcasting, axes, scalar coercion."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..dtypes import DType
from ..errors import AxisError, DTypeError, GraphBuildError, ShapeError
from ..graph import OpDef, TensorType, Value, _user_location, register_builder, register_op

__all__ = [
    "defop", "broadcast_shapes", "normalize_axes", "normalize_axis", "coerce_pair",
    "require_float", "same_dtype", "TensorType", "Value", "register_builder", "build_error",
    "axis_for", "axes_for",
]


def defop(name, infer, reference, vjp=None, lowering=None, operand_ranges=None) -> OpDef:
    return register_op(OpDef(name, infer, reference, vjp, lowering,
                             operand_ranges=operand_ranges))


def build_error(exc_type: type, op: str, msg: str, *operands) -> Exception:
    """An error found by a builder before ``Graph.apply``, worded like apply's own errors: the op,
    the problem, the operand types and the user's file:line."""
    shown = ", ".join(str(v.type) if isinstance(v, Value) else repr(v) for v in operands)
    return exc_type(f"{op}: {msg} (operands: {shown or 'none'}; at {_user_location()})")


def axis_for(op: str, axis, x: Value, ndim: int | None = None) -> int:
    """``normalize_axis`` for a builder: errors name the op, the operand and the user's line."""
    try:
        return normalize_axis(axis, x.ndim if ndim is None else ndim)
    except AxisError as e:
        raise build_error(AxisError, op, str(e), x) from None


def axes_for(op: str, axis, x: Value) -> tuple[int, ...]:
    try:
        return normalize_axes(axis, x.ndim)
    except AxisError as e:
        raise build_error(AxisError, op, str(e), x) from None


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy broadcasting; raises ShapeError naming the incompatible dimension."""
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(nd):
        dims = {s[len(s) - nd + i] for s in shapes if len(s) - nd + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            shown = " and ".join(str(tuple(s)) for s in shapes)
            raise ShapeError(f"shapes {shown} cannot be broadcast (axis {i - nd}: {sorted(dims)})")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def normalize_axis(axis: int, ndim: int) -> int:
    """A non-negative axis.  Like PyTorch, a rank-0 tensor accepts axis 0 or -1 (returned as 0)."""
    if isinstance(axis, np.integer):
        axis = int(axis)
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise AxisError(f"axis must be an int, got {axis!r}")
    if ndim == 0:
        if axis not in (0, -1):
            raise AxisError(f"axis {axis} is out of range for a rank-0 tensor")
        return 0
    if not -ndim <= axis < ndim:
        raise AxisError(f"axis {axis} is out of range for a rank-{ndim} tensor")
    return axis % ndim


def normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    """None -> all axes; int or sequence -> sorted non-negative tuple; repeats are errors.
    On a rank-0 tensor axis 0/-1 is accepted and reduces nothing (PyTorch's convention)."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = tuple(normalize_axis(a, ndim) for a in axes)
    if len(set(out)) != len(out):
        raise AxisError(f"repeated axis in {axis!r}")
    return tuple(sorted(out)) if ndim else ()


def coerce_pair(a, b, op: str) -> tuple[Value, Value]:
    """Turn a Python scalar operand into a rank-0 constant of the other operand's dtype."""
    if isinstance(a, Value) and isinstance(b, Value):
        return a, b
    if isinstance(a, Value):
        return a, _scalar_like(b, a, op)
    if isinstance(b, Value):
        return _scalar_like(a, b, op), b
    raise build_error(GraphBuildError, op, "at least one operand must be a graph Value", a, b)


def _scalar_like(x, like: Value, op: str) -> Value:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        try:
            x = float(x)  # numpy scalars
        except (TypeError, ValueError):
            raise build_error(
                GraphBuildError, op, f"cannot combine a graph Value with {type(x).__name__}",
                like, x,
            ) from None
    if not like.dtype.is_float and isinstance(x, float) and not float(x).is_integer():
        raise build_error(DTypeError, op, f"float scalar {x} meets an integer tensor; cast first",
                          like, x)
    return like.graph.scalar(x, like.dtype)


def require_float(t: TensorType, what: str = "operand") -> None:
    if not t.dtype.is_float:
        raise DTypeError(f"{what} must be floating point, got {t.dtype.name}")


def same_dtype(types: Sequence[TensorType]) -> DType:
    dts = {t.dtype for t in types}
    if len(dts) != 1:
        raise DTypeError(
            f"operand dtypes differ ({', '.join(t.dtype.name for t in types)}); use .cast()"
        )
    return types[0].dtype
