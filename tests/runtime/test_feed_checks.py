"""Feeds are checked the same way on every backend, before anything runs: class labels in
range (or ignore_index), finiteness of the values as the device holds them, and empty
tensors (a clear compile error on the GPU).  A rejected feed leaves the session unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn

BACKENDS = ["wgpu", "reference"]


def _classifier(backend, in_dtype=mn.f32, label_shape=(4,), ignore_index=-100):
    g = mn.Graph("clf")
    x = g.input("x", (4, 8), dtype=in_dtype)
    y = g.input("y", label_shape, dtype=mn.i32)
    logits = mn.nn.Linear(8, 5, name="fc")(g, x.cast(mn.f32) if in_dtype != mn.f32 else x)
    labels = y.reshape(4) if label_shape != (4,) else y
    loss = mn.ops.cross_entropy(logits, labels, ignore_index=ignore_index)
    s = mn.compile(g, loss=loss, optimizer=mn.optim.SGD(lr=0.1), backend=backend)
    s.init_params(seed=0)
    return s


def _x():
    return np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_label_is_refused_and_changes_nothing(gpu, backend):
    s = _classifier(backend)
    before = s.get_params()
    with pytest.raises(mn.FeedError, match=r"feed 'y'.*label.*1000 at index \(2,\).*\[0, 5\)"):
        s.step(x=_x(), y=np.array([0, 1, 1000, 1]))
    with pytest.raises(mn.FeedError, match=r"-1 at index \(0,\)"):
        s.step(x=_x(), y=np.array([-1, 1, 2, 1]))
    for k, v in s.get_params().items():
        np.testing.assert_array_equal(v, before[k])
    assert s.step_count == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_and_labels_through_a_reshape(gpu, backend):
    """ignore_index is allowed; a label fed in another shape is still checked."""
    s = _classifier(backend, label_shape=(2, 2), ignore_index=7)
    loss = s.step(x=_x(), y=np.array([[0, 7], [4, 1]])).loss
    assert np.isfinite(loss)
    with pytest.raises(mn.FeedError, match=r"feed 'y'.*5 at index \(1, 0\)"):
        s.step(x=_x(), y=np.array([[0, 7], [5, 1]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_that_overflow_the_input_dtype_are_refused(gpu, backend):
    """1e39 is finite in float64 but inf in f32: named with its index, nothing runs."""
    s = _classifier(backend)
    before = s.get_params()
    x = _x().astype(np.float64)
    x[1, 3] = 1e39
    with pytest.raises(mn.FeedError, match=r"feed 'x'.*after conversion to f32.*\(1, 3\)"):
        s.step(x=x, y=np.array([0, 1, 2, 3]))
    for k, v in s.get_params().items():
        np.testing.assert_array_equal(v, before[k])


def test_values_beyond_f16_range_fed_to_an_f16_input(gpu):
    s = _classifier("wgpu", in_dtype=mn.f16)
    x = _x()
    x[0, 0] = 1e5  # f16 max is 65504
    with pytest.raises(mn.FeedError, match=r"feed 'x'.*after conversion to f16.*\(0, 0\)"):
        s.step(x=x, y=np.array([0, 1, 2, 3]))
    nan = _x()
    nan[2, 2] = np.nan
    with pytest.raises(mn.FeedError, match=r"feed 'x' has 1 NaN/inf value\(s\); the first at"):
        s.step(x=nan, y=np.array([0, 1, 2, 3]))


def test_empty_tensors_are_a_clear_compile_error_on_the_gpu(gpu):
    g = mn.Graph("empty")
    x = g.input("x", (0, 8))
    y = mn.nn.Linear(8, 5, name="fc")(g, x)
    with pytest.raises(mn.GraphBuildError, match=r"input 'x' \(f32\[0,8\]\) has no elements"):
        mn.compile(g, outputs={"y": y})
    ref = mn.compile(g, outputs={"y": y}, backend="reference")  # the oracle evaluates them
    assert ref.run(x=np.zeros((0, 8), np.float32))["y"].shape == (0, 5)


def test_unknown_compile_options_are_named(gpu):
    g = mn.Graph("opts")
    x = g.input("x", (2, 2))
    with pytest.raises(mn.GraphBuildError, match=r"unknown option\(s\) \['fuze'\]"):
        mn.compile(g, outputs={"y": x * 2.0}, fuze=False)
    with pytest.raises(mn.GraphBuildError, match=r"unknown option\(s\) \['fuse'\].*reference"):
        mn.compile(g, outputs={"y": x * 2.0}, backend="reference", fuse=False)
