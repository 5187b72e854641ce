"""Convolution and pooling ops (NCHW): conv2d and its two gradients as ops of their own,
max/avg pooling and their gradients, and conv1d built on conv2d.

Every op here has an exact numpy reference (float64-exact, so the VJPs can be checked against
PyTorch and finite differences) and lowers to a dedicated kernel archetype (``kernels/conv.py``,
``kernels/pool.py``): the convolutions are implicit GEMMs, deterministic (no float atomics) —
except 1×1, stride-1, unpadded ones with enough output tiles, which the compiler expands into
batched matmuls over strided views (``Kernel.rewrite``, section "1×1 convolutions" below).

Attribute conventions (all tuples, so graphs hash and print stably):

* ``stride`` ``(sh, sw)``, ``dilation`` ``(dh, dw)``, ``groups`` an int;
* ``padding`` ``((top, bottom), (left, right))`` — asymmetric padding is allowed for
  convolutions; pooling pads symmetrically (PyTorch's rule: at most half the kernel).

Gradients:

* ``conv2d`` → ``conv2d_input_grad(dy, w)`` (a transposed convolution, needs the input's
  spatial size) and ``conv2d_weight_grad(x, dy)``; the bias gradient is ``dy.sum((0, 2, 3))``.
  Both gradient ops are linear in each operand and their own VJPs are again convolutions, so
  second-order gradients work (except through a split weight gradient, see below).
* ``conv2d_weight_grad`` reduces over ``N·OH·OW``; with ``split = S > 1`` it returns ``S``
  partial sums over consecutive chunks of that range (shape ``(S, O, C/groups, kh, kw)``) and
  the builder adds them with an ordinary ``sum`` — a deterministic split-K that keeps a large
  GPU busy when the weight is small and the image large.  The VJP picks ``S`` from the shapes
  (:func:`weight_grad_split`).
* ``max_pool2d`` computes the values and the argmax (flat ``ih * W + iw`` index in the input
  plane, PyTorch's ``return_indices`` convention); its gradient scatters ``dy`` to that argmax.
  Tie policy (PyTorch's): windows are scanned row by row, left to right, and the *first*
  maximal element wins and gets the whole gradient (a NaN counts as maximal, the last NaN
  wins, as in PyTorch's CPU kernel; on the GPU NaN handling is best effort).  Padding never
  wins: a window is initialized with its first in-bounds element.
* ``avg_pool2d`` (``count_include_pad`` as in PyTorch, floor mode) and ``avg_pool2d_grad``;
  each is the other's adjoint, so second order works.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..dtypes import i32
from ..errors import AutodiffError, DTypeError, GraphBuildError, ShapeError
from ..graph import Value
from . import reduce as R
from . import shape as S
from ._common import TensorType, build_error, defop, register_builder, require_float
from .lowering import Kernel

__all__ = [
    "conv2d", "conv2d_input_grad", "conv2d_weight_grad", "conv1d", "max_pool2d",
    "max_pool2d_with_indices", "max_pool2d_grad", "avg_pool2d", "avg_pool2d_grad",
    "conv_output_size", "weight_grad_split", "normalize_padding",
]

# ---------------------------------------------------------------------------------------------
# argument normalization


def _pair(v, what: str, low: int = 1) -> tuple[int, int]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (int(v), int(v))
    try:
        a, b = (int(x) for x in v)
        if any(isinstance(x, bool) or int(x) != x for x in v):
            raise TypeError
    except (TypeError, ValueError):
        raise GraphBuildError(f"{what} must be an int or a pair of ints, got {v!r}") from None
    if a < low or b < low:
        raise GraphBuildError(f"{what} must be >= {low}, got {v!r}")
    return a, b


def normalize_padding(padding, kernel=None, dilation=(1, 1), stride=(1, 1)):
    """``int`` | ``(ph, pw)`` | ``((top, bottom), (left, right))`` | ``'valid'`` | ``'same'``
    (stride 1 only; the odd extra pixel goes bottom/right, as in PyTorch) →
    ``((top, bottom), (left, right))``."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding == "same":
            if tuple(stride) != (1, 1):
                raise GraphBuildError("padding='same' needs stride 1 (as in PyTorch)")
            out = []
            for k, d in zip(kernel, dilation, strict=True):
                total = d * (k - 1)
                out.append((total // 2, total - total // 2))
            return tuple(out)
        raise GraphBuildError(f"padding must be an int, pairs, 'valid' or 'same', got {padding!r}")
    if isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        p = int(padding)
        res = ((p, p), (p, p))
    else:
        try:
            items = list(padding)
        except TypeError:
            raise GraphBuildError(f"bad padding {padding!r}") from None
        if len(items) != 2:
            raise GraphBuildError(f"padding must have 2 entries (height, width), got {padding!r}")
        res = []
        for it in items:
            if isinstance(it, (int, np.integer)) and not isinstance(it, bool):
                res.append((int(it), int(it)))
            else:
                try:
                    a, b = (int(x) for x in it)
                except (TypeError, ValueError):
                    raise GraphBuildError(f"bad padding {padding!r}") from None
                res.append((a, b))
        res = tuple(res)
    if any(p < 0 for pair in res for p in pair):
        raise GraphBuildError(f"padding must be >= 0, got {padding!r}")
    return res


def conv_output_size(size: int, k: int, stride: int, pad: tuple[int, int], dilation: int) -> int:
    """Output length of a convolution / pooling window along one axis (floor mode)."""
    return (size + pad[0] + pad[1] - dilation * (k - 1) - 1) // stride + 1


def _conv_attrs(attrs):
    return attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"]


def _check_conv_attrs(attrs):
    st, pad, dil, groups = _conv_attrs(attrs)
    if len(st) != 2 or min(st) < 1:
        raise ShapeError(f"stride must be two ints >= 1, got {st}")
    if len(dil) != 2 or min(dil) < 1:
        raise ShapeError(f"dilation must be two ints >= 1, got {dil}")
    if len(pad) != 2 or any(len(p) != 2 or min(p) < 0 for p in pad):
        raise ShapeError(f"padding must be ((top, bottom), (left, right)) >= 0, got {pad}")
    if not isinstance(groups, int) or groups < 1:
        raise ShapeError(f"groups must be an int >= 1, got {groups!r}")


def _out_hw(h, w, kh, kw, attrs):
    st, pad, dil, _ = _conv_attrs(attrs)
    oh = conv_output_size(h, kh, st[0], pad[0], dil[0])
    ow = conv_output_size(w, kw, st[1], pad[1], dil[1])
    if oh < 1 or ow < 1:
        raise ShapeError(
            f"the {kh}x{kw} kernel (dilation {dil}) does not fit the {h}x{w} input padded by "
            f"{pad}: output would be {oh}x{ow}")
    return oh, ow


def _same_float(types, what):
    for t in types:
        require_float(t, what)
    if len({t.dtype for t in types}) != 1:
        names = ", ".join(t.dtype.name for t in types)
        raise DTypeError(f"{what}: operand dtypes differ ({names})")


# ---------------------------------------------------------------------------------------------
# numpy references (float64-exact; vectorized over batch and channels)


def _windows(x, kh, kw, oh, ow, attrs, fill=0.0):
    """(N, C, OH, OW, kh, kw) view of the padded input: the receptive field of every output."""
    st, pad, dil, _ = _conv_attrs(attrs)
    xp = np.pad(x, ((0, 0), (0, 0), pad[0], pad[1]), constant_values=fill)
    sn, sc, sh, sw = xp.strides
    n, c = x.shape[:2]
    return np.lib.stride_tricks.as_strided(
        xp, (n, c, oh, ow, kh, kw),
        (sn, sc, sh * st[0], sw * st[1], sh * dil[0], sw * dil[1]), writeable=False)


def _conv2d_ref(xs, attrs):
    x, w = xs[0], xs[1]
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    g = attrs["groups"]
    oh, ow = _out_hw(h, wd, kh, kw, attrs)
    win = _windows(x, kh, kw, oh, ow, attrs).reshape(n, g, cg, oh, ow, kh, kw)
    y = np.einsum("ngcpqij,gocij->ngopq", win, w.reshape(g, o // g, cg, kh, kw), optimize=True)
    y = y.reshape(n, o, oh, ow)
    if len(xs) == 3:
        y = y + xs[2].reshape(1, o, 1, 1)
    return [np.ascontiguousarray(y, dtype=x.dtype)]


def _input_grad_ref(xs, attrs):
    dy, w = xs
    n, o, oh, ow = dy.shape
    _, cg, kh, kw = w.shape
    g = attrs["groups"]
    h, wd = attrs["input_size"]
    st, pad, dil, _ = _conv_attrs(attrs)
    hp, wp = h + sum(pad[0]), wd + sum(pad[1])
    dxp = np.zeros((n, g, cg, hp, wp), dtype=np.result_type(dy, w))
    dyg = dy.reshape(n, g, o // g, oh, ow)
    wg = w.reshape(g, o // g, cg, kh, kw)
    for i in range(kh):
        for j in range(kw):
            part = np.einsum("ngopq,goc->ngcpq", dyg, wg[..., i, j], optimize=True)
            r0, c0 = i * dil[0], j * dil[1]
            dxp[:, :, :, r0:r0 + (oh - 1) * st[0] + 1:st[0],
                c0:c0 + (ow - 1) * st[1] + 1:st[1]] += part
    dx = dxp[:, :, :, pad[0][0]:pad[0][0] + h, pad[1][0]:pad[1][0] + wd]
    return [np.ascontiguousarray(dx.reshape(n, g * cg, h, wd), dtype=dy.dtype)]


def _weight_grad_ref(xs, attrs):
    x, dy = xs
    n, c, h, wd = x.shape
    _, o, oh, ow = dy.shape
    kh, kw = attrs["kernel_size"]
    g = attrs["groups"]
    cg = c // g
    split = attrs["split"]
    win = _windows(x, kh, kw, oh, ow, attrs).reshape(n, g, cg, oh, ow, kh, kw)
    if split == 1:
        dw = np.einsum("ngcpqij,ngopq->gocij", win, dy.reshape(n, g, o // g, oh, ow),
                       optimize=True)
        return [np.ascontiguousarray(dw.reshape(o, cg, kh, kw), dtype=x.dtype)]
    kt = n * oh * ow
    a = dy.reshape(n, g, o // g, oh * ow).transpose(1, 2, 0, 3).reshape(g, o // g, kt)
    b = win.transpose(1, 2, 5, 6, 0, 3, 4).reshape(g, cg * kh * kw, kt)
    chunk = -(-kt // split)
    parts = []
    for s in range(split):
        lo, hi = s * chunk, min((s + 1) * chunk, kt)
        parts.append(np.einsum("gok,gqk->goq", a[:, :, lo:hi], b[:, :, lo:hi]))
    dw = np.stack(parts).reshape(split, o, cg, kh, kw)
    return [np.ascontiguousarray(dw, dtype=x.dtype)]


# ---------------------------------------------------------------------------------------------
# conv2d and its gradients


def _conv2d_infer(types, attrs):
    if len(types) not in (2, 3):
        raise ShapeError(f"conv2d takes (x, weight[, bias]), got {len(types)} operands")
    _check_conv_attrs(attrs)
    x, w = types[0], types[1]
    _same_float(types, "conv2d")
    if x.ndim != 4:
        raise ShapeError(f"input must be 4-D (N, C, H, W), got {x.shape}")
    if w.ndim != 4:
        raise ShapeError(f"weight must be 4-D (O, C/groups, kh, kw), got {w.shape}")
    g = attrs["groups"]
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    if c % g or o % g:
        raise ShapeError(f"groups={g} must divide input channels {c} and output channels {o}")
    if cg * g != c:
        raise ShapeError(f"weight expects {cg} x groups={g} = {cg * g} input channels, input "
                         f"has {c}")
    if min(kh, kw) < 1:
        raise ShapeError(f"empty kernel {w.shape}")
    if len(types) == 3 and types[2].shape != (o,):
        raise ShapeError(f"bias must have shape ({o},), got {types[2].shape}")
    oh, ow = _out_hw(h, wd, kh, kw, attrs)
    return [TensorType((n, o, oh, ow), x.dtype)]


# weight_grad_split: chunks of at least WGRAD_MIN_CHUNK until WGRAD_TARGET 64×64 tiles exist
# (two workgroups per SM of a 132-SM GPU); before 2026-12 the rule was chunks >= 1024 and 128
# tiles (ResNet-50 weight gradients at 14×14 and 7×7 unsplit).  The H200 sweep of
# bench/conv_bench.py (docs/benchmarks.md) chose these: e.g. 1×1 1024→256 at 14×14, 216 µs
# unsplit, 89 µs in 4 chunks of 196, 110 µs in 3.
WGRAD_MIN_CHUNK = 192
WGRAD_TARGET = 264


def weight_grad_split(n_reduce: int, rows: int, cols: int) -> int:
    """How many partial sums ``conv2d_weight_grad`` uses: the (N·OH·OW) reduction is cut into
    chunks of at least ``WGRAD_MIN_CHUNK`` so that about ``WGRAD_TARGET`` output tiles (64×64)
    exist in all; 1 for small problems.  Depends on shapes only (plans stay
    device-independent)."""
    tiles = max(1, -(-rows // 64) * -(-cols // 64))
    s = min(n_reduce // WGRAD_MIN_CHUNK, -(-WGRAD_TARGET // tiles), 32)
    return max(1, s)


def _conv2d_vjp(n, c):
    x, w = n.inputs[0], n.inputs[1]
    a = n.attrs
    dy = c[0]
    dx = conv2d_input_grad(dy, w, x.shape[2:], **_kw(a))
    o, cg, kh, kw = w.shape
    _, _, oh, ow = dy.shape
    split = _wgrad_split(x.shape[0], oh * ow, o, cg, kh, kw, a)
    dw = conv2d_weight_grad(x, dy, (kh, kw), split=split, **_kw(a))
    out = [dx, dw]
    if len(n.inputs) == 3:
        out.append(R.sum(dy, (0, 2, 3)))
    return out


def _wgrad_split(n: int, ohw: int, o: int, cg: int, kh: int, kw: int, a) -> int:
    """The weight gradient's ``split``: ``weight_grad_split``, except for a 1×1 convolution
    whose matmul form pays with one partial product per image while that rule's chunks cannot
    be addressed by a batched matmul (the reduction over several images at once, 7×7 maps)."""
    g = a["groups"]
    split = weight_grad_split(n * ohw, o // g, cg * kh * kw)
    if n > 1 and _pointwise_conv(a, (kh, kw)) and wgrad_chunk(n, ohw, split) is None and \
            _matmul_pays(n, o, cg):
        return n
    return split


def _kw(a):
    return {"stride": a["stride"], "padding": a["padding"], "dilation": a["dilation"],
            "groups": a["groups"]}


# ---------------------------------------------------------------------------------------------
# 1×1 convolutions as batched matmuls
#
# A 1×1, stride-1, unpadded, ungrouped convolution is a matmul per image over the (C, H·W) view
# of NCHW: y[n] = W @ x[n], dx[n] = Wᵀ @ dy[n], dW = Σ_n dy[n] @ x[n]ᵀ.  The matmul kernel
# (vec4 staging, register prefetch, tuned tiles) runs these faster than the implicit-GEMM
# template, whose staging pays ~25 integer ops per element for index math a 1×1 kernel does not
# need.  The three ops keep their kernels as lowering and say through ``Kernel.rewrite`` where
# the matmul form is used instead; the compile pass that expands composites applies it, after
# autodiff, so gradients, fusion (a pointwise consumer becomes the matmul's epilogue through the
# reshape), the tuner (the matmul's candidates) and the profiler (``matmul B×M×N×K`` rows) see
# ordinary matmuls.  Views only: the reshapes and permutes fold into the matmul's strides.

# Fewest 64×64 output tiles (times the batch) for which the matmul form is used.  The matmul
# has no split-K for batched problems, the conv kernels do (``choose_split_k``): below this the
# conv path keeps the GPU busier.  H200 sweep (docs/benchmarks.md, 2026-12-01, 1×1 section):
# with ≥ 196 tiles the matmul beat the conv plan on 9 of 11 problems (e.g. 256→1024 at 14×14
# forward 112 vs 195 µs, weight gradients 85–116 vs 131–139 µs); at 128 tiles (2048→512 at
# 7×7, input gradient) the split conv kernel won (119 vs 132 µs), at 32 tiles clearly (115 vs
# 306 µs forward).
MATMUL_MIN_TILES = 192


def _pointwise_conv(attrs, kernel) -> bool:
    """1×1 kernel, stride 1, no padding, one group: a matmul per image."""
    st, pad, _, groups = _conv_attrs(attrs)
    return tuple(kernel) == (1, 1) and st == (1, 1) and pad == ((0, 0), (0, 0)) and groups == 1


def _matmul_pays(batch: int, rows: int, cols: int) -> bool:
    return batch * -(-rows // 64) * -(-cols // 64) >= MATMUL_MIN_TILES


def _forward_rewrite(attrs, in_types, out_types):
    x, w = in_types[0], in_types[1]
    n, _, h, wd = x.shape
    if _pointwise_conv(attrs, w.shape[2:]) and _matmul_pays(n, w.shape[0], h * wd):
        return _forward_as_matmul
    return None


def _forward_as_matmul(graph, node):
    """y[n] = W (O, C) @ x[n] (C, H·W), plus the bias as an ordinary add (the epilogue)."""
    x, w = node.inputs[0], node.inputs[1]
    n, c, h, wd = x.shape
    o = w.shape[0]
    y = graph.apply("matmul", S.reshape(w, (o, c)), S.reshape(x, (n, c, h * wd)),
                    transpose_a=False, transpose_b=False, f32_only=True)
    y = S.reshape(y, (n, o, h, wd))
    if len(node.inputs) == 3:
        y = y + S.reshape(node.inputs[2], (o, 1, 1))
    return [y]


def _input_grad_rewrite(attrs, in_types, out_types):
    dy, w = in_types
    n, _, h, wd = dy.shape
    if _pointwise_conv(attrs, w.shape[2:]) and _matmul_pays(n, w.shape[1], h * wd):
        return _input_grad_as_matmul
    return None


def _input_grad_as_matmul(graph, node):
    """dx[n] = Wᵀ (C, O) @ dy[n] (O, H·W); the transpose is a stride swap."""
    dy, w = node.inputs
    n, o, h, wd = dy.shape
    c = w.shape[1]
    dx = graph.apply("matmul", S.reshape(w, (o, c)), S.reshape(dy, (n, o, h * wd)),
                     transpose_a=True, transpose_b=False, f32_only=True)
    return [S.reshape(dx, (n, c, h, wd))]


def wgrad_chunk(n: int, hw: int, split: int) -> int | None:
    """Length of the weight gradient's ``split`` chunks of the (n, p) range when a batched
    matmul can address them (one batch stride): one chunk per image, or equal chunks of the
    only image; None otherwise (chunks straddling or cutting several images)."""
    total = n * hw
    if total % split:
        return None
    ch = total // split
    return ch if ch == hw or n == 1 else None


def _weight_grad_rewrite(attrs, in_types, out_types):
    x, dy = in_types
    n, c, h, wd = x.shape
    split, o = attrs["split"], dy.shape[1]
    if not _pointwise_conv(attrs, attrs["kernel_size"]) or \
            wgrad_chunk(n, h * wd, split) is None:
        return None
    return _weight_grad_as_matmul if _matmul_pays(split, o, c) else None


def _weight_grad_as_matmul(graph, node):
    """Chunk s of the partial sums: dy[chunk s] (O, ch) @ x[chunk s]ᵀ (ch, C), a batch over the
    chunks (of one image each, or of the one image cut along H·W)."""
    x, dy = node.inputs
    n, c, h, wd = x.shape
    o, split = dy.shape[1], node.attrs["split"]
    ch = wgrad_chunk(n, h * wd, split)

    def chunks(v, rows):
        if n == 1:  # (rows, S, ch) -> (S, rows, ch)
            return S.permute(S.reshape(v, (rows, split, ch)), (1, 0, 2))
        return S.reshape(v, (n, rows, ch))

    dw = graph.apply("matmul", chunks(dy, o), chunks(x, c), transpose_a=False,
                     transpose_b=True, f32_only=True)
    return [S.reshape(dw, ((split,) if split > 1 else ()) + (o, c, 1, 1))]


defop("conv2d", _conv2d_infer, _conv2d_ref, _conv2d_vjp,
      Kernel("conv2d", rewrite=_forward_rewrite))


def _input_grad_infer(types, attrs):
    _check_conv_attrs(attrs)
    dy, w = types
    _same_float(types, "conv2d_input_grad")
    if dy.ndim != 4 or w.ndim != 4:
        raise ShapeError(f"dy and weight must be 4-D, got {dy.shape} and {w.shape}")
    g = attrs["groups"]
    n, o, oh, ow = dy.shape
    o2, cg, kh, kw = w.shape
    if o2 != o or o % g:
        raise ShapeError(f"dy has {o} channels, weight {o2} outputs (groups={g})")
    h, wd = attrs["input_size"]
    if (oh, ow) != _out_hw(h, wd, kh, kw, attrs):
        raise ShapeError(f"dy spatial size {(oh, ow)} does not match a convolution of a "
                         f"{h}x{wd} input")
    return [TensorType((n, cg * g, h, wd), dy.dtype)]


def _input_grad_vjp(n, c):
    # dx = A^T dy with A the convolution: <dx, c> = <dy, conv2d(c, w)> = <w, wgrad(c, dy)>
    dy, w = n.inputs
    a = n.attrs
    kh, kw = w.shape[2:]
    return [conv2d(c[0], w, **_kw(a)),
            conv2d_weight_grad(c[0], dy, (kh, kw), split=1, **_kw(a))]


defop("conv2d_input_grad", _input_grad_infer, _input_grad_ref, _input_grad_vjp,
      Kernel("conv2d_input_grad", rewrite=_input_grad_rewrite))


def _weight_grad_infer(types, attrs):
    _check_conv_attrs(attrs)
    x, dy = types
    _same_float(types, "conv2d_weight_grad")
    if x.ndim != 4 or dy.ndim != 4:
        raise ShapeError(f"x and dy must be 4-D, got {x.shape} and {dy.shape}")
    g = attrs["groups"]
    n, c, h, wd = x.shape
    n2, o, oh, ow = dy.shape
    kh, kw = attrs["kernel_size"]
    if n2 != n:
        raise ShapeError(f"x has batch {n}, dy {n2}")
    if c % g or o % g:
        raise ShapeError(f"groups={g} must divide channels {c} and {o}")
    if (oh, ow) != _out_hw(h, wd, kh, kw, attrs):
        raise ShapeError(f"dy spatial size {(oh, ow)} does not match a {kh}x{kw} convolution "
                         f"of a {h}x{wd} input")
    split = attrs["split"]
    if not isinstance(split, int) or split < 1:
        raise ShapeError(f"split must be an int >= 1, got {split!r}")
    shape = (o, c // g, kh, kw)
    return [TensorType(((split,) + shape) if split > 1 else shape, x.dtype)]


def _weight_grad_vjp(n, c):
    if n.attrs["split"] != 1:
        raise AutodiffError(
            f"grad: second-order gradients through a split conv2d_weight_grad (split="
            f"{n.attrs['split']}, at {n.loc}) are not supported; build it with split=1")
    x, dy = n.inputs
    a = n.attrs
    # dw = wgrad(x, dy): <dw, c> = <conv2d(x, c), dy>
    return [conv2d_input_grad(dy, c[0], x.shape[2:], **_kw(a)), conv2d(x, c[0], **_kw(a))]


defop("conv2d_weight_grad", _weight_grad_infer, _weight_grad_ref, _weight_grad_vjp,
      Kernel("conv2d_weight_grad", rewrite=_weight_grad_rewrite))


def _conv_common(stride, padding, dilation, groups, kernel):
    st = _pair(stride, "stride")
    dil = _pair(dilation, "dilation")
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise GraphBuildError(f"groups must be a positive int, got {groups!r}")
    pad = normalize_padding(padding, kernel, dil, st)
    return {"stride": st, "padding": pad, "dilation": dil, "groups": int(groups)}


def _check_values(op, *vals):
    for v in vals:
        if v is not None and not isinstance(v, Value):
            raise build_error(GraphBuildError, op, "operands must be graph Values", *vals)


@register_builder("conv2d")
def conv2d(x: Value, weight: Value, bias: Value | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1) -> Value:
    """2-D convolution (cross-correlation, as PyTorch), NCHW.  ``weight`` is
    ``(O, C/groups, kh, kw)``; ``padding`` an int, ``(ph, pw)``, ``((top, bottom), (left,
    right))``, ``'valid'`` or ``'same'``."""
    _check_values("conv2d", x, weight, bias)
    kernel = weight.shape[2:] if weight.ndim == 4 else (1, 1)
    try:
        attrs = _conv_common(stride, padding, dilation, groups, kernel)
    except GraphBuildError as e:
        raise build_error(type(e), "conv2d", str(e), x, weight) from None
    ins = (x, weight) if bias is None else (x, weight, bias)
    return x.graph.apply("conv2d", *ins, **attrs)


def conv2d_input_grad(dy: Value, weight: Value, input_size: Sequence[int], stride=1, padding=0,
                      dilation=1, groups: int = 1) -> Value:
    """Gradient of ``conv2d`` with respect to its input (a transposed convolution) for an input
    of spatial size ``input_size`` = (H, W)."""
    _check_values("conv2d_input_grad", dy, weight)
    attrs = _conv_common(stride, padding, dilation, groups, weight.shape[2:])
    return dy.graph.apply("conv2d_input_grad", dy, weight,
                          input_size=tuple(int(s) for s in input_size), **attrs)


def conv2d_weight_grad(x: Value, dy: Value, kernel_size: Sequence[int], stride=1, padding=0,
                       dilation=1, groups: int = 1, split: int = 1) -> Value:
    """Gradient of ``conv2d`` with respect to its weight, ``(O, C/groups, kh, kw)``.  ``split``
    > 1 computes that many partial sums (one kernel) and adds them with ``sum``."""
    _check_values("conv2d_weight_grad", x, dy)
    kernel = _pair(kernel_size, "kernel_size")
    attrs = _conv_common(stride, padding, dilation, groups, kernel)
    out = x.graph.apply("conv2d_weight_grad", x, dy, kernel_size=kernel, split=int(split),
                        **attrs)
    return R.sum(out, 0) if split > 1 else out


def conv1d(x: Value, weight: Value, bias: Value | None = None, stride: int = 1, padding=0,
           dilation: int = 1, groups: int = 1) -> Value:
    """1-D convolution, (N, C, L) with weight (O, C/groups, k): a conv2d over a height-1 image.
    ``padding``: an int, ``(left, right)``, ``'valid'`` or ``'same'``."""
    _check_values("conv1d", x, weight, bias)
    if x.ndim != 3 or weight.ndim != 3:
        raise build_error(ShapeError, "conv1d", "input must be (N, C, L) and weight (O, C/groups, "
                          "k)", x, weight)

    def one(v, what):
        if isinstance(v, (tuple, list)):
            if len(v) != 1:
                raise build_error(GraphBuildError, "conv1d", f"{what} must be an int", x)
            v = v[0]
        return v

    stride, dilation = one(stride, "stride"), one(dilation, "dilation")
    if isinstance(padding, str):
        if padding == "same":
            if int(stride) != 1:
                raise build_error(GraphBuildError, "conv1d", "padding='same' needs stride 1", x)
            k = weight.shape[2]
            total = int(dilation) * (k - 1)
            pad = (total // 2, total - total // 2)
        elif padding == "valid":
            pad = (0, 0)
        else:
            raise build_error(GraphBuildError, "conv1d", f"bad padding {padding!r}", x)
    elif isinstance(padding, (int, np.integer)):
        pad = (int(padding), int(padding))
    else:
        pad = tuple(int(p) for p in padding)
        if len(pad) == 1:
            pad = (pad[0], pad[0])
    n, c, length = x.shape
    o, cg, k = weight.shape
    y = conv2d(S.reshape(x, (n, c, 1, length)), S.reshape(weight, (o, cg, 1, k)), bias,
               stride=(1, stride), padding=((0, 0), pad), dilation=(1, dilation), groups=groups)
    return S.reshape(y, (n, o, y.shape[3]))


# ---------------------------------------------------------------------------------------------
# pooling


def _pool_attrs(kernel_size, stride, padding, dilation=1):
    k = _pair(kernel_size, "kernel_size")
    st = k if stride is None else _pair(stride, "stride")
    pad = _pair(padding, "padding", low=0)
    dil = _pair(dilation, "dilation")
    for p, kk, d in zip(pad, k, dil, strict=True):
        if p > (d * (kk - 1) + 1) // 2:
            raise GraphBuildError(f"pad should be at most half of the effective kernel size, "
                                  f"got padding {pad} for kernel {k} (dilation {dil})")
    return {"kernel_size": k, "stride": st, "padding": ((pad[0], pad[0]), (pad[1], pad[1])),
            "dilation": dil, "groups": 1}


def _pool_out(types, attrs, what):
    (x,) = types[:1]
    require_float(x, what)
    if x.ndim != 4:
        raise ShapeError(f"{what} needs a 4-D (N, C, H, W) input, got {x.shape}")
    kh, kw = attrs["kernel_size"]
    oh, ow = _out_hw(x.shape[2], x.shape[3], kh, kw, attrs)
    return x.shape[0], x.shape[1], oh, ow


def _pool_scan(x, attrs):
    """Yield (valid mask (OH, OW), flat input index (OH, OW), values (N, C, OH, OW)) for every
    kernel offset in window scan order (row by row, left to right)."""
    n, c, h, w = x.shape
    kh, kw = attrs["kernel_size"]
    st, pad, dil, _ = _conv_attrs(attrs)
    oh, ow = conv_output_size(h, kh, st[0], pad[0], dil[0]), conv_output_size(
        w, kw, st[1], pad[1], dil[1])
    rows0 = np.arange(oh) * st[0] - pad[0][0]
    cols0 = np.arange(ow) * st[1] - pad[1][0]
    for i in range(kh):
        for j in range(kw):
            r = rows0 + i * dil[0]
            cc = cols0 + j * dil[1]
            valid = ((r >= 0) & (r < h))[:, None] & ((cc >= 0) & (cc < w))[None, :]
            rc, ccc = np.clip(r, 0, h - 1), np.clip(cc, 0, w - 1)
            vals = x[:, :, rc[:, None], ccc[None, :]]
            yield valid, rc[:, None] * w + ccc[None, :], vals


def _max_pool_ref(xs, attrs):
    x = xs[0]
    best = idx = None
    seen = None
    for valid, flat, vals in _pool_scan(x, attrs):
        if best is None:
            best = np.full(vals.shape, -np.inf, dtype=np.result_type(x, np.float32))
            idx = np.zeros(vals.shape, dtype=np.int64)
            seen = np.zeros(valid.shape, dtype=bool)
        first = valid & ~seen  # the window's first in-bounds element: initial index
        idx = np.where(first, flat, idx)
        seen |= valid
        upd = valid & ((vals > best) | np.isnan(vals))
        best = np.where(upd, vals, best)
        idx = np.where(upd, flat, idx)
    return [best.astype(x.dtype), idx.astype(np.int32)]


def _max_pool_infer(types, attrs):
    n, c, oh, ow = _pool_out(types, attrs, "max_pool2d")
    return [TensorType((n, c, oh, ow), types[0].dtype), TensorType((n, c, oh, ow), i32)]


def _max_pool_vjp(n, c):
    x = n.inputs[0]
    y_ct = c[0]
    if y_ct is None:
        return [None]
    idx = n.outputs[1]
    return [n.out.graph.apply("max_pool2d_grad", y_ct, idx, input_size=tuple(x.shape[2:]),
                              **_pool_only(n.attrs))]


def _pool_only(a):
    return {k: a[k] for k in ("kernel_size", "stride", "padding", "dilation", "groups")}


defop("max_pool2d", _max_pool_infer, _max_pool_ref, _max_pool_vjp, Kernel("max_pool2d"))


def _max_pool_grad_infer(types, attrs):
    dy, idx = types
    require_float(dy, "max_pool2d_grad")
    if idx.dtype is not i32 or idx.shape != dy.shape or dy.ndim != 4:
        raise ShapeError(f"max_pool2d_grad takes dy and i32 indices of one 4-D shape, got "
                         f"{dy} and {idx}")
    h, w = attrs["input_size"]
    kh, kw = attrs["kernel_size"]
    if dy.shape[2:] != _out_hw(h, w, kh, kw, attrs):
        raise ShapeError(f"dy spatial size {dy.shape[2:]} does not match pooling of {h}x{w}")
    return [TensorType(dy.shape[:2] + (h, w), dy.dtype)]


def _max_pool_grad_ref(xs, attrs):
    dy, idx = xs
    n, c, oh, ow = dy.shape
    h, w = attrs["input_size"]
    dx = np.zeros((n * c, h * w), dtype=np.result_type(dy, np.float32))
    rows = np.repeat(np.arange(n * c), oh * ow)
    np.add.at(dx, (rows, idx.reshape(-1).astype(np.int64)), dy.reshape(-1))
    return [dx.reshape(n, c, h, w).astype(dy.dtype)]


def _max_pool_grad_vjp(n, c):
    raise AutodiffError(f"grad: second-order gradients through max_pool2d (at {n.loc}) are not "
                        "supported")


defop("max_pool2d_grad", _max_pool_grad_infer, _max_pool_grad_ref, _max_pool_grad_vjp,
      Kernel("max_pool2d_grad"))


def max_pool2d_with_indices(x: Value, kernel_size, stride=None, padding=0,
                            dilation=1) -> tuple[Value, Value]:
    """Max pooling (floor mode) and the argmax of every window as i32 flat indices
    ``ih * W + iw`` into the input plane (PyTorch's ``return_indices=True``)."""
    _check_values("max_pool2d", x)
    try:
        attrs = _pool_attrs(kernel_size, stride, padding, dilation)
    except GraphBuildError as e:
        raise build_error(type(e), "max_pool2d", str(e), x) from None
    return x.graph.apply("max_pool2d", x, **attrs)


@register_builder("max_pool2d")
def max_pool2d(x: Value, kernel_size, stride=None, padding=0, dilation=1) -> Value:
    """Max pooling, NCHW, floor mode; ``stride`` defaults to ``kernel_size``; padding (at most
    half the kernel) is never selected.  The gradient goes to the first maximal element of each
    window in scan order (PyTorch's tie policy)."""
    return max_pool2d_with_indices(x, kernel_size, stride, padding, dilation)[0]


def max_pool2d_grad(dy: Value, indices: Value, input_size, kernel_size, stride=None, padding=0,
                    dilation=1) -> Value:
    """``dy`` scattered (added) to the argmax positions ``indices`` of max_pool2d."""
    attrs = _pool_attrs(kernel_size, stride, padding, dilation)
    return dy.graph.apply("max_pool2d_grad", dy, indices,
                          input_size=tuple(int(s) for s in input_size), **attrs)


def _divisors(attrs, h, w):
    """(OH, OW) divisor of every window."""
    kh, kw = attrs["kernel_size"]
    if attrs["count_include_pad"]:
        st, pad, dil, _ = _conv_attrs(attrs)
        oh = conv_output_size(h, kh, st[0], pad[0], dil[0])
        ow = conv_output_size(w, kw, st[1], pad[1], dil[1])
        return np.full((oh, ow), float(kh * kw))
    count = 0
    for valid, _, _ in _pool_scan(np.zeros((1, 1, h, w)), attrs):
        count = count + valid
    return count.astype(np.float64)


def _avg_pool_ref(xs, attrs):
    x = xs[0]
    acc = 0.0
    for valid, _, vals in _pool_scan(x, attrs):
        acc = acc + np.where(valid, vals, 0.0)
    return [(acc / _divisors(attrs, *x.shape[2:])).astype(x.dtype)]


def _avg_pool_infer(types, attrs):
    n, c, oh, ow = _pool_out(types, attrs, "avg_pool2d")
    return [TensorType((n, c, oh, ow), types[0].dtype)]


def _avg_pool_vjp(n, c):
    x = n.inputs[0]
    return [avg_pool2d_grad(c[0], x.shape[2:], **_avg_only(n.attrs))]


def _avg_only(a):
    return {"kernel_size": a["kernel_size"], "stride": a["stride"],
            "padding": (a["padding"][0][0], a["padding"][1][0]),
            "count_include_pad": a["count_include_pad"]}


defop("avg_pool2d", _avg_pool_infer, _avg_pool_ref, _avg_pool_vjp, Kernel("avg_pool2d"))


def _avg_pool_grad_infer(types, attrs):
    (dy,) = types
    require_float(dy, "avg_pool2d_grad")
    if dy.ndim != 4:
        raise ShapeError(f"dy must be 4-D, got {dy.shape}")
    h, w = attrs["input_size"]
    kh, kw = attrs["kernel_size"]
    if dy.shape[2:] != _out_hw(h, w, kh, kw, attrs):
        raise ShapeError(f"dy spatial size {dy.shape[2:]} does not match pooling of {h}x{w}")
    return [TensorType(dy.shape[:2] + (h, w), dy.dtype)]


def _avg_pool_grad_ref(xs, attrs):
    (dy,) = xs
    n, c, oh, ow = dy.shape
    h, w = attrs["input_size"]
    g = dy / _divisors(attrs, h, w)
    dx = np.zeros((n, c, h * w), dtype=np.result_type(dy, np.float32))
    for valid, flat, _ in _pool_scan(np.zeros((1, 1, h, w)), attrs):
        sel = valid.reshape(-1)
        np.add.at(dx, (slice(None), slice(None), flat.reshape(-1)[sel]),
                  g.reshape(n, c, -1)[:, :, sel])
    return [dx.reshape(n, c, h, w).astype(dy.dtype)]


def _avg_pool_grad_vjp(n, c):
    return [avg_pool2d(c[0], **_avg_only(n.attrs))]


defop("avg_pool2d_grad", _avg_pool_grad_infer, _avg_pool_grad_ref, _avg_pool_grad_vjp,
      Kernel("avg_pool2d_grad"))


@register_builder("avg_pool2d")
def avg_pool2d(x: Value, kernel_size, stride=None, padding=0,
               count_include_pad: bool = True) -> Value:
    """Average pooling, NCHW, floor mode (PyTorch's ``avg_pool2d``; ``count_include_pad``
    divides by the full window size, else by the number of in-bounds elements)."""
    _check_values("avg_pool2d", x)
    try:
        attrs = _pool_attrs(kernel_size, stride, padding)
    except GraphBuildError as e:
        raise build_error(type(e), "avg_pool2d", str(e), x) from None
    return x.graph.apply("avg_pool2d", x, count_include_pad=bool(count_include_pad), **attrs)


def avg_pool2d_grad(dy: Value, input_size, kernel_size, stride=None, padding=0,
                    count_include_pad: bool = True) -> Value:
    attrs = _pool_attrs(kernel_size, stride, padding)
    return dy.graph.apply("avg_pool2d_grad", dy, input_size=tuple(int(s) for s in input_size),
                          count_include_pad=bool(count_include_pad), **attrs)

