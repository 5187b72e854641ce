"""Reductions (sum mean max min logsumexp) over axes with keepdims: forward and VJP against
PyTorch (float64), VJP against finite differences, and PyTorch's even split at tied extremes."""

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura import ops
from meganeura.reference import evaluate

from ._torchref import check_forward, check_op, rand, second_order

CASES = [
    ((2, 3, 4), None),
    ((2, 3, 4), 0),
    ((2, 3, 4), 1),
    ((2, 3, 4), -1),
    ((2, 3, 4), (0, 2)),
    ((2, 3, 4), (-1, 0)),
    ((2, 3, 4), (0, 1, 2)),
    ((5,), None),
    ((5,), 0),
    ((), None),
    ((1, 3), 0),
    ((1, 3), None),
    ((3, 1), 1),
    ((2, 1, 3), (1,)),
]


def _dims(x, axis):
    if axis is None:
        return tuple(range(x.ndim))
    return (axis,) if isinstance(axis, int) else tuple(axis)


def _twin(fn):
    def twin_for(axis, keepdims):
        def twin(x):
            dims = _dims(x, axis)
            if x.ndim == 0:
                return fn(x.reshape(1), 0, keepdims).reshape(()) if dims == () else x
            return fn(x, dims, keepdims)

        return twin

    return twin_for


TWINS = {
    "sum": _twin(lambda x, d, k: torch.sum(x, dim=d, keepdim=k)),
    "mean": _twin(lambda x, d, k: torch.mean(x, dim=d, keepdim=k)),
    "max": _twin(lambda x, d, k: torch.amax(x, dim=d, keepdim=k)),
    "min": _twin(lambda x, d, k: torch.amin(x, dim=d, keepdim=k)),
    "logsumexp": _twin(lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k)),
}
DOMAIN = {"sum": "any", "mean": "any", "max": "distinct", "min": "distinct", "logsumexp": "any"}


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", sorted(TWINS))
def test_reduce(name, case, keepdims, rng):
    shape, axis = case
    build = getattr(ops, name)
    check_op(lambda x: build(x, axis, keepdims=keepdims), TWINS[name](axis, keepdims),
             rand(rng, shape, DOMAIN[name]))


@pytest.mark.parametrize("name", sorted(TWINS))
def test_reduce_method_form(name, rng):
    x = rand(rng, (3, 4), DOMAIN[name])
    check_forward(lambda v: getattr(v, name)(axis=-1), TWINS[name](-1, False), x)
    check_forward(lambda v: getattr(v, name)(0, keepdims=True), TWINS[name](0, True), x)
    check_forward(lambda v: getattr(v, name)(), TWINS[name](None, False), x)


@pytest.mark.parametrize("name", sorted(TWINS))
def test_reduce_second_order(name, rng):
    second_order(lambda x: getattr(ops, name)(x, 1) ** 2, lambda x: TWINS[name](1, False)(x) ** 2,
                 rand(rng, (2, 3, 2), DOMAIN[name]))


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)], ids=str)
@pytest.mark.parametrize("name", ["max", "min"])
def test_extreme_ties_split_evenly(name, axis, keepdims):
    """Tied extremes share the gradient evenly, like torch.amax/amin (and full torch.max)."""
    x = np.array([[1.0, 3.0, 3.0, -2.0], [3.0, -2.0, 0.5, -2.0], [-2.0, -2.0, 3.0, 1.0]])
    check_op(lambda v: getattr(ops, name)(v, axis, keepdims=keepdims),
             TWINS[name](axis, keepdims), x, fd=False)


@pytest.mark.parametrize("name,twin", [("max", torch.max), ("min", torch.min)])
def test_full_extreme_ties_match_torch_max(name, twin):
    x = np.array([[1.0, 3.0, 3.0], [3.0, -2.0, -2.0]])
    g = mn.Graph()
    p = g.param("x", x.shape)
    g2, grads = mn.grad(g, getattr(p, name)() * 2.0)
    (ours,) = evaluate(g2, [grads["x"]], {"x": x}, dtype=np.float64)
    t = torch.tensor(x, requires_grad=True)
    (twin(t) * 2.0).backward()
    np.testing.assert_array_equal(ours, t.grad.numpy())
    assert ours.sum() == 2.0


def test_logsumexp_large_values(rng):
    x = rand(rng, (3, 5)) * 300.0
    check_op(lambda v: ops.logsumexp(v, -1), TWINS["logsumexp"](-1, False), x, fd=False)


@pytest.mark.parametrize("name", ["sum", "max", "min"])
def test_reduce_int(name):
    x = np.array([[3, -1, 4], [1, -5, 9]], dtype=np.int32)
    check_forward(lambda v: getattr(ops, name)(v, 1), TWINS[name](1, False), x)
    check_forward(lambda v: getattr(ops, name)(v), TWINS[name](None, False), x)


def test_reduce_output_types():
    g = mn.Graph()
    x = g.input("x", (2, 3, 4))
    assert ops.sum(x, (0, 2)).shape == (3,)
    assert ops.mean(x, -1, keepdims=True).shape == (2, 3, 1)
    assert ops.max(x).shape == ()
    assert ops.logsumexp(x, (1, 2), keepdims=True).shape == (2, 1, 1)
    assert ops.sum(g.input("i", (4,), mn.i32)).dtype is mn.i32


@pytest.mark.parametrize("xshape,shape", [((2, 3), (2, 3)), ((2, 3), (3,)), ((2, 3), (1, 3)),
                                          ((4, 2, 3), (2, 1)), ((2, 3), ()), ((2, 3), (1, 1))],
                         ids=str)
def test_sum_to(xshape, shape, rng):
    """sum_to, the adjoint of broadcasting (used by every broadcasting VJP)."""

    def twin(x):
        lead = x.ndim - len(shape)
        dims = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                         if d == 1 and x.shape[lead + i] != 1)
        return (x.sum(dim=dims, keepdim=True) if dims else x).reshape(shape)

    check_op(lambda v: ops.sum_to(v, shape), twin, rand(rng, xshape))
