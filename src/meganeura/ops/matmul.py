"""Batched matrix multiply with broadcast batch dims; operands may be read transposed in place."""

from __future__ import annotations

import numpy as np

from ..errors import DTypeError, GraphBuildError, ShapeError
from ..graph import Value
from . import reduce as _reduce
from . import shape as _shape
from ._common import (
    TensorType,
    broadcast_shapes,
    build_error,
    defop,
    register_builder,
    same_dtype,
)
from .lowering import Matmul


def _mk(shape, t):
    return (shape[-1], shape[-2]) if t else (shape[-2], shape[-1])


def _matmul_infer(types, attrs):
    a, b = types
    dt = same_dtype(types)
    if not dt.is_float:
        raise DTypeError(f"matmul needs floating point operands, got {dt.name}")
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError("matmul operands must have rank >= 2 (the builder lifts vectors)")
    m, k = _mk(a.shape, attrs["transpose_a"])
    k2, n = _mk(b.shape, attrs["transpose_b"])
    if k != k2:
        raise ShapeError(f"inner dimensions differ: {a.shape} @ {b.shape} "
                         f"(contracting {k} with {k2})")
    try:
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ShapeError as e:
        raise ShapeError(f"batch dims: {e}") from None
    return [TensorType(batch + (m, n), dt)]


def _matmul_ref(xs, attrs):
    a, b = xs
    if attrs["transpose_a"]:
        a = np.swapaxes(a, -1, -2)
    if attrs["transpose_b"]:
        b = np.swapaxes(b, -1, -2)
    return [np.ascontiguousarray(np.matmul(a, b))]


def _matmul_vjp(n, c):
    a, b = n.inputs
    g = c[0]
    ta, tb = n.attrs["transpose_a"], n.attrs["transpose_b"]
    if not ta and not tb:
        ga, gb = matmul(g, b, transpose_b=True), matmul(a, g, transpose_a=True)
    elif not ta and tb:
        ga, gb = matmul(g, b), matmul(g, a, transpose_a=True)
    elif ta and not tb:
        ga, gb = matmul(b, g, transpose_b=True), matmul(a, g)
    else:
        ga, gb = (matmul(b, g, transpose_a=True, transpose_b=True),
                  matmul(g, a, transpose_a=True, transpose_b=True))
    return [_reduce.sum_to(ga, a.shape), _reduce.sum_to(gb, b.shape)]


defop("matmul", _matmul_infer, _matmul_ref, _matmul_vjp, Matmul())


@register_builder("matmul")
def matmul(a: Value, b: Value, transpose_a: bool = False, transpose_b: bool = False) -> Value:
    """``a @ b`` with numpy semantics (vectors lifted and dropped again); ``transpose_a/b``
    contract the operand's last two axes swapped without materializing the transpose."""
    if not isinstance(a, Value) or not isinstance(b, Value):
        raise build_error(GraphBuildError, "matmul", "both operands must be graph Values", a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise build_error(ShapeError, "matmul", "operands must not be rank-0 (scalars)", a, b)
    va, vb = a.ndim == 1, b.ndim == 1
    a2 = _shape.reshape(a, (1, a.shape[0])) if va else a
    b2 = _shape.reshape(b, (b.shape[0], 1)) if vb else b
    out = a.graph.apply("matmul", a2, b2, transpose_a=bool(transpose_a and not va),
                        transpose_b=bool(transpose_b and not vb))
    if va or vb:
        shape = out.shape[:-2] + (() if va else (out.shape[-2],)) + (() if vb else (out.shape[-1],))
        out = _shape.reshape(out, shape)
    return out
