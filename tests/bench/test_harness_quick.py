"""The benchmark harness itself stays tested: --quick on lavapipe/CPU, gates, report."""

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture
def bench_path():
    sys.path.insert(0, os.path.abspath(BENCH))
    yield
    sys.path.remove(os.path.abspath(BENCH))


def test_quick_harness_and_report(gpu, bench_path, tmp_path):
    import harness
    import report

    out = tmp_path / "r.json"
    assert harness.main(["--quick", "--workloads", "mlp", "--impls", "wgpu", "--warmup", "1",
                         "--steps", "2", "--torch-device", "cpu", "--out", str(out)]) == 0
    rec = json.load(open(out))[0]
    o = rec["ours"]["wgpu"]
    assert o["gates"]["fwd_pass"] and o["gates"]["bwd_pass"], o["gates"]
    for k in ("infer", "train_sgd", "train_adamw"):
        assert o[k]["median_ms"] > 0 and o[k]["peak_bytes"] > 0
    text = report.build(json.load(open(out)), str(tmp_path))
    assert "| mlp/main |" in text and (tmp_path / "bench-ratios.png").exists()


def test_gates_detect_a_wrong_gradient(bench_path):
    import numpy as np
    from harness import gates

    ref = {"loss": np.array(1.0), "grad:w": np.ones(10)}
    ok = gates({"loss": np.array(1.0), "grad:w": np.ones(10) * (1 + 1e-5)}, ref)
    bad = gates({"loss": np.array(1.0), "grad:w": np.ones(10) * 1.01}, ref)
    assert ok["bwd_pass"] and not bad["bwd_pass"] and bad["worst_param"] == "grad:w"


def test_f64_aware_gate(bench_path):
    import numpy as np
    from gate_f64 import f64_gates

    f64 = {"grad:a": np.ones(4), "grad:b": np.ones(4)}
    f32 = {"grad:a": np.ones(4) * 1.02, "grad:b": np.ones(4)}  # PyTorch f32 itself 2% off on a
    ok = f64_gates({"grad:a": np.ones(4) * 0.98, "grad:b": np.ones(4)}, f32, f64)
    bad = f64_gates({"grad:a": np.ones(4), "grad:b": np.ones(4) * 1.01}, f32, f64)
    assert ok["pass"] and not bad["pass"] and bad["fails"] == ["grad:b"]


def test_quick_all_five_workloads_pass_their_gates(gpu, bench_path, tmp_path):
    """Tiny configs of the five matched workloads through the whole harness (lavapipe +
    PyTorch CPU): every cell timed and every gate passed."""
    import harness

    out = tmp_path / "five.json"
    assert harness.main(["--quick", "--workloads", "smollm2,smolvla,whisper,resnet50,unet",
                         "--impls", "wgpu", "--warmup", "0", "--steps", "1",
                         "--torch-device", "cpu", "--out", str(out)]) == 0
    recs = json.load(open(out))
    assert [r["workload"] for r in recs] == ["smollm2", "smolvla", "whisper", "resnet50", "unet"]
    for r in recs:
        assert "error" not in r, r.get("tb")
        o = r["ours"]["wgpu"]
        assert "error" not in o, o.get("tb")
        assert o["gates"]["fwd_pass"] and o["gates"]["bwd_pass"], (r["key"], o["gates"])
        assert r["torch"]["cells"]["eager_f32"]["train_sgd"]["median_ms"] > 0
