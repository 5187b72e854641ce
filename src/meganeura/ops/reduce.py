"""Reductions over axes (with keepdims): sum, mean, max, min, logsumexp."""

from __future__ import annotations

import builtins

import numpy as np

from ..dtypes import bool_
from ..errors import AxisError, DTypeError
from ..graph import Value
from . import elementwise as _ew
from . import shape as _shape
from ._common import TensorType, axes_for, defop, register_builder, require_float
from .lowering import Composite, Reduce


def _reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_infer(need_float: bool):
    def infer(types, attrs):
        (t,) = types
        if need_float:
            require_float(t)
        elif t.dtype is bool_:
            raise DTypeError("cannot reduce a bool tensor; cast it first")
        axes = attrs["axes"]
        if any(a >= builtins.max(t.ndim, 1) for a in axes):
            raise AxisError(f"axes {axes} out of range for rank {t.ndim}")
        return [TensorType(_reduced_shape(t.shape, axes, attrs["keepdims"]), t.dtype)]

    return infer


def expand_back(c: Value, x_shape, axes, keepdims) -> Value:
    """Broadcast a reduced cotangent back to the input shape."""
    if not keepdims:
        c = _shape.reshape(c, _reduced_shape(x_shape, axes, True))
    return _shape.broadcast_to(c, x_shape)


def _sum_vjp(n, c):
    x = n.inputs[0]
    return [expand_back(c[0], x.shape, n.attrs["axes"], n.attrs["keepdims"])]


def _count(shape, axes) -> int:
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


def _mean_vjp(n, c):
    x = n.inputs[0]
    scale = 1.0 / builtins.max(_count(x.shape, n.attrs["axes"]), 1)
    return [expand_back(c[0] * scale, x.shape, n.attrs["axes"], n.attrs["keepdims"])]


def _extreme_vjp(n, c):
    # Gradient shared evenly between tied extremes (PyTorch's amax/amin convention).
    x = n.inputs[0]
    axes, kd = n.attrs["axes"], n.attrs["keepdims"]
    out = expand_back(n.out, x.shape, axes, kd)
    mask = x.eq(out).cast(x.dtype)
    count = sum(mask, axes, keepdims=True)
    return [expand_back(c[0], x.shape, axes, kd) * mask / count]


def _ref(fn):
    def reference(xs, attrs):
        x = xs[0]
        return [np.asarray(fn(x, axis=attrs["axes"], keepdims=attrs["keepdims"]), dtype=x.dtype)]

    return reference


def _expand_mean(graph, node):
    x = node.inputs[0]
    s = sum(x, node.attrs["axes"], node.attrs["keepdims"])
    return [s * (1.0 / builtins.max(_count(x.shape, node.attrs["axes"]), 1))]


def _logsumexp_ref(x, axis, keepdims):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def _logsumexp_vjp(n, c):
    x = n.inputs[0]
    axes, kd = n.attrs["axes"], n.attrs["keepdims"]
    lse = expand_back(n.out, x.shape, axes, kd)
    return [expand_back(c[0], x.shape, axes, kd) * _ew.exp(x - lse)]


def _expand_logsumexp(graph, node):
    x = node.inputs[0]
    axes, kd = node.attrs["axes"], node.attrs["keepdims"]
    m = _ew.stop_gradient(max(x, axes, keepdims=True))
    s = sum(_ew.exp(x - m), axes, keepdims=True)
    out = _ew.log(s) + m
    return [out if kd else _shape.reshape(out, _reduced_shape(x.shape, axes, False))]


defop("sum", _reduce_infer(False), _ref(np.sum), _sum_vjp, Reduce("sum"))
defop("mean", _reduce_infer(True), _ref(np.mean), _mean_vjp, Composite(_expand_mean))
defop("max", _reduce_infer(False), _ref(np.max), _extreme_vjp, Reduce("max"))
defop("min", _reduce_infer(False), _ref(np.min), _extreme_vjp, Reduce("min"))
defop("logsumexp", _reduce_infer(True), _ref(_logsumexp_ref), _logsumexp_vjp,
      Composite(_expand_logsumexp))


def _builder(name):
    def build(x: Value, axis=None, keepdims: bool = False) -> Value:
        axes = axes_for(name, axis, x)
        return x.graph.apply(name, x, axes=axes, keepdims=bool(keepdims))

    build.__name__ = name
    build.__doc__ = f"{name} over ``axis`` (None: all axes), optionally keeping reduced dims."
    register_builder(name, build)
    return build


sum = _builder("sum")
mean = _builder("mean")
max = _builder("max")
min = _builder("min")
logsumexp = _builder("logsumexp")


def sum_to(x: Value, shape) -> Value:
    """Sum a broadcast result back down to ``shape`` (the VJP of broadcasting)."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1
    )
    s = sum(x, axes, keepdims=True) if axes else x
    return _shape.reshape(s, shape)
