"""Every op through the whole GPU path (passes → plan → codegen → runtime) against the numpy
reference: forward value and the gradient of sum(y * ct) w.r.t. each operand, with fusion and
the memory planner on, and off (results must agree to 1e-6)."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import ops, reference

R = np.random.default_rng(1234)

# name -> (operand shapes, builder, positive-inputs?, tolerance)
EW, RED = 1e-5, 1e-4
CASES = {
    "neg": ([(3, 5)], lambda a: -a, False, EW),
    "abs": ([(3, 5)], lambda a: abs(a), False, EW),
    "exp": ([(4, 7)], lambda a: a.exp(), False, EW),
    "log": ([(4, 7)], lambda a: a.log(), True, EW),
    "sqrt": ([(4, 7)], lambda a: a.sqrt(), True, EW),
    "rsqrt": ([(4, 7)], lambda a: a.rsqrt(), True, EW),
    "reciprocal": ([(4, 7)], lambda a: a.reciprocal(), True, EW),
    "relu": ([(33,)], lambda a: a.relu(), False, EW),
    "sigmoid": ([(3, 9)], lambda a: (a * 4.0).sigmoid(), False, EW),
    "tanh": ([(3, 9)], lambda a: (a * 3.0).tanh(), False, EW),
    "silu": ([(3, 9)], lambda a: (a * 3.0).silu(), False, EW),
    "gelu": ([(3, 9)], lambda a: (a * 2.0).gelu(), False, EW),
    "gelu_tanh": ([(3, 9)], lambda a: (a * 2.0).gelu("tanh"), False, EW),
    "erf": ([(3, 9)], lambda a: a.erf(), False, EW),
    "expm1": ([(4, 9)], lambda a: ops.expm1(a * 0.7), False, EW),
    "sin_cos": ([(5,)], lambda a: a.sin() * a.cos(), False, EW),
    "square": ([(2, 3)], lambda a: a.square(), False, EW),
    "add_bcast": ([(4, 1, 3), (5, 1)], lambda a, b: a + b, False, EW),
    "sub_scalar": ([(4, 3)], lambda a: 2.0 - a, False, EW),
    "mul_rank": ([(2, 3, 4), (4,)], lambda a, b: a * b, False, EW),
    "div": ([(3, 4), (1, 4)], lambda a, b: a / b, True, EW),
    "pow": ([(3, 4), (3, 4)], lambda a, b: a ** b, True, EW),
    "pow_int": ([(3, 4)], lambda a: a ** 3.0, False, EW),
    "maximum": ([(3, 4), (4,)], lambda a, b: ops.maximum(a, b), False, EW),
    "minimum": ([(3, 4), (3, 1)], lambda a, b: ops.minimum(a, b), False, EW),
    "where": ([(3, 4), (3, 4)], lambda a, b: ops.where(a > b, a * 2.0, b), False, EW),
    "cast_roundtrip": ([(6,)], lambda a: (a * 3.0).cast(mn.i32).cast(mn.f32) + a, False, EW),
    "stop_gradient": ([(2, 3)], lambda a: a * ops.stop_gradient(a), False, EW),
    "sum_all": ([(5, 6)], lambda a: a.sum(), False, RED),
    "sum_axis0": ([(5, 6)], lambda a: a.sum(0), False, RED),
    "sum_mid_keep": ([(3, 4, 5)], lambda a: a.sum(1, keepdims=True), False, RED),
    "sum_two_axes": ([(3, 4, 5)], lambda a: a.sum((0, 2)), False, RED),
    "mean": ([(4, 6)], lambda a: a.mean(-1), False, RED),
    "max": ([(4, 6)], lambda a: a.max(1), False, RED),
    "min_all": ([(4, 6)], lambda a: a.min(), False, RED),
    "logsumexp": ([(3, 8)], lambda a: ops.logsumexp(a * 3.0, -1), False, RED),
    "reshape": ([(2, 6)], lambda a: a.reshape(3, 4) * 2.0, False, EW),
    "permute": ([(2, 3, 4)], lambda a: a.permute(2, 0, 1) + 1.0, False, EW),
    "transpose_reshape": ([(3, 4)], lambda a: a.T.reshape(12) * 1.5, False, EW),
    "broadcast_to": ([(3, 1)], lambda a: ops.broadcast_to(a, (2, 3, 4)) * 1.0, False, EW),
    "slice": ([(5, 6)], lambda a: a[1:4, ::2] * 2.0, False, EW),
    "squeeze": ([(3, 1, 2)], lambda a: a.squeeze(1).unsqueeze(0) * 2.0, False, EW),
    "concat": ([(2, 3), (2, 5)], lambda a, b: ops.concat([a, b * 2.0], 1), False, EW),
    "split": ([(6, 2)], lambda a: ops.split(a, [2, 4], 0)[1] * 3.0, False, EW),
    "flip": ([(3, 2, 4)], lambda a: a * ops.flip(a, (0, 2)) + ops.flip(a, 1).exp(), False, EW),
    "flip_matmul": ([(4, 5), (5, 3)], lambda a, b: ops.flip(a, 0) @ ops.flip(b, 1), False, RED),
    "rope_halves": ([(2, 3, 8), (3, 8)], lambda a, c: __import__(
        "meganeura.nn.transformer", fromlist=["x"]).apply_rope(a, c.cos(), c.sin()), False, EW),
    "matmul": ([(5, 7), (7, 3)], lambda a, b: a @ b, False, RED),
    "matmul_tb": ([(5, 7), (3, 7)], lambda a, b: ops.matmul(a, b, transpose_b=True), False, RED),
    "matmul_ta": ([(7, 5), (7, 3)], lambda a, b: ops.matmul(a, b, transpose_a=True), False, RED),
    "matmul_batch": ([(2, 1, 4, 3), (5, 3, 6)], lambda a, b: a @ b, False, RED),
    "matmul_vec": ([(4,), (4, 3)], lambda a, b: a @ b, False, RED),
    "softmax": ([(3, 7)], lambda a: ops.softmax(a * 2.0, -1), False, RED),
    "log_softmax": ([(3, 7)], lambda a: ops.log_softmax(a, 0), False, RED),
    "mse": ([(4, 3), (4, 3)], lambda a, b: ops.mse_loss(a, b), False, RED),
    "l1": ([(4, 3), (4, 3)], lambda a, b: ops.l1_loss(a, b), False, RED),
    "bce": ([(4, 3)], lambda a: ops.bce_with_logits(a, ops.stop_gradient(a.sigmoid())), False,
            RED),
}


def _build(case):
    shapes, fn, positive, tol = CASES[case]
    g = mn.Graph(case)
    ps = [g.param(f"p{i}", s) for i, s in enumerate(shapes)]
    y = fn(*ps)
    ct = g.input("ct", y.shape)
    loss = (y * ct).sum()
    g2, grads = mn.grad(g, loss)
    outs = {"y": g2[y], **{f"d{n}": v for n, v in grads.items()}}
    env = {}
    for i, s in enumerate(shapes):
        a = R.normal(size=s).astype(np.float32)
        env[f"p{i}"] = np.abs(a) + 0.5 if positive else a
    env["ct"] = R.normal(size=y.shape).astype(np.float32)
    return g2, outs, env, tol


def _compare(got, want, tol, what):
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_forward_and_gradient_on_gpu(gpu, case):
    g2, outs, env, tol = _build(case)
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    sess = mn.compile(g2, outputs=outs, device=gpu)
    sess.set_params({k: v for k, v in env.items() if k != "ct"})
    got = sess.run(ct=env["ct"])
    for k in outs:
        _compare(got[k], want[k], tol, f"{case}/{k}")
    # fusion and memory planning never change results
    plain = mn.compile(g2, outputs=outs, device=gpu, fuse=False, plan_memory=False)
    plain.set_params({k: v for k, v in env.items() if k != "ct"})
    got2 = plain.run(ct=env["ct"])
    for k in outs:
        np.testing.assert_allclose(got2[k], got[k], rtol=1e-6, atol=1e-6 * max(
            1.0, float(np.abs(got[k]).max())), err_msg=f"{case}/{k} fused vs unfused")


def test_cross_entropy_on_gpu(gpu):
    g = mn.Graph()
    logits = g.param("logits", (6, 5))
    y = g.input("y", (6,), dtype=mn.i32)
    loss = ops.cross_entropy(logits * 2.0, y, ignore_index=3, label_smoothing=0.1)
    g2, grads = mn.grad(g, loss)
    outs = {"loss": g2[loss], "d": grads["logits"]}
    env = {"logits": R.normal(size=(6, 5)).astype(np.float32),
           "y": np.array([0, 3, 4, 1, 2, 3], np.int32)}
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    sess = mn.compile(g2, outputs=outs, device=gpu)
    sess.set_params({"logits": env["logits"]})
    got = sess.run(y=env["y"])
    for k in outs:
        _compare(got[k], want[k], RED, k)


def test_concat_of_many_inputs_is_chunked_to_8_bindings(gpu):
    g = mn.Graph()
    ps = [g.param(f"p{i}", (i + 1, 3)) for i in range(17)]
    y = ops.concat([p * float(i) for i, p in enumerate(ps)], 0)
    env = {f"p{i}": R.normal(size=(i + 1, 3)).astype(np.float32) for i in range(17)}
    sess = mn.compile(g, outputs={"y": y}, device=gpu)
    sess.set_params(env)
    want = np.concatenate([env[f"p{i}"] * i for i in range(17)], 0)
    np.testing.assert_allclose(sess.run()["y"], want, rtol=1e-6)
    specs = [d.spec for d in sess.executable.infer.dispatches if d.label.startswith("concat")]
    assert len(specs) == 3 and all(s.n_bindings <= 8 for s in specs)


def test_wide_fused_expression_stays_within_8_bindings(gpu):
    g = mn.Graph()
    ps = [g.param(f"p{i}", (5,)) for i in range(12)]
    y = ps[0]
    for p in ps[1:]:
        y = y * 0.5 + p.tanh()
    s = y.sum()
    env = {f"p{i}": R.normal(size=5).astype(np.float32) for i in range(12)}
    sess = mn.compile(g, outputs={"y": y, "s": s}, device=gpu)
    sess.set_params(env)
    want = dict(zip(["y", "s"], reference.evaluate(g, [y, s], env, np.float64)))
    got = sess.run()
    for k in want:
        _compare(got[k], want[k], RED, k)
    assert all(d.spec.n_bindings <= 8 for d in sess.executable.infer.dispatches)


def test_two_views_of_one_tensor_share_one_binding(gpu):
    """RoPE-style halves of one buffer in one kernel: bound once (WebGPU forbids overlapping
    writable bindings; Dawn validates it)."""
    g = mn.Graph()
    x = g.param("x", (4, 8))
    lo, hi = x[:, :4], x[:, 4:]
    y = ops.concat([lo * 2.0 - hi, hi * lo], 1)
    z = ops.matmul(x, x, transpose_b=True)  # both operands from one buffer
    env = {"x": R.normal(size=(4, 8)).astype(np.float32)}
    sess = mn.compile(g, outputs={"y": y, "z": z}, device=gpu)
    sess.set_params(env)
    got = sess.run()
    want = reference.evaluate(g, [y, z], env, np.float64)
    _compare(got["y"], want[0], EW, "y")
    _compare(got["z"], want[1], RED, "z")
    for d in sess.executable.infer.dispatches:
        decls = d.spec.wgsl.count("var<storage, read_write>")
        assert decls == d.spec.n_bindings, d.label
