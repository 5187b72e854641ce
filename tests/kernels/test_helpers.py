"""Accuracy of the WGSL helper functions (codegen/wgsl_helpers.py) on dense grids, evaluated
on the device through the pointwise emitter, against float64 numpy/scipy of the same f32
inputs."""

import numpy as np
import pytest
from scipy import special

from meganeura.dtypes import f32
from meganeura.errors import MeganeuraError
from meganeura.kernels import Instr, PointwiseKernel, Strided
from meganeura.kernels.wgsl_helpers import HELPERS, helper_source, resolve


def _unary(run, expr, helpers, x):
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = PointwiseKernel(
        shape=x.shape,
        inputs=(Strided.contiguous(f32, x.shape),),
        instrs=(Instr(expr, (("in", 0),), f32, helpers),),
        outputs=(0,),
        name="helper_" + helpers[-1],
    )
    (y,) = run(k, [x], [(x.shape, f32)])
    return y.astype(np.float64), x.astype(np.float64)


def _grid(lo, hi, n=100_001, tiny=True):
    parts = [np.linspace(lo, hi, n)]
    if tiny:
        t = np.logspace(-30, 0, 301)
        parts += [t, -t, np.array([0.0, -0.0])]
    return np.concatenate(parts).astype(np.float32)


def test_erf(run):
    y, x = _unary(run, "mn_erf({0})", ("mn_erf",), _grid(-8, 8))
    ref = special.erf(x)
    assert np.max(np.abs(y - ref)) <= 2e-7
    small = (np.abs(x) < 1) & (x != 0)
    assert np.max(np.abs(y[small] / ref[small] - 1)) <= 1e-6  # x P(x^2): relative near 0
    assert np.all(y[x == 0] == 0)
    y, _ = _unary(run, "mn_erf({0})", ("mn_erf",),
                  np.array([np.inf, -np.inf, 1e30, -1e30], np.float32))
    np.testing.assert_array_equal(y, [1, -1, 1, -1])


def test_tanh(run):
    y, x = _unary(run, "mn_tanh({0})", ("mn_tanh",), _grid(-30, 30))
    ref = np.tanh(x)
    nz = ref != 0
    assert np.max(np.abs(y[nz] / ref[nz] - 1)) <= 1e-6
    assert np.max(np.abs(y - ref)) <= 2e-7
    big = np.array([1e3, -1e3, 3e38, -3e38, np.inf, -np.inf, 88.0, 89.0, -89.0], np.float32)
    y, x = _unary(run, "mn_tanh({0})", ("mn_tanh",), big)
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y, np.sign(x))


def test_sigmoid(run):
    y, x = _unary(run, "mn_sigmoid({0})", ("mn_sigmoid",), _grid(-80, 80))
    ref = special.expit(x)
    rel = np.abs(y / ref - 1)
    assert np.max(rel[np.abs(x) <= 20]) <= 2e-6
    # the far tail is exp(x): Vulkan allows exp 3 + 2|x| ulp, lavapipe is within that
    assert np.max(rel) <= 1e-5
    big = np.array([1e4, -1e4, np.inf, -np.inf, 200.0, -200.0], np.float32)
    y, _ = _unary(run, "mn_sigmoid({0})", ("mn_sigmoid",), big)
    np.testing.assert_array_equal(y, [1, 0, 1, 0, 1, 0])


def test_gelu_erf(run):
    y, x = _unary(run, "mn_gelu_erf({0})", ("mn_erf", "mn_gelu_erf"), _grid(-12, 12))
    ref = 0.5 * x * special.erfc(-x / np.sqrt(2.0))
    assert np.max(np.abs(y - ref)) <= 1e-6
    rel = np.abs(y - ref) / np.where(ref == 0, 1, np.abs(ref))
    assert np.max(rel[x >= -5]) <= 3e-6
    # further out the tail is exp(-x^2/2): the driver's exp error grows with |x|
    assert np.max(rel[np.abs(ref) > 1e-30]) <= 5e-5


def test_gelu_tanh(run):
    y, x = _unary(run, "mn_gelu_tanh({0})", ("mn_tanh", "mn_gelu_tanh"), _grid(-12, 12))
    # 0.5 x (1 + tanh u) == x expit(2u); the latter keeps float64 accurate in the tail
    ref = x * special.expit(2.0 * np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))
    assert np.max(np.abs(y - ref)) <= 1e-6
    rel = np.abs(y - ref) / np.where(ref == 0, 1, np.abs(ref))
    assert np.max(rel[x >= -3]) <= 3e-6
    assert np.max(rel[np.abs(ref) > 1e-30]) <= 5e-5
    y, _ = _unary(run, "mn_gelu_tanh({0})", ("mn_gelu_tanh",),
                  np.array([1e20, 3e38, np.inf, -1e20], np.float32))
    np.testing.assert_array_equal(y[:3], np.array([1e20, 3e38, np.inf], np.float32))
    assert y[3] == 0


def test_pow(run):
    bases = np.concatenate([np.linspace(-5, 5, 401), [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 10.0]])
    exps = np.array([0, 1, 2, 3, 4, 5, 7, -1, -2, -3, 16, 17, -17, 0.5, 1.5, 2.5, -0.5, 3.3,
                     -2.7, 30.0, 31.0])
    a, b = np.meshgrid(bases, exps, indexing="ij")
    a = a.astype(np.float32).ravel()
    b = b.astype(np.float32).ravel()
    k = PointwiseKernel(
        shape=a.shape,
        inputs=(Strided.contiguous(f32, a.shape), Strided.contiguous(f32, b.shape)),
        instrs=(Instr("mn_pow({0}, {1})", (("in", 0), ("in", 1)), f32, ("mn_pow",)),),
        outputs=(0,),
        name="helper_pow",
    )
    (y,) = run(k, [a, b], [(a.shape, f32)])
    with np.errstate(all="ignore"):
        ref = np.power(a.astype(np.float64), b.astype(np.float64))
    y = y.astype(np.float64)
    assert np.array_equal(np.isnan(y), np.isnan(ref)), "NaN pattern differs from numpy"
    inf = np.isinf(ref)
    assert np.array_equal(y[inf], ref[inf])
    fin = np.isfinite(ref) & (np.abs(ref) < 3e38)
    small_int = fin & (np.abs(b) <= 16) & (b == np.round(b))
    with np.errstate(invalid="ignore"):
        rel = np.abs(y - ref) / np.maximum(np.abs(ref), 1e-30)
    assert np.max(rel[small_int]) <= 2e-6  # binary powering: a few roundings
    assert np.max(rel[fin & (np.abs(ref) > 1e-30)]) <= 1e-5
    # numpy/torch special cases
    sa = np.array([0, 0, 0, np.nan, -2, -2, -8, 1, 2, -0.0, -0.0, -0.0, -0.0], np.float32)
    sb = np.array([0, -1, 0.5, 0, 3, 0.5, 1 / 3, np.nan, -np.inf, -1, -17, 3, 0.5], np.float32)
    (y,) = run(k.__class__(sa.shape, (Strided.contiguous(f32, sa.shape),) * 2, k.instrs, (0,),
                           "helper_pow"), [sa, sb], [(sa.shape, f32)])
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(y, np.power(sa, sb))


def test_resolve_and_unknown():
    assert resolve(["mn_gelu_erf"])[-1] == "mn_gelu_erf"
    order = resolve(["mn_gelu_erf", "mn_erfc"])
    assert order.index("mn_erfc_tail") < order.index("mn_erf") < order.index("mn_erfc")
    assert order.index("mn_erfc_tail") < order.index("mn_gelu_erf")
    assert len(order) == len(set(order))
    src = helper_source(["mn_gelu_tanh"])
    assert "fn mn_sigmoid" in src and "fn mn_gelu_tanh" in src
    for name in ("mn_sigmoid", "mn_tanh", "mn_erf", "mn_gelu_erf", "mn_gelu_tanh", "mn_pow"):
        assert name in HELPERS
    with pytest.raises(MeganeuraError, match="unknown WGSL helper"):
        resolve(["mn_nope"])
