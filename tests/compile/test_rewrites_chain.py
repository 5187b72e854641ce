"""Chained row reductions (compile/rewrites.py ``chained``): a LayerNorm's two reductions run
as one ``chain_reduce`` dispatch for rows up to the cap and as two kernels above it; the
results, gradients and a fetched intermediate equal the float64 reference."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim, reference
from meganeura.kernels.multi_reduce import CHAIN_MAX_REDUCED
from meganeura.nn.transformer import LayerNorm


def _graph(width: int, rows: int = 3):
    g = mn.Graph("ln")
    x = g.input("x", (rows, width))
    y = LayerNorm(width, name="ln")(g, x * 2.0)
    return g, y


def _params(width: int) -> dict:
    return {"ln.weight": np.linspace(0.5, 1.5, width, dtype=np.float32),
            "ln.bias": np.linspace(-0.2, 0.2, width, dtype=np.float32)}


@pytest.mark.parametrize("width", [2, 7, 384, CHAIN_MAX_REDUCED, CHAIN_MAX_REDUCED + 1])
def test_layer_norm_is_one_dispatch_up_to_the_cap(gpu, width):
    """128 rows: fewer would make the scheduler split each long reduction in two passes
    (``split_plan``).  (A width-1 row is no reduction: the graph passes fold it away.)"""
    g, y = _graph(width, rows=128)
    s = mn.compile(g, outputs={"y": y})
    s.set_params(_params(width))
    labels = s.kernel_labels(inference=True)
    chains = [lbl for lbl in labels if lbl.startswith("chain_reduce")]
    reductions = [lbl for lbl in labels if lbl.startswith("reduce_")]
    if width <= CHAIN_MAX_REDUCED:
        assert len(chains) == 1 and not reductions, labels
    else:
        assert not chains and len(reductions) == 2, labels
    xs = np.random.default_rng(width).normal(1.0, 2.0, size=(128, width)).astype(np.float32)
    want = reference.evaluate(g, [y], {"x": xs, **_params(width)}, np.float64)[0]
    np.testing.assert_allclose(s.run(x=xs)["y"], want, rtol=2e-5, atol=2e-5)


def test_fetched_intermediate_is_still_stored(gpu):
    """The centered rows are a fetched result: the chain writes them as well as y."""
    g = mn.Graph("ln_fetch")
    x = g.input("x", (5, 48))
    xc = x - mn.ops.mean(x, -1, keepdims=True)
    y = xc * mn.ops.rsqrt(mn.ops.mean(mn.ops.square(xc), -1, keepdims=True) + 1e-5)
    s = mn.compile(g, outputs={"y": y, "xc": xc})
    assert any(lbl.startswith("chain_reduce") for lbl in s.kernel_labels(inference=True))
    xs = np.random.default_rng(1).normal(size=(5, 48)).astype(np.float32)
    got = s.run(x=xs)
    want = reference.evaluate(g, [y, xc], {"x": xs}, np.float64)
    np.testing.assert_allclose(got["y"], want[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got["xc"], want[1], rtol=2e-5, atol=2e-6)


def test_training_step_matches_reference(gpu):
    """Forward and backward LayerNorm pairs chained in a training step: the losses and the
    parameter updates of two steps equal the float64 reference's (updates within 1e-4
    relative L2, the strict gradient gate is 1e-3)."""
    width = 40
    g = mn.Graph("ln_train")
    x = g.input("x", (6, width))
    w = g.param("w", (width, width))
    y = LayerNorm(width, name="ln")(g, x @ w)
    loss = ((y - 0.3) * (y - 0.3)).mean()
    init = {"w": np.linspace(-0.3, 0.3, width * width, dtype=np.float32).reshape(width, width),
            **_params(width)}

    def sess(backend=None, **kw):
        s = mn.compile(g, loss=loss, outputs={}, optimizer=optim.SGD(lr=0.1), backend=backend,
                       **kw)
        s.set_params(init)
        return s

    s = sess()
    assert sum(lbl.startswith("chain_reduce") for lbl in s.kernel_labels()) >= 2, \
        s.kernel_labels()
    ref = sess("reference", dtype=np.float64)
    xs = np.random.default_rng(2).normal(size=(6, width)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_allclose(s.step(x=xs).loss, ref.step(x=xs).loss, rtol=1e-5)
    got, want = s.get_params(), ref.get_params()
    for name, p0 in init.items():
        d_got, d_want = got[name] - p0, want[name] - p0
        err = np.linalg.norm(d_got - d_want) / np.linalg.norm(d_want)
        assert err < 1e-4, (name, err)
