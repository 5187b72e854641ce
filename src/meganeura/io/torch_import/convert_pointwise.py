"""Converters of ATen's pointwise ops: arithmetic, comparisons, unary functions, casts and
constants shaped like a tensor.  ATen promotes dtypes implicitly; every converter casts its
operands to the node's result dtype (or, for comparisons, to the promoted operand dtype)."""

from __future__ import annotations

import math

import torch

from ... import ops
from ...dtypes import bool_, f32
from .convert import aten, promoted


def _scaled(cx, b, alpha):
    if alpha == 1:
        return b
    return cx.v(b, cx.out_dtype) * alpha


@aten("add.Tensor", "add.Scalar")
def _add(cx, a, b, alpha=1):
    x, y = cx.pair(a, b)
    return x + _scaled(cx, y, alpha)


@aten("sub.Tensor", "sub.Scalar")
def _sub(cx, a, b, alpha=1):
    x, y = cx.pair(a, b)
    return x - _scaled(cx, y, alpha)


@aten("rsub.Scalar", "rsub.Tensor")
def _rsub(cx, a, b, alpha=1):
    x, y = cx.pair(a, b)
    return y - _scaled(cx, x, alpha)


@aten("mul.Tensor", "mul.Scalar")
def _mul(cx, a, b):
    """On booleans ATen's mul is a logical and (``torch.isclose`` decomposes into one)."""
    x, y = cx.pair(a, b)
    return ops.logical_and(x, y) if x.dtype is bool_ else x * y


@aten("div.Tensor", "div.Scalar")
def _div(cx, a, b):
    x, y = cx.pair(a, b)
    return x / y


def _trunc(q):
    return ops.where(q < 0, -ops.floor(-q), ops.floor(q))


@aten("div.Tensor_mode", "div.Scalar_mode")
def _div_mode(cx, a, b, rounding_mode=None):
    x, y = cx.pair(a, b, f32)
    q = x / y
    if rounding_mode == "floor":
        q = ops.floor(q)
    elif rounding_mode == "trunc":
        q = _trunc(q)
    return ops.cast(q, cx.out_dtype)


@aten("remainder.Tensor", "remainder.Scalar")
def _remainder(cx, a, b):
    """Python's modulo (the sign of the divisor), as ATen: a - floor(a / b) * b."""
    x, y = cx.pair(a, b, f32)
    return ops.cast(x - ops.floor(x / y) * y, cx.out_dtype)


@aten("pow.Tensor_Scalar", "pow.Tensor_Tensor")
def _pow(cx, a, b):
    x = cx.v(a, cx.out_dtype)
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        if b == 2:
            return ops.square(x)
        if b == 0.5:
            return ops.sqrt(x)
        if b == -1:
            return ops.reciprocal(x)
        return x ** float(b)
    return x ** cx.v(b, cx.out_dtype)


@aten("pow.Scalar")
def _pow_scalar(cx, a, b):
    return float(a) ** cx.v(b, cx.out_dtype)


@aten("maximum.default")
def _maximum(cx, a, b):
    return ops.maximum(*cx.pair(a, b))


@aten("minimum.default")
def _minimum(cx, a, b):
    return ops.minimum(*cx.pair(a, b))


def _clamp_values(cx, y, lo, hi, inclusive: bool):
    """``min(max(y, lo), hi)`` as two selects, so that the gradient at the bounds is
    PyTorch's: ``clamp`` passes it where ``lo <= y <= hi`` (``inclusive``), ``hardtanh`` only
    where ``lo < y < hi``.  (``maximum``/``minimum`` would split it in halves at ties.)"""
    if lo is not None:
        y, lo = cx.pair(y, lo)
        y = ops.where(y < lo if inclusive else y <= lo, lo, y)
    if hi is not None:
        y, hi = cx.pair(y, hi)
        y = ops.where(y > hi if inclusive else y >= hi, hi, y)
    return y


@aten("clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_max.default",
      "hardtanh.default")
def _clamp(cx, x, lo=None, hi=None):
    name = cx.node.target.__name__
    if name.startswith("clamp_max"):
        lo, hi = None, lo
    hardtanh = name.startswith("hardtanh")
    if hardtanh and lo is None:
        lo, hi = -1.0, 1.0
    return _clamp_values(cx, cx.v(x, cx.out_dtype), lo, hi, inclusive=not hardtanh)


@aten("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar")
def _where(cx, c, a, b):
    return ops.where(cx.v(c, bool_), *cx.pair(a, b))


def _compare(op):
    def conv(cx, a, b):
        x, y = cx.pair(a, b, promoted(a, b))
        return op(x, y)

    return conv


for _n, _op in (("eq", lambda x, y: x.eq(y)), ("ne", lambda x, y: x.ne(y)),
                ("lt", lambda x, y: x < y), ("le", lambda x, y: x <= y),
                ("gt", lambda x, y: x > y), ("ge", lambda x, y: x >= y)):
    aten(f"{_n}.Tensor", f"{_n}.Scalar")(_compare(_op))


def _bool_only(node):
    """ATen's bitwise ops are our logical ops on booleans only."""
    v = node.meta.get("val")
    return None if v is None or v.dtype == torch.bool else f"on {v.dtype} (not bool)"


@aten("logical_and.default")
def _and(cx, a, b):
    return ops.logical_and(cx.v(a, bool_), cx.v(b, bool_))


@aten("logical_or.default")
def _or(cx, a, b):
    return ops.logical_or(cx.v(a, bool_), cx.v(b, bool_))


@aten("logical_not.default")
def _not(cx, a):
    return ops.logical_not(cx.v(a, bool_))


aten("bitwise_and.Tensor", check=_bool_only)(_and)
aten("bitwise_or.Tensor", check=_bool_only)(_or)
aten("bitwise_not.default", check=_bool_only)(_not)

_UNARY = {
    "neg": ops.neg, "abs": ops.abs, "exp": ops.exp, "expm1": ops.expm1, "log": ops.log,
    "sqrt": ops.sqrt, "rsqrt": ops.rsqrt, "reciprocal": ops.reciprocal, "sin": ops.sin,
    "cos": ops.cos, "tanh": ops.tanh, "sigmoid": ops.sigmoid, "relu": ops.relu, "erf": ops.erf,
    "sign": ops.sign, "floor": ops.floor, "silu": ops.silu,
    "log1p": lambda x: ops.log(x + 1.0),
    "log2": lambda x: ops.log(x) * (1.0 / math.log(2.0)),
    "log10": lambda x: ops.log(x) * (1.0 / math.log(10.0)),
    "exp2": lambda x: ops.exp(x * math.log(2.0)),
    "ceil": lambda x: -ops.floor(-x),
    "trunc": _trunc,
    "square": ops.square,
}


def _unary(fn):
    def conv(cx, x):
        return fn(cx.v(x, cx.out_dtype))

    return conv


for _n, _f in _UNARY.items():
    aten(f"{_n}.default")(_unary(_f))


@aten("gelu.default")
def _gelu(cx, x, approximate="none"):
    return ops.gelu(cx.v(x, cx.out_dtype), approximate=approximate)


@aten("leaky_relu.default")
def _leaky_relu(cx, x, slope=0.01):
    y = cx.v(x, cx.out_dtype)
    return ops.where(y > 0, y, y * float(slope))


@aten("elu.default")
def _elu(cx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    y = cx.v(x, cx.out_dtype)
    # a select, not minimum(y, 0): the gradient at 0 is the negative branch's whole (ATen's
    # rule), where minimum would halve it
    neg = ops.expm1(ops.where(y > 0, 0.0, y) * float(input_scale)) * float(alpha)
    return ops.where(y > 0, y, neg) * float(scale)


@aten("_to_copy.default", "clone.default", "alias.default", "lift_fresh_copy.default",
      "detach.default", "contiguous.default")
def _copy(cx, x, *args, **kwargs):
    """Copies and casts: a cast to the result's dtype (nothing when it is the same)."""
    return cx.v(x, cx.out_dtype)


@aten("_assert_tensor_metadata.default")
def _assert_meta(cx, *args, **kwargs):
    """Export's dtype/shape assertions: the graph's types already say the same."""
    return None


@aten("full_like.default", "zeros_like.default", "ones_like.default")
def _full_like(cx, x, fill=None, **kwargs):
    name = cx.node.target.__name__
    value = {"zeros_like": 0, "ones_like": 1}.get(name, fill)
    dt = cx.out_dtype
    return cx.graph.full(cx.out_shape, value if not dt.is_float else float(value), dt)


@aten("scalar_tensor.default")
def _scalar_tensor(cx, s, **kwargs):
    return cx.graph.full((), s, cx.out_dtype)

