"""Graph building: bad builds fail at build time with a specific error naming the op, the operand
types and the user's line; the IR dump is readable; copies keep ids; fingerprints are stable."""

import os
import subprocess
import sys

import numpy as np
import pytest

import meganeura as mn
from meganeura import ops
from meganeura.errors import (
    AutodiffError,
    AxisError,
    DTypeError,
    GraphBuildError,
    MeganeuraError,
    NameConflictError,
    ShapeError,
)
from meganeura.reference import evaluate

HERE = os.path.basename(__file__)


def _g():
    g = mn.Graph("t")
    return g, g.input("x", (2, 3)), g.param("w", (4, 5))


# each case: (build function, exception type, strings the message must contain)
def _matmul_inner(g, x, w):
    x @ w


def _broadcast(g, x, w):
    x + g.input("y", (4,))


def _float_labels(g, x, w):
    ops.cross_entropy(g.input("logits", (4, 3)), g.input("labels", (4,)))


def _label_shape(g, x, w):
    ops.cross_entropy(g.input("logits", (4, 3)), g.input("labels", (3,), mn.i32))


def _label_shape_3d(g, x, w):
    # the class axis is the LAST axis: labels (2, 5) do not fit logits (2, 5, 3) -> (2, 5) ok,
    # but labels (2, 3) would fit a class-axis-1 convention and must be rejected
    ops.cross_entropy(g.input("logits", (2, 5, 3)), g.input("labels", (2, 3), mn.i32))


def _sum_axis(g, x, w):
    ops.sum(x, 2)


def _mean_axes_repeated(g, x, w):
    x.mean(axis=(1, -1))


def _softmax_axis(g, x, w):
    ops.softmax(x, axis=-3)


def _permute_axis(g, x, w):
    x.permute(0, 2)


def _permute_not_perm(g, x, w):
    x.permute(1, 1)


def _duplicate_name(g, x, w):
    g.param("x", (7,))


def _mixed_dtypes(g, x, w):
    g.input("a", (2,)) + g.input("b", (2,), mn.i32)


def _reshape_size(g, x, w):
    x.reshape(4, 2)


def _concat_mismatch(g, x, w):
    ops.concat([x, g.input("y", (3, 2))], axis=0)


def _gelu_approx(g, x, w):
    x.gelu(approximate="sigmoid")


def _two_graphs(g, x, w):
    other = mn.Graph("other")
    x * other.input("z", (2, 3))


def _float_scalar_int(g, x, w):
    g.input("i", (2, 3), mn.i32) + 0.5


def _where_cond(g, x, w):
    ops.where(x, x, x)


def _squeeze(g, x, w):
    x.squeeze(1)


def _getitem_range(g, x, w):
    x[:, 3]


def _split_sizes(g, x, w):
    ops.split(x, [1, 1], axis=1)


def _mse_shapes(g, x, w):
    ops.mse_loss(x, g.input("t", (3, 2)))


def _broadcast_to(g, x, w):
    x.broadcast_to((4, 3, 2))


def _matmul_int(g, x, w):
    g.input("i", (2, 3), mn.i32) @ g.input("j", (3, 2), mn.i32)


def _exp_int(g, x, w):
    g.input("i", (2, 3), mn.i32).exp()


def _ce_reduction(g, x, w):
    ops.cross_entropy(g.input("logits", (4, 3)), g.input("labels", (4,), mn.i32),
                      reduction="avg")


def _logical_float(g, x, w):
    ops.logical_and(x, x)


def _matmul_batch(g, x, w):
    g.input("a", (2, 3, 4)) @ g.input("b", (3, 4, 5))


def _unsqueeze_axis(g, x, w):
    x.unsqueeze(4)


def _slice_step(g, x, w):
    x[::-1]


def _one_hot_classes(g, x, w):
    g.input("labels", (4,), mn.i32).one_hot(0)


def _one_hot_float(g, x, w):
    ops.nn.one_hot(x, 3)


def _bce_dtype(g, x, w):
    ops.bce_with_logits(x, g.input("t", (2, 3), mn.i32))


BAD_BUILDS = {
    "matmul inner dims": (_matmul_inner, ShapeError, ["matmul", "f32[2,3]", "f32[4,5]"]),
    "matmul batch dims": (_matmul_batch, ShapeError, ["matmul", "f32[2,3,4]", "f32[3,4,5]"]),
    "broadcast": (_broadcast, ShapeError, ["add", "f32[2,3]", "f32[4]"]),
    "float labels": (_float_labels, DTypeError, ["cross_entropy", "f32[4,3]", "f32[4]"]),
    "label shape": (_label_shape, ShapeError, ["cross_entropy", "f32[4,3]", "i32[3]"]),
    "label shape, class axis last": (_label_shape_3d, ShapeError,
                                     ["cross_entropy", "f32[2,5,3]", "i32[2,3]"]),
    "sum axis": (_sum_axis, AxisError, ["sum", "f32[2,3]", "axis 2"]),
    "mean repeated axes": (_mean_axes_repeated, AxisError, ["mean", "f32[2,3]", "repeated"]),
    "softmax axis": (_softmax_axis, AxisError, ["softmax", "f32[2,3]", "-3"]),
    "permute axis": (_permute_axis, AxisError, ["permute", "f32[2,3]", "axis 2"]),
    "permute not a permutation": (_permute_not_perm, AxisError, ["permute", "f32[2,3]"]),
    "duplicate name": (_duplicate_name, NameConflictError,
                       ["param", "'x'", "f32[7]", "input f32[2,3]"]),
    "mixed dtypes": (_mixed_dtypes, DTypeError, ["add", "f32[2]", "i32[2]", "cast"]),
    "reshape size": (_reshape_size, ShapeError, ["reshape", "f32[2,3]", "(4, 2)"]),
    "concat": (_concat_mismatch, ShapeError, ["concat", "f32[2,3]", "f32[3,2]"]),
    "gelu approximate": (_gelu_approx, GraphBuildError, ["gelu", "f32[2,3]", "'sigmoid'"]),
    "two graphs": (_two_graphs, GraphBuildError, ["mul", "f32[2,3]", "another graph"]),
    "float scalar meets int": (_float_scalar_int, DTypeError, ["add", "i32[2,3]", "0.5"]),
    "where condition": (_where_cond, DTypeError, ["where", "f32[2,3]", "bool"]),
    "squeeze size": (_squeeze, ShapeError, ["squeeze", "f32[2,3]", "axis 1"]),
    "index range": (_getitem_range, ShapeError, ["getitem", "f32[2,3]", "index 3"]),
    "split sizes": (_split_sizes, ShapeError, ["split", "f32[2,3]", "(1, 1)"]),
    "mse shapes": (_mse_shapes, ShapeError, ["mse_loss", "f32[2,3]", "f32[3,2]"]),
    "broadcast_to": (_broadcast_to, ShapeError, ["broadcast_to", "f32[2,3]", "(4, 3, 2)"]),
    "matmul ints": (_matmul_int, DTypeError, ["matmul", "i32[2,3]", "i32[3,2]"]),
    "exp of int": (_exp_int, DTypeError, ["exp", "i32[2,3]"]),
    "cross_entropy reduction": (_ce_reduction, GraphBuildError, ["cross_entropy", "'avg'",
                                                                 "f32[4,3]", "i32[4]"]),
    "logical on floats": (_logical_float, DTypeError, ["logical_and", "f32[2,3]"]),
    "unsqueeze axis": (_unsqueeze_axis, AxisError, ["unsqueeze", "f32[2,3]", "axis 4"]),
    "negative slice step": (_slice_step, ShapeError, ["slice", "f32[2,3]", "step"]),
    "one_hot classes": (_one_hot_classes, ShapeError, ["one_hot", "i32[4]", "num_classes"]),
    "one_hot float labels": (_one_hot_float, DTypeError, ["one_hot", "f32[2,3]", "integer"]),
    "bce dtypes": (_bce_dtype, DTypeError, ["bce_with_logits", "f32[2,3]", "i32[2,3]"]),
}


@pytest.mark.parametrize("case", sorted(BAD_BUILDS))
def test_bad_build(case):
    fn, exc, needles = BAD_BUILDS[case]
    g, x, w = _g()
    n_before = len(g.nodes)
    with pytest.raises(exc) as info:
        fn(g, x, w)
    msg = str(info.value)
    for s in needles:
        assert s in msg, f"{s!r} not in message: {msg}"
    # the error points at the line of this file that built the op
    assert HERE in msg, f"no {HERE}:line in message: {msg}"
    line = int(msg.split(f"{HERE}:")[1].split(")")[0].split(";")[0])
    assert fn.__code__.co_firstlineno < line <= fn.__code__.co_firstlineno + 6
    assert isinstance(info.value, MeganeuraError)
    # a failed build leaves no half-built node behind the operands it created
    assert all(n.op in ("input", "param") for n in g.nodes[n_before:])


def test_grad_wrt_input_is_an_error():
    g, x, w = _g()
    loss = (x * 2.0).sum()
    with pytest.raises(AutodiffError) as info:
        mn.grad(g, loss, wrt=[x])
    msg = str(info.value)
    assert "grad" in msg and "f32[2,3]" in msg and "input" in msg and "'x'" in msg
    with pytest.raises(AutodiffError, match="'x' is not a parameter"):
        mn.grad(g, loss, wrt=["x"])
    with pytest.raises(AutodiffError, match="result of mul"):
        mn.grad(g, loss, wrt=[x * 2.0])


def test_grad_of_non_scalar_loss_is_an_error():
    g, x, w = _g()
    y = (x @ g.param("v", (3, 4))).relu()
    with pytest.raises(AutodiffError) as info:
        mn.grad(g, y)
    assert "grad" in str(info.value) and "f32[2,4]" in str(info.value)
    with pytest.raises(AutodiffError, match="floating point"):
        mn.grad(g, g.input("n", (), mn.i32))
    with pytest.raises(AutodiffError, match="different graph"):
        mn.grad(mn.Graph(), y.sum())


def test_errors_are_value_errors_too():
    # callers that only know Python's types still catch them sensibly
    assert issubclass(ShapeError, ValueError) and issubclass(DTypeError, TypeError)
    assert issubclass(AutodiffError, ValueError)


def test_value_has_no_truth_value():
    g, x, _ = _g()
    with pytest.raises(TypeError, match="truth value"):
        bool(x > 0)
    with pytest.raises(AttributeError, match="no_such_op"):
        x.no_such_op()


# ---------------------------------------------------------------------------------- operators

def test_operators_dispatch_to_ops():
    g = mn.Graph()
    a, b = g.input("a", (2, 3)), g.input("b", (3,))
    m = g.input("m", (3, 4))
    cases = {
        "add": a + b, "sub": a - b, "mul": a * b, "div": a / b, "pow": a**b, "neg": -a,
        "abs": abs(a), "matmul": a @ m, "less": a < b, "less_equal": a <= b, "greater": a > b,
        "greater_equal": a >= b, "equal": a.eq(b), "not_equal": a.ne(b),
        "relu": a.relu(), "exp": a.exp(), "permute": a.T, "slice": a[0:1],
    }
    for op, v in cases.items():
        assert v.node.op == op, (op, v.node.op)
        assert v.graph is g
    assert (a + 1.0).node.inputs[1].node.op == "full"
    assert (2 - a).node.inputs[0].shape == ()
    # == keeps identity semantics so values can key dicts
    assert a == a and not (a == b)
    assert {a: 1, b: 2}[b] == 2


def test_types_are_inferred():
    g = mn.Graph()
    a = g.input("a", (4, 1, 3))
    b = g.input("b", (2, 1))
    assert (a * b).shape == (4, 2, 3)
    assert (a < b).dtype is mn.bool_
    assert a.cast(mn.i32).dtype is mn.i32
    assert ops.cross_entropy(g.input("l", (2, 5, 3)), g.input("y", (2, 5), mn.i32)).shape == ()
    assert ops.cross_entropy(g.input("l2", (2, 5, 3)), g.input("y2", (2, 5), mn.i32),
                             reduction="none").shape == (2, 5)
    assert [v.shape for v in ops.split(a, 3, axis=-1)] == [(4, 1, 1)] * 3


# ---------------------------------------------------------------------------------- IR dump

def _small_graph(name="demo"):
    g = mn.Graph(name)
    x = g.input("x", (2, 3))
    y = g.input("y", (2,), mn.i32)
    w = g.param("w", (3, 4), init=mn.init.zeros())
    h = (x @ w).relu()
    loss = ops.cross_entropy(h, y)
    return g, loss


def test_print_graph_is_readable():
    g, loss = _small_graph()
    text = str(g)
    print(g)
    assert text.startswith("graph demo {") and text.rstrip().endswith("}")
    for s in ["input 'x' : f32[2,3]", "input 'y' : i32[2]", "param 'w' : f32[3,4]", "init=",
              "matmul(%0, %2)", "relu(%3) : f32[2,4]", "cross_entropy(%4, %1)",
              "reduction=mean", f"# {HERE}:"]:
        assert s in text, f"{s!r} not in\n{text}"
    # one line per node (plus the braces), every op line with the user's file:line
    lines = text.splitlines()
    assert len(lines) == len(g.nodes) + 2
    assert all(f"# {HERE}:" in ln for ln in lines[1:-1])
    assert repr(g) == text


def test_print_shows_updates():
    g = mn.Graph()
    w = g.param("w", (2,))
    g.set_update("w", w * 0.5)
    assert "update 'w' <- %" in str(g)


# ---------------------------------------------------------------------------------- copy / ids

def test_copy_keeps_ids_and_is_independent():
    g, loss = _small_graph()
    c = g.copy()
    assert c is not g and c.name == g.name
    assert [v.id for v in c.values] == [v.id for v in g.values]
    assert [n.op for n in c.nodes] == [n.op for n in g.nodes]
    assert [v.type for v in c.values] == [v.type for v in g.values]
    assert all(a is not b for a, b in zip(c.nodes, g.nodes, strict=True))
    # new_graph[v] maps a value of the original onto the copy
    cl = c[loss]
    assert cl is not loss and cl.id == loss.id and cl.graph is c and cl.node.op == "cross_entropy"
    assert c[cl] is cl
    assert set(c.params) == {"w"} and c.params["w"].id == g.params["w"].id
    assert c.leaves["w"].init == g.leaves["w"].init
    # building on the copy leaves the original alone
    n = len(g.nodes)
    cl * 2.0
    assert len(g.nodes) == n and len(c.nodes) > n
    with pytest.raises(GraphBuildError, match="not a value of graph"):
        g[c.values[-1]]
    # and they evaluate the same
    env = {"x": np.ones((2, 3)), "y": np.array([0, 3], np.int32), "w": np.full((3, 4), 0.1)}
    assert evaluate(g, [loss], env)[0] == evaluate(c, [cl], env)[0]


def test_copy_keeps_updates_and_constants():
    g = mn.Graph()
    w = g.param("w", (2,))
    k = g.const(np.array([1.0, 2.0]), name="k")
    g.set_update("w", w * k)
    c = g.copy("renamed")
    assert c.name == "renamed"
    assert c.updates["w"].id == g.updates["w"].id and c.updates["w"].graph is c
    np.testing.assert_array_equal(c.constants["k"], [1.0, 2.0])


# ---------------------------------------------------------------------------------- fingerprint

def test_fingerprint_is_structural():
    g1, _ = _small_graph("a")
    g2, _ = _small_graph("b")  # other name and other build lines: same structure
    assert g1.fingerprint() == g2.fingerprint()
    assert g1.copy().fingerprint() == g1.fingerprint()
    assert len(g1.fingerprint()) == 16

    def variant(shape=(3, 4), act="relu", red="mean", name="w"):
        g = mn.Graph()
        x = g.input("x", (2, 3))
        y = g.input("y", (2,), mn.i32)
        h = getattr(x @ g.param(name, shape), act)()
        ops.cross_entropy(h, y, reduction=red)
        return g.fingerprint()

    base = variant()
    assert variant() == base
    assert variant(shape=(3, 5)) != base
    assert variant(act="tanh") != base
    assert variant(red="sum") != base
    assert variant(name="w2") != base


def test_fingerprint_is_stable_across_processes():
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            "from test_graph import _small_graph; print(_small_graph()[0].fingerprint())")
    here = _small_graph()[0].fingerprint()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == here


# ---------------------------------------------------------------------------------- reference

def test_reference_follows_graph_dtypes_in_float32_mode():
    g = mn.Graph()
    x = g.input("x", (3,))
    y = (x * 0.1).cast(mn.f16)
    a, b = evaluate(g, [x * 0.1, y], {"x": np.array([1.0, 2.0, 3.0])})
    assert a.dtype == np.float32 and b.dtype == np.float16
    (c,) = evaluate(g, [y], {"x": np.array([1.0, 2.0, 3.0])}, dtype=np.float64)
    assert c.dtype == np.float64
    np.testing.assert_allclose(c, [0.1, 0.2, 0.3], rtol=1e-15)


def test_reference_missing_feed():
    g = mn.Graph()
    x = g.input("x", (3,))
    with pytest.raises(mn.FeedError, match="'x'"):
        evaluate(g, [x.exp()], {})
