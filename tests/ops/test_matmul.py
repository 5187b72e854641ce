"""matmul: 2-D, vectors, batched with broadcast batch dims, transpose_a/b read in place —
forward and VJP against PyTorch (float64), VJP against finite differences."""

import pytest
import torch

import meganeura as mn
from meganeura import ops

from ._torchref import check_forward, check_op, rand, second_order

# (a shape, b shape) as they would be multiplied without transposes
SHAPES = [
    ((3, 4), (4, 5)),
    ((1, 4), (4, 1)),
    ((4,), (4, 5)),             # vector @ matrix
    ((3, 4), (4,)),             # matrix @ vector
    ((4,), (4,)),               # dot product
    ((2, 3, 4), (4, 5)),        # batch on one side
    ((3, 4), (2, 4, 5)),        # rank mismatch the other way
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 6)),  # broadcast batch dims (size-1 and rank mismatch)
    ((1, 3, 4), (2, 4, 5)),
    ((4,), (2, 4, 5)),          # vector against a batch
    ((2, 3, 4), (4,)),
]


def _t(shape, flag):
    """Stored shape of an operand read transposed (vectors are never transposed)."""
    if not flag or len(shape) < 2:
        return shape
    return shape[:-2] + (shape[-1], shape[-2])


def _twin(ta, tb):
    def twin(a, b):
        if ta and a.ndim >= 2:
            a = a.mT
        if tb and b.ndim >= 2:
            b = b.mT
        return torch.matmul(a, b)

    return twin


@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_matmul(shapes, ta, tb, rng):
    sa, sb = _t(shapes[0], ta), _t(shapes[1], tb)
    check_op(lambda a, b: ops.matmul(a, b, transpose_a=ta, transpose_b=tb), _twin(ta, tb),
             rand(rng, sa), rand(rng, sb))


@pytest.mark.parametrize("shapes", SHAPES[:4] + SHAPES[8:9], ids=str)
def test_matmul_operator(shapes, rng):
    check_op(lambda a, b: a @ b, torch.matmul, rand(rng, shapes[0]), rand(rng, shapes[1]))


def test_matmul_of_transpose_property(rng):
    a, b = rand(rng, (3, 4)), rand(rng, (2, 5, 4))
    check_op(lambda a, b: a @ b.T, lambda a, b: a @ b.mT, a, b)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_second_order(ta, tb, rng):
    sa, sb = _t((2, 3, 4), ta), _t((4, 5), tb)
    second_order(lambda a, b: ops.matmul(a, b, transpose_a=ta, transpose_b=tb).tanh(),
                 lambda a, b: _twin(ta, tb)(a, b).tanh(), rand(rng, sa), rand(rng, sb))


def test_matmul_with_constant_operand(rng):
    # only one side is a parameter: the other side's gradient is not requested
    from ._torchref import Spec

    a, b = rand(rng, (3, 4)), rand(rng, (4, 2))
    check_op(ops.matmul, torch.matmul, Spec(a, diff=False), b)
    check_op(ops.matmul, torch.matmul, a, Spec(b, diff=False))


def test_matmul_output_shapes():
    g = mn.Graph()
    a = g.input("a", (2, 1, 3, 4))
    b = g.input("b", (5, 4, 6))
    assert (a @ b).shape == (2, 5, 3, 6)
    assert ops.matmul(a, g.input("c", (6, 4)), transpose_b=True).shape == (2, 1, 3, 6)
    v = g.input("v", (4,))
    assert (v @ v).shape == ()
    assert (a @ v).shape == (2, 1, 3)
    assert (v @ b).shape == (5, 6)


def test_matmul_large_values_float64(rng):
    check_forward(ops.matmul, torch.matmul, rand(rng, (8, 16)) * 1e3, rand(rng, (16, 8)) * 1e-3)
