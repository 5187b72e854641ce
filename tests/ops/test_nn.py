"""softmax, log_softmax, one_hot and the losses (cross_entropy, mse_loss, l1_loss,
bce_with_logits): forward and VJP against PyTorch (float64), VJP against finite differences."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import meganeura as mn
from meganeura import ops
from meganeura.reference import evaluate

from ._torchref import Spec, check_forward, check_op, rand, second_order

SOFTMAX_CASES = [((5,), -1), ((5,), 0), ((2, 3), -1), ((2, 3), 0), ((2, 3, 4), 1),
                 ((2, 3, 4), -1), ((1, 4), 0), ((3, 1), -1), ((), -1)]


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=str)
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax(name, case, rng):
    shape, axis = case
    twin = getattr(torch, name)
    check_op(lambda x: getattr(ops, name)(x, axis), lambda x: twin(x, axis), rand(rng, shape))


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_method_default_axis_and_large_values(name, rng):
    twin = getattr(torch, name)
    x = rand(rng, (3, 6)) * 200.0
    check_op(lambda v: getattr(v, name)(), lambda t: twin(t, -1), x, fd=False)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_second_order(name, rng):
    twin = getattr(torch, name)
    second_order(lambda x: getattr(ops, name)(x, 1), lambda x: twin(x, 1), rand(rng, (2, 4, 3)))


# ---------------------------------------------------------------------------------- one_hot

@pytest.mark.parametrize("shape", [(5,), (2, 3), ()], ids=str)
def test_one_hot(shape, rng):
    labels = rng.integers(0, 4, shape).astype(np.int32)
    check_forward(lambda y: ops.nn.one_hot(y, 4, dtype="f32"),
                  lambda y: F.one_hot(y, 4).to(torch.float64), labels)
    out = check_forward(lambda y: y.one_hot(4, dtype=mn.i32),
                        lambda y: F.one_hot(y, 4).to(torch.int32), labels)[0]
    assert out.dtype == np.int32


def test_one_hot_out_of_range_labels_give_zero_rows():
    g = mn.Graph()
    y = g.input("y", (4,), mn.i32)
    (out,) = evaluate(g, [ops.nn.one_hot(y, 3)], {"y": np.array([0, -100, 3, 2])})
    np.testing.assert_array_equal(out, [[1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 1]])


# ---------------------------------------------------------------------------------- cross-entropy

CE_SHAPES = [((5, 4), (5,)), ((2, 3, 4), (2, 3)), ((2, 2, 3, 5), (2, 2, 3)), ((4,), ()),
             ((1, 3), (1,))]
IGNORES = ["none", "default", "custom"]


def _labels(rng, shape, C, ignore):
    y = rng.integers(0, C, shape).astype(np.int32)
    if ignore == "none" or y.size < 2:
        return y, -100
    flat = y.reshape(-1)
    if ignore == "default":
        flat[:: 3] = -100
        return y, -100
    flat[:] = np.arange(flat.size) % C  # every class appears; class 1 is ignored
    return y, 1


def _ce_twin(reduction, ignore_index, label_smoothing):
    def twin(logits, labels):
        if logits.ndim > 2:
            logits = logits.movedim(-1, 1)  # PyTorch wants the class axis at 1
        return F.cross_entropy(logits, labels, reduction=reduction, ignore_index=ignore_index,
                               label_smoothing=label_smoothing)

    return twin


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("ignore", IGNORES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shapes", CE_SHAPES, ids=str)
def test_cross_entropy(shapes, reduction, ignore, smoothing, rng):
    ls, ys = shapes
    C = ls[-1]
    labels, ignore_index = _labels(rng, ys, C, ignore)
    logits = rand(rng, ls) * 2.0
    check_op(lambda x, y: ops.cross_entropy(x, y, reduction=reduction, ignore_index=ignore_index,
                                            label_smoothing=smoothing),
             _ce_twin(reduction, ignore_index, smoothing), logits, labels)


def test_cross_entropy_large_logits(rng):
    logits = rand(rng, (4, 6)) * 300.0
    labels = rng.integers(0, 6, (4,)).astype(np.int32)
    check_op(ops.cross_entropy, _ce_twin("mean", -100, 0.0), logits, labels, fd=False)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_second_order(reduction, rng):
    labels = np.array([[0, 2, -100], [1, 1, 3]], dtype=np.int32)
    second_order(lambda x, y: ops.cross_entropy(x, y, reduction=reduction, label_smoothing=0.2),
                 _ce_twin(reduction, -100, 0.2), rand(rng, (2, 3, 4)), labels)


def test_cross_entropy_matches_composite_expansion(rng):
    """The op's Composite lowering (what the GPU path runs) agrees with its reference."""
    from meganeura.ops.nn import _expand_ce

    for reduction in ("mean", "sum", "none"):
        g = mn.Graph()
        x = g.input("x", (3, 2, 5))
        y = g.input("y", (3, 2), mn.i32)
        out = ops.cross_entropy(x, y, reduction=reduction, ignore_index=2, label_smoothing=0.3)
        (expanded,) = _expand_ce(g, out.node)
        env = {"x": rand(rng, (3, 2, 5)), "y": rng.integers(0, 5, (3, 2)).astype(np.int32)}
        a, b = evaluate(g, [out, expanded], env, dtype=np.float64)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------- other losses

LOSS_SHAPES = [(5,), (2, 3), (), (2, 1, 3)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", LOSS_SHAPES, ids=str)
def test_mse_loss(shape, reduction, rng):
    check_op(lambda p, t: ops.mse_loss(p, t, reduction), lambda p, t: F.mse_loss(p, t,
             reduction=reduction), rand(rng, shape), rand(rng, shape))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", LOSS_SHAPES, ids=str)
def test_l1_loss(shape, reduction, rng):
    target = rand(rng, shape)
    pred = target + rand(rng, shape, "away0")  # |pred - target| away from the kink at 0
    check_op(lambda p, t: ops.l1_loss(p, t, reduction), lambda p, t: F.l1_loss(p, t,
             reduction=reduction), pred, target)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", LOSS_SHAPES, ids=str)
def test_bce_with_logits(shape, reduction, rng):
    logits = rand(rng, shape) * 3.0
    targets = rng.uniform(0.0, 1.0, shape)
    check_op(lambda x, t: ops.bce_with_logits(x, t, reduction),
             lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction=reduction),
             logits, targets)


def test_bce_with_logits_large_logits_and_hard_targets(rng):
    logits = np.array([-200.0, -30.0, -1.0, 0.0, 1.0, 30.0, 200.0])
    targets = np.array([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    check_op(lambda x, t: ops.bce_with_logits(x, t, "sum"),
             lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction="sum"),
             logits, Spec(targets, diff=False), fd=False)


@pytest.mark.parametrize("name", ["mse_loss", "l1_loss", "bce_with_logits"])
def test_losses_second_order(name, rng):
    x = rand(rng, (2, 3))
    t = x + rand(rng, (2, 3), "away0") if name == "l1_loss" else rng.uniform(0, 1, (2, 3))
    twin = {"mse_loss": F.mse_loss, "l1_loss": F.l1_loss,
            "bce_with_logits": F.binary_cross_entropy_with_logits}[name]
    second_order(lambda a, b: getattr(ops, name)(a, b) * 3.0, lambda a, b: twin(a, b) * 3.0, x, t)


@pytest.mark.parametrize("bad", [3, -1, 7])
def test_cross_entropy_reference_rejects_out_of_range_labels(bad, rng):
    # PyTorch raises for such targets; the oracle does too instead of indexing out of bounds
    g = mn.Graph()
    loss = ops.cross_entropy(g.input("x", (2, 3)), g.input("y", (2,), mn.i32))
    with pytest.raises(mn.FeedError, match=f"label {bad} is out of range for 3 classes"):
        evaluate(g, [loss], {"x": rand(rng, (2, 3)), "y": np.array([0, bad], np.int32)})
    with pytest.raises((IndexError, RuntimeError)):
        F.cross_entropy(torch.zeros(2, 3), torch.tensor([0, bad]))
