"""An f16-weight artifact in the browser runtime: web/meganeura.js upcasts the stored halves, so
the page gives ``mn.load_program``'s results for the same artifact."""

from __future__ import annotations

import numpy as np

import meganeura as mn
from meganeura.io.datasets import load_digits
from meganeura.models.mlp import mlp_classifier

from .test_browser import _run, page, pytestmark, site  # noqa: F401  (fixtures, skip marks)


def test_browser_runs_an_f16_weight_artifact_like_python(gpu, page, site):  # noqa: F811
    m = mlp_classifier(32, hidden=(32,))
    s = mn.compile(m.graph, outputs={"logits": m.logits}, portable=True)
    s.init_params(seed=2)
    s.export(site[0] / "half", weights="f16")
    x = load_digits("test")[0][:32]
    want = mn.load_program(site[0] / "half", device=gpu).run(x=x)["logits"]
    r = _run(page, "half/", {"x": x})
    assert "error" not in r, r["error"]
    got = np.asarray(r["out"]["logits"], np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    full = s.run(x=x)["logits"]  # the f32 weights: only f16 rounding apart
    assert 0 < np.linalg.norm(got - full) <= 5e-3 * np.linalg.norm(full)

