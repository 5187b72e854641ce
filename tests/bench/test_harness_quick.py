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
    # re-measure our cells only, with the fast precision: PyTorch's timings are kept
    torch_before = rec["torch"]
    assert harness.main(["--quick", "--workloads", "mlp", "--impls", "wgpu", "--warmup", "1",
                         "--steps", "2", "--torch-device", "cpu", "--out", str(out),
                         "--refresh-ours", "t1", "--fast"]) == 0
    rec2 = json.load(open(out))[0]
    assert rec2["refresh"] == "t1" and rec2["torch"] == torch_before
    o2 = rec2["ours"]["wgpu"]
    assert o2["gates"]["fwd_pass"] and o2["gates"]["bwd_pass"]
    # lavapipe has no tensor cores: recorded as such, never timed as if it were fast
    assert "no f16 subgroup matrices" in o2["fast"]["skipped"]
    text = report.build(json.load(open(out)), str(tmp_path))
    assert "run `t1`" in text and "Fast path: our" in text


def test_fast_report_rows(bench_path):
    """The fast table and its worst-ratio headline from a synthetic record."""
    import report

    def ms(x):
        return {"median_ms": x}

    gate = {"fwd_rel_l2": 1e-3, "bwd_rel_l2": 2e-2, "bwd_min_cos": 0.999, "fwd_pass": True,
            "bwd_pass": True, "worst_param": "grad:w"}
    rec = {"key": "w/main", "torch": {"cells": {
        "eager_tf32": {"infer": ms(2.0), "train_sgd": ms(8.0)},
        "eager_bf16": {"infer": ms(4.0), "train_sgd": ms(5.0)}}},
        "ours": {"dawn": {"fast": {"gates": gate, "infer": ms(3.0), "train_sgd": ms(10.0)}}}}
    assert report.fast_ratios(rec) == {"infer": 1.5, "train_sgd": 2.0}
    text = "\n".join(report.fast_section([rec]))
    assert "| w/main | 3.00 | 10.00 |" in text and "Worst fast-path training ratio: 2.00" in text
    rec["ours"]["dawn"]["fast"]["gates"] = dict(gate, bwd_pass=False)
    assert report.fast_ratios(rec)["train_sgd"] is None
    assert "| w/main | fail | fail |" in "\n".join(report.fast_section([rec]))


def test_gates_detect_a_wrong_gradient(bench_path):
    import numpy as np
    from harness import gates

    ref = {"loss": np.array(1.0), "grad:w": np.ones(10)}
    ok = gates({"loss": np.array(1.0), "grad:w": np.ones(10) * (1 + 1e-5)}, ref)
    bad = gates({"loss": np.array(1.0), "grad:w": np.ones(10) * 1.01}, ref)
    assert ok["bwd_pass"] and not bad["bwd_pass"] and bad["worst_param"] == "grad:w"
    # fast tolerances: 3% off passes, a flipped gradient fails (cosine -1 recorded)
    from harness import FAST

    assert gates({"loss": np.array(1.0), "grad:w": ref["grad:w"] * 1.03}, ref, FAST)["bwd_pass"]
    g = gates({"loss": np.array(1.0), "grad:w": -ref["grad:w"]}, ref, FAST)
    assert not g["bwd_pass"] and g["bwd_min_cos"] == pytest.approx(-1.0)


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


def test_f64_gates_attach_to_their_variant(bench_path, tmp_path):
    """``report.py --gate64`` files carry the variant they judged: a min-latency gate must not
    mark the main row (or the other way round)."""
    import report

    def rec(variant):
        gate = {"fwd_rel_l2": 1e-5, "bwd_rel_l2": 2e-2, "bwd_min_cos": 0.9997,
                "fwd_pass": True, "bwd_pass": False, "worst_param": "grad:w"}
        cell = {"median_ms": 1.0, "peak_bytes": 1 << 20, "dispatches": 10}
        o = {"gates": gate, "infer": cell, "train_sgd": cell, "train_adamw": cell,
             "compile_infer_s": 0.1, "compile_infer_warm_s": 0.1, "compile_train_sgd_s": 0.2}
        return {"key": f"resnet50/{variant}", "workload": "resnet50", "variant": variant,
                "torch": {"cells": {"eager_f32": {"infer": {"median_ms": 1.0}}}},
                "ours": {"wgpu": o}}

    results = tmp_path / "r.json"
    results.write_text(json.dumps([rec("main"), rec("minlat")]))
    row = {"ours_vs_f64": 0.02, "torch32_vs_f64": 0.025, "ours_vs_torch32": 0.019}
    gate = tmp_path / "g.json"
    gate.write_text(json.dumps({"workload": "resnet50", "variant": "main", "impl": "wgpu",
                                "pass": True, "worst": "grad:w", "worst_row": row,
                                "fails": [], "rows": {}}))
    report.main([str(results), "--gate64", str(gate), "--out", str(tmp_path)])
    text = (tmp_path / "benchmarks.md").read_text()
    inference = text.split("## Strict f32 — inference")[1].split("##")[0]
    assert "| resnet50/main | 1.00 † |" in inference
    assert "| resnet50/minlat | fail |" in inference


def test_paired_rounds_quick(gpu, bench_path, tmp_path):
    """bench/paired.py: every cell timed in every round, ratios per round, a verdict that
    needs the worst round below 1 to say 'faster'."""
    import paired

    out = tmp_path / "p.json"
    assert paired.main(["--quick", "--workloads", "mlp", "--impl", "wgpu", "--rounds", "3",
                        "--warmup", "1", "--steps", "2", "--torch-device", "cpu",
                        "--out", str(out)]) == 0
    rec = json.load(open(out))[0]
    assert "error" not in rec, rec
    assert set(rec["round_median_ms"]) == {"ours/infer", "ours/train", "eager/infer",
                                           "eager/train"}
    assert all(len(v) == 3 and min(v) > 0 for v in rec["round_median_ms"].values())
    r = rec["ratios"]["ours/eager/train"]
    want = [a / b for a, b in zip(rec["round_median_ms"]["ours/train"],
                                  rec["round_median_ms"]["eager/train"], strict=True)]
    assert r["min"] == pytest.approx(min(want)) and r["max"] == pytest.approx(max(want))
    assert paired.verdict({"median": 0.8, "min": 0.7, "max": 0.99}) == "faster"
    assert paired.verdict({"median": 0.8, "min": 0.7, "max": 1.01}) == "parity"
    assert paired.verdict({"median": 1.2, "min": 1.01, "max": 1.3}) == "slower"
    png = tmp_path / "p.png"
    assert paired.main(["--out", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 5000  # a drawn figure (the bars of the run above)


def test_paired_fast_against_strict(gpu, bench_path, tmp_path, capsys):
    """bench/paired.py --fast --no-torch: our strict and fast cells in the same rounds, the
    ratio fast ÷ strict per round, no PyTorch cell."""
    import paired

    out = tmp_path / "p.json"
    assert paired.main(["--quick", "--workloads", "mlp", "--impl", "wgpu", "--rounds", "2",
                        "--warmup", "1", "--steps", "2", "--fast", "--no-torch",
                        "--out", str(out)]) == 0
    rec = json.load(open(out))[0]
    assert set(rec["round_median_ms"]) == {"ours/infer", "ours/train", "fast/infer",
                                           "fast/train"}
    assert set(rec["ratios"]) == {"fast/ours/infer", "fast/ours/train"}
    rm = rec["round_median_ms"]
    want = [a / b for a, b in zip(rm["fast/train"], rm["ours/train"], strict=True)]
    assert rec["ratios"]["fast/ours/train"]["max"] == pytest.approx(max(want))
    assert "fast÷ours/train" in capsys.readouterr().out


def test_harness_times_resident_inputs_and_reports_the_upload(gpu, bench_path):
    """Our timed steps read feeds already on the GPU (as PyTorch's do); the upload is timed
    on its own and reported as ``feed_upload_ms``."""
    import harness
    from workloads import WORKLOADS

    import meganeura as mn

    w = WORKLOADS["mlp"](True, "main")
    sess = mn.compile(w.graph, outputs=w.outputs)
    sess.set_params(w.params)
    calls = []
    orig = sess._upload_feeds
    sess._upload_feeds = lambda arrays: (calls.append(1), orig(arrays))
    res = harness.time_ours(sess, True, w.feeds, 2, 3)
    assert res["median_ms"] > 0 and res["feed_upload_ms"] > 0
    assert len(calls) == 1 + 5  # once before the 5 timed/warm-up steps, 5 × for the upload timing
