"""Shape ops: reshape, permute/transpose, broadcast_to, squeeze/unsqueeze, slice (and its VJP
``pad_slice``), ``x[...]`` indexing, concat, split.  All are pure index maps (``View``): codegen
folds them into consumers where it can."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import AxisError, GraphBuildError, ShapeError
from ..graph import Value, as_shape
from ._common import (
    TensorType,
    axes_for,
    axis_for,
    broadcast_shapes,
    build_error,
    defop,
    register_builder,
    same_dtype,
)
from .lowering import View

# ------------------------------------------------------------------ reshape


def _reshape_infer(types, attrs):
    (t,) = types
    shape = attrs["shape"]
    if int(np.prod(shape, dtype=np.int64)) != t.size:
        raise ShapeError(f"cannot reshape {t.shape} ({t.size} elements) to {shape}")
    return [TensorType(shape, t.dtype)]


defop("reshape", _reshape_infer, lambda xs, a: [xs[0].reshape(a["shape"])],
      lambda n, c: [reshape(c[0], n.inputs[0].shape)], View("reshape"))


@register_builder("reshape")
def reshape(x: Value, *shape) -> Value:
    """Reshape (one ``-1`` allowed).  ``x.reshape(2, 3)`` or ``x.reshape((2, 3))``."""
    if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
        shape = tuple(shape[0])
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise build_error(ShapeError, "reshape", f"only one -1 allowed, got {shape}", x)
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
        if known == 0 or x.size % known:
            raise build_error(ShapeError, "reshape", f"cannot infer -1 in {shape}", x)
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    if any(s < 0 for s in shape):
        raise build_error(ShapeError, "reshape", f"invalid target shape {shape}", x)
    shape = as_shape(shape, "reshape")
    if shape == x.shape:
        return x
    return x.graph.apply("reshape", x, shape=shape)


# ------------------------------------------------------------------ permute


def _permute_infer(types, attrs):
    (t,) = types
    perm = attrs["perm"]
    if sorted(perm) != list(range(t.ndim)):
        raise AxisError(f"perm {perm} is not a permutation of {t.ndim} axes")
    return [TensorType(tuple(t.shape[p] for p in perm), t.dtype)]


def _permute_vjp(n, c):
    inv = tuple(int(i) for i in np.argsort(n.attrs["perm"]))
    return [permute(c[0], inv)]


defop("permute", _permute_infer,
      lambda xs, a: [np.ascontiguousarray(np.transpose(xs[0], a["perm"]))], _permute_vjp,
      View("permute"))


@register_builder("permute")
def permute(x: Value, *perm) -> Value:
    """Reorder axes: output axis i is input axis perm[i]."""
    if len(perm) == 1 and not isinstance(perm[0], (int, np.integer)):
        perm = tuple(perm[0])
    perm = tuple(axis_for("permute", int(p), x) for p in perm)
    if perm == tuple(range(x.ndim)):
        return x
    return x.graph.apply("permute", x, perm=perm)


@register_builder("transpose")
def transpose(x: Value, *axes) -> Value:
    """No axes: reverse all axes (numpy ``.T``).  Two axes: swap them.  Else a permutation."""
    if not axes:
        return permute(x, tuple(reversed(range(x.ndim))))
    if len(axes) == 2 and all(isinstance(a, (int, np.integer)) for a in axes):
        a, b = (axis_for("transpose", int(v), x) for v in axes)
        if x.ndim == 0:
            return x
        perm = list(range(x.ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return permute(x, perm)
    return permute(x, *axes)


@register_builder("matrix_transpose")
def matrix_transpose(x: Value) -> Value:
    if x.ndim < 2:
        return x
    return transpose(x, -2, -1)


# ------------------------------------------------------------------ broadcast_to


def _broadcast_infer(types, attrs):
    (t,) = types
    shape = attrs["shape"]
    if len(shape) < t.ndim or broadcast_shapes(t.shape, shape) != shape:
        raise ShapeError(f"cannot broadcast {t.shape} to {shape}")
    return [TensorType(shape, t.dtype)]


def _broadcast_vjp(n, c):
    from .reduce import sum_to

    return [sum_to(c[0], n.inputs[0].shape)]


defop("broadcast_to", _broadcast_infer,
      lambda xs, a: [np.ascontiguousarray(np.broadcast_to(xs[0], a["shape"]))],
      _broadcast_vjp, View("broadcast"))


@register_builder("broadcast_to")
def broadcast_to(x: Value, shape: Sequence[int]) -> Value:
    shape = as_shape(shape, "broadcast_to")
    if shape == x.shape:
        return x
    return x.graph.apply("broadcast_to", x, shape=shape)


# ------------------------------------------------------------------ squeeze / unsqueeze


@register_builder("squeeze")
def squeeze(x: Value, axis=None) -> Value:
    """Drop size-1 axes (all of them, or the given ones, which must have size 1)."""
    if axis is None:
        axes = tuple(i for i, d in enumerate(x.shape) if d == 1)
    else:
        axes = axes_for("squeeze", axis, x)
        bad = [a for a in axes if x.shape[a] != 1]
        if bad:
            raise build_error(ShapeError, "squeeze",
                              f"axis {bad[0]} has size {x.shape[bad[0]]}, not 1", x)
    return reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


@register_builder("unsqueeze")
def unsqueeze(x: Value, axis: int) -> Value:
    """Insert a size-1 axis at ``axis`` (in the output's numbering)."""
    ax = axis_for("unsqueeze", axis, x, ndim=x.ndim + 1)
    shape = list(x.shape)
    shape.insert(ax, 1)
    return reshape(x, tuple(shape))


# ------------------------------------------------------------------ slice and its adjoint


def _slice_infer(types, attrs):
    (t,) = types
    starts, stops, steps = attrs["starts"], attrs["stops"], attrs["steps"]
    if not (len(starts) == len(stops) == len(steps) == t.ndim):
        raise ShapeError(f"slice needs one (start, stop, step) per axis of {t.shape}")
    out = []
    for d, s, e, st in zip(t.shape, starts, stops, steps, strict=True):
        if st <= 0 or not (0 <= s <= d) or not (s <= e <= d):
            raise ShapeError(f"bad slice {s}:{e}:{st} for an axis of size {d}")
        out.append(max(0, -(-(e - s) // st)))
    return [TensorType(tuple(out), t.dtype)]


def _slices(a) -> tuple[slice, ...]:
    return tuple(
        slice(s, e, st) for s, e, st in zip(a["starts"], a["stops"], a["steps"], strict=True)
    )


def _slice_ref(xs, a):
    idx = _slices(a)
    return [np.ascontiguousarray(xs[0][idx])]


def _slice_vjp(n, c):
    return [c[0].graph.apply("pad_slice", c[0], in_shape=n.inputs[0].shape, **n.attrs)]


defop("slice", _slice_infer, _slice_ref, _slice_vjp, View("slice"))


def _pad_infer(types, attrs):
    (t,) = types
    (expect,) = _slice_infer([TensorType(attrs["in_shape"], t.dtype)],
                             {k: attrs[k] for k in ("starts", "stops", "steps")})
    if expect.shape != t.shape:
        raise ShapeError(f"pad_slice operand {t.shape} does not match slice shape {expect.shape}")
    return [TensorType(attrs["in_shape"], t.dtype)]


def _pad_ref(xs, a):
    out = np.zeros(a["in_shape"], dtype=xs[0].dtype)
    idx = _slices(a)
    out[idx] = xs[0]
    return [out]


def _pad_vjp(n, c):
    a = n.attrs
    return [c[0].graph.apply("slice", c[0], starts=a["starts"], stops=a["stops"], steps=a["steps"])]


defop("pad_slice", _pad_infer, _pad_ref, _pad_vjp, View("pad_slice"))


@register_builder("slice")
def slice_(x: Value, axis: int, start: int | None = None, stop: int | None = None,
           step: int = 1) -> Value:
    """``x`` restricted to ``start:stop:step`` along ``axis`` (Python slice semantics, step > 0)."""
    if x.ndim == 0:
        raise build_error(ShapeError, "slice", "cannot slice a rank-0 tensor", x)
    ax = axis_for("slice", axis, x)
    if step is None:
        step = 1
    if step <= 0:
        raise build_error(ShapeError, "slice", f"step must be positive, got {step}", x)
    s, e, st = slice(start, stop, step).indices(x.shape[ax])
    e = max(e, s)
    starts = [0] * x.ndim
    stops = list(x.shape)
    steps = [1] * x.ndim
    starts[ax], stops[ax], steps[ax] = s, e, st
    if (s, e, st) == (0, x.shape[ax], 1):
        return x
    return x.graph.apply("slice", x, starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))


@register_builder("getitem")
def getitem(x: Value, idx) -> Value:
    """Basic indexing: ints, slices (step > 0), ``None`` and ``...``.  Arrays: use ``gather``."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    for i in idx:
        if not (i is None or i is Ellipsis or isinstance(i, (slice, int, np.integer))) \
                or isinstance(i, (bool, np.bool_)):
            raise build_error(GraphBuildError, "getitem", f"index {i!r} "
                              f"({type(i).__name__}) is not an int, slice, None or ...; "
                              "index with arrays through mn.ops.take", x)
    if sum(i is Ellipsis for i in idx) > 1:
        raise build_error(GraphBuildError, "getitem", f"index {idx!r}: only one ellipsis allowed",
                          x)
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if n_real > x.ndim:
        raise build_error(ShapeError, "getitem", f"too many indices ({n_real}) in {idx!r}", x)
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (x.ndim - n_real) + idx[k + 1:]
    idx = idx + (slice(None),) * (x.ndim - sum(1 for i in idx if i is not None))
    out, axis, final_shape = x, 0, []
    for i in idx:
        if i is None:
            final_shape.append(1)
            continue
        if isinstance(i, slice):
            out = slice_(out, axis, i.start, i.stop, i.step)
            final_shape.append(out.shape[axis])
        elif isinstance(i, (int, np.integer)):
            d = x.shape[axis]
            if not -d <= i < d:
                raise build_error(ShapeError, "getitem",
                                  f"index {i} is out of range for axis {axis} of size {d}", x)
            i = int(i) % d
            out = slice_(out, axis, i, i + 1)
        else:
            raise build_error(
                GraphBuildError, "getitem",
                f"unsupported index {i!r}; use gather/embedding for tensor indices", x,
            )
        axis += 1
    return reshape(out, tuple(final_shape))


# ------------------------------------------------------------------ concat / split


def _concat_infer(types, attrs):
    if not types:
        raise ShapeError("concat needs at least one operand")
    dt = same_dtype(types)
    ax = attrs["axis"]
    base = types[0].shape
    for t in types[1:]:
        if t.ndim != len(base) or any(
            d != b for i, (d, b) in enumerate(zip(t.shape, base, strict=True)) if i != ax
        ):
            raise ShapeError(f"concat along axis {ax}: shapes {[t.shape for t in types]} differ "
                             "off the concat axis")
    shape = list(base)
    shape[ax] = sum(t.shape[ax] for t in types)
    return [TensorType(tuple(shape), dt)]


def _concat_vjp(n, c):
    ax = n.attrs["axis"]
    sizes = [v.shape[ax] for v in n.inputs]
    parts = split(c[0], sizes, ax) if len(sizes) > 1 else (c[0],)
    return [p if v.dtype.is_float else None for p, v in zip(parts, n.inputs, strict=True)]


defop("concat", _concat_infer, lambda xs, a: [np.concatenate(xs, axis=a["axis"])], _concat_vjp,
      View("concat"))


@register_builder("concat")
def concat(values: Sequence[Value], axis: int = 0) -> Value:
    values = list(values)
    if not values:
        raise build_error(ShapeError, "concat", "needs at least one operand")
    if not isinstance(values[0], Value):
        raise build_error(GraphBuildError, "concat", "operands must be graph Values", *values)
    if values[0].ndim == 0:
        raise build_error(ShapeError, "concat", "cannot concatenate rank-0 tensors", *values)
    ax = axis_for("concat", axis, values[0])
    if len(values) == 1:
        return values[0]
    return values[0].graph.apply("concat", *values, axis=ax)


def _split_infer(types, attrs):
    (t,) = types
    ax, sizes = attrs["axis"], attrs["sizes"]
    if sum(sizes) != t.shape[ax] or any(s < 0 for s in sizes):
        raise ShapeError(f"sizes {sizes} do not add up to axis {ax} of {t.shape}")
    outs = []
    for s in sizes:
        shape = list(t.shape)
        shape[ax] = s
        outs.append(TensorType(tuple(shape), t.dtype))
    return outs


def _split_ref(xs, a):
    cuts = np.cumsum(a["sizes"])[:-1]
    return [np.ascontiguousarray(p) for p in np.split(xs[0], cuts, axis=a["axis"])]


def _split_vjp(n, c):
    from .elementwise import zeros_like

    parts = [ct if ct is not None else zeros_like(o) for ct, o in zip(c, n.outputs, strict=True)]
    return [concat(parts, n.attrs["axis"])]


defop("split", _split_infer, _split_ref, _split_vjp, View("split"))


@register_builder("split")
def split(x: Value, sizes_or_sections, axis: int = 0) -> tuple[Value, ...]:
    """Split along ``axis`` into the given sizes, or into N equal sections when given an int."""
    if x.ndim == 0:
        raise build_error(ShapeError, "split", "cannot split a rank-0 tensor", x)
    ax = axis_for("split", axis, x)
    d = x.shape[ax]
    if isinstance(sizes_or_sections, (int, np.integer)):
        n = int(sizes_or_sections)
        if n <= 0 or d % n:
            raise build_error(ShapeError, "split",
                              f"axis {ax} of size {d} cannot be split into {n} equal parts", x)
        sizes = (d // n,) * n
    else:
        sizes = tuple(int(s) for s in sizes_or_sections)
    out = x.graph.apply("split", x, axis=ax, sizes=sizes)
    return out if isinstance(out, tuple) else (out,)


# ------------------------------------------------------------------ flip


def _flip_infer(types, attrs):
    (t,) = types
    if any(not 0 <= a < t.ndim for a in attrs["axes"]):
        raise AxisError(f"flip axes {attrs['axes']} out of range for {t.shape}")
    return [t]


defop("flip", _flip_infer,
      lambda xs, a: [np.ascontiguousarray(np.flip(xs[0], a["axes"]))],
      lambda n, c: [flip(c[0], n.attrs["axes"])], View("flip"))


@register_builder("flip")
def flip(x: Value, axis=-1) -> Value:
    """Reverse the order of elements along ``axis`` (int or tuple): a view (negative stride)."""
    axes = tuple(a for a in axes_for("flip", axis, x) if x.shape[a] > 1)
    if not axes:
        return x
    return x.graph.apply("flip", x, axes=axes)
