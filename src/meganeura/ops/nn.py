"""Neural-network ops: softmax, log_softmax, one_hot, and the losses (cross-entropy with integer
labels, mse, l1, bce_with_logits).  Class axes are the last axis."""

from __future__ import annotations

import numpy as np

from ..dtypes import as_dtype, bool_, f32
from ..errors import AxisError, DTypeError, FeedError, GraphBuildError, ShapeError
from ..graph import Value, ValueRange
from . import elementwise as E
from . import reduce as R
from . import shape as S
from ._common import (
    TensorType,
    axis_for,
    build_error,
    defop,
    register_builder,
    require_float,
)
from .lowering import Composite, Kernel

_REDUCTIONS = ("mean", "sum", "none")

# ------------------------------------------------------------------ softmax / log_softmax


def _axis_infer(types, attrs):
    (t,) = types
    require_float(t)
    if not 0 <= attrs["axis"] < max(t.ndim, 1):
        raise AxisError(f"axis {attrs['axis']} out of range for {t.shape}")
    return [t]


def _softmax_np(x, axis):
    axis = axis if x.ndim else None  # a rank-0 tensor: softmax is 1, log_softmax 0
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax_np(x, axis):
    axis = axis if x.ndim else None
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))


def _softmax_vjp(n, c):
    y, g, ax = n.out, c[0], n.attrs["axis"]
    return [y * (g - R.sum(g * y, ax, keepdims=True))]


def _log_softmax_vjp(n, c):
    y, g, ax = n.out, c[0], n.attrs["axis"]
    return [g - E.exp(y) * R.sum(g, ax, keepdims=True)]


def _expand_softmax(graph, node):
    x, ax = node.inputs[0], node.attrs["axis"]
    e = E.exp(x - R.max(x, ax, keepdims=True))
    return [e / R.sum(e, ax, keepdims=True)]


def _expand_log_softmax(graph, node):
    x, ax = node.inputs[0], node.attrs["axis"]
    z = x - R.max(x, ax, keepdims=True)
    return [z - E.log(R.sum(E.exp(z), ax, keepdims=True))]


defop("softmax", _axis_infer, lambda xs, a: [_softmax_np(xs[0], a["axis"])], _softmax_vjp,
      Composite(_expand_softmax))
defop("log_softmax", _axis_infer, lambda xs, a: [_log_softmax_np(xs[0], a["axis"])],
      _log_softmax_vjp, Composite(_expand_log_softmax))


@register_builder("softmax")
def softmax(x: Value, axis: int = -1) -> Value:
    return x.graph.apply("softmax", x, axis=axis_for("softmax", axis, x))


@register_builder("log_softmax")
def log_softmax(x: Value, axis: int = -1) -> Value:
    return x.graph.apply("log_softmax", x, axis=axis_for("log_softmax", axis, x))


# ------------------------------------------------------------------ one_hot


def _one_hot_infer(types, attrs):
    (t,) = types
    if not t.dtype.is_int:
        raise DTypeError(f"one_hot needs integer labels, got {t.dtype.name}")
    if attrs["num_classes"] < 1:
        raise ShapeError(f"num_classes must be at least 1, got {attrs['num_classes']}")
    return [TensorType(t.shape + (attrs["num_classes"],), attrs["dtype"])]


def _one_hot_ref(xs, a):
    y = xs[0]
    return [(y[..., None] == np.arange(a["num_classes"])).astype(a["dtype"].np)]


defop("one_hot", _one_hot_infer, _one_hot_ref, lambda n, c: [None], Kernel("one_hot"))


@register_builder("one_hot")
def one_hot(labels: Value, num_classes: int, dtype=f32) -> Value:
    """Rows of the identity; labels outside [0, num_classes) give all-zero rows."""
    return labels.graph.apply("one_hot", labels, num_classes=int(num_classes),
                              dtype=as_dtype(dtype))


# ------------------------------------------------------------------ cross-entropy


def _ce_infer(types, attrs):
    logits, labels = types
    if not logits.dtype.is_float:
        raise DTypeError(f"logits must be floating point, got {logits.dtype.name}")
    if not labels.dtype.is_int:
        raise DTypeError(
            f"labels must be integer class indices (i32), got {labels.dtype.name}; "
            "for probability targets use a soft-target loss"
        )
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise ShapeError(f"labels shape {labels.shape} must equal logits shape without its class "
                         f"axis {logits.shape[:-1]}")
    if attrs["reduction"] not in _REDUCTIONS:
        raise GraphBuildError(f"reduction must be one of {_REDUCTIONS}, got {attrs['reduction']!r}")
    if not 0.0 <= attrs["label_smoothing"] <= 1.0:
        raise GraphBuildError(f"label_smoothing must be in [0, 1], got {attrs['label_smoothing']}")
    shape = labels.shape if attrs["reduction"] == "none" else ()
    return [TensorType(shape, logits.dtype)]


def _ce_ref(xs, a):
    logits, labels = xs
    C = logits.shape[-1]
    logp = _log_softmax_np(logits, -1)
    valid = labels != a["ignore_index"]
    bad = valid & ((labels < 0) | (labels >= C))
    if bad.any():
        raise FeedError(f"cross_entropy: label {int(labels[bad].flat[0])} is out of range for "
                        f"{C} classes (and is not ignore_index={a['ignore_index']})")
    safe = np.where(valid, labels, 0).astype(np.int64)
    nll = -np.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    eps = a["label_smoothing"]
    per = (1.0 - eps) * nll + eps * (-np.mean(logp, axis=-1)) if eps else nll
    per = np.where(valid, per, 0.0).astype(logits.dtype)
    if a["reduction"] == "none":
        return [per]
    if a["reduction"] == "sum":
        return [np.asarray(per.sum(), dtype=logits.dtype)]
    return [np.asarray(per.sum() / valid.sum(), dtype=logits.dtype)]


def _ce_parts(logits: Value, labels: Value, a):
    """(per-example loss, valid mask as float, target distribution) built from graph ops."""
    C = logits.shape[-1]
    logp = log_softmax(logits, -1)
    valid = labels.ne(a["ignore_index"]).cast(logits.dtype)
    target = one_hot(labels, C, logits.dtype)
    eps = a["label_smoothing"]
    if eps:
        target = target * (1.0 - eps) + eps / C
    per = -R.sum(logp * target, -1) * valid
    return per, valid, target


def _ce_scale(valid: Value, a):
    if a["reduction"] == "mean":
        return 1.0 / R.sum(valid)
    return None


def _expand_ce(graph, node):
    logits, labels = node.inputs
    per, valid, _ = _ce_parts(logits, labels, node.attrs)
    red = node.attrs["reduction"]
    if red == "none":
        return [per]
    total = R.sum(per)
    return [total * _ce_scale(valid, node.attrs) if red == "mean" else total]


def _ce_vjp(n, c):
    logits, labels = n.inputs
    a = n.attrs
    g = c[0]
    valid = labels.ne(a["ignore_index"]).cast(logits.dtype)
    target = one_hot(labels, logits.shape[-1], logits.dtype)
    eps = a["label_smoothing"]
    if eps:
        target = target * (1.0 - eps) + eps / logits.shape[-1]
    d = softmax(logits, -1) - target  # d(per-example loss)/d logits for a valid row
    if a["reduction"] == "none":
        w = g * valid
    else:
        w = valid * g if a["reduction"] == "sum" else valid * (g / R.sum(valid))
    return [d * S.unsqueeze(w, -1), None]


def _ce_label_range(types, a):
    return {1: ValueRange(0, types[0].shape[-1], (a["ignore_index"],),
                          f"cross_entropy label (classes: {types[0].shape[-1]}, "
                          f"ignore_index={a['ignore_index']})")}


defop("cross_entropy", _ce_infer, _ce_ref, _ce_vjp, Composite(_expand_ce),
      operand_ranges=_ce_label_range)


@register_builder("cross_entropy")
def cross_entropy(logits: Value, labels: Value, reduction: str = "mean", ignore_index: int = -100,
                  label_smoothing: float = 0.0) -> Value:
    """Softmax cross-entropy with integer labels (class axis last), PyTorch semantics: ``mean``
    divides by the number of non-ignored labels; label smoothing mixes in the uniform target."""
    return logits.graph.apply("cross_entropy", logits, labels, reduction=reduction,
                              ignore_index=int(ignore_index),
                              label_smoothing=float(label_smoothing))


# ------------------------------------------------------------------ regression / binary losses


def _check_pair(pred: Value, target: Value, name: str):
    if not isinstance(pred, Value) or not isinstance(target, Value):
        raise build_error(GraphBuildError, name, "prediction and target must be graph Values",
                          pred, target)
    if pred.graph is not target.graph:
        raise build_error(GraphBuildError, name, "prediction and target belong to different "
                          "graphs", pred, target)
    if pred.shape != target.shape:
        raise build_error(ShapeError, name, "prediction and target differ in shape", pred, target)
    if pred.dtype != target.dtype or not pred.dtype.is_float:
        raise build_error(DTypeError, name, "prediction and target must share a floating dtype",
                          pred, target)


def _check_reduction(reduction: str, name: str, *operands) -> None:
    if reduction not in _REDUCTIONS:
        raise build_error(GraphBuildError, name,
                          f"reduction must be one of {_REDUCTIONS}, got {reduction!r}", *operands)


def _reduce_loss(per: Value, reduction: str) -> Value:
    if reduction == "mean":
        return R.mean(per)
    if reduction == "sum":
        return R.sum(per)
    return per


def mse_loss(pred: Value, target: Value, reduction: str = "mean") -> Value:
    _check_pair(pred, target, "mse_loss")
    _check_reduction(reduction, "mse_loss", pred, target)
    return _reduce_loss(E.square(pred - target), reduction)


def l1_loss(pred: Value, target: Value, reduction: str = "mean") -> Value:
    _check_pair(pred, target, "l1_loss")
    _check_reduction(reduction, "l1_loss", pred, target)
    return _reduce_loss(E.abs(pred - target), reduction)


def _bce_infer(types, attrs):
    x, y = types
    if x.shape != y.shape:
        raise ShapeError("logits and targets differ in shape")
    if x.dtype != y.dtype or not x.dtype.is_float:
        raise DTypeError("logits and targets must share a floating dtype")
    return [x]


def _bce_ref(xs, a):
    x, y = xs
    return [(np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype)]


def _bce_vjp(n, c):
    x, y = n.inputs
    return [c[0] * (E.sigmoid(x) - y), -c[0] * x]


def _expand_bce(graph, node):
    x, y = node.inputs
    return [E.relu(x) - x * y + E.log(1.0 + E.exp(-E.abs(x)))]


defop("bce_with_logits", _bce_infer, _bce_ref, _bce_vjp, Composite(_expand_bce))


def bce_with_logits(logits: Value, targets: Value, reduction: str = "mean") -> Value:
    """Binary cross-entropy on logits (numerically stable form); targets in [0, 1]."""
    _check_pair(logits, targets, "bce_with_logits")
    _check_reduction(reduction, "bce_with_logits", logits, targets)
    per = logits.graph.apply("bce_with_logits", logits, targets)
    return _reduce_loss(per, reduction)


del bool_
