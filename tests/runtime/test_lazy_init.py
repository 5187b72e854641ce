"""Initial values are written at first use, not at compile: a session whose parameters are
then set (pretrained weights, a checkpoint) never samples or uploads the random ones, and
every other path sees exactly the values an eager init gives."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.init import init_leaves
from meganeura.models.mlp import mlp_classifier


def _model():
    return mlp_classifier(8, in_dim=12, hidden=(16,), classes=5)


def _compile(m, backend="wgpu", **kw):
    return mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                      optimizer=optim.SGD(lr=0.1, momentum=0.9), backend=backend, **kw)


def _feeds():
    r = np.random.default_rng(0)
    return {"x": r.normal(size=(8, 12)).astype(np.float32),
            "y": r.integers(0, 5, 8).astype(np.int32)}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_values_equal_an_eager_init(gpu):
    m = _model()
    s = _compile(m)
    assert s.buffers.pending  # nothing sampled yet
    _assert_same(s.get_state(), {k: v.astype(np.float32) if v.dtype == np.float64 else v
                                 for k, v in init_leaves(s.program.graph, 0).items()})
    assert not s.buffers.pending


def test_set_params_skips_their_initial_values(gpu, monkeypatch):
    m = _model()
    s = _compile(m)
    made = []
    make = s.buffers._make_initial
    monkeypatch.setattr(s.buffers, "_make_initial", lambda names: made.extend(names)
                        or make(names))
    ref = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                     optimizer=optim.SGD(lr=0.1, momentum=0.9), backend="reference")
    w = {k: v + 0.5 for k, v in ref.get_params().items()}
    s.set_params(w)
    ref.set_params(w)
    got, want = s.step(**_feeds()).loss, ref.step(**_feeds()).loss
    assert made and not set(made) & set(w)  # only the optimizer states were initialised
    assert got == pytest.approx(want, rel=1e-5)
    _assert_same({k: np.round(v, 5) for k, v in s.get_params().items()},
                 {k: np.round(v, 5) for k, v in ref.get_params().items()})


def test_step_and_run_use_the_initial_values(gpu):
    m = _model()
    a, b = _compile(m), _compile(m)
    b.get_params()  # b initialised by a read, a by its first dispatch
    la, lb = a.step(**_feeds()).loss, b.step(**_feeds()).loss
    assert la == lb
    _assert_same(a.run(x=_feeds()["x"]), b.run(x=_feeds()["x"]))


def test_a_sharing_session_sees_the_values(gpu):
    m = _model()
    a = _compile(m, group_params=False)
    inf = mn.compile(m.graph, outputs={"logits": m.logits}, share=a)
    want = _compile(m).run(x=_feeds()["x"])
    _assert_same(inf.run(x=_feeds()["x"]), want)


def test_gpu_buffer_is_initialised_for_the_host(gpu):
    m = _model()
    s = _compile(m)
    name = s.param_names[0]
    buf, off, size = s.gpu_buffer(name)
    raw = np.frombuffer(bytes(s.dev.queue.read_buffer(buf, off, size)), np.float32)
    np.testing.assert_array_equal(raw, s.get_params()[name].ravel())
    assert np.abs(raw).max() > 0
