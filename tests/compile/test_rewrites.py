"""Kernel-list rewrites (compile/rewrites.py): post passes in reductions and merged
neighbouring elementwise kernels, checked against the reference."""

import numpy as np

import meganeura as mn
from meganeura import optim


def test_neighbouring_elementwise_kernels_merge(gpu):
    """Two stored elementwise results over one shape come from one dispatch; a kernel that
    reads its neighbour's output at other elements (a flip) stays separate.  Training matches
    the reference interpreter."""
    g = mn.Graph("merge")
    x = g.input("x", (16, 32))
    w = g.param("w", (32, 32))
    h = x @ w
    a = h.tanh()  # both stored (matmul operands), same shape, independent
    b = h.sigmoid()
    c = mn.ops.flip(a, (1,)) * 3.0  # reads a at mirrored columns
    loss = ((a @ w).sum() + (b @ w).sum() + (c @ w).sum()) / 100.0

    def sess(backend=None, **kw):
        s = mn.compile(g, loss=loss, outputs={}, optimizer=optim.SGD(lr=0.01),
                       backend=backend, **kw)
        s.set_params({"w": np.linspace(-0.2, 0.2, 32 * 32, dtype=np.float32).reshape(32, 32)})
        return s

    s = sess()
    labels = s.kernel_labels()
    merged = [lbl for lbl in labels if "+pointwise" in lbl]
    assert any("tanh" in lbl and "sigmoid" in lbl for lbl in merged), labels
    assert not any("flip" in lbl or ("tanh" in lbl and "mul" in lbl.split("|")[-1])
                   for lbl in merged), labels
    ref = sess("reference", dtype=np.float64)
    xs = np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_allclose(s.step(x=xs).loss, ref.step(x=xs).loss, rtol=1e-5)
    np.testing.assert_allclose(s.get_params()["w"], ref.get_params()["w"], rtol=1e-5, atol=1e-7)


def test_norm_runs_its_elementwise_pass_in_the_reduction(gpu):
    """RMS-norm: the reduction stores rstd and, in the same dispatch, writes x * rstd * w over
    the rows; a reduction over more than POST_MAX_REDUCED elements keeps a separate
    elementwise kernel.  Both equal the reference."""
    from meganeura import reference
    from meganeura.compile.rewrites import POST_MAX_REDUCED

    for width in (96, POST_MAX_REDUCED + 4):
        g = mn.Graph("norm")
        x = g.input("x", (6, width))
        w = g.param("w", (width,))
        rstd = ((x * x).mean(axis=-1, keepdims=True) + 1e-6).rsqrt()
        y = x * rstd * w
        s = mn.compile(g, outputs={"y": y, "rstd": rstd})
        xs = np.random.default_rng(0).normal(size=(6, width)).astype(np.float32)
        ws = np.linspace(0.5, 1.5, width, dtype=np.float32)
        s.set_params({"w": ws})
        labels = s.kernel_labels(inference=True)
        merged = any("=>" in lbl for lbl in labels)
        assert merged == (width <= POST_MAX_REDUCED), labels
        got = s.run(x=xs)
        want = reference.evaluate(g, [y, rstd], {"x": xs, "w": ws}, np.float64)
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["rstd"], want[1], rtol=1e-5)
