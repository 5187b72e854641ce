"""``precision="fast"`` end to end: a training step and inference of an MLP.  On a device with
f16 subgroup matrices (Dawn on the H200) the matmuls run on tensor cores and must pass the fast
gates against float64 (DESIGN.md §5: forward ≤ 1e-2, gradients ≤ 5e-2, cosine ≥ 0.99); on any
other device fast is the strict program, bit for bit."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.kernels.matmul import SG_FEATURE
from meganeura.models.mlp import mlp_classifier

LR = 0.5


def _session(backend, precision="strict", **kw):
    m = mlp_classifier(64, in_dim=48, hidden=(96, 80), classes=10)
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=optim.SGD(lr=LR), backend=backend, precision=precision, **kw)
    s.init_params(seed=5)
    return s


def _feeds():
    r = np.random.default_rng(1)
    return {"x": r.normal(size=(64, 48)).astype(np.float32),
            "y": r.integers(0, 10, 64).astype(np.int32)}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _cos(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def test_fast_training_step(gpu):
    feeds = _feeds()
    fast = _session(None, "fast", device=gpu)
    p0 = fast.get_params()
    logits = fast.run(x=feeds["x"])["logits"]
    fast.step(**feeds)
    p1 = fast.get_params()
    variants = fast.kernel_variants()
    n_tc = sum(n for v in variants.values() for k, n in v.items() if k.startswith("sgmat"))
    if SG_FEATURE not in gpu.features:
        # no tensor cores: the very same program as strict
        strict = _session(None, "strict", device=gpu)
        np.testing.assert_array_equal(strict.run(x=feeds["x"])["logits"], logits)
        strict.step(**feeds)
        for k, v in strict.get_params().items():
            np.testing.assert_array_equal(v, p1[k])
        assert n_tc == 0
        return
    assert n_tc >= 3, variants  # forward matmuls and their gradients
    ref = _session("reference", dtype=np.float64)
    ref.set_params(p0)
    want = ref.run(x=feeds["x"])["logits"]
    assert _rel(logits, want) <= 1e-2
    # and it really is reduced precision: strict f32 is far closer to float64
    strict = _session(None, "strict", device=gpu)
    strict.set_params(p0)
    assert _rel(strict.run(x=feeds["x"])["logits"], want) * 10 < _rel(logits, want)
    ref.step(**feeds)
    r1 = ref.get_params()
    for k in p0:
        g_fast = (p0[k].astype(np.float64) - p1[k]) / LR
        g_ref = (p0[k].astype(np.float64) - r1[k]) / LR
        assert _rel(g_fast, g_ref) <= 5e-2, k
        assert _cos(g_fast, g_ref) >= 0.99, k


def test_unknown_precision_is_refused(gpu):
    with pytest.raises(mn.GraphBuildError, match="precision must be one of"):
        _session(None, "bf16", device=gpu)
