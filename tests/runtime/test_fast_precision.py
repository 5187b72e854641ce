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

from ..kernels._util import no_subgroup_matrix_reason

LR = 0.5


def _session(backend, precision="strict", big=False, **kw):
    """The MLP; ``big``: sizes whose matmuls reach tensor cores (≥ TC_MIN_TILES output tiles)."""
    m = mlp_classifier(512 if big else 64, in_dim=512 if big else 48,
                       hidden=(512, 512) if big else (96, 80), classes=10)
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=optim.SGD(lr=LR), backend=backend, precision=precision, **kw)
    s.init_params(seed=5)
    return s


def _feeds(big=False):
    r = np.random.default_rng(1)
    n, d = (512, 512) if big else (64, 48)
    return {"x": r.normal(size=(n, d)).astype(np.float32),
            "y": r.integers(0, 10, n).astype(np.int32)}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _cos(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def _fast_step(gpu, feeds, big=False):
    """Logits before the step, parameters before and after, and how many kernels of the fast
    session run on subgroup matrices."""
    fast = _session(None, "fast", big=big, device=gpu)
    p0 = fast.get_params()
    logits = fast.run(x=feeds["x"])["logits"]
    fast.step(**feeds)
    variants = fast.kernel_variants()
    n_tc = sum(n for v in variants.values() for k, n in v.items() if k.startswith("sgmat"))
    return logits, p0, fast.get_params(), n_tc


def test_fast_is_strict_without_tensor_cores(gpu):
    """Where no f16 subgroup matrices exist (lavapipe CI), fast is the very same program as
    strict, bit for bit."""
    if SG_FEATURE in gpu.features:
        pytest.skip(f"{gpu.adapter_name} has f16 subgroup matrices: fast differs from strict "
                    "there (test_fast_training_step_meets_the_fast_gates)")
    feeds = _feeds()
    logits, _, p1, n_tc = _fast_step(gpu, feeds)
    strict = _session(None, "strict", device=gpu)
    np.testing.assert_array_equal(strict.run(x=feeds["x"])["logits"], logits)
    strict.step(**feeds)
    for k, v in strict.get_params().items():
        np.testing.assert_array_equal(v, p1[k])
    assert n_tc == 0


def test_fast_training_step_meets_the_fast_gates(gpu):
    """On tensor cores: forward ≤ 1e-2 and gradients ≤ 5e-2 / cosine ≥ 0.99 against float64,
    and measurably less precise than strict (so the fast path really ran)."""
    reason = no_subgroup_matrix_reason(gpu)
    if reason:
        pytest.skip(reason)
    feeds = _feeds(big=True)
    logits, p0, p1, n_tc = _fast_step(gpu, feeds, big=True)
    assert n_tc >= 3  # forward matmuls and their gradients
    ref = _session("reference", big=True, dtype=np.float64)
    ref.set_params(p0)
    want = ref.run(x=feeds["x"])["logits"]
    assert _rel(logits, want) <= 1e-2
    # and it really is reduced precision: strict f32 is far closer to float64
    strict = _session(None, "strict", big=True, device=gpu)
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
