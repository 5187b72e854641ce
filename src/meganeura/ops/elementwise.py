"""Elementwise ops: unary math, binary arithmetic with numpy broadcasting, comparisons, where,
cast, stop_gradient, full.  Each VJP is the exact derivative of its own forward."""

from __future__ import annotations

import math

import numpy as np
from scipy import special as _special

from ..dtypes import DType, as_dtype, bool_, u32
from ..errors import DTypeError, GraphBuildError
from ..graph import Value, as_shape
from . import reduce as _reduce
from ._common import (
    TensorType,
    broadcast_shapes,
    coerce_pair,
    defop,
    register_builder,
    require_float,
    same_dtype,
)
from .lowering import Pointwise

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_C = 0.044715


def _g(x: Value):
    return x.graph


# ---------------------------------------------------------------------------------------------
# unary


def _unary_infer(kind: str):
    def infer(types, attrs):
        (t,) = types
        if kind == "float":
            require_float(t)
        elif kind == "signed" and t.dtype in (bool_, u32):
            raise DTypeError(f"operand must be a signed number, got {t.dtype.name}")
        return [t]

    return infer


def _unary(name, kind, ref, vjp, expr, helpers=()):
    """Register unary op ``name`` and its builder/method."""
    defop(name, _unary_infer(kind), lambda xs, a: [np.asarray(ref(xs[0]), dtype=xs[0].dtype)],
          vjp, Pointwise(expr, tuple(helpers)))

    def build(x: Value) -> Value:
        return x.graph.apply(name, x)

    build.__name__ = name
    build.__doc__ = f"Elementwise {name}."
    register_builder(name, build)
    return build


def _stable_sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype)


neg = _unary("neg", "signed", np.negative, lambda n, c: [-c[0]], "(-{0})")
abs = _unary("abs", "signed", np.abs, lambda n, c: [c[0] * sign(n.inputs[0])], "abs({0})")
sign = _unary("sign", "signed", np.sign, lambda n, c: [zeros_like(n.inputs[0])], "sign({0})")
exp = _unary("exp", "float", np.exp, lambda n, c: [c[0] * n.out], "exp({0})")
log = _unary("log", "float", np.log, lambda n, c: [c[0] / n.inputs[0]], "log({0})")
sqrt = _unary("sqrt", "float", np.sqrt, lambda n, c: [c[0] * 0.5 / n.out], "sqrt({0})")
rsqrt = _unary(
    "rsqrt", "float", lambda x: 1.0 / np.sqrt(x),
    lambda n, c: [c[0] * (-0.5) * n.out * n.out * n.out], "inverseSqrt({0})",
)
reciprocal = _unary(
    "reciprocal", "float", lambda x: 1.0 / x, lambda n, c: [-c[0] * n.out * n.out], "(1.0 / {0})"
)
square = _unary("square", "signed", np.square, lambda n, c: [c[0] * 2 * n.inputs[0]], "({0} * {0})")
# relu's VJP reads its output (relu(x) > 0 exactly where x > 0): the output is usually stored
# anyway (the next layer's input), so the input need not stay alive for the backward.
relu = _unary(
    "relu", "float", lambda x: np.maximum(x, 0),
    lambda n, c: [where(n.out > 0, c[0], 0.0)], "max({0}, 0.0)",
)
sigmoid = _unary(
    "sigmoid", "float", _stable_sigmoid,
    lambda n, c: [c[0] * n.out * (1.0 - n.out)], "mn_sigmoid({0})", ["mn_sigmoid"],
)
tanh = _unary(
    "tanh", "float", np.tanh, lambda n, c: [c[0] * (1.0 - n.out * n.out)], "mn_tanh({0})",
    ["mn_tanh"],
)
# expm1: exp(x) - 1 without cancellation near 0 (the Taylor series where |x| < 0.5; WGSL's
# exp/log are only accurate to a few ulp / 2^-21 absolute, so Kahan's log trick would not do).
def _expm1_series() -> str:
    """Horner form of x·(1 + x/2! + … + x^8/9!): relative error < 1e-9 for |x| < 0.5."""
    body = repr(1.0 / math.factorial(10))
    for k in range(9, 1, -1):
        body = f"({1.0 / math.factorial(k)!r} + {{0}} * {body})"
    return f"{{0}} * (1.0 + {{0}} * {body})"


expm1 = _unary(
    "expm1", "float", np.expm1, lambda n, c: [c[0] * exp(n.inputs[0])],
    f"select(exp({{0}}) - 1.0, {_expm1_series()}, abs({{0}}) < 0.5)",
)
sin = _unary("sin", "float", np.sin, lambda n, c: [c[0] * cos(n.inputs[0])], "sin({0})")
cos = _unary("cos", "float", np.cos, lambda n, c: [-c[0] * sin(n.inputs[0])], "cos({0})")
floor = _unary(
    "floor", "float", np.floor, lambda n, c: [zeros_like(n.inputs[0])], "floor({0})"
)
erf = _unary(
    "erf", "float", _special.erf,
    lambda n, c: [c[0] * (2.0 / math.sqrt(math.pi)) * exp(-square(n.inputs[0]))],
    "mn_erf({0})", ["mn_erf"],
)


def _silu_vjp(n, c):
    x = n.inputs[0]
    s = sigmoid(x)
    return [c[0] * (s * (1.0 + x * (1.0 - s)))]


silu = _unary(
    "silu", "float", lambda x: x * _stable_sigmoid(x), _silu_vjp,
    "({0} * mn_sigmoid({0}))", ["mn_sigmoid"],
)


# gelu has an attribute (approximate) so it is registered by hand.
def _gelu_ref(xs, attrs):
    x = xs[0]
    if attrs["approximate"] == "tanh":
        y = 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x**3)))
    else:
        y = 0.5 * x * (1.0 + _special.erf(x * _INV_SQRT_2))
    return [np.asarray(y, dtype=x.dtype)]


def _gelu_vjp(n, c):
    x = n.inputs[0]
    if n.attrs["approximate"] == "tanh":
        t = tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x))
        dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
    else:
        d = 0.5 * (1.0 + erf(x * _INV_SQRT_2)) + x * exp(-0.5 * x * x) * _INV_SQRT_2PI
    return [c[0] * d]


def _gelu_lower(attrs, in_types, out_types):
    if attrs["approximate"] == "tanh":
        return Pointwise("mn_gelu_tanh({0})", ("mn_tanh", "mn_gelu_tanh"))
    return Pointwise("mn_gelu_erf({0})", ("mn_erf", "mn_gelu_erf"))


def _gelu_infer(types, attrs):
    require_float(types[0])
    if attrs.get("approximate") not in ("none", "tanh"):
        raise GraphBuildError(
            f"approximate must be 'none' or 'tanh', got {attrs.get('approximate')!r}"
        )
    return [types[0]]


defop("gelu", _gelu_infer, _gelu_ref, _gelu_vjp, _gelu_lower)


@register_builder("gelu")
def gelu(x: Value, approximate: str = "none") -> Value:
    """GELU; ``approximate='none'`` is the exact erf form, ``'tanh'`` the tanh approximation."""
    return x.graph.apply("gelu", x, approximate=approximate)


# ---------------------------------------------------------------------------------------------
# binary with broadcasting


def _sum_to(g: Value, shape) -> Value:
    return _reduce.sum_to(g, shape)


def _binary_infer(kind: str):
    def infer(types, attrs):
        dt = same_dtype(types)
        if kind in ("arith", "float") and dt is bool_:
            raise DTypeError("arithmetic on bool tensors; cast to a number type first")
        if kind == "float":
            require_float(types[0])
        shape = broadcast_shapes(*(t.shape for t in types))
        return [TensorType(shape, bool_ if kind == "compare" else dt)]

    return infer


def _binary(name, kind, ref, vjp, expr, helpers=()):
    def reference(xs, attrs):
        out = ref(xs[0], xs[1])
        return [np.asarray(out, dtype=bool if kind == "compare" else xs[0].dtype)]

    defop(name, _binary_infer(kind), reference, vjp, Pointwise(expr, tuple(helpers)))

    def build(a, b) -> Value:
        a, b = coerce_pair(a, b, name)
        return a.graph.apply(name, a, b)

    build.__name__ = name
    register_builder(name, build)
    return build


def _bvjp(fa, fb):
    """VJP of a broadcasting binary op from the two partial cotangents (full-shape)."""

    def vjp(n, c):
        a, b = n.inputs
        ga = _sum_to(fa(n, c[0]), a.shape) if fa and a.dtype.is_float else None
        gb = _sum_to(fb(n, c[0]), b.shape) if fb and b.dtype.is_float else None
        return [ga, gb]

    return vjp


add = _binary("add", "arith", np.add, _bvjp(lambda n, c: c, lambda n, c: c), "({0} + {1})")
sub = _binary("sub", "arith", np.subtract, _bvjp(lambda n, c: c, lambda n, c: -c), "({0} - {1})")
mul = _binary(
    "mul", "arith", np.multiply,
    _bvjp(lambda n, c: c * n.inputs[1], lambda n, c: c * n.inputs[0]), "({0} * {1})",
)
div = _binary(
    "div", "float", np.divide,
    _bvjp(lambda n, c: c / n.inputs[1], lambda n, c: -c * n.out / n.inputs[1]), "({0} / {1})",
)


def _pow_grad_base(n, c):
    # PyTorch's convention: d/da is 0 where the exponent is 0 (also at a == 0, where the
    # unmasked formula would give 0 * inf).
    a, b = n.inputs
    return where(b.eq(0.0), 0.0, c * b * pow(a, b - 1.0))


def _pow_grad_exp(n, c):
    # PyTorch's convention: d/db is 0 where the base is 0 and the exponent is >= 0.
    a, b = n.inputs
    zero_base = logical_and(a.eq(0.0), b >= 0.0)
    safe = where(zero_base, 1.0, a)  # keeps log (and its own VJP) finite where masked
    return where(zero_base, 0.0, c * n.out * log(safe))


pow = _binary(
    "pow", "float", np.power, _bvjp(_pow_grad_base, _pow_grad_exp), "mn_pow({0}, {1})", ["mn_pow"]
)


def _tie_mask(n, first: bool):
    """1 where this operand wins, 0.5 at ties (PyTorch splits the gradient evenly)."""
    a, b = n.inputs
    win = (a > b) if (n.op == "maximum") == first else (a < b)
    tie = a.eq(b)
    return where(win, 1.0, where(tie, 0.5, 0.0)).cast(a.dtype)


maximum = _binary(
    "maximum", "arith", np.maximum,
    _bvjp(lambda n, c: c * _tie_mask(n, True), lambda n, c: c * _tie_mask(n, False)),
    "max({0}, {1})",
)
minimum = _binary(
    "minimum", "arith", np.minimum,
    _bvjp(lambda n, c: c * _tie_mask(n, True), lambda n, c: c * _tie_mask(n, False)),
    "min({0}, {1})",
)

less = _binary("less", "compare", np.less, None, "({0} < {1})")
less_equal = _binary("less_equal", "compare", np.less_equal, None, "({0} <= {1})")
greater = _binary("greater", "compare", np.greater, None, "({0} > {1})")
greater_equal = _binary("greater_equal", "compare", np.greater_equal, None, "({0} >= {1})")
equal = _binary("equal", "compare", np.equal, None, "({0} == {1})")
not_equal = _binary("not_equal", "compare", np.not_equal, None, "({0} != {1})")


def _logical_infer(types, attrs):
    for t in types:
        if t.dtype is not bool_:
            raise DTypeError(f"logical ops take bool operands, got {t.dtype.name}")
    return [TensorType(broadcast_shapes(*(t.shape for t in types)), bool_)]


defop("logical_and", _logical_infer, lambda xs, a: [np.logical_and(*xs)], None,
      Pointwise("({0} && {1})"))
defop("logical_or", _logical_infer, lambda xs, a: [np.logical_or(*xs)], None,
      Pointwise("({0} || {1})"))
defop("logical_not", _logical_infer, lambda xs, a: [np.logical_not(xs[0])], None,
      Pointwise("(!{0})"))


@register_builder("logical_and")
def logical_and(a: Value, b: Value) -> Value:
    return a.graph.apply("logical_and", a, b)


@register_builder("logical_or")
def logical_or(a: Value, b: Value) -> Value:
    return a.graph.apply("logical_or", a, b)


@register_builder("logical_not")
def logical_not(a: Value) -> Value:
    return a.graph.apply("logical_not", a)


# ---------------------------------------------------------------------------------------------
# where


def _where_infer(types, attrs):
    c, a, b = types
    if c.dtype is not bool_:
        raise DTypeError(f"where: condition must be bool, got {c.dtype.name}")
    dt = same_dtype([a, b])
    return [TensorType(broadcast_shapes(c.shape, a.shape, b.shape), dt)]


def _where_vjp(n, c):
    cond, a, b = n.inputs
    g = c[0]
    zero = zeros_like(g)
    ga = _sum_to(where(cond, g, zero), a.shape) if a.dtype.is_float else None
    gb = _sum_to(where(cond, zero, g), b.shape) if b.dtype.is_float else None
    return [None, ga, gb]


defop("where", _where_infer, lambda xs, a: [np.where(xs[0], xs[1], xs[2]).astype(xs[1].dtype)],
      _where_vjp, Pointwise("select({2}, {1}, {0})"))


@register_builder("where")
def where(cond: Value, a, b) -> Value:
    """``a`` where ``cond`` else ``b`` (broadcasting; scalars adopt the other branch's dtype)."""
    if not isinstance(a, Value) and not isinstance(b, Value):
        a = cond.graph.scalar(a)
    a, b = coerce_pair(a, b, "where")
    return cond.graph.apply("where", cond, a, b)


# ---------------------------------------------------------------------------------------------
# cast, stop_gradient, full


def _cast_infer(types, attrs):
    return [TensorType(types[0].shape, attrs["dtype"])]


def _cast_vjp(n, c):
    src = n.inputs[0].dtype
    if not (src.is_float and n.out.dtype.is_float):
        return [None]
    return [c[0].cast(src)]


def _cast_lower(attrs, in_types, out_types):
    dt: DType = attrs["dtype"]
    reg = "bool" if dt is bool_ else dt.wgsl
    return Pointwise(f"{reg}({{0}})")


def _cast_ref(xs, a):
    x, dt = xs[0], a["dtype"]
    if dt.is_float and np.issubdtype(x.dtype, np.floating):
        # float -> float: the interpreter rounds to the graph dtype itself (float32 mode) and
        # keeps double precision in float64 mode, like every other float op.
        return [x]
    return [x.astype(dt.np)]


defop("cast", _cast_infer, _cast_ref, _cast_vjp, _cast_lower)


@register_builder("cast")
def cast(x: Value, dtype) -> Value:
    dt = as_dtype(dtype)
    if dt == x.dtype:
        return x
    return x.graph.apply("cast", x, dtype=dt)


defop("stop_gradient", lambda t, a: [t[0]], lambda xs, a: [xs[0]], lambda n, c: [None],
      Pointwise("{0}"))


@register_builder("stop_gradient")
def stop_gradient(x: Value) -> Value:
    """Identity forward; blocks gradients flowing back through it."""
    return x.graph.apply("stop_gradient", x)


def _full_infer(types, attrs):
    return [TensorType(as_shape(attrs["shape"], "full"), attrs["dtype"])]


def _full_lower(attrs, in_types, out_types):
    dt: DType = attrs["dtype"]
    v = attrs["value"]
    if dt is bool_:
        return Pointwise("true" if v else "false")
    if dt.is_float:
        return Pointwise(f"{dt.wgsl}({float(v)!r})")
    return Pointwise(f"{dt.wgsl}({int(v)})")


def _full_ref(xs, a):
    # Floats in float64: the interpreter rounds to the graph dtype only when asked to
    # (float32 mode).
    dt = a["dtype"]
    return [np.full(a["shape"], a["value"], dtype=np.float64 if dt.is_float else dt.np)]


defop("full", _full_infer, _full_ref, None, _full_lower)


def zeros_like(x: Value) -> Value:
    return x.graph.full(x.shape, 0, x.dtype)


def ones_like(x: Value) -> Value:
    return x.graph.full(x.shape, 1, x.dtype)
