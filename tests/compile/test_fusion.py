"""Fusion decisions (compile/fusion.py): which values get a buffer of their own."""

import numpy as np

import meganeura as mn
from meganeura import ops, optim
from meganeura.compile.fusion import materialized_values


def _norm_graph():
    """RMSNorm-like: xhat = x * rstd is read by two later kernels (xhat * w for the next
    layer, and a reduction); rstd is stored (the backward reads it too)."""
    g = mn.Graph("norm")
    x = g.input("x", (32, 64))
    w = g.param("w", (64,))
    rstd = ((x * x).mean(axis=-1, keepdims=True) + 1e-6).rsqrt()
    xhat = x * rstd
    y = xhat * w
    s = (xhat * y).sum(axis=0) + rstd.sum()
    return g, x, xhat, y, s


def test_cheap_shared_value_is_recomputed_not_stored():
    g, x, xhat, y, s = _norm_graph()
    out = materialized_values(g, [y, s])
    assert xhat.id not in out  # each consumer recomputes x * rstd
    assert y.id in out and s.id in out


def test_recompute_never_extends_a_larger_input():
    """``v = big[:, :4] * 3`` is read by two late kernels.  Recomputing it there would keep the
    (64, 256) matmul result alive past its last reader for a (64, 4) value: stored instead.
    ``u = col * 3`` from a (64, 1) column costs no more than itself: recomputed."""
    g = mn.Graph("extend")
    a = g.input("a", (64, 32))
    w = g.param("w", (32, 256))
    big = a @ w  # a stored matmul result
    col = big.sum(axis=1, keepdims=True)  # stored (64, 1)
    v = big[:, :4] * 3.0
    u = col * 3.0
    t = (col.exp() * 5.0).sum(axis=0, keepdims=True)  # later kernels
    r1 = (v * t + u).sum()
    r2 = (v + t * u).sum()
    out = materialized_values(g, [r1, r2])
    assert big.id in out and col.id in out
    assert v.id in out and u.id not in out


def test_recompute_gives_the_reference_results_with_fewer_dispatches(gpu):
    g, x, xhat, y, s = _norm_graph()
    loss = (y * y).mean() + s.sum()
    xs = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
    sess = mn.compile(g, loss=loss, outputs={"y": y, "s": s}, optimizer=optim.SGD(lr=0.1))
    ref = mn.compile(g, loss=loss, outputs={"y": y, "s": s}, optimizer=optim.SGD(lr=0.1),
                     backend="reference", dtype=np.float64)
    for ss in (sess, ref):
        ss.set_params({"w": np.linspace(0.5, 1.5, 64, dtype=np.float32)})
    for _ in range(2):
        got, want = sess.step(x=xs), ref.step(x=xs)
        np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
    np.testing.assert_allclose(sess.get_params()["w"], ref.get_params()["w"], rtol=1e-5)
    labels = sess.kernel_labels()
    assert not any(lbl.startswith("pointwise[1]") and lbl.endswith(" mul") for lbl in labels), \
        labels


def _labels(sess) -> list[str]:
    return [d.label for d in sess.infer.stream.dispatches]


def test_dense_bias_activation_and_residual_are_one_matmul_epilogue(gpu):
    """``dense`` views the product at x's leading shape before adding the bias, so the bias,
    the gelu and a residual add all run in the GEMM's epilogue (no separate dispatches), and
    the result matches float64."""
    from meganeura.nn.transformer import dense

    g = mn.Graph("mlp")
    x = g.input("x", (2, 5, 8))
    h = ops.gelu(dense(g, x, "up", 8, 16))
    y = x + dense(g, h, "down", 16, 8)
    sess = mn.compile(g, outputs={"y": y})
    labels = _labels(sess)
    assert not any(lb.startswith("pointwise") for lb in labels), labels
    assert any("gelu" in lb for lb in labels if lb.startswith("matmul")), labels
    ref = mn.compile(g, outputs={"y": y}, backend="reference", dtype=np.float64)
    params = {k: np.random.default_rng(1).normal(size=v.shape).astype(np.float32)
              for k, v in ((n, g.leaves[n].value.type) for n in g.params)}
    xs = np.random.default_rng(2).normal(size=(2, 5, 8)).astype(np.float32)
    for ss in (sess, ref):
        ss.set_params(params)
    np.testing.assert_allclose(sess.run(x=xs)["y"], ref.run(x=xs)["y"], rtol=1e-5, atol=1e-5)


def test_activation_after_conv1d_reshape_is_the_conv_epilogue(gpu):
    """conv1d is a conv2d over a height-1 image viewed back as (N, C, L): the activation that
    follows is moved below that view (simplify's ``sink_reshapes_below_activations``) and
    fused into the conv kernel; results match float64, also in a training step (where the
    conv output is read by the backward as well)."""
    g = mn.Graph("c1")
    x = g.input("x", (2, 3, 11))
    w = g.param("w", (4, 3, 3))
    b = g.param("b", (4,))
    y = ops.gelu(ops.conv1d(x, w, b, padding=1))
    sess = mn.compile(g, outputs={"y": y})
    labels = _labels(sess)
    assert len(labels) == 1 and labels[0].startswith("conv2d") and "gelu" in labels[0], labels
    ref = mn.compile(g, outputs={"y": y}, backend="reference", dtype=np.float64)
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(4, 3, 3)).astype(np.float32),
              "b": rng.normal(size=(4,)).astype(np.float32)}
    xs = rng.normal(size=(2, 3, 11)).astype(np.float32)
    for ss in (sess, ref):
        ss.set_params(params)
    np.testing.assert_allclose(sess.run(x=xs)["y"], ref.run(x=xs)["y"], rtol=1e-5, atol=1e-5)
    loss = (y * y).mean()
    tr = mn.compile(g, loss=loss, optimizer=optim.SGD(lr=0.1))
    tref = mn.compile(g, loss=loss, optimizer=optim.SGD(lr=0.1), backend="reference",
                      dtype=np.float64)
    for ss in (tr, tref):
        ss.set_params(params)
    np.testing.assert_allclose(tr.step(x=xs).loss, tref.step(x=xs).loss, rtol=1e-5)
    np.testing.assert_allclose(tr.get_params()["w"], tref.get_params()["w"], rtol=1e-4,
                               atol=1e-6)


def test_value_read_through_a_transpose_is_stored_once_not_recomputed():
    """``x = transpose(a) + pos`` read by two kernels: recomputing it would read ``a``
    transposed (uncoalesced) in both; it is stored once instead.  The same value from a
    contiguous input is still recomputed."""
    g = mn.Graph("tr")
    a = g.input("a", (1, 32, 48))
    pos = g.input("pos", (48, 32))
    for src, stored in ((ops.transpose(a, 1, 2), True), (ops.reshape(a, (1, 48, 32)), False)):
        x = src + pos
        r1 = (x * x).sum(axis=-1, keepdims=True)
        r2 = (x.exp() * r1).sum(axis=1)
        out = materialized_values(g, [r1, r2])
        assert (x.id in out) is stored
