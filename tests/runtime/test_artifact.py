"""Export → load: an artifact runs without the compiler and gives the session's results."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import meganeura as mn
from meganeura.models.mlp import mlp_classifier


def _trained(batch=16):
    m = mlp_classifier(batch, in_dim=64, hidden=(32,), classes=10)
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=mn.optim.AdamW(lr=1e-2))
    s.init_params(seed=3)
    r = np.random.default_rng(0)
    x = r.normal(size=(batch, 64)).astype(np.float32)
    y = r.integers(0, 10, batch).astype(np.int32)
    for _ in range(3):
        s.step(x=x, y=y)
    return s, x, y


def test_exported_program_gives_the_sessions_outputs_and_trains_on(gpu, tmp_path):
    s, x, y = _trained()
    s.export(tmp_path / "mlp")
    p = mn.load_program(tmp_path / "mlp", device=gpu)
    np.testing.assert_array_equal(p.run(x=x)["logits"], s.run(x=x)["logits"])
    for k, v in s.get_state().items():
        np.testing.assert_array_equal(p.get_state()[k], v)
    # the training stream too: one more step on both gives the same loss and parameters
    got, want = p.step(x=x, y=y), s.step(x=x, y=y)
    np.testing.assert_allclose(got["__loss__"], want.loss, rtol=1e-6)
    for k, v in s.get_state().items():
        np.testing.assert_allclose(p.get_state()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_artifact_layout_and_bad_feeds(gpu, tmp_path):
    s, x, _ = _trained()
    s.export(tmp_path / "a")
    files = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert files == ["kernels", "manifest.json", "weights.safetensors"]
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert man["program"]["outputs"] == ["logits"] and man["version"] == 1
    p = mn.load_program(tmp_path / "a", device=gpu)
    with pytest.raises(mn.FeedError, match="feed 'x' has shape"):
        p.run(x=x[:3])
    with pytest.raises(mn.FeedError, match=r"feed 'y'.*label.*99"):
        p.step(x=x, y=np.full(16, 99, np.int32))


def test_export_replaces_an_artifact_but_never_another_folder(gpu, tmp_path):
    s, x, _ = _trained()
    s.export(tmp_path / "a")
    s.export(tmp_path / "a")  # replaced in place
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"x")
    with pytest.raises(mn.CheckpointError, match="not a meganeura artifact"):
        s.export(other)
    assert (other / "cat.jpg").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "photos"]  # no temp folders


def test_broken_artifacts_are_clear_errors(gpu, tmp_path):
    with pytest.raises(mn.CheckpointError, match="no manifest.json"):
        mn.load_program(tmp_path, device=gpu)
    s, _, _ = _trained()
    s.export(tmp_path / "a")
    (tmp_path / "a" / "kernels" / "000.wgsl").unlink()
    with pytest.raises(mn.CheckpointError, match="unreadable"):
        mn.load_program(tmp_path / "a", device=gpu)


def test_portable_programs_fit_webgpus_guaranteed_limits(gpu, tmp_path):
    """compile(portable=True): bindings aligned for every WebGPU device (256 bytes), workgroups
    of at most 256 invocations, no optional features; same results as the device's program."""
    s, x, _ = _trained()
    m = mlp_classifier(16, in_dim=64, hidden=(32,), classes=10)
    p = mn.compile(m.graph, outputs={"logits": m.logits}, portable=True)
    p.set_params(s.get_params())
    p.export(tmp_path / "web")
    man = json.loads((tmp_path / "web" / "manifest.json").read_text())
    offsets = {b[2] for st in man["streams"].values() for op in st["ops"]
               for b in op.get("bindings", ())}
    assert all(o % 256 == 0 for o in offsets)
    for src in (tmp_path / "web" / "kernels").iterdir():
        text = src.read_text()
        assert "enable " not in text
        sizes = [np.prod([int(n) for n in dims.split(",")])
                 for dims in re.findall(r"@workgroup_size\(([\d, ]+)\)", text)]
        assert sizes and max(sizes) <= 256
    np.testing.assert_allclose(p.run(x=x)["logits"], s.run(x=x)["logits"], rtol=1e-6, atol=1e-6)
