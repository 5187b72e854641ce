"""Convolution and pooling ops: forward and VJP against PyTorch (CPU, float64, <= 1e-10 relative
L2) and finite differences on the numpy reference (<= 1e-6), including stride, asymmetric
padding, dilation, groups, depthwise, 1x1, the split weight gradient, pooling ties (PyTorch's
first-maximum policy) and second-order gradients through the convolution gradients."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import meganeura as mn
from meganeura import ops
from meganeura.autodiff import grad
from meganeura.errors import AutodiffError, GraphBuildError, ShapeError
from meganeura.graph import registered_ops
from meganeura.ops.lowering import Kernel
from meganeura.reference import evaluate

from ._torchref import TORCH_TOL, assert_close, check_forward, check_op, rand, second_order


def _torch_conv(x, w, b, stride, padding, dilation, groups):
    (pt, pb), (pl, pr) = padding
    x = F.pad(x, (pl, pr, pt, pb))
    return F.conv2d(x, w, b, stride=stride, dilation=dilation, groups=groups)


# (x shape, w shape, bias, stride, padding ((t, b), (l, r)), dilation, groups)
CONV_CASES = {
    "3x3_pad1": ((2, 3, 5, 6), (4, 3, 3, 3), True, (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    "stride2_asym_dil": ((2, 4, 7, 6), (6, 2, 3, 3), True, (2, 1), ((1, 0), (2, 1)), (1, 2), 2),
    "groups2_nobias": ((1, 4, 5, 5), (4, 2, 2, 3), False, (1, 2), ((0, 1), (1, 0)), (1, 1), 2),
    "depthwise": ((2, 3, 6, 5), (6, 1, 3, 3), True, (1, 1), ((1, 1), (1, 1)), (1, 1), 3),
    "1x1_stride2": ((2, 5, 5, 4), (3, 5, 1, 1), True, (2, 2), ((0, 0), (0, 0)), (1, 1), 1),
    "7x7_s2_p3": ((1, 2, 8, 8), (3, 2, 7, 7), False, (2, 2), ((3, 3), (3, 3)), (1, 1), 1),
    "dil2_stride2": ((1, 2, 9, 8), (2, 2, 3, 2), True, (2, 3), ((2, 1), (0, 2)), (2, 2), 1),
    "stride3_pad_big": ((1, 2, 6, 7), (2, 2, 2, 2), True, (3, 3), ((2, 2), (1, 3)), (1, 1), 1),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv2d_forward_and_vjp(rng, case):
    xs, ws, has_b, st, pad, dil, g = CONV_CASES[case]
    inputs = [rand(rng, xs), rand(rng, ws)] + ([rand(rng, (ws[0],))] if has_b else [])

    def ours(x, w, b=None):
        return ops.conv2d(x, w, b, stride=st, padding=pad, dilation=dil, groups=g)

    def theirs(x, w, b=None):
        return _torch_conv(x, w, b, st, pad, dil, g)

    check_op(ours, theirs, *inputs)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
def test_conv2d_padding_forms_match_torch(rng):
    x, w = rand(rng, (1, 2, 6, 5)), rand(rng, (3, 2, 4, 3))
    # 'same' with an even kernel: the extra pixel goes bottom/right, as in PyTorch
    check_forward(lambda a, b: ops.conv2d(a, b, padding="same", dilation=(1, 2)),
                  lambda a, b: F.conv2d(a, b, padding="same", dilation=(1, 2)), x, w)
    check_forward(lambda a, b: ops.conv2d(a, b, padding="valid"),
                  lambda a, b: F.conv2d(a, b), x, w)
    check_forward(lambda a, b: ops.conv2d(a, b, padding=(2, 1)),
                  lambda a, b: F.conv2d(a, b, padding=(2, 1)), x, w)


def test_conv_gradient_ops_are_registered_kernels():
    reg = registered_ops()
    for name in ("conv2d", "conv2d_input_grad", "conv2d_weight_grad", "max_pool2d",
                 "max_pool2d_grad", "avg_pool2d", "avg_pool2d_grad"):
        op = reg[name]
        assert isinstance(op.lowering, Kernel) and op.lowering.archetype == name
        assert op.reference is not None and op.vjp is not None
    from meganeura.kernels.archetypes import archetype

    for name in ("conv2d", "conv2d_input_grad", "conv2d_weight_grad", "max_pool2d",
                 "max_pool2d_grad", "avg_pool2d", "avg_pool2d_grad"):
        assert archetype(name).name == name


def test_conv2d_vjp_builds_the_gradient_ops():
    g = mn.Graph()
    x = g.param("x", (2, 3, 6, 6))
    w = g.param("w", (4, 3, 3, 3))
    b = g.param("b", (4,))
    loss = ops.conv2d(x, w, b, padding=1).sum()
    g2, grads = grad(g, loss)
    assert grads["x"].node.op == "conv2d_input_grad"
    assert grads["w"].node.op == "conv2d_weight_grad"
    assert grads["b"].node.op == "reshape" or grads["b"].node.op == "sum"


@pytest.mark.parametrize("split", [2, 3, 7])
def test_split_weight_grad_partials_sum_to_torch(rng, split):
    xs, ws, _, st, pad, dil, g = CONV_CASES["stride2_asym_dil"]
    x, w = rand(rng, xs), rand(rng, ws)
    gr = mn.Graph()
    xv = gr.input("x", xs)
    wv = gr.param("w", ws)
    y = ops.conv2d(xv, wv, stride=st, padding=pad, dilation=dil, groups=g)
    dyv = gr.input("dy", y.shape)
    dw = ops.conv2d_weight_grad(xv, dyv, ws[2:], stride=st, padding=pad, dilation=dil, groups=g,
                                split=split)
    assert dw.node.op == "sum" and dw.node.inputs[0].shape == (split,) + ws
    dy = rand(rng, y.shape)
    (ours,) = evaluate(gr, [dw], {"x": x, "dy": dy}, dtype=np.float64)
    tw = torch.tensor(w, requires_grad=True)
    ty = _torch_conv(torch.tensor(x), tw, None, st, pad, dil, g)
    (tg,) = torch.autograd.grad(ty, tw, torch.tensor(dy))
    assert_close(ours, tg.numpy(), TORCH_TOL, "split weight grad")


def test_weight_grad_split_heuristic():
    from meganeura.ops.conv import weight_grad_split

    assert weight_grad_split(100, 8, 72) == 1  # small: one chunk
    assert weight_grad_split(4 * 56 * 56, 64, 576) == 30  # ResNet-50 layer1 3x3
    assert weight_grad_split(4 * 14 * 14, 256, 2304) == 2  # layer3 3x3: 144 tiles
    assert weight_grad_split(10**7, 1, 1) == 32  # capped


@pytest.mark.parametrize("case", ["stride2_asym_dil", "depthwise"])
def test_conv2d_second_order(rng, case):
    xs, ws, has_b, st, pad, dil, g = CONV_CASES[case]
    inputs = [rand(rng, xs), rand(rng, ws)]

    def ours(x, w):
        return ops.conv2d(x, w, stride=st, padding=pad, dilation=dil, groups=g).square()

    def theirs(x, w):
        return _torch_conv(x, w, None, st, pad, dil, g).square()

    second_order(ours, theirs, *inputs)


def test_conv1d_matches_torch(rng):
    x, w, b = rand(rng, (2, 4, 11)), rand(rng, (6, 2, 3)), rand(rng, (6,))
    check_op(lambda a, c, d: ops.conv1d(a, c, d, stride=2, padding=1, dilation=2, groups=2),
             lambda a, c, d: F.conv1d(a, c, d, stride=2, padding=1, dilation=2, groups=2),
             x, w, b)
    check_forward(lambda a, c: ops.conv1d(a, c, padding=(2, 0)),
                  lambda a, c: F.conv1d(F.pad(a, (2, 0)), c), x, rand(rng, (3, 4, 3)))


# ------------------------------------------------------------------ pooling

POOL_CASES = {
    "3x3_s2_p1": ((2, 3, 7, 6), 3, 2, 1, 1),
    "2x2": ((1, 2, 6, 8), 2, None, 0, 1),
    "3x2_s1": ((1, 2, 5, 5), (3, 2), 1, (1, 0), 1),
    "dilated": ((1, 2, 9, 8), 3, 2, 1, (2, 1)),
}


@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_max_pool2d_distinct_values(rng, case):
    xs, k, s, p, d = POOL_CASES[case]
    x = rand(rng, xs, "distinct")
    check_op(lambda a: ops.max_pool2d(a, k, s, p, dilation=d),
             lambda a: F.max_pool2d(a, k, s, p, dilation=d), x)


def test_max_pool2d_indices_match_torch(rng):
    x = rand(rng, (2, 2, 7, 6), "distinct")

    def ours(a):
        return ops.max_pool2d_with_indices(a, 3, 2, 1)

    def theirs(a):
        return F.max_pool2d(a, 3, 2, 1, return_indices=True)

    check_forward(ours, theirs, x)


@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_max_pool2d_ties_follow_torch(rng, case):
    """Values from a 3-element set: most windows hold several maxima; the gradient goes to the
    first one in scan order (PyTorch's policy), checked exactly against PyTorch."""
    xs, k, s, p, d = POOL_CASES[case]
    x = rng.integers(0, 3, xs).astype(np.float64)
    check_op(lambda a: ops.max_pool2d(a, k, s, p, dilation=d),
             lambda a: F.max_pool2d(a, k, s, p, dilation=d), x, fd=False)
    # all-equal input: every window's gradient goes to its first in-bounds element
    check_op(lambda a: ops.max_pool2d(a, k, s, p, dilation=d),
             lambda a: F.max_pool2d(a, k, s, p, dilation=d), np.ones(xs), fd=False)


def test_max_pool2d_negative_inf_and_padding_never_win():
    x = np.full((1, 1, 3, 3), -np.inf)
    x[0, 0, 1, 1] = -5.0
    gr = mn.Graph()
    xv = gr.input("x", x.shape)
    y, idx = ops.max_pool2d_with_indices(xv, 2, 1, 1)
    yo, io = evaluate(gr, [y, idx], {"x": x}, dtype=np.float64)
    ty, ti = F.max_pool2d(torch.tensor(x), 2, 1, 1, return_indices=True)
    np.testing.assert_array_equal(yo, ty.numpy())
    np.testing.assert_array_equal(io, ti.numpy())


AVG_CASES = {
    "3x3_s2_p1": ((2, 3, 7, 6), 3, 2, 1),
    "2x2": ((1, 2, 6, 8), 2, None, 0),
    "3x2_s1_p": ((1, 2, 5, 5), (3, 2), 1, (1, 1)),
}


@pytest.mark.parametrize("cip", [True, False])
@pytest.mark.parametrize("case", sorted(AVG_CASES))
def test_avg_pool2d(rng, case, cip):
    xs, k, s, p = AVG_CASES[case]
    check_op(lambda a: ops.avg_pool2d(a, k, s, p, count_include_pad=cip),
             lambda a: F.avg_pool2d(a, k, s, p, count_include_pad=cip), rand(rng, xs))


@pytest.mark.parametrize("cip", [True, False])
def test_avg_pool2d_second_order(rng, cip):
    second_order(lambda a: ops.avg_pool2d(a, 3, 2, 1, count_include_pad=cip).square(),
                 lambda a: F.avg_pool2d(a, 3, 2, 1, count_include_pad=cip).square(),
                 rand(rng, (1, 2, 6, 5)))


def test_global_average_pool_is_mean(rng):
    check_op(lambda a: ops.mean(a, (2, 3)), lambda a: a.mean((2, 3)), rand(rng, (2, 3, 4, 5)))


# ------------------------------------------------------------------ errors


def test_bad_builds_are_clear():
    g = mn.Graph()
    x = g.input("x", (1, 4, 5, 5))
    with pytest.raises(ShapeError, match="groups=3 must divide"):
        ops.conv2d(x, g.param("w", (3, 2, 3, 3)), groups=3)
    with pytest.raises(ShapeError, match="weight expects 3"):
        ops.conv2d(x, g.param("w2", (4, 3, 3, 3)))
    with pytest.raises(ShapeError, match="does not fit"):
        ops.conv2d(x, g.param("w3", (4, 4, 7, 7)))
    with pytest.raises(ShapeError, match="bias must have shape"):
        ops.conv2d(x, g.param("w4", (2, 4, 3, 3)), g.param("b4", (3,)))
    with pytest.raises(GraphBuildError, match="stride must be"):
        ops.conv2d(x, g.param("w5", (2, 4, 3, 3)), stride=0)
    with pytest.raises(GraphBuildError, match="padding must be >= 0"):
        ops.conv2d(x, g.param("w6", (2, 4, 3, 3)), padding=-1)
    with pytest.raises(GraphBuildError, match="same' needs stride 1"):
        ops.conv2d(x, g.param("w7", (2, 4, 3, 3)), padding="same", stride=2)
    with pytest.raises(GraphBuildError, match="at most half"):
        ops.max_pool2d(x, 2, padding=2)
    with pytest.raises(ShapeError, match="4-D"):
        ops.max_pool2d(g.input("v", (4, 5)), 2)


def test_second_order_limits_are_explicit():
    g = mn.Graph()
    x = g.param("x", (1, 1, 4, 4))
    loss = ops.max_pool2d(x, 2).square().sum()
    g1, gr = grad(g, loss)
    l2 = gr["x"].square().sum()
    with pytest.raises(AutodiffError, match="second-order gradients through max_pool2d"):
        grad(g1, l2)
    g = mn.Graph()
    x = g.param("x", (1, 1, 4, 4))
    dy = g.param("dy", (1, 1, 4, 4))
    dw = ops.conv2d_weight_grad(x, dy, (1, 1), split=2)
    with pytest.raises(AutodiffError, match="split conv2d_weight_grad"):
        grad(g, dw.square().sum())


def test_float32_reference_keeps_dtype(rng):
    g = mn.Graph()
    x = g.input("x", (1, 2, 5, 5))
    w = g.param("w", (3, 2, 3, 3))
    y = ops.conv2d(x, w, padding=1)
    p = ops.max_pool2d(y, 2)
    a = ops.avg_pool2d(y, 2)
    outs = evaluate(g, [y, p, a], {"x": rand(rng, (1, 2, 5, 5)), "w": rand(rng, (3, 2, 3, 3))})
    assert all(o.dtype == np.float32 for o in outs)



