"""A step is submitted as several command buffers (``GPUStream.launch``) so the GPU starts
while the host still encodes: the cut points parse strictly, and a step cut anywhere gives
bit-identical results to one command buffer (training updates and fetched outputs).  After
each submit the next step is encoded ahead (``GPUStream.prepare``); it must run on the feeds,
parameters and initial values written after it was encoded."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier
from meganeura.runtime.executable import (
    PREENCODE_ENV,
    PREPARED_SEGMENTS,
    SEGMENTS_ENV,
    preencode_enabled,
    segment_bounds,
)


def test_segment_bounds_default_env_and_clipping():
    assert segment_bounds(5, "0") == [0, 5]
    assert segment_bounds(5, "") == [0, 5]
    assert segment_bounds(100, "12,96") == [0, 12, 96, 100]
    assert segment_bounds(20, "96, 12") == [0, 12, 20]  # sorted, beyond n dropped
    assert segment_bounds(0, "3") == [0, 0]


def test_segment_bounds_rejects_bad_values():
    with pytest.raises(ValueError, match=SEGMENTS_ENV):
        segment_bounds(10, "a,b")
    with pytest.raises(ValueError, match="≥ 0"):
        segment_bounds(10, "-1")


def _run(monkeypatch, cuts: str):
    monkeypatch.setenv(SEGMENTS_ENV, cuts)
    m = mlp_classifier(8, in_dim=12, hidden=(16, 16), classes=5)
    sess = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                      optimizer=optim.SGD(lr=0.1, momentum=0.9))
    r = np.random.default_rng(0)
    feeds = {"x": r.normal(size=(8, 12)).astype(np.float32),
             "y": r.integers(0, 5, 8).astype(np.int32)}
    n = len(sess.train.commands)
    losses = [float(sess.step(**feeds).loss) for _ in range(3)]
    # the steps went through exactly the segments the setting names (none: one encode)
    want = list(zip(segment_bounds(n, cuts), segment_bounds(n, cuts)[1:]))
    assert sorted(sess.train._segments) == (want if len(want) > 1 else [])
    return n, losses, sess.get_params(), sess.run(x=feeds["x"])["logits"]


def test_segmented_steps_are_bit_identical(monkeypatch, gpu):
    n, loss1, p1, out1 = _run(monkeypatch, "0")
    assert n >= 4
    for cuts in ("1", f"1,2,{n - 1}", f"{n // 2}"):
        _, loss2, p2, out2 = _run(monkeypatch, cuts)
        assert loss1 == loss2, cuts
        assert all(np.array_equal(p1[k], p2[k]) for k in p1), cuts
        assert np.array_equal(out1, out2), cuts


def _mlp_session():
    m = mlp_classifier(8, in_dim=12, hidden=(16, 16), classes=5)
    return mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                      optimizer=optim.Adam(lr=1e-2))


def _feeds(i: int) -> dict:
    r = np.random.default_rng(i)
    return {"x": r.normal(size=(8, 12)).astype(np.float32),
            "y": r.integers(0, 5, 8).astype(np.int32)}


def _history(monkeypatch, ahead: str):
    """Steps and runs on changing feeds, a set_params and an init_params in between."""
    monkeypatch.setenv(PREENCODE_ENV, ahead)
    monkeypatch.delenv(SEGMENTS_ENV, raising=False)
    sess = _mlp_session()
    out = [float(sess.step(**_feeds(i)).loss) for i in range(3)]
    out.append(sess.run(x=_feeds(7)["x"])["logits"])
    out.append(sess.run(x=_feeds(8)["x"])["logits"])
    params = sess.get_params()
    sess.set_params({k: v * 0.5 for k, v in params.items()})  # written after the encode ahead
    out.append(sess.run(x=_feeds(7)["x"])["logits"])
    out.append(float(sess.step(**_feeds(3)).loss))
    sess.init_params(seed=5)  # every parameter and state rewritten after the encode ahead
    out.append(float(sess.step(**_feeds(4)).loss))
    out.append(sess.run(x=_feeds(9)["x"])["logits"])
    return sess, out, sess.get_params()


def test_steps_encoded_ahead_match_steps_encoded_on_demand(monkeypatch, gpu):
    _, want, want_p = _history(monkeypatch, "0")
    sess, got, got_p = _history(monkeypatch, "1")
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)
    assert all(np.array_equal(got_p[k], want_p[k]) for k in want_p)
    # the next step of each stream is waiting, cut where PREPARED_SEGMENTS says
    n = len(sess.train.commands)
    cuts = ",".join(map(str, PREPARED_SEGMENTS))
    assert len(sess.train.prepared.command_buffers) == len(segment_bounds(n, cuts)) - 1
    assert sess.train.prepared.readback is not None and sess.infer.prepared is not None
    monkeypatch.setenv(PREENCODE_ENV, "0")
    sess.step(**_feeds(5))
    assert sess.train.prepared is None  # submitted, and nothing encoded ahead


def test_preencode_setting_is_checked_before_anything_runs(monkeypatch, gpu):
    assert preencode_enabled("1") and not preencode_enabled("0") and preencode_enabled(" 1 ")
    sess = _mlp_session()
    sess.step(**_feeds(0))
    before = sess.get_params()
    monkeypatch.setenv(PREENCODE_ENV, "yes")
    with pytest.raises(ValueError, match=PREENCODE_ENV):
        sess.step(**_feeds(1))
    assert all(np.array_equal(v, sess.get_params()[k]) for k, v in before.items())


@pytest.mark.parametrize("impl,module", [("wgpu", "wgpu"), ("dawn", "wgpudawn")])
def test_raw_calls_are_the_implementations_own_entry_points(impl, module):
    """After the first checked encode, both implementations encode through their webgpu.h
    functions directly; an unknown implementation keeps the wrappers."""
    from types import SimpleNamespace

    from meganeura.runtime.executable import _raw_calls

    pytest.importorskip(module)
    lib, null = _raw_calls(SimpleNamespace(implementation=impl))
    for fn in ("SetPipeline", "SetBindGroup", "DispatchWorkgroups"):
        assert callable(getattr(lib, f"wgpuComputePassEncoder{fn}"))
    assert null is not None
    assert _raw_calls(SimpleNamespace(implementation="reference")) is None


def test_a_failed_encode_ahead_keeps_this_step_and_fails_the_next(monkeypatch, gpu):
    """The step is submitted before the next one is encoded: if that encode fails, this
    step's results still arrive, and the next call (encoding on demand) raises the error."""
    from meganeura.runtime.executable import GPUStream

    monkeypatch.delenv(PREENCODE_ENV, raising=False)
    sess = _mlp_session()
    want = _mlp_session()
    boom = RuntimeError("no memory for the readback buffer")

    def failing(self, fetch=True):
        raise boom
    monkeypatch.setattr(GPUStream, "prepare", failing)
    assert float(sess.step(**_feeds(0)).loss) == float(want.step(**_feeds(0)).loss)
    assert sess.train.prepared is None
    monkeypatch.setattr(GPUStream, "_readback", lambda self: (_ for _ in ()).throw(boom))
    with pytest.raises(RuntimeError, match="no memory"):
        sess.step(**_feeds(1))
