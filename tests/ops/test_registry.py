"""The op registry as a whole: every op declares its type rule, reference, VJP (or is
deliberately non-differentiable) and lowering; Composite lowerings (what the GPU path runs after
expansion) compute the same values as the op's reference."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import ops
from meganeura.graph import registered_ops
from meganeura.ops.lowering import Composite, Kernel, Matmul, Pointwise, Reduce, View
from meganeura.reference import evaluate

from ._torchref import rand

NON_DIFFERENTIABLE = {"less", "less_equal", "greater", "greater_equal", "equal", "not_equal",
                      "logical_and", "logical_or", "logical_not", "full"}
LEAVES = {"input", "param", "state", "constant"}

REQUIRED = """neg abs sign exp log sqrt rsqrt reciprocal square relu sigmoid tanh sin cos floor erf
silu gelu add sub mul div pow maximum minimum less less_equal greater greater_equal equal
not_equal logical_and logical_or logical_not where cast stop_gradient sum mean max min logsumexp
reshape permute broadcast_to slice concat split matmul softmax log_softmax one_hot cross_entropy
bce_with_logits""".split()


def _ours():
    import meganeura.ops as family

    return {n: o for n, o in registered_ops().items()
            if o.reference is not None and o.infer.__module__.startswith(family.__name__)}


def test_every_required_op_is_registered():
    missing = sorted(set(REQUIRED) - set(registered_ops()))
    assert not missing, missing
    # builders that are compositions of other ops
    for name in ("mse_loss", "l1_loss", "transpose", "matrix_transpose", "squeeze", "unsqueeze",
                 "getitem", "slice_", "sum_to", "zeros_like", "ones_like"):
        assert callable(getattr(ops, name))


@pytest.mark.parametrize("name", sorted(set(REQUIRED) | {"pad_slice", "full"}))
def test_op_declares_everything(name):
    op = registered_ops()[name]
    assert op.infer is not None and op.reference is not None
    assert op.lowering is not None, f"{name} has no lowering"
    lowering = op.lowering
    if not isinstance(lowering, (Pointwise, Reduce, Matmul, View, Composite, Kernel)):
        assert callable(lowering), f"{name}: lowering {lowering!r}"
    if name in NON_DIFFERENTIABLE:
        assert op.vjp is None
    else:
        assert op.vjp is not None, f"{name} has no VJP"


def test_leaves_are_not_ops_of_a_family():
    assert LEAVES <= set(registered_ops())
    assert not (LEAVES & set(_ours()))


def _composite_cases():
    def x(g, shape=(2, 3, 4)):
        return g.input("x", shape)

    return {
        "mean": lambda g: ops.mean(x(g), (0, 2)),
        "mean_keep": lambda g: ops.mean(x(g), -1, keepdims=True),
        "logsumexp": lambda g: ops.logsumexp(x(g), 1),
        "logsumexp_all_keep": lambda g: ops.logsumexp(x(g), None, keepdims=True),
        "softmax": lambda g: ops.softmax(x(g), 1),
        "log_softmax": lambda g: ops.log_softmax(x(g), -1),
        "cross_entropy": lambda g: ops.cross_entropy(
            x(g), g.input("y", (2, 3), mn.i32), ignore_index=1, label_smoothing=0.2),
        "cross_entropy_none": lambda g: ops.cross_entropy(x(g), g.input("y", (2, 3), mn.i32),
                                                          reduction="none"),
        "bce_with_logits": lambda g: ops.bce_with_logits(x(g), g.input("t", (2, 3, 4)), "none"),
    }


@pytest.mark.parametrize("case", sorted(_composite_cases()))
def test_composite_expansion_matches_reference(case, rng):
    g = mn.Graph()
    out = _composite_cases()[case](g)
    node = out.node
    assert isinstance(node.opdef.lowering, Composite)
    (expanded,) = node.opdef.lowering.expand(g, node)
    assert expanded.type == out.type
    env = {"x": rand(rng, (2, 3, 4)) * 3.0, "y": rng.integers(0, 4, (2, 3)).astype(np.int32),
           "t": rng.uniform(0, 1, (2, 3, 4))}
    a, b = evaluate(g, [out, expanded], env, dtype=np.float64)
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-13)
    a32, b32 = evaluate(g, [out, expanded], env)
    assert a32.dtype == b32.dtype == np.float32
    np.testing.assert_allclose(b32, a32, rtol=2e-5, atol=1e-6)
