"""f16-weight artifacts (``sess.export(path, weights="f16")``): parameters stored as f16, upcast
to f32 on load; the program and its results are those of the f32 program on the rounded
parameters, within f16 tolerance of the original; states stay exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import meganeura as mn
from tests.runtime.test_artifact import _trained


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_f16_artifact_is_half_the_weights_and_runs_like_the_rounded_f32_program(gpu, tmp_path):
    s, x, y = _trained()
    s.export(tmp_path / "f32")
    s.export(tmp_path / "f16", weights="f16")
    man = json.loads((tmp_path / "f16" / "manifest.json").read_text())
    assert sorted(man["program"]["stored_f16"]) == sorted(s.param_names)
    stored = load_file(str(tmp_path / "f16" / "weights.safetensors"))
    assert all(stored[n].dtype == np.float16 for n in s.param_names)
    states = [n for n in s.get_state() if n not in s.param_names]
    assert states and all(stored[n].dtype != np.float16 for n in states)  # moments stay exact
    p_bytes = sum(v.nbytes for n, v in s.get_params().items())
    size = {k: (tmp_path / k / "weights.safetensors").stat().st_size for k in ("f32", "f16")}
    assert size["f32"] - size["f16"] == pytest.approx(p_bytes / 2, abs=1024)

    p = mn.load_program(tmp_path / "f16", device=gpu)
    got = p.run(x=x)["logits"]
    want = s.run(x=x)["logits"]
    assert 0 < _rel(got, want) <= 5e-3  # f16 rounding of the weights, nothing more
    rounded = {n: v.astype(np.float16).astype(np.float32) for n, v in s.get_params().items()}
    s.set_params(rounded)
    np.testing.assert_array_equal(got, s.run(x=x)["logits"])  # exactly the upcast weights
    for n, v in rounded.items():
        np.testing.assert_array_equal(p.get_state()[n], v)
    np.testing.assert_allclose(p.step(x=x, y=y)["__loss__"], s.step(x=x, y=y).loss, rtol=1e-6)


def test_f16_export_refuses_what_f16_cannot_hold_and_unknown_formats(gpu, tmp_path):
    s, _, _ = _trained()
    with pytest.raises(ValueError, match="weights must be one of"):
        s.export(tmp_path / "a", weights="bf16")
    name = s.param_names[0]
    big = s.get_params()[name].copy()
    big.flat[0] = 1e5
    s.set_params({name: big})
    with pytest.raises(ValueError, match=f"parameter '{name}' holds 100000, beyond f16"):
        s.export(tmp_path / "a", weights="f16")
    assert not (tmp_path / "a").exists()


def test_f16_artifact_with_f32_weights_is_a_clear_error(gpu, tmp_path):
    s, _, _ = _trained()
    s.export(tmp_path / "a", weights="f16")
    w = tmp_path / "a" / "weights.safetensors"
    t = load_file(str(w))
    name = s.param_names[0]
    t[name] = t[name].astype(np.float32)  # a weights file from an f32 export
    save_file(t, str(w))
    with pytest.raises(mn.CheckpointError, match=f"'{name}' should be stored as f16.*float32"):
        mn.load_program(tmp_path / "a", device=gpu)
