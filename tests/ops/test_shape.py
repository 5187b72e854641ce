"""Shape ops (reshape permute transpose matrix_transpose broadcast_to squeeze unsqueeze
slice/getitem concat split): forward and VJP against PyTorch (float64), VJP against finite
differences.  Their VJPs are other shape ops (reshape back, inverse permutation, sum_to,
pad_slice, split/concat), so the second-order tests exercise those too."""

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura import ops

from ._torchref import check_forward, check_op, rand, second_order

RESHAPES = [
    ((2, 3), (3, 2)),
    ((2, 3), (6,)),
    ((2, 3, 4), (4, -1)),
    ((2, 3, 4), (-1,)),
    ((6,), (1, 2, 1, 3)),
    ((), (1, 1)),
    ((1,), ()),
    ((2, 3), (2, 3)),
]


@pytest.mark.parametrize("case", RESHAPES, ids=str)
def test_reshape(case, rng):
    src, dst = case
    check_op(lambda x: ops.reshape(x, dst), lambda x: x.reshape(dst), rand(rng, src))
    # the varargs method form
    check_forward(lambda x: x.reshape(*dst), lambda x: x.reshape(dst), rand(rng, src))


PERMS = [((2, 3), (1, 0)), ((2, 3, 4), (2, 0, 1)), ((2, 3, 4), (0, 2, 1)),
         ((2, 3, 4, 5), (3, 1, 0, 2)), ((2, 3, 4), (-1, 0, 1)), ((1, 3, 1), (2, 1, 0))]


@pytest.mark.parametrize("case", PERMS, ids=str)
def test_permute(case, rng):
    shape, perm = case
    check_op(lambda x: ops.permute(x, perm), lambda x: x.permute(perm), rand(rng, shape))
    check_forward(lambda x: x.permute(*perm), lambda x: x.permute(perm), rand(rng, shape))


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (5,), ()], ids=str)
def test_transpose_reverses_axes(shape, rng):
    check_op(lambda x: ops.transpose(x), lambda x: x.permute(tuple(reversed(range(x.ndim)))),
             rand(rng, shape))


@pytest.mark.parametrize("case", [((2, 3, 4), (0, 2)), ((2, 3, 4), (-1, 1)), ((2, 3), (0, 1)),
                                  ((2, 3, 4), (1, 1))], ids=str)
def test_transpose_two_axes(case, rng):
    shape, (a, b) = case
    check_op(lambda x: ops.transpose(x, a, b), lambda x: torch.transpose(x, a, b),
             rand(rng, shape))


@pytest.mark.parametrize("shape", [(2, 3), (4, 2, 3), (2, 1, 3, 4)], ids=str)
def test_matrix_transpose(shape, rng):
    x = rand(rng, shape)
    check_op(ops.matrix_transpose, lambda x: x.mT, x)
    check_op(lambda v: v.T, lambda x: x.mT, x)


def test_matrix_transpose_of_vector_is_identity():
    g = mn.Graph()
    v = g.input("v", (3,))
    assert v.T is v


BROADCASTS = [((3,), (2, 3)), ((2, 1), (2, 4)), ((), (2, 3)), ((1, 1), (3, 1, 2)),
              ((2, 1, 3), (4, 2, 5, 3)), ((1,), (1,))]


@pytest.mark.parametrize("case", BROADCASTS, ids=str)
def test_broadcast_to(case, rng):
    src, dst = case
    check_op(lambda x: ops.broadcast_to(x, dst), lambda x: torch.broadcast_to(x, dst),
             rand(rng, src))


SQUEEZES = [((1, 3, 1), None), ((1, 3, 1), 0), ((1, 3, 1), -1), ((1, 3, 1), (0, 2)),
            ((2, 3), None), ((1,), None), ((1, 1), (1,))]


@pytest.mark.parametrize("case", SQUEEZES, ids=str)
def test_squeeze(case, rng):
    shape, axis = case

    def twin(x):
        return x.squeeze() if axis is None else x.squeeze(axis)

    check_op(lambda x: ops.squeeze(x, axis), twin, rand(rng, shape))


@pytest.mark.parametrize("case", [((2, 3), 0), ((2, 3), 1), ((2, 3), 2), ((2, 3), -1),
                                  ((2, 3), -3), ((), 0), ((4,), -1)], ids=str)
def test_unsqueeze(case, rng):
    shape, axis = case
    check_op(lambda x: ops.unsqueeze(x, axis), lambda x: x.unsqueeze(axis), rand(rng, shape))


SLICES = [
    ((5,), 0, 1, 4, 1),
    ((5,), 0, None, None, 2),
    ((5,), 0, -3, None, 1),
    ((5,), 0, 3, 1, 1),        # empty
    ((4, 6), 1, 1, 6, 2),
    ((4, 6), 0, -1, None, 1),
    ((4, 6), -1, None, -2, 3),
    ((2, 3, 7), 2, 2, 100, 2),  # stop past the end is clipped
]


@pytest.mark.parametrize("case", SLICES, ids=str)
def test_slice(case, rng):
    shape, axis, start, stop, step = case

    def twin(x):
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(start, stop, step)
        return x[tuple(idx)]

    check_op(lambda x: ops.slice_(x, axis, start, stop, step), twin, rand(rng, shape))


INDICES = [
    (slice(1, 3),),
    (1,),
    (-1,),
    (0, 2),
    (slice(None), 1),
    (Ellipsis, 0),
    (Ellipsis, slice(None, None, 2)),
    (None, 1),
    (1, None, slice(1, None)),
    (slice(None, None, 3), Ellipsis, None),
    (-2, slice(2, 0)),      # empty
    (Ellipsis,),
    (1, 2, 3),
    (slice(None), None, -1, Ellipsis),
]


@pytest.mark.parametrize("idx", INDICES, ids=str)
def test_getitem(idx, rng):
    check_op(lambda x: x[idx], lambda x: x[idx], rand(rng, (3, 4, 5)))


CONCATS = [
    ([(2, 3), (4, 3)], 0),
    ([(2, 3), (2, 1), (2, 4)], 1),
    ([(2, 3), (2, 2)], -1),
    ([(3,), (5,)], 0),
    ([(2, 1, 3), (2, 2, 3), (2, 1, 3)], 1),
    ([(2, 3)], 0),
]


@pytest.mark.parametrize("case", CONCATS, ids=str)
def test_concat(case, rng):
    shapes, axis = case
    xs = [rand(rng, s) for s in shapes]
    check_op(lambda *vs: ops.concat(vs, axis), lambda *ts: torch.cat(ts, axis), *xs)


SPLITS = [((6, 2), [1, 2, 3], 0), ((2, 6), 3, 1), ((2, 6), [6], -1), ((4, 5), [2, 0, 3], 1),
          ((7,), [3, 4], 0)]


@pytest.mark.parametrize("case", SPLITS, ids=str)
def test_split(case, rng):
    shape, sizes, axis = case

    def twin(x):
        if isinstance(sizes, int):
            return torch.split(x, x.shape[axis] // sizes, axis)
        return torch.split(x, sizes, axis)

    check_op(lambda x: ops.split(x, sizes, axis), twin, rand(rng, shape))


def test_split_with_unused_part(rng):
    # only some outputs reach the loss: the VJP fills the rest with zeros
    check_op(lambda x: ops.split(x, [2, 3], 1)[1].exp(),
             lambda x: torch.split(x, [2, 3], 1)[1].exp(), rand(rng, (3, 5)))


@pytest.mark.parametrize("name", ["reshape", "permute", "broadcast_to", "slice", "getitem",
                                  "concat", "split"])
def test_shape_second_order(name, rng):
    x = rand(rng, (2, 3, 4))
    cases = {
        "reshape": (lambda v: ops.reshape(v * v, (4, 6)), lambda t: (t * t).reshape(4, 6)),
        "permute": (lambda v: ops.permute(v, (2, 0, 1)).exp(), lambda t: t.permute(2, 0, 1).exp()),
        "broadcast_to": (lambda v: ops.broadcast_to(v, (3, 2, 3, 4)).sin(),
                         lambda t: torch.broadcast_to(t, (3, 2, 3, 4)).sin()),
        "slice": (lambda v: v[:, 1:, ::2].tanh(), lambda t: t[:, 1:, ::2].tanh()),
        "getitem": (lambda v: v[1, None, ..., 2] ** 3, lambda t: t[1, None, ..., 2] ** 3),
        "concat": (lambda v: ops.concat([v, v * v], 1).exp(),
                   lambda t: torch.cat([t, t * t], 1).exp()),
        "split": (lambda v: ops.split(v.exp(), [1, 3], -1)[1] * v[..., 1:],
                  lambda t: torch.split(t.exp(), [1, 3], -1)[1] * t[..., 1:]),
    }
    second_order(*cases[name], x)


def test_int_shape_ops():
    i = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    check_forward(lambda v: v.permute(2, 0, 1).reshape(4, 6)[1:, ::2], lambda t: t.permute(2, 0, 1)
                  .reshape(4, 6)[1:, ::2], i)
    check_forward(lambda v: ops.concat(ops.split(v, [1, 3], -1)[::-1], -1),
                  lambda t: torch.cat(torch.split(t, [1, 3], -1)[::-1], -1), i)


def test_noop_shape_ops_return_the_value():
    g = mn.Graph()
    x = g.input("x", (2, 3))
    assert ops.reshape(x, (2, 3)) is x
    assert ops.permute(x, (0, 1)) is x
    assert ops.broadcast_to(x, (2, 3)) is x
    assert ops.slice_(x, 1, 0, 3) is x
    assert ops.concat([x]) is x
    assert ops.squeeze(x) is x


PADS = [((5,), (1,), (4,), (1,)), ((4, 6), (0, 1), (4, 6), (1, 2)),
        ((3, 7), (1, 2), (2, 7), (1, 3)), ((4,), (2,), (2,), (1,))]


@pytest.mark.parametrize("case", PADS, ids=str)
def test_pad_slice(case, rng):
    """pad_slice, the VJP of slice: zeros with the operand scattered into the sliced positions."""
    in_shape, starts, stops, steps = case
    out_shape = tuple(len(range(s, e, st)) for s, e, st in zip(starts, stops, steps, strict=True))

    def build(x):
        return x.graph.apply("pad_slice", x, in_shape=in_shape, starts=starts, stops=stops,
                             steps=steps)

    def twin(x):
        out = torch.zeros(in_shape, dtype=torch.float64)
        idx = tuple(slice(s, e, st) for s, e, st in zip(starts, stops, steps, strict=True))
        return out.index_put(tuple(torch.arange(in_shape[i])[idx[i]].reshape(
            [-1 if j == i else 1 for j in range(len(in_shape))]) for i in range(len(in_shape))),
            x)

    check_op(build, twin, rand(rng, out_shape))
    second_order(lambda x: build(x * x), lambda x: twin(x * x), rand(rng, out_shape))


@pytest.mark.parametrize("case", [((5,), -1), ((2, 3, 4), (0, 2)), ((2, 3), 1), ((3, 1), 1)],
                         ids=str)
def test_flip(case, rng):
    shape, axis = case
    dims = axis if isinstance(axis, tuple) else (axis,)
    check_op(lambda x: ops.flip(x, axis), lambda x: torch.flip(x, dims), rand(rng, shape))
