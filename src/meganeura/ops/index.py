"""Index ops: ``embedding`` (gather rows of a table by integer ids) and its adjoint
``embedding_grad`` (deterministic scatter-add of rows), ``dynamic_slice`` and
``dynamic_update_slice`` (a slice at a runtime position: reading and writing a KV cache).

Out-of-range ids (negative or >= the number of rows) read as zero rows in ``embedding`` and
contribute nothing to ``embedding_grad`` (no error: the GPU cannot raise one).

``dynamic_update_slice``/``dynamic_slice`` take the start as an integer scalar graph Value (or a
Python int); like XLA, the start is clamped to ``[0, dim - size]`` so the slice always lies inside
the tensor.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import i32
from ..errors import DTypeError, GraphBuildError, ShapeError
from ..graph import Value
from . import elementwise as E
from ._common import TensorType, axis_for, build_error, defop, register_builder
from .lowering import Kernel

__all__ = ["embedding", "embedding_grad", "take", "dynamic_slice", "dynamic_update_slice"]

# ------------------------------------------------------------------ embedding


def _embedding_infer(types, a):
    ids, table = types
    if not ids.dtype.is_int:
        raise DTypeError(f"ids must be integers (i32), got {ids.dtype.name}")
    if table.ndim != 2:
        raise ShapeError(f"table must be (num_rows, dim), got shape {table.shape}")
    if not table.dtype.is_float:
        raise DTypeError(f"table must be floating point, got {table.dtype.name}")
    return [TensorType(ids.shape + (table.shape[1],), table.dtype)]


def _valid(ids, n):
    ids = ids.astype(np.int64)
    return ids, (ids >= 0) & (ids < n)


def _embedding_ref(xs, a):
    ids, table = xs
    ids, ok = _valid(ids, table.shape[0])
    out = table[np.where(ok, ids, 0)]
    return [np.where(ok[..., None], out, 0).astype(table.dtype)]


def _embedding_vjp(n, c):
    ids, table = n.inputs
    return [None, embedding_grad(ids, c[0], table.shape[0])]


defop("embedding", _embedding_infer, _embedding_ref, _embedding_vjp, Kernel("embedding"))


@register_builder("embedding")
def embedding(ids: Value, table: Value) -> Value:
    """Rows of ``table`` (V, D) picked by integer ``ids`` (...): shape (..., D).  Ids outside
    [0, V) give zero rows (and no gradient)."""
    if not isinstance(ids, Value) or not isinstance(table, Value):
        raise build_error(GraphBuildError, "embedding", "ids and table must be graph Values",
                          ids, table)
    return ids.graph.apply("embedding", ids, table)


@register_builder("take")
def take(x: Value, idx: Value, axis: int = 0) -> Value:
    """``x`` indexed along ``axis`` by the integer tensor ``idx``: the result has shape
    ``x.shape[:axis] + idx.shape + x.shape[axis + 1:]`` (numpy's ``take``), built on
    ``embedding`` (indices outside [0, x.shape[axis]) give zeros; gradient w.r.t. ``x``)."""
    from . import shape as S

    if not isinstance(x, Value) or not isinstance(idx, Value):
        raise build_error(GraphBuildError, "take", "x and idx must be graph Values", x, idx)
    if x.ndim == 0:
        raise build_error(ShapeError, "take", "x must have rank >= 1", x, idx)
    ax = axis_for("take", axis, x)
    perm = (ax,) + tuple(d for d in range(x.ndim) if d != ax)
    xt = S.permute(x, perm)
    rest = xt.shape[1:]
    table = S.reshape(xt, (x.shape[ax], int(np.prod(rest, dtype=np.int64))))
    rows = S.reshape(embedding(idx, table), idx.shape + rest)
    k = idx.ndim
    # rows: idx dims, then x's other axes in order; move idx dims to position ax
    back = tuple(range(k, k + ax)) + tuple(range(k)) + tuple(range(k + ax, k + len(rest)))
    return S.permute(rows, back)


def _embedding_grad_infer(types, a):
    ids, dout = types
    if not ids.dtype.is_int:
        raise DTypeError(f"ids must be integers (i32), got {ids.dtype.name}")
    if not dout.dtype.is_float:
        raise DTypeError(f"dout must be floating point, got {dout.dtype.name}")
    if dout.ndim != ids.ndim + 1 or dout.shape[:-1] != ids.shape:
        raise ShapeError(f"dout shape {dout.shape} must be ids shape {ids.shape} + (dim,)")
    if a["num_rows"] < 1:
        raise ShapeError(f"num_rows must be >= 1, got {a['num_rows']}")
    return [TensorType((a["num_rows"], dout.shape[-1]), dout.dtype)]


def _embedding_grad_ref(xs, a):
    ids, dout = xs
    V = a["num_rows"]
    ids, ok = _valid(ids, V)
    out = np.zeros((V, dout.shape[-1]), dtype=dout.dtype)
    np.add.at(out, ids[ok], dout[ok])  # in position order, like the GPU kernel
    return [out]


def _embedding_grad_vjp(n, c):
    ids, _ = n.inputs
    return [None, embedding(ids, c[0])]


defop("embedding_grad", _embedding_grad_infer, _embedding_grad_ref, _embedding_grad_vjp,
      Kernel("embedding_grad"))


@register_builder("embedding_grad")
def embedding_grad(ids: Value, dout: Value, num_rows: int) -> Value:
    """The adjoint of ``embedding``: a (num_rows, D) table whose row r is the sum, in position
    order, of the rows of ``dout`` (..., D) whose id is r (exact zeros where r never occurs)."""
    return ids.graph.apply("embedding_grad", ids, dout, num_rows=int(num_rows))


# ------------------------------------------------------------------ dynamic slices


def _check_start(t: TensorType):
    if not t.dtype.is_int or t.size != 1 or t.ndim > 1:
        raise DTypeError(f"start must be an integer scalar (i32, shape () or (1,)), got {t}")


def _dus_infer(types, a):
    x, upd, start = types
    _check_start(start)
    ax = a["axis"]
    if x.dtype != upd.dtype:
        raise DTypeError(f"x and update dtypes differ ({x.dtype.name}, {upd.dtype.name})")
    if upd.ndim != x.ndim or not 0 <= ax < x.ndim:
        raise ShapeError(f"update {upd.shape} must have the rank of x {x.shape} (axis {ax})")
    for d, (n, m) in enumerate(zip(x.shape, upd.shape, strict=True)):
        if (d != ax and n != m) or (d == ax and m > n):
            raise ShapeError(f"update {upd.shape} does not fit into x {x.shape} along axis {ax}")
    return [x]


def _start(start, n, size) -> int:
    return int(np.clip(int(np.asarray(start).reshape(-1)[0]), 0, n - size))


def _dus_ref(xs, a):
    x, upd, start = xs
    ax = a["axis"]
    s = _start(start, x.shape[ax], upd.shape[ax])
    out = np.array(x, copy=True)
    idx = [slice(None)] * x.ndim
    idx[ax] = slice(s, s + upd.shape[ax])
    out[tuple(idx)] = upd
    return [out]


def _dus_vjp(n, c):
    x, upd, start = n.inputs
    ax = n.attrs["axis"]
    dx = dynamic_update_slice(c[0], E.zeros_like(upd), start, ax) if x.dtype.is_float else None
    du = dynamic_slice(c[0], start, upd.shape[ax], ax) if upd.dtype.is_float else None
    return [dx, du, None]


defop("dynamic_update_slice", _dus_infer, _dus_ref, _dus_vjp, Kernel("dynamic_update_slice"))


def _ds_infer(types, a):
    x, start = types
    _check_start(start)
    ax, size = a["axis"], a["size"]
    if not 0 <= ax < x.ndim or not 0 <= size <= x.shape[ax]:
        raise ShapeError(f"cannot take {size} elements along axis {ax} of {x.shape}")
    shape = list(x.shape)
    shape[ax] = size
    return [TensorType(tuple(shape), x.dtype)]


def _ds_ref(xs, a):
    x, start = xs
    ax, size = a["axis"], a["size"]
    s = _start(start, x.shape[ax], size)
    idx = [slice(None)] * x.ndim
    idx[ax] = slice(s, s + size)
    return [np.ascontiguousarray(x[tuple(idx)])]


def _ds_vjp(n, c):
    x, start = n.inputs
    return [dynamic_update_slice(E.zeros_like(x), c[0], start, n.attrs["axis"]), None]


defop("dynamic_slice", _ds_infer, _ds_ref, _ds_vjp, Kernel("dynamic_slice"))


def _as_start(x: Value, start, op: str) -> Value:
    if isinstance(start, Value):
        return start
    if isinstance(start, (int, np.integer)) and not isinstance(start, bool):
        return x.graph.const(np.array(int(start), dtype=np.int32), dtype=i32)
    raise build_error(GraphBuildError, op, f"start must be an integer scalar Value or int, got "
                      f"{start!r}", x)


@register_builder("dynamic_update_slice")
def dynamic_update_slice(x: Value, update: Value, start, axis: int) -> Value:
    """``x`` with ``x[..., s:s+u, ...]`` (along ``axis``, u = update.shape[axis]) replaced by
    ``update``; s = clip(start, 0, x.shape[axis] - u) where ``start`` is an integer scalar
    graph Value read at run time (e.g. the position where new K/V rows enter a cache)."""
    if x.ndim == 0:
        raise build_error(ShapeError, "dynamic_update_slice", "x must have rank >= 1", x)
    ax = axis_for("dynamic_update_slice", axis, x)
    return x.graph.apply("dynamic_update_slice", x, update,
                         _as_start(x, start, "dynamic_update_slice"), axis=ax)


@register_builder("dynamic_slice")
def dynamic_slice(x: Value, start, size: int, axis: int) -> Value:
    """``x[..., s:s+size, ...]`` along ``axis`` with s = clip(start, 0, x.shape[axis] - size)
    read at run time."""
    if x.ndim == 0:
        raise build_error(ShapeError, "dynamic_slice", "x must have rank >= 1", x)
    ax = axis_for("dynamic_slice", axis, x)
    return x.graph.apply("dynamic_slice", x, _as_start(x, start, "dynamic_slice"),
                         size=int(size), axis=ax)
