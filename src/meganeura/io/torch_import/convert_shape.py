"""Converters of ATen's view, layout and indexing ops: reshapes, permutes, broadcasts, slices,
concatenation, padding, and the indexing ops (``index``, ``index_select``, ``gather``,
``embedding``), which all become ``take`` (a row gather with an exact scatter-add gradient)."""

from __future__ import annotations

import numpy as np
import torch

from ... import ops
from ...dtypes import f32, i32
from ...graph import Value
from .convert import aten

_BIG = 2**62  # ATen's "to the end" (INT64_MAX) in slice bounds


@aten("view.default", "_unsafe_view.default", "reshape.default", "view_copy.default")
def _view(cx, x, shape):
    return ops.reshape(cx.v(x), tuple(int(s) for s in shape))


@aten("permute.default", "permute_copy.default")
def _permute(cx, x, perm):
    return ops.permute(cx.v(x), tuple(int(p) for p in perm))


@aten("t.default")
def _t(cx, x):
    return ops.transpose(cx.v(x))


@aten("transpose.int")
def _transpose(cx, x, a, b):
    return ops.transpose(cx.v(x), int(a), int(b))


@aten("expand.default", "expand_copy.default")
def _expand(cx, x, size, implicit=False):
    x = cx.v(x)
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if int(s) == -1 else int(s) for i, s in enumerate(size))
    return ops.broadcast_to(x, shape)


@aten("unsqueeze.default")
def _unsqueeze(cx, x, dim):
    return ops.unsqueeze(cx.v(x), int(dim))


@aten("squeeze.dims", "squeeze.dim", "squeeze.default")
def _squeeze(cx, x, dims=None):
    x = cx.v(x)
    if dims is None:
        return ops.reshape(x, cx.out_shape)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    nd = max(x.ndim, 1)
    return ops.squeeze(x, tuple(d % nd for d in dims if x.ndim and x.shape[d % nd] == 1))


@aten("slice.Tensor", "slice_copy.Tensor")
def _slice(cx, x, dim=0, start=None, end=None, step=1):
    x = cx.v(x)
    n = x.shape[dim]
    start = None if start is None else max(min(int(start), _BIG), -_BIG)
    end = None if end is None or end >= _BIG else int(end)
    if start is not None and start < -n:
        start = 0
    return ops.slice_(x, int(dim), start, end, int(step))


@aten("select.int", "select_copy.int")
def _select(cx, x, dim, index):
    x = cx.v(x)
    dim = int(dim) % x.ndim
    i = int(index) % x.shape[dim]
    return ops.squeeze(ops.slice_(x, dim, i, i + 1), dim)


@aten("cat.default")
def _cat(cx, tensors, dim=0):
    dt = cx.out_dtype
    vals = [cx.v(t, dt) for t in tensors]
    vals = [v for v in vals if v.size or v.ndim != 1]  # torch skips legacy empty (0,) tensors
    if len(vals) == 1:
        return vals[0]
    return ops.concat(vals, int(dim) % vals[0].ndim)


@aten("split_with_sizes.default", "split_with_sizes_copy.default")
def _split_sizes(cx, x, sizes, dim=0):
    return tuple(ops.split(cx.v(x), [int(s) for s in sizes], int(dim)))


@aten("split.Tensor", "split_copy.Tensor")
def _split(cx, x, size, dim=0):
    x = cx.v(x)
    n = x.shape[int(dim)]
    sizes = [min(int(size), n - s) for s in range(0, n, int(size))]
    return tuple(ops.split(x, sizes, int(dim))) if len(sizes) > 1 else (x,)


@aten("unbind.int")
def _unbind(cx, x, dim=0):
    x = cx.v(x)
    d = int(dim) % x.ndim
    return tuple(ops.squeeze(p, d) for p in ops.split(x, x.shape[d], d))


@aten("flip.default")
def _flip(cx, x, dims):
    return ops.flip(cx.v(x), tuple(int(d) for d in dims))


@aten("constant_pad_nd.default")
def _pad(cx, x, pad, value=0.0):
    """ATen's pad list runs from the last axis backwards ((left, right) per axis); negative
    entries crop.  Zero padding is a ``pad_slice`` view; another fill value adds a constant
    that is ``value`` in the border only."""
    x = cx.v(x)
    pads = [(0, 0)] * (x.ndim - len(pad) // 2) + \
        [(int(pad[2 * i]), int(pad[2 * i + 1])) for i in reversed(range(len(pad) // 2))]
    for ax, (lo, hi) in enumerate(pads):
        if lo < 0 or hi < 0:
            x = ops.slice_(x, ax, max(-lo, 0), x.shape[ax] - max(-hi, 0))
    pads = [(max(lo, 0), max(hi, 0)) for lo, hi in pads]
    if not any(lo or hi for lo, hi in pads):
        return x
    shape = tuple(d + lo + hi for d, (lo, hi) in zip(x.shape, pads))
    starts = tuple(lo for lo, _ in pads)
    stops = tuple(lo + d for d, (lo, _) in zip(x.shape, pads))
    y = x.graph.apply("pad_slice", x, in_shape=shape, starts=starts, stops=stops,
                      steps=(1,) * x.ndim)
    if value:
        border = np.full(shape, float(value), x.dtype.np)
        border[tuple(slice(a, b) for a, b in zip(starts, stops))] = 0
        y = y + x.graph.const(border)
    return y


# ------------------------------------------------------------------ indexing


def _take(x: Value, idx: Value, axis: int) -> Value:
    """``take`` for any dtype: our row gather reads float tables, so booleans and integers
    (masks, position ids; exact in f32 below 2^24) pass through f32 and back."""
    if x.dtype.is_float:
        return ops.take(x, idx, axis)
    return ops.cast(ops.take(ops.cast(x, f32), idx, axis), x.dtype)


def _index_value(cx, idx, n: int) -> Value:
    """An index argument as an i32 value with negative indices wrapped (ATen's rule)."""
    if isinstance(idx, torch.Tensor):
        arr = idx.detach().cpu().numpy().astype(np.int64)
        return cx.graph.const(np.where(arr < 0, arr + n, arr).astype(np.int32))
    v = cx.v(idx, i32)
    return ops.where(v < 0, v + n, v)


def _index_check(node):
    """Index tensors must sit on consecutive axes (other layouts move the result's axes)."""
    idx = node.args[1]
    used = [i for i, t in enumerate(idx) if t is not None]
    if used and used != list(range(used[0], used[-1] + 1)):
        return "non-adjacent index tensors"
    if any(t is not None and str(t.meta["val"].dtype) == "torch.bool" for t in idx):
        return "boolean mask index"
    return None


@aten("index.Tensor", check=_index_check)
def _index(cx, x, indices):
    """x[..., i0, i1, ...] with index tensors on consecutive axes a..a+k-1: the indexed axes
    merge into one, and the flat index ``sum(i_j · stride_j)`` (broadcast) picks its rows."""
    x = cx.v(x)
    used = [i for i, t in enumerate(indices) if t is not None]
    a, k = used[0], len(used)
    dims = x.shape[a:a + k]
    strides = [int(np.prod(dims[j + 1:], dtype=np.int64)) for j in range(k)]
    flat = None
    for j, t in enumerate(indices[a:a + k]):
        term = _index_value(cx, t, dims[j])
        term = term * strides[j] if strides[j] != 1 else term
        flat = term if flat is None else flat + term
    merged = ops.reshape(x, x.shape[:a] + (int(np.prod(dims, dtype=np.int64)),) +
                         x.shape[a + k:])
    return _take(merged, flat, a)


@aten("index_select.default")
def _index_select(cx, x, dim, index):
    x = cx.v(x)
    d = int(dim) % x.ndim
    return _take(x, _index_value(cx, index, x.shape[d]), d)


@aten("gather.default")
def _gather(cx, x, dim, index, sparse_grad=False):
    """out[p] = x[p with axis ``dim`` replaced by index[p]]: one ``take`` from the flattened
    ``x`` with the flat positions ``index·stride + (the other coordinates' offset)``."""
    x = cx.v(x)
    d = int(dim) % x.ndim
    shape = tuple(cx.out_shape)
    strides = np.array([int(np.prod(x.shape[j + 1:], dtype=np.int64)) for j in range(x.ndim)])
    grid = np.indices(shape, dtype=np.int64)
    base = sum(grid[j] * strides[j] for j in range(x.ndim) if j != d)
    lin = _index_value(cx, index, x.shape[d])
    lin = lin * int(strides[d]) if strides[d] != 1 else lin
    lin = lin + cx.graph.const(base.astype(np.int32))
    return _take(ops.reshape(x, (x.size,)), lin, 0)


def _embedding_check(node):
    scale_grad = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq")
    return "scale_grad_by_freq=True" if scale_grad else None


@aten("embedding.default", check=_embedding_check)
def _embedding(cx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Rows of the table; the ``padding_idx`` row gets no gradient (as in PyTorch): the
    table is read through a stop-gradient on that row only."""
    table = cx.v(weight)
    if padding_idx is not None and padding_idx >= 0:
        keep = np.ones((table.shape[0], 1), table.dtype.np)
        keep[padding_idx] = 0
        k = cx.graph.const(keep)
        table = table * k + ops.stop_gradient(table) * (1.0 - k)
    return ops.embedding(_index_value(cx, indices, table.shape[0]), table)
