"""Converters of ATen's matmuls, reductions, softmax, convolution, pooling, normalization,
attention, interpolation and dropout.

The norms are compositions of primitive ops, like ``mn.nn``'s layers (so autodiff gives their
exact gradients).  Batch norm in training mode (``_native_batch_norm_legit_functional``)
also returns the new running statistics; the importer turns the export's buffer mutations into
``Graph.set_update``s of the matching states, so they advance after every step as in PyTorch.
"""

from __future__ import annotations

import math

import numpy as np

from ... import ops
from ...dtypes import bool_, f32
from .convert import aten, static_array

# ------------------------------------------------------------------ matmul


def _rhs(b):
    """``b`` as (operand, transposed): a transposed 2-D view feeds the matmul directly
    (``transpose_b``), the layout ``nn.Linear`` exports as ``permute(w) → addmm``."""
    n = b.node
    if n.op == "permute" and b.ndim == 2 and n.attrs["perm"] == (1, 0):
        return n.inputs[0], True
    return b, False


def _mm(a, b):
    rhs, tb = _rhs(b)
    return ops.matmul(a, rhs, transpose_b=tb)


@aten("mm.default", "bmm.default", "matmul.default")
def _matmul(cx, a, b):
    return _mm(*cx.pair(a, b))


@aten("addmm.default", "baddbmm.default")
def _addmm(cx, bias, a, b, beta=1, alpha=1):
    x, y = cx.pair(a, b)
    out = _mm(x, y)
    out = out * float(alpha) if alpha != 1 else out
    if beta == 0:
        return out
    c = cx.v(bias, cx.out_dtype)
    return out + (c * float(beta) if beta != 1 else c)


# ------------------------------------------------------------------ reductions


def _dims(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    return tuple(int(d) for d in dim) if isinstance(dim, (list, tuple)) else int(dim)


def _reduction(fn, float_only=False):
    def conv(cx, x, dim=None, keepdim=False, dtype=None):
        v = cx.v(x, cx.out_dtype if (float_only or dtype is not None) else None)
        if v.dtype is bool_:
            v = ops.cast(v, cx.out_dtype)
        return ops.cast(fn(v, _dims(v, dim), keepdims=bool(keepdim)), cx.out_dtype)

    return conv


aten("sum.dim_IntList", "sum.default")(_reduction(ops.sum))
aten("mean.dim", "mean.default")(_reduction(ops.mean, float_only=True))
aten("amax.default")(_reduction(ops.max))
aten("amin.default")(_reduction(ops.min))
aten("logsumexp.default")(_reduction(ops.logsumexp, float_only=True))


@aten("any.dim", "any.dims", "any.default")
def _any(cx, x, dim=None, keepdim=False):
    v = ops.cast(cx.v(x), f32)
    return ops.max(v, _dims(v, dim), keepdims=bool(keepdim)) > 0.0


def _indices_unused(node):
    """Only the values output of max/min over a dim is supported (no argmax indices)."""
    for user in node.users:
        if getattr(user.target, "__name__", "") != "getitem" or user.args[1] != 0:
            return "indices output used"
    return None


@aten("max.dim", check=_indices_unused)
def _max_dim(cx, x, dim, keepdim=False):
    return ops.max(cx.v(x), int(dim), keepdims=bool(keepdim)), None


@aten("min.dim", check=_indices_unused)
def _min_dim(cx, x, dim, keepdim=False):
    return ops.min(cx.v(x), int(dim), keepdims=bool(keepdim)), None


@aten("var.correction")
def _var(cx, x, dim=None, *, correction=None, keepdim=False):
    """Variance with Bessel's correction ``correction`` (ATen's default 1)."""
    v = cx.v(x, cx.out_dtype)
    axes = _dims(v, dim)
    if axes is None:
        axes = tuple(range(v.ndim))
    axes = (axes,) if isinstance(axes, int) else axes
    n = math.prod(v.shape[a] for a in axes)
    c = 1.0 if correction is None else float(correction)
    xc = v - ops.mean(v, axes, keepdims=True)
    scale = 1.0 / (n - c) if n > c else float("nan")
    return ops.sum(xc * xc, axes, keepdims=bool(keepdim)) * scale


@aten("_softmax.default", "softmax.int")
def _softmax(cx, x, dim, half_to_float=False):
    return ops.softmax(cx.v(x, cx.out_dtype), int(dim))


@aten("_log_softmax.default", "log_softmax.int")
def _log_softmax(cx, x, dim, half_to_float=False):
    return ops.log_softmax(cx.v(x, cx.out_dtype), int(dim))


# ------------------------------------------------------------------ convolution and pooling


def _conv_check(node):
    a = list(node.args) + [None] * 9
    if a[6]:
        return "transposed convolution"
    if len(node.meta["val"].shape) not in (3, 4):
        return f"{len(node.meta['val'].shape) - 2}-d convolution"
    return None


@aten("convolution.default", check=_conv_check)
def _convolution(cx, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    x, w = cx.pair(x, w)
    b = None if b is None else cx.v(b, cx.out_dtype)
    if x.ndim == 3:
        return ops.conv1d(x, w, b, int(stride[0]), int(padding[0]), int(dilation[0]),
                          int(groups))
    return ops.conv2d(x, w, b, tuple(stride), tuple(padding), tuple(dilation), int(groups))


def _pool_check(node):
    """Ceil mode only where it gives the floor-mode size (the common case of even inputs)."""
    args = list(node.args)
    name = node.target.__name__
    if name.startswith("max_pool2d_with") and _indices_unused(node):
        return "indices output used"
    ceil_at = 5 if name.startswith("max_pool") else 4
    ceil = args[ceil_at] if len(args) > ceil_at else node.kwargs.get("ceil_mode", False)
    if name.startswith("avg_pool") and len(args) > 6 and args[6] is not None:
        return "divisor_override"
    if not ceil:
        return None
    x = node.args[0].meta["val"]
    k = list(args[1]) * (2 // len(args[1]))
    s = (list(args[2]) or k) if len(args) > 2 else k
    s = s * (2 // len(s))
    p = (list(args[3]) if len(args) > 3 else [0]) or [0]
    p = p * (2 // len(p))
    for i in range(2):
        span = int(x.shape[2 + i]) + 2 * p[i] - k[i]
        if span % s[i]:
            return "ceil_mode=True"
    return None


@aten("max_pool2d_with_indices.default", "max_pool2d.default", check=_pool_check)
def _max_pool(cx, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    y = ops.max_pool2d(cx.v(x), tuple(kernel), tuple(stride) or None, padding, dilation)
    return (y, None) if cx.node.target.__name__.startswith("max_pool2d_with") else y


@aten("avg_pool2d.default", check=_pool_check)
def _avg_pool(cx, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    return ops.avg_pool2d(cx.v(x), tuple(kernel), tuple(stride) or None, padding,
                          count_include_pad=bool(count_include_pad))


def _adaptive_check(node):
    x, out = node.args[0].meta["val"].shape[-2:], node.args[1]
    if any(int(d) % int(o) for d, o in zip(x, out)):
        return "output size not dividing the input"
    return None


@aten("_adaptive_avg_pool2d.default", "adaptive_avg_pool2d.default", check=_adaptive_check)
def _adaptive_avg(cx, x, output_size):
    x = cx.v(x)
    h, w = x.shape[-2:]
    oh, ow = (int(o) for o in output_size)
    if (oh, ow) == (1, 1):
        return ops.mean(x, (-2, -1), keepdims=True)
    return ops.avg_pool2d(x, (h // oh, w // ow))


# ------------------------------------------------------------------ normalization


def _affine(y, w, b, shape):
    if w is not None:
        y = y * ops.reshape(w, shape)
    if b is not None:
        y = y + ops.reshape(b, shape)
    return y


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _opt(cx, t):
    return None if t is None else cx.v(t, cx.out_dtype)


@aten("native_layer_norm.default")
def _layer_norm(cx, x, shape, w, b, eps):
    x = cx.v(x, cx.out_dtype)
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    mean = ops.mean(x, axes, keepdims=True)
    xc = x - mean
    rstd = ops.rsqrt(ops.mean(xc * xc, axes, keepdims=True) + float(eps))
    y = _affine(xc * rstd, _opt(cx, w), _opt(cx, b), tuple(shape))
    return y, mean, rstd


@aten("native_group_norm.default")
def _group_norm(cx, x, w, b, n, c, hw, group, eps):
    x = cx.v(x, cx.out_dtype)
    h = ops.reshape(x, (int(n), int(group), -1))
    mean = ops.mean(h, -1, keepdims=True)
    hc = h - mean
    rstd = ops.rsqrt(ops.mean(hc * hc, -1, keepdims=True) + float(eps))
    y = _affine(ops.reshape(hc * rstd, x.shape), _opt(cx, w), _opt(cx, b), _channel_shape(x))
    return y, ops.reshape(mean, (int(n), int(group))), ops.reshape(rstd, (int(n), int(group)))


def _batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = ops.mean(x, axes, keepdims=True)
    xc = x - mean
    var = ops.mean(xc * xc, axes, keepdims=True)
    return xc, mean, var


def _bn_train(cx, x, w, b, rm, rv, momentum, eps):
    """Batch statistics (biased variance) and PyTorch's running-statistic updates, which take
    the unbiased batch variance: ``running = (1 - m)·running + m·batch``."""
    x = cx.v(x, cx.out_dtype)
    xc, mean, var = _batch_stats(x)
    rstd = ops.rsqrt(var + float(eps))
    y = _affine(xc * rstd, _opt(cx, w), _opt(cx, b), _channel_shape(x))
    c = x.shape[1]
    outs = (y, ops.reshape(mean, (c,)), ops.reshape(rstd, (c,)))
    if rm is None:
        return outs
    n = x.size // c
    m = float(momentum)
    bm = ops.stop_gradient(ops.reshape(mean, (c,)))
    bv = ops.stop_gradient(ops.reshape(var, (c,)))
    new_rm = cx.v(rm) * (1.0 - m) + bm * m
    new_rv = cx.v(rv) * (1.0 - m) + bv * (m * n / max(n - 1, 1))
    return outs + (new_rm, new_rv)


def _bn_eval(cx, x, w, b, rm, rv, eps):
    x = cx.v(x, cx.out_dtype)
    shape = _channel_shape(x)
    rstd = ops.rsqrt(cx.v(rv) + float(eps))
    y = (x - ops.reshape(cx.v(rm), shape)) * ops.reshape(rstd, shape)
    return _affine(y, _opt(cx, w), _opt(cx, b), shape), cx.v(rm), rstd


@aten("_native_batch_norm_legit_functional.default")
def _bn_functional(cx, x, w, b, rm, rv, training, momentum, eps):
    if training:
        return _bn_train(cx, x, w, b, rm, rv, momentum, eps)
    y, mean, rstd = _bn_eval(cx, x, w, b, rm, rv, eps)
    return y, mean, rstd, cx.v(rm), cx.v(rv)


@aten("_native_batch_norm_legit_no_training.default")
def _bn_no_training(cx, x, w, b, rm, rv, momentum, eps):
    return _bn_eval(cx, x, w, b, rm, rv, eps)


@aten("_native_batch_norm_legit.no_stats")
def _bn_no_stats(cx, x, w, b, training, momentum, eps):
    return _bn_train(cx, x, w, b, None, None, momentum, eps)


# ------------------------------------------------------------------ attention


def _sdpa_check(node):
    a = list(node.args) + [None] * 8
    p = a[4] if a[4] is not None else node.kwargs.get("dropout_p", 0.0)
    if p:
        return "dropout_p > 0"
    if len(node.args[0].meta["val"].shape) not in (3, 4):
        return "rank other than 3 or 4"
    return None


def _attn_mask(cx, mask, sq, skv):
    """(causal, additive float mask or None) for SDPA's ``attn_mask``: a boolean mask keeps
    True positions; a constant mask equal to the lower triangle becomes ``causal``."""
    arr = static_array(mask)
    if arr is not None and arr.dtype == np.bool_:
        tri = np.tril(np.ones((sq, skv), bool))
        if np.array_equal(np.broadcast_to(arr, arr.shape[:-2] + (sq, skv)),
                          np.broadcast_to(tri, arr.shape[:-2] + (sq, skv))):
            return True, None
        return False, cx.graph.const(np.where(arr, 0.0, -np.inf).astype(np.float32))
    if arr is not None:
        return False, cx.v(mask, f32)
    m = cx.v(mask)
    if m.dtype is bool_:
        return False, ops.where(m, 0.0, float("-inf"))
    return False, ops.cast(m, f32)


@aten("scaled_dot_product_attention.default", check=_sdpa_check)
def _sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    q, k, v = (cx.v(t, cx.out_dtype) for t in (q, k, v))
    three = q.ndim == 3
    if three:
        q, k, v = (ops.unsqueeze(t, 1) for t in (q, k, v))
    causal, mask = bool(is_causal), None
    if attn_mask is not None:
        c2, mask = _attn_mask(cx, attn_mask, q.shape[2], k.shape[2])
        causal = causal or c2
    if mask is not None and mask.ndim < 4:
        mask = ops.reshape(mask, (1,) * (4 - mask.ndim) + mask.shape)
    out = ops.attention(q, k, v, causal=causal, scale=scale, mask=mask)
    return ops.squeeze(out, 1) if three else out


# ------------------------------------------------------------------ interpolation, dropout


def _src_index(out: int, size: int, scale, align_corners: bool | None) -> np.ndarray:
    """Source coordinates of each output pixel along one axis, PyTorch's rule: a given scale
    factor is used as is (1/scale), else size/out; align_corners maps the corner pixels."""
    dst = np.arange(out, dtype=np.float64)
    if align_corners:
        return dst * ((size - 1) / (out - 1)) if out > 1 else np.zeros(out)
    r = 1.0 / float(scale) if scale else size / out
    if align_corners is None:  # nearest
        return np.floor(dst * r)
    return np.maximum((dst + 0.5) * r - 0.5, 0.0)


def _scales(sf):
    return list(sf) if sf else [None, None]


@aten("upsample_nearest2d.vec", "upsample_nearest2d.default")
def _nearest(cx, x, output_size, scale_factors=None, *rest):
    """Integer factors: a reshape + broadcast (its gradient a sum); other sizes: a row gather
    per axis."""
    x = cx.v(x)
    n, c, h, w = x.shape
    oh, ow = cx.out_shape[2:]
    if oh % h == 0 and ow % w == 0:
        y = ops.reshape(x, (n, c, h, 1, w, 1))
        return ops.reshape(ops.broadcast_to(y, (n, c, h, oh // h, w, ow // w)), (n, c, oh, ow))
    sh, sw = _scales(scale_factors)
    ih = np.minimum(_src_index(oh, h, sh, None), h - 1).astype(np.int32)
    iw = np.minimum(_src_index(ow, w, sw, None), w - 1).astype(np.int32)
    y = ops.take(x, cx.graph.const(ih), 2)
    return ops.take(y, cx.graph.const(iw), 3)


def _interp_matrix(out: int, size: int, scale, align_corners: bool) -> np.ndarray:
    """(out, size) linear-interpolation weights along one axis."""
    src = _src_index(out, size, scale, bool(align_corners))
    i0 = np.minimum(np.floor(src).astype(np.int64), size - 1)
    i1 = np.minimum(i0 + 1, size - 1)
    l1 = src - i0
    m = np.zeros((out, size))
    np.add.at(m, (np.arange(out), i0), 1.0 - l1)
    np.add.at(m, (np.arange(out), i1), l1)
    return m.astype(np.float32)


@aten("upsample_bilinear2d.vec", "upsample_bilinear2d.default")
def _bilinear(cx, x, output_size, align_corners, scale_factors=None, *rest):
    """Separable: ``A_h · x · A_wᵀ`` with constant interpolation matrices (two matmuls, whose
    gradients are the transposed interpolations)."""
    x = cx.v(x, cx.out_dtype)
    h, w = x.shape[2:]
    oh, ow = cx.out_shape[2:]
    sh, sw = _scales(scale_factors)
    aw = cx.graph.const(_interp_matrix(ow, w, sw, align_corners))
    ah = cx.graph.const(_interp_matrix(oh, h, sh, align_corners))
    y = ops.matmul(x, aw, transpose_b=True)
    return ops.matmul(ops.reshape(ah, (1, 1, oh, h)), y)


def _dropout_check(node):
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else True
    return "training mode with p > 0 (call module.eval() or set p=0)" if p and train else None


@aten("native_dropout.default", check=_dropout_check)
def _dropout(cx, x, p, train=True):
    v = cx.v(x)
    return v, cx.graph.full(v.shape, True, bool_)


@aten("dropout.default", check=_dropout_check)
def _dropout_plain(cx, x, p, train=True):
    return cx.v(x)

