"""embedding / embedding_grad / dynamic_slice / dynamic_update_slice: forward and VJPs against
PyTorch (float64; F.embedding, index_add, slice assignment), VJPs against finite differences."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import meganeura as mn
from meganeura import ops
from meganeura.reference import evaluate

from ._torchref import check_forward, check_op, rand, second_order


@pytest.mark.parametrize("ids_shape", [(5,), (2, 3), ()], ids=str)
def test_embedding(ids_shape, rng):
    V, D = 6, 3
    ids = rng.integers(0, V, ids_shape).astype(np.int32)
    if ids.size > 2:
        ids.reshape(-1)[:2] = ids.reshape(-1)[-1]  # repeated ids accumulate
    check_op(lambda i, t: ops.embedding(i, t), lambda i, t: F.embedding(i, t),
             ids, rand(rng, (V, D)))


def test_embedding_method_and_second_order(rng):
    ids = np.array([[1, 0, 1], [3, 3, 2]], np.int32)
    t = rand(rng, (4, 2))
    check_op(lambda i, t: i.embedding(t), lambda i, t: F.embedding(i, t), ids, t)
    second_order(lambda i, t: ops.embedding(i, t) * ops.embedding(i, t),
                 lambda i, t: F.embedding(i, t) ** 2, ids, t)


def test_embedding_out_of_range_ids_give_zero_rows_and_no_gradient(rng):
    V, D = 4, 3
    ids = np.array([0, -1, 4, 3, 100, 3], np.int32)
    table = rand(rng, (V, D))

    def twin(i, t):
        ok = (i >= 0) & (i < V)
        return F.embedding(torch.where(ok, i, 0), t) * ok[:, None]

    check_op(lambda i, t: ops.embedding(i, t), twin, ids, table)


@pytest.mark.parametrize("case", [((5, 3), (4,), 0), ((2, 5, 3), (2, 2), 1), ((2, 3, 4), (3,), 2),
                                  ((4,), (2, 3), 0), ((3, 4), (), 1)], ids=str)
def test_take(case, rng):
    xs, ishape, axis = case
    idx = rng.integers(0, xs[axis], ishape).astype(np.int32)
    check_op(lambda x, i: ops.take(x, i, axis), lambda x, i: _torch_take(x, i, axis),
             rand(rng, xs), idx)


def _torch_take(x, i, axis):
    out = torch.index_select(x, axis, i.reshape(-1))
    return out.reshape(x.shape[:axis] + tuple(i.shape) + x.shape[axis + 1:])


def test_embedding_grad(rng):
    V, D = 7, 4
    ids = np.array([[2, 5, 2], [0, 2, 9]], np.int32)  # 9: out of range, ignored
    dout = rand(rng, (2, 3, D))

    def twin(i, d):
        ok = (i >= 0) & (i < V)
        return torch.zeros(V, D, dtype=d.dtype).index_add(0, i[ok], d[ok])

    out = check_op(lambda i, d: ops.embedding_grad(i, d, V), twin, ids, dout)
    del out
    g = mn.Graph()
    i_ = g.input("i", ids.shape, mn.i32)
    d_ = g.input("d", dout.shape)
    (res,) = evaluate(g, [ops.embedding_grad(i_, d_, V)], {"i": ids, "d": dout}, np.float64)
    assert np.all(res[[1, 3, 4, 6]] == 0.0)  # rows that never occur are exact zeros


def test_embedding_errors():
    g = mn.Graph()
    t = g.input("t", (4, 3))
    with pytest.raises(mn.DTypeError, match="integers"):
        ops.embedding(g.input("f", (2,)), t)
    with pytest.raises(mn.ShapeError, match="num_rows, dim"):
        ops.embedding(g.input("i", (2,), mn.i32), g.input("t1", (4,)))
    with pytest.raises(mn.ShapeError, match="dout shape"):
        ops.embedding_grad(g.input("i2", (2,), mn.i32), g.input("d", (3, 3)), 4)


DUS_CASES = [((5, 3), (2, 3), 0, 1), ((5, 3), (2, 3), 0, 4), ((5, 3), (2, 3), 0, -2),
             ((2, 6, 3), (2, 1, 3), 1, 5), ((2, 3, 4), (2, 3, 2), 2, 1), ((4,), (4,), 0, 0)]


def _dus_twin(axis):
    def twin(x, u, s):
        n, m = x.shape[axis], u.shape[axis]
        st = int(np.clip(int(s), 0, n - m))
        out = x.clone()
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(st, st + m)
        out[tuple(idx)] = u
        return out

    return twin


@pytest.mark.parametrize("case", DUS_CASES, ids=str)
def test_dynamic_update_slice(case, rng):
    xs, us, axis, start = case
    check_op(lambda x, u, s: ops.dynamic_update_slice(x, u, s, axis), _dus_twin(axis),
             rand(rng, xs), rand(rng, us), np.array(start, np.int32))


@pytest.mark.parametrize("case", DUS_CASES, ids=str)
def test_dynamic_slice(case, rng):
    xs, us, axis, start = case
    size = us[axis]

    def twin(x, s):
        st = int(np.clip(int(s), 0, x.shape[axis] - size))
        return x.narrow(axis, st, size)

    check_op(lambda x, s: ops.dynamic_slice(x, s, size, axis), twin, rand(rng, xs),
             np.array([start], np.int32))


def test_dynamic_update_slice_python_int_start_and_kv_cache_pattern(rng):
    cache = rand(rng, (1, 2, 6, 3))
    new = rand(rng, (1, 2, 1, 3))
    check_forward(lambda c, n: ops.dynamic_update_slice(c, n, 4, axis=2), lambda c, n: torch.cat(
        [c[:, :, :4], n, c[:, :, 5:]], 2), cache, new)
    g = mn.Graph()
    c = g.state("cache", (1, 2, 6, 3))
    pos = g.input("pos", (), mn.i32)
    g.set_update("cache", ops.dynamic_update_slice(c, g.input("new", (1, 2, 1, 3)), pos, 2))
    (res,) = evaluate(g, [g.updates["cache"]], {"cache": cache, "new": new,
                                                "pos": np.array(2, np.int32)}, np.float64)
    want = cache.copy()
    want[:, :, 2:3] = new
    np.testing.assert_array_equal(res, want)


def test_dynamic_slice_errors():
    g = mn.Graph()
    x = g.input("x", (4, 3))
    with pytest.raises(mn.DTypeError, match="integer scalar"):
        ops.dynamic_slice(x, g.input("s", (2,), mn.i32), 2, 0)
    with pytest.raises(mn.DTypeError, match="integer scalar"):
        ops.dynamic_slice(x, g.input("sf", ()), 2, 0)
    with pytest.raises(mn.ShapeError, match="cannot take"):
        ops.dynamic_slice(x, 0, 5, 0)
    with pytest.raises(mn.ShapeError, match="does not fit"):
        ops.dynamic_update_slice(x, g.input("u", (2, 2)), 0, 0)
    with pytest.raises(mn.AxisError):
        ops.dynamic_update_slice(x, g.input("u2", (2, 3)), 0, 2)
