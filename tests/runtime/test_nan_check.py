"""compile(nan_check="step"): a step whose loss or some gradient is NaN/inf applies no update
(parameters, optimizer states, the step counter and user states keep their values) and reading
its result raises NonFiniteError naming the loss or the first bad gradient; on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn

BACKENDS = ["wgpu", "reference"]
RNG = np.random.default_rng(7)
X = RNG.normal(size=(8, 6)).astype(np.float32)
Y = RNG.normal(size=(8, 3)).astype(np.float32)


def _regressor(backend, nan_check="step", optimizer=None):
    """Two linear layers (two parameter groups' worth of tensors) and a step-count state."""
    g = mn.Graph("reg")
    x = g.input("x", (8, 6))
    y = g.input("y", (8, 3))
    seen = g.state("seen", (), init=mn.init.zeros())
    h = mn.nn.Linear(6, 5, name="fc1")(g, x).tanh()
    out = mn.nn.Linear(5, 3, name="fc2")(g, h)
    g.set_update("seen", seen + 1.0)
    opt = optimizer or mn.optim.AdamW(lr=0.05, weight_decay=0.1, clip_grad_norm=10.0)
    s = mn.compile(g, loss=mn.ops.mse_loss(out, y), optimizer=opt, backend=backend,
                   nan_check=nan_check)
    s.init_params(seed=3)
    return s


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inf_loss_at_step_k_leaves_the_state_of_step_k_minus_1(gpu, backend):
    s, twin = _regressor(backend), _regressor(backend)
    for _ in range(3):
        assert np.isfinite(s.step(x=X, y=Y).loss + twin.step(x=X, y=Y).loss)
    before = s.get_state()
    bad = s.step(x=X, y=Y * 1e30)  # (out - 1e30)^2 overflows f32: the loss is inf
    with pytest.raises(mn.NonFiniteError, match=r"step 4: NaN/inf in the loss") as e:
        _ = bad.loss
    assert e.value.culprit == "loss" and e.value.step == 4
    assert isinstance(e.value, FloatingPointError)
    with pytest.raises(mn.NonFiniteError):  # every read says so
        _ = bad.outputs
    _assert_same(s.get_state(), before)  # params, AdamW moments, optim.step, 'seen'
    assert s.step_count == 3 and float(before["optim.step"]) == 3.0
    # training goes on as if the bad batch had never been fed
    np.testing.assert_allclose(s.step(x=X, y=Y).loss, twin.step(x=X, y=Y).loss, rtol=1e-6)
    for k, v in twin.get_state().items():
        np.testing.assert_allclose(s.get_state()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    assert s.step_count == 4


def _sqrt_graph(backend):
    """loss = sum(w * x) + sum(sqrt(v + c)): finite at v + c = 0, but d/dv = inf there."""
    g = mn.Graph("sqrt")
    x = g.input("x", (3,))
    c = g.input("c", (3,))
    w = g.param("w", (3,), init=mn.init.ones())
    v = g.param("v", (3,), init=mn.init.zeros())
    loss = (w * x).sum() + (v + c).sqrt().sum()
    s = mn.compile(g, loss=loss, optimizer=mn.optim.SGD(lr=0.1, momentum=0.9),
                   backend=backend, nan_check="step")
    s.init_params()
    return s


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_gradient_with_a_finite_loss_names_the_parameter(gpu, backend):
    s = _sqrt_graph(backend)
    ones = np.ones(3, np.float32)
    assert np.isfinite(s.step(x=ones, c=ones).loss)
    before = s.get_state()
    r = s.step(x=ones, c=-before["v"])  # sqrt(0): finite loss, infinite gradient of v
    with pytest.raises(mn.NonFiniteError, match=r"the gradient of parameter 'v'") as e:
        _ = r.loss
    assert e.value.culprits == ("v",)  # 'w' had a finite gradient: not accused
    _assert_same(s.get_state(), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_good_steps_are_unaffected_and_the_guard_is_off_by_default(gpu, backend):
    guarded, plain = _regressor(backend), _regressor(backend, nan_check=None)
    assert plain.program.nonfinite is None and guarded.program.nonfinite is not None
    for _ in range(3):
        np.testing.assert_allclose(guarded.step(x=X, y=Y).loss, plain.step(x=X, y=Y).loss,
                                   rtol=1e-6)
    assert np.isinf(plain.step(x=X, y=Y * 1e30).loss)  # unguarded: no error, update applied
    assert float(plain.get_state()["optim.step"]) == 4.0


def test_the_guard_costs_nothing_when_off(gpu):
    default = _regressor("wgpu", nan_check=None)
    off = _regressor("wgpu", nan_check="off")
    on = _regressor("wgpu")
    n = [len(s.kernel_labels()) for s in (default, off, on)]
    assert n[0] == n[1] < n[2]
    assert [f.name for f in default.train.stream.fetch] == ["__loss__"]


@pytest.mark.parametrize("bad, match", [
    ("always", r"nan_check must be one of \(None, 'off', 'step'\), got 'always'"),
    (True, r"nan_check must be one of .* got True"),
])
def test_bad_nan_check_values_are_named(bad, match):
    with pytest.raises(mn.GraphBuildError, match=match):
        _regressor("reference", nan_check=bad)


def test_nan_check_needs_an_optimizer():
    g = mn.Graph("inf")
    x = g.input("x", (2,))
    with pytest.raises(mn.GraphBuildError, match=r"nan_check='step'.*needs loss= and optimizer="):
        mn.compile(g, outputs={"y": x * 2.0}, backend="reference", nan_check="step")
