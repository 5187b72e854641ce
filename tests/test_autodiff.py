"""Reverse-mode autodiff as a graph transform: accumulation at fan-out, zeros for unused
parameters, stop_gradient, differentiating a gradient graph again, and its errors."""

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura import ops
from meganeura.errors import AutodiffError
from meganeura.graph import OpDef, register_op, registered_ops
from meganeura.reference import evaluate

from .ops._torchref import FD_TOL, TORCH_TOL, assert_close, finite_difference


def _rng():
    return np.random.default_rng(1234)


def _grads(g, loss, env, wrt=None):
    g2, grads = mn.grad(g, loss, wrt)
    names = list(grads)
    vals = evaluate(g2, [grads[n] for n in names], env, dtype=np.float64)
    return dict(zip(names, vals, strict=True)), g2, grads


def _torch_grads(fn, env, names):
    ts = {k: torch.tensor(v, requires_grad=k in names) if v.dtype == np.float64
          else torch.tensor(v.astype(np.int64)) for k, v in env.items()}
    loss = fn(ts)
    gs = torch.autograd.grad(loss, [ts[n] for n in names], allow_unused=True)
    return {n: (np.zeros(env[n].shape) if t is None else t.numpy()) for n, t in zip(names, gs,
                                                                                     strict=True)}


def test_fan_out_accumulates():
    rng = _rng()
    g = mn.Graph()
    x = g.param("x", (3, 4))
    w = g.param("w", (4, 2))
    h = x @ w                                   # h used three times below, x twice
    loss = (h * h.tanh()).sum() + h.sum() + (x * x.exp()).mean()
    env = {"x": rng.standard_normal((3, 4)), "w": rng.standard_normal((4, 2))}
    ours, _, _ = _grads(g, loss, env)

    def twin(t):
        h = t["x"] @ t["w"]
        return (h * h.tanh()).sum() + h.sum() + (t["x"] * t["x"].exp()).mean()

    theirs = _torch_grads(twin, env, ["x", "w"])
    numeric = finite_difference(g, loss, env, ["x", "w"])
    for n in ("x", "w"):
        assert_close(ours[n], theirs[n], TORCH_TOL, n)
        assert_close(ours[n], numeric[n], FD_TOL, n)


def test_same_value_as_both_operands():
    g = mn.Graph()
    x = g.param("x", (5,))
    loss = (x * x).sum() + (x @ x) + ops.maximum(x, x).sum()
    env = {"x": _rng().standard_normal(5)}
    ours, _, _ = _grads(g, loss, env)
    theirs = _torch_grads(lambda t: (t["x"] * t["x"]).sum() + t["x"] @ t["x"]
                          + torch.maximum(t["x"], t["x"]).sum(), env, ["x"])
    assert_close(ours["x"], theirs["x"], TORCH_TOL, "x")
    np.testing.assert_allclose(ours["x"], 4 * env["x"] + 1, rtol=1e-14)


def test_unused_parameter_gets_exact_zeros_of_its_shape():
    g = mn.Graph()
    x = g.param("x", (3,))
    g.param("unused", (2, 5))
    g.param("scalar_unused", ())
    loss = (x * x).sum()
    ours, g2, grads = _grads(g, loss, {"x": np.arange(3.0), "unused": np.ones((2, 5)),
                                       "scalar_unused": np.array(2.0)})
    assert set(grads) == {"x", "unused", "scalar_unused"}
    assert grads["unused"].shape == (2, 5) and grads["unused"].dtype is mn.f32
    assert ours["unused"].shape == (2, 5) and ours["scalar_unused"].shape == ()
    assert np.all(ours["unused"] == 0.0) and ours["scalar_unused"] == 0.0
    np.testing.assert_array_equal(ours["x"], [0.0, 2.0, 4.0])
    # the zeros are a constant fill, not a computation that could produce -0.0 or NaN
    assert grads["unused"].node.op == "full"


def test_loss_independent_of_all_params():
    g = mn.Graph()
    g.param("w", (2,))
    x = g.input("x", (2,))
    ours, _, _ = _grads(g, (x * x).sum(), {"x": np.ones(2), "w": np.ones(2)})
    np.testing.assert_array_equal(ours["w"], np.zeros(2))


def test_stop_gradient_blocks():
    rng = _rng()
    g = mn.Graph()
    w = g.param("w", (3,))
    v = g.param("v", (3,))
    x = g.input("x", (3,))
    # w reaches the loss only through stop_gradient; v both directly and through it
    loss = (ops.stop_gradient(w) * x).sum() + (v * ops.stop_gradient(v * v)).sum()
    env = {"w": rng.standard_normal(3), "v": rng.standard_normal(3), "x": rng.standard_normal(3)}
    ours, _, _ = _grads(g, loss, env)
    np.testing.assert_array_equal(ours["w"], np.zeros(3))
    np.testing.assert_allclose(ours["v"], env["v"] ** 2, rtol=1e-15)
    theirs = _torch_grads(lambda t: (t["w"].detach() * t["x"]).sum()
                          + (t["v"] * (t["v"] * t["v"]).detach()).sum(), env, ["w", "v"])
    for n in ("w", "v"):
        assert_close(ours[n], theirs[n], TORCH_TOL, n)


def test_comparisons_and_int_paths_carry_no_gradient():
    rng = _rng()
    g = mn.Graph()
    w = g.param("w", (4,))
    mask = (w > 0.0).cast(mn.f32)              # through a comparison
    trunc = (w * 3.0).cast(mn.i32).cast(mn.f32)  # through an integer cast
    loss = (w * mask).sum() + (trunc * w).sum()
    env = {"w": rng.uniform(0.2, 2.0, 4) * np.array([1, -1, 1, -1])}
    ours, _, _ = _grads(g, loss, env)
    theirs = _torch_grads(lambda t: (t["w"] * (t["w"] > 0).double()).sum()
                          + ((t["w"] * 3.0).to(torch.int32).double() * t["w"]).sum(), env, ["w"])
    assert_close(ours["w"], theirs["w"], TORCH_TOL, "w")


def test_wrt_selects_parameters_by_name_or_value():
    g = mn.Graph()
    a, b = g.param("a", (2,)), g.param("b", (2,))
    loss = (a * b).sum()
    _, grads = mn.grad(g, loss, wrt=["a"])
    assert set(grads) == {"a"}
    _, grads = mn.grad(g, loss, wrt=b)
    assert set(grads) == {"b"}
    _, grads = mn.grad(g, loss)
    assert set(grads) == {"a", "b"}


def test_grad_leaves_the_original_graph_alone():
    g = mn.Graph()
    a = g.param("a", (2,))
    loss = (a.exp() * a).sum()
    n, fp = len(g.nodes), g.fingerprint()
    g2, grads = mn.grad(g, loss)
    assert len(g.nodes) == n and g.fingerprint() == fp
    assert len(g2.nodes) > n and grads["a"].graph is g2
    # the forward part of the new graph is the old graph, ids kept
    assert g2[loss].id == loss.id and g2[loss].graph is g2


def test_loss_that_is_a_parameter():
    g = mn.Graph()
    s = g.param("s", ())
    ours, _, _ = _grads(g, s, {"s": np.array(3.0)})
    assert ours["s"] == 1.0


def test_second_use_of_grad_on_the_returned_graph():
    """grad(grad(...)): Hessian-vector products through the VJPs' own VJPs, against PyTorch."""
    rng = _rng()
    g = mn.Graph()
    x = g.input("x", (4, 3))
    y = g.input("y", (4,), mn.i32)
    w1 = g.param("w1", (3, 5))
    w2 = g.param("w2", (5, 3))
    h = ops.gelu(x @ w1, approximate="tanh")
    logits = ops.softmax(h, -1) @ w2 + h[:, :3].sigmoid()
    loss = ops.cross_entropy(logits, y, label_smoothing=0.1)
    g1, grads = mn.grad(g, loss)
    # a second scalar in the gradient graph: <grads, v>, then differentiate it again
    vs = {n: g1.input(f"v_{n}", grads[n].shape) for n in grads}
    l2 = sum(((grads[n] * vs[n]).sum() for n in grads), g1.scalar(0.0))
    g2, hvp = mn.grad(g1, l2)
    assert set(hvp) == {"w1", "w2"}
    env = {"x": rng.standard_normal((4, 3)), "y": np.array([0, 2, 1, 2], np.int32),
           "w1": rng.standard_normal((3, 5)), "w2": rng.standard_normal((5, 3)),
           "v_w1": rng.standard_normal((3, 5)), "v_w2": rng.standard_normal((5, 3))}
    ours = dict(zip(hvp, evaluate(g2, list(hvp.values()), env, dtype=np.float64), strict=True))

    t = {k: torch.tensor(v, requires_grad=k in ("w1", "w2")) for k, v in env.items()
         if k != "y"}
    th = torch.nn.functional.gelu(t["x"] @ t["w1"], approximate="tanh")
    tlogits = torch.softmax(th, -1) @ t["w2"] + th[:, :3].sigmoid()
    tl = torch.nn.functional.cross_entropy(tlogits, torch.tensor(env["y"]).long(),
                                           label_smoothing=0.1)
    g_w1, g_w2 = torch.autograd.grad(tl, [t["w1"], t["w2"]], create_graph=True)
    tl2 = (g_w1 * t["v_w1"]).sum() + (g_w2 * t["v_w2"]).sum()
    h_w1, h_w2 = torch.autograd.grad(tl2, [t["w1"], t["w2"]])
    assert_close(ours["w1"], h_w1.numpy(), TORCH_TOL, "w1")
    assert_close(ours["w2"], h_w2.numpy(), TORCH_TOL, "w2")
    # the first-order gradients are still there in the twice-differentiated graph
    (gw1,) = evaluate(g2, [g2[grads["w1"]]], env, dtype=np.float64)
    assert_close(gw1, g_w1.detach().numpy(), TORCH_TOL, "first order")


def test_grad_again_with_a_new_loss_on_the_gradient_graph():
    g = mn.Graph()
    w = g.param("w", (3,))
    g1, grads = mn.grad(g, (w**3).sum())          # d/dw = 3 w^2
    g2, grads2 = mn.grad(g1, (grads["w"] ** 2).sum())  # d/dw sum(9 w^4) = 36 w^3
    env = {"w": np.array([0.5, -1.0, 2.0])}
    (out,) = evaluate(g2, [grads2["w"]], env, dtype=np.float64)
    np.testing.assert_allclose(out, 36 * env["w"] ** 3, rtol=1e-14)


def _no_grad_op():
    name = "test_identity_without_vjp"
    if name not in registered_ops():
        register_op(OpDef(name, lambda types, attrs: [types[0]], lambda xs, a: [xs[0]]))
    return name


def test_op_without_gradient_rule_on_the_path():
    name = _no_grad_op()
    g = mn.Graph()
    w = g.param("w", (3,))
    x = g.input("x", (3,))
    y = g.apply(name, w * 2.0)
    loss = (y * x).sum()
    with pytest.raises(AutodiffError) as info:
        mn.grad(g, loss)
    msg = str(info.value)
    assert name in msg and "no gradient rule" in msg and "test_autodiff.py:" in msg
    # off the path (only inputs reach it) it is fine
    z = g.apply(name, x)
    _, grads = mn.grad(g, (w * z).sum())
    assert set(grads) == {"w"}
    # and so is a loss that only reaches it through stop_gradient
    mn.grad(g, (w * g.apply(name, ops.stop_gradient(w))).sum())


def test_non_scalar_loss():
    g = mn.Graph()
    w = g.param("w", (3,))
    with pytest.raises(AutodiffError) as info:
        mn.grad(g, w * 2.0)
    assert "scalar" in str(info.value) and "f32[3]" in str(info.value)
    with pytest.raises(AutodiffError, match="f32\\[1\\]"):
        mn.grad(g, (w * 2.0).sum(keepdims=True))
    with pytest.raises(AutodiffError, match="graph Value"):
        mn.grad(g, 1.0)


def test_mlp_training_gradients_against_torch_and_finite_differences():
    rng = _rng()
    g = mn.Graph()
    x = g.input("x", (6, 4))
    y = g.input("y", (6,), mn.i32)
    w1, b1 = g.param("w1", (5, 4)), g.param("b1", (5,))
    w2, b2 = g.param("w2", (3, 5)), g.param("b2", (3,))
    h = (ops.matmul(x, w1, transpose_b=True) + b1).relu()
    logits = ops.matmul(h, w2, transpose_b=True) + b2
    loss = ops.cross_entropy(logits, y) + 1e-2 * ((w1 * w1).sum() + (w2 * w2).sum())
    env = {"x": rng.standard_normal((6, 4)), "y": rng.integers(0, 3, 6).astype(np.int32),
           "w1": rng.standard_normal((5, 4)), "b1": rng.standard_normal(5),
           "w2": rng.standard_normal((3, 5)), "b2": rng.standard_normal(3)}
    ours, _, _ = _grads(g, loss, env)

    def twin(t):
        h = torch.relu(t["x"] @ t["w1"].T + t["b1"])
        lo = h @ t["w2"].T + t["b2"]
        return (torch.nn.functional.cross_entropy(lo, t["y"])
                + 1e-2 * ((t["w1"] ** 2).sum() + (t["w2"] ** 2).sum()))

    names = ["w1", "b1", "w2", "b2"]
    theirs = _torch_grads(twin, env, names)
    numeric = finite_difference(g, loss, env, names)
    for n in names:
        assert_close(ours[n], theirs[n], TORCH_TOL, n)
        assert_close(ours[n], numeric[n], FD_TOL, n)


def test_relu_backward_reads_its_output_not_its_input():
    """relu's VJP masks with relu(x) > 0 (the same elements as x > 0), so a training plan need
    not keep the pre-activation alive: in ResNet-style conv → BN → relu stacks that is the
    batch-norm output.  Checked on the graph and against PyTorch."""
    g = mn.Graph()
    x = g.param("x", (5, 7))
    pre = x * 2.0 - 0.5
    y = ops.relu(pre)
    g2, grads = mn.grad(g, (y * y).sum())
    y2, pre2 = g2[y], g2[pre]
    masks = [n for n in g2.nodes if n.op == "greater"]
    assert masks and all(y2 in n.inputs and pre2 not in n.inputs for n in masks)
    xs = np.random.default_rng(0).normal(size=(5, 7))
    xs[0, :3] = 0.25  # exactly at the kink: pre = 0
    got = evaluate(g2, [grads["x"]], {"x": xs}, np.float64)[0]
    xt = torch.tensor(xs, requires_grad=True)
    (torch.relu(xt * 2.0 - 0.5) ** 2).sum().backward()
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-12, atol=0)
