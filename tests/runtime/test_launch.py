"""A step is submitted as several command buffers (``GPUStream.launch``) so the GPU starts
while the host still encodes: the cut points parse strictly, and a step cut anywhere gives
bit-identical results to one command buffer (training updates and fetched outputs)."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier
from meganeura.runtime.executable import SEGMENTS_ENV, segment_bounds


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
