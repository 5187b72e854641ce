"""Session behaviour common to every backend: feed validation, parameters, checkpoints."""

import os

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier

BACKENDS = ["reference", "wgpu"]


def _session(backend, hidden=(16,), opt=None, batch=8):
    m = mlp_classifier(batch, in_dim=12, hidden=hidden, classes=5)
    opt = opt or optim.AdamW(lr=optim.WarmupCosine(1e-2, 3, 30), weight_decay=0.1,
                             clip_grad_norm=1.0)
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits}, optimizer=opt,
                   backend=backend)
    s.init_params(seed=3)
    return s


def _data(i, batch=8):
    r = np.random.default_rng(i)
    return r.normal(size=(batch, 12)).astype(np.float32), r.integers(0, 5, batch).astype(np.int32)


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param != "reference":
        request.getfixturevalue("gpu")
    return request.param


def test_bad_feeds_raise_before_anything_runs(backend):
    s = _session(backend)
    x, y = _data(0)
    before = s.get_params()
    cases = [
        ({"x": x}, "missing 'y'"),
        ({"x": x, "y": y, "z": x}, "unknown 'z'"),
        ({"x": x[:4], "y": y}, "shape (4, 12)"),
        ({"x": x, "y": y.astype(np.float32)}, "expected integers"),
        ({"x": x.astype(np.int32), "y": y}, "expected floating"),
        ({"x": np.where(x > 1, np.nan, x), "y": y}, "NaN"),
        ({"x": x, "y": y.astype(np.int64) + 2**40}, "outside the i32 range"),
    ]
    for feeds, msg in cases:
        with pytest.raises(mn.FeedError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            s.step(**feeds)
    after = s.get_params()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    assert s.step_count == 0


def test_set_params_checks_names_and_shapes(backend):
    s = _session(backend)
    with pytest.raises(mn.FeedError, match="unknown tensors"):
        s.set_params({"nope": np.zeros(3)})
    with pytest.raises(mn.FeedError, match="mlp.0.weight"):
        s.set_params({"mlp.0.weight": np.zeros((3, 3))})
    with pytest.raises(mn.FeedError, match="missing parameters"):
        s.set_params({"mlp.0.weight": np.zeros((16, 12))}, strict=True)


def test_inference_session_refuses_step(backend):
    m = mlp_classifier(4, in_dim=12, hidden=(8,), classes=5)
    s = mn.compile(m.graph, outputs={"logits": m.logits}, backend=backend)
    with pytest.raises(mn.FeedError, match="no optimizer"):
        s.step(x=np.zeros((4, 12), np.float32))
    assert s.run(x=np.zeros((4, 12), np.float32))["logits"].shape == (4, 5)


def test_checkpoint_resume_matches_uninterrupted_run(backend, tmp_path):
    a = _session(backend)
    losses_a = [a.step(x=x, y=y).loss for x, y in map(_data, range(12))]
    b = _session(backend)
    for i in range(5):
        b.step(*(), **dict(zip("xy", _data(i))))
    path = tmp_path / "ck.safetensors"
    b.save(path)
    c = _session(backend)
    c.load(path)
    assert c.step_count == 5
    losses_c = [c.step(x=x, y=y).loss for x, y in map(_data, range(5, 12))]
    np.testing.assert_allclose(losses_c, losses_a[5:], rtol=1e-6, atol=1e-7)
    assert "optim.step" in c.get_state()


def test_corrupt_truncated_and_mismatched_checkpoints(backend, tmp_path):
    s = _session(backend)
    s.step(**dict(zip("xy", _data(0))))
    good = tmp_path / "good.safetensors"
    s.save(good)
    before = s.get_state()

    truncated = tmp_path / "trunc.safetensors"
    truncated.write_bytes(good.read_bytes()[: os.path.getsize(good) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a checkpoint" * 10)
    with pytest.raises(mn.CheckpointError, match="corrupt or truncated"):
        s.load(truncated)
    with pytest.raises(mn.CheckpointError, match="corrupt or truncated"):
        s.load(garbage)
    with pytest.raises(mn.CheckpointError, match="does not exist"):
        s.load(tmp_path / "missing.safetensors")

    other = _session(backend, hidden=(7,))
    with pytest.raises(mn.CheckpointError, match=r"mismatched tensors \[mlp.0.weight: file "
                       r"float32\[16, 12\] vs graph f32\[7,12\]"):
        other.load(good)

    from safetensors.numpy import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(foreign))
    with pytest.raises(mn.CheckpointError, match="not a meganeura checkpoint"):
        s.load(foreign)
    after = s.get_state()
    for k in before:  # nothing was overwritten by the failed loads
        np.testing.assert_array_equal(before[k], after[k])


def test_checkpoint_write_is_atomic(backend, tmp_path, monkeypatch):
    s = _session(backend)
    path = tmp_path / "ck.safetensors"
    s.save(path)
    original = path.read_bytes()
    s.step(**dict(zip("xy", _data(0))))

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        s.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["ck.safetensors"]


def test_fingerprint_mismatch_is_reported(tmp_path):
    s = _session("reference")
    path = tmp_path / "ck.safetensors"
    s.save(path)
    m = mlp_classifier(8, in_dim=12, hidden=(16,), classes=5, activation="tanh")
    t = mn.compile(m.graph, loss=m.loss, optimizer=optim.AdamW(
        lr=optim.WarmupCosine(1e-2, 3, 30), weight_decay=0.1, clip_grad_norm=1.0),
        backend="reference")
    with pytest.raises(mn.CheckpointError, match="different graph"):
        t.load(path)
    t.load(path, strict_fingerprint=False)
    np.testing.assert_array_equal(t.get_params()["mlp.0.weight"], s.get_params()["mlp.0.weight"])


def test_tensor_larger_than_the_device_allows_is_a_clear_error(gpu):
    g = mn.Graph()
    limit = int(gpu.limits["max_storage_buffer_binding_size"])
    w = g.param("huge", (limit // 4 + 64,))
    with pytest.raises(mn.LimitError, match=r"param 'huge'.*binds at most"):
        mn.compile(g, outputs={"s": w.sum()}, device=gpu)


def test_lazy_results_survive_later_steps_and_readback_buffers_are_reused(gpu):
    ref = _session("reference")
    s = _session("wgpu")
    pending = [s.step(**dict(zip("xy", _data(i)))) for i in range(3)]
    want = [ref.step(**dict(zip("xy", _data(i)))).loss for i in range(3)]
    got = [r.loss for r in reversed(pending)][::-1]  # read in reverse, after all steps ran
    np.testing.assert_allclose(got, want, rtol=1e-5)
    pool = s.train.readback_pool
    assert len(pool) == 3
    assert np.isfinite(s.step(**dict(zip("xy", _data(3)))).loss)
    assert len(pool) == 3  # the next step took a pooled buffer and gave it back


_OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.05),
    "sgd-momentum": lambda: optim.SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "sgd-nesterov": lambda: optim.SGD(lr=optim.StepLR(0.05, 2), momentum=0.9, nesterov=True),
    "adam": lambda: optim.Adam(lr=1e-2),
    "adamw": lambda: optim.AdamW(lr=optim.WarmupCosine(1e-2, 2, 20), weight_decay=0.1,
                                 clip_grad_norm=1.0),
}


@pytest.mark.parametrize("opt", sorted(_OPTIMIZERS))
def test_get_state_set_params_round_trip_keeps_scalar_states(backend, opt, tmp_path):
    """set_params(get_state()) must leave a session able to step, save and load: scalar states
    (``optim.step``) once came back as shape (1,) on the reference backend."""
    s = _session(backend, opt=_OPTIMIZERS[opt]())
    twin = _session(backend, opt=_OPTIMIZERS[opt]())
    for i in range(2):
        s.step(**dict(zip("xy", _data(i))))
        twin.step(**dict(zip("xy", _data(i))))
    state = s.get_state()
    assert state["optim.step"].shape == ()
    s.set_params(state)
    assert {k: v.shape for k, v in s.get_state().items()} == {k: v.shape
                                                              for k, v in state.items()}
    s.save(tmp_path / "direct.safetensors")  # a checkpoint load() accepts, right away
    _session(backend, opt=_OPTIMIZERS[opt]()).load(tmp_path / "direct.safetensors")
    loss = s.step(**dict(zip("xy", _data(2)))).loss
    assert loss == pytest.approx(twin.step(**dict(zip("xy", _data(2)))).loss, rel=1e-6)
    path = tmp_path / "ck.safetensors"
    s.save(path)
    again = _session(backend, opt=_OPTIMIZERS[opt]())
    again.load(path)
    for k, v in s.get_state().items():
        np.testing.assert_array_equal(again.get_state()[k], v, err_msg=k)
    assert again.step(**dict(zip("xy", _data(3)))).loss == pytest.approx(
        s.step(**dict(zip("xy", _data(3)))).loss, rel=1e-6)
