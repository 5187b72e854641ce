"""The roofline profile: each kernel's flops and compulsory bytes come from its description,
achieved rates from GPU timestamps, and the bound from the adapter's peaks."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.compile.executable import Dispatch, Loc
from meganeura.kernels.ir import KernelSpec
from meganeura.models.mlp import mlp_classifier
from meganeura.runtime.profile import REPEATS, KernelTime, Profile, repeatable
from meganeura.runtime.roofline import DevicePeak, peaks_for

PEAK = DevicePeak("test", f32_flops=10e12, f16_tensor_flops=100e12, bandwidth=1e12)


def test_compute_and_memory_bounds():
    # 2·1024³ flops in 1 ms at 10 TFLOP/s peak: bound 0.215 ms -> 21.5 %
    mm = KernelTime("mm", calls=2, total_ns=2e6, flops=2 * 1024**3, bytes=3 * 4 * 1024**2)
    r = mm.roofline(PEAK)
    assert r["bound"] == "compute"
    assert r["tflops"] == pytest.approx(2 * 1024**3 / 1e-3 / 1e12)
    assert r["pct_of_bound"] == pytest.approx(100 * (2 * 1024**3 / 10e12) / 1e-3)
    # 1e8 bytes in 0.2 ms at 1 TB/s: bound 0.1 ms -> 50 %, memory-bound
    ew = KernelTime("add", calls=1, total_ns=2e5, flops=0, bytes=100_000_000)
    r = ew.roofline(PEAK)
    assert r["bound"] == "memory" and r["pct_of_bound"] == pytest.approx(50.0)
    assert r["gbps"] == pytest.approx(500.0)
    tc = KernelTime("mm tc", calls=1, total_ns=1e6, flops=2 * 1024**3, tensor_cores=True)
    assert tc.roofline(PEAK)["pct_of_bound"] == pytest.approx(100 * 2 * 1024**3 / 100e12 / 1e-3)
    assert mm.roofline(None)["pct_of_bound"] is None


def test_peaks_from_the_table_and_the_environment(monkeypatch):
    monkeypatch.delenv("MEGANEURA_PEAKS", raising=False)
    assert peaks_for("NVIDIA H200").bandwidth == 4.8e12
    assert peaks_for("llvmpipe (LLVM 15.0.6, 256 bits)") is None
    monkeypatch.setenv("MEGANEURA_PEAKS", "f32=1e11,bw=5e10")
    p = peaks_for("llvmpipe")
    assert (p.f32_flops, p.bandwidth, p.f16_tensor_flops) == (1e11, 5e10, 0.0)
    monkeypatch.setenv("MEGANEURA_PEAKS", "fp32=1")
    with pytest.raises(ValueError, match="unknown key 'fp32'"):
        peaks_for("x")
    monkeypatch.setenv("MEGANEURA_PEAKS", "f32=fast")
    with pytest.raises(ValueError, match="'fast' is not a number"):
        peaks_for("x")


def test_profile_reports_flops_bytes_and_bounds_per_kernel(gpu, monkeypatch):
    if not gpu.has_timestamps:
        pytest.fail("the test adapter must support timestamp queries")
    monkeypatch.setenv("MEGANEURA_PEAKS", "f32=1e11,bw=5e10")
    g = mn.Graph("mm")
    x = g.input("x", (64, 96))
    w = g.param("w", (96, 32))
    s = mn.compile(g, outputs={"y": (x @ w).relu()})
    prof = s.profile(steps=2, inference=True, x=np.ones((64, 96), np.float32))
    rows = prof.roofline()
    mm = [r for r in rows if r["label"].startswith("matmul")]
    assert len(mm) == 1
    assert mm[0]["flops"] == 2 * 64 * 96 * 32
    assert mm[0]["bytes"] == 4 * (64 * 96 + 96 * 32 + 64 * 32)
    assert mm[0]["pct_of_bound"] > 0 and mm[0]["bound"] in ("compute", "memory")
    assert "% bound" in str(prof) and "TFLOP/s" in str(prof)
    # the empty dispatch's pass costs something, and no more than the step's median kernel
    assert 0 < prof.pass_floor_us <= 2 * np.median([r["alone_us"] for r in rows])
    assert prof.stream_floor_us >= 0 and mm[0]["mean_us"] > 0 and not mm[0]["estimated"]
    assert f"an empty dispatch: {prof.stream_floor_us:.1f} µs in stream, " \
           f"{prof.pass_floor_us:.1f} µs alone" in str(prof)
    if not gpu.is_cpu:  # on a GPU the pass's own cost is gone in stream (H200, Dawn: 1.9 vs
        # 6.5 µs); a CPU rasterizer's dispatches cost about a pass each, in stream or alone
        # (lavapipe under CI load: 49.6 vs 45.1 µs), so there the relation is noise
        assert prof.stream_floor_us < prof.pass_floor_us
        assert mm[0]["mean_us"] < mm[0]["alone_us"]
    alone = s.profile(steps=2, inference=True, repeats=0, x=np.ones((64, 96), np.float32))
    assert alone.repeats == 0 and alone.gpu_ms_per_step == alone.alone_ms_per_step
    assert f"floor of this timing: {alone.pass_floor_us:.1f} µs" in str(alone)
    with pytest.raises(ValueError, match="repeats must be an int >= 0, got -1"):
        s.profile(steps=1, inference=True, repeats=-1, x=np.ones((64, 96), np.float32))


def _dispatch(binds, inplace=()):
    return Dispatch("k", KernelSpec("k", "", len(binds), (1, 1, 1)), tuple(binds), inplace)


def test_only_dispatches_without_read_written_ranges_repeat():
    a, b = Loc("temp", "", 0, 64), Loc("temp", "", 64, 64)
    assert repeatable(_dispatch([a, b]))
    assert repeatable(_dispatch([a, Loc("param", "w", 0, 64)]))
    assert not repeatable(_dispatch([a, b], inplace=(1,)))  # an in-place update
    assert not repeatable(_dispatch([a, Loc("temp", "", 32, 64)]))  # ranges overlap
    assert repeatable(_dispatch([a, Loc("out", "y", 0, 64)]))  # same offsets, other buffer


def test_a_repeated_timing_step_equals_a_plain_step(gpu):
    """The in-stream timing dispatches every repeatable kernel 8 times: the step must still
    leave exactly the parameters and optimizer state of one plain step (AdamW's in-place
    updates are the dispatches that must not repeat)."""
    from meganeura.runtime.profile import _timestamped_steps

    m = mlp_classifier(16, in_dim=24, hidden=(32,), classes=5)
    sessions = []
    for _ in range(2):
        s = mn.compile(m.graph, loss=m.loss, optimizer=optim.AdamW(lr=1e-2, weight_decay=0.1))
        s.init_params(seed=3)
        s.train.pinned.materialize()
        rng = np.random.default_rng(0)
        s._upload_feeds({"x": rng.standard_normal((16, 24)).astype(np.float32),
                         "y": rng.integers(0, 5, 16).astype(np.int32)})
        sessions.append(s)
    timed, plain = sessions
    reps = [REPEATS if repeatable(d) else 0 for d in timed.train.stream.dispatches]
    assert 0 < reps.count(0) < len(reps)
    _timestamped_steps(timed.dev, timed.train, 1, reps)
    plain.dev.queue.submit([plain.train.encode()])
    for get in ("get_params", "get_state"):
        got, want = getattr(timed, get)(), getattr(plain, get)()
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_split_k_partials_and_sum_count_as_one_gemm():
    part = KernelTime("matmul 1x8x8x64 [split-K 4]", calls=2, total_ns=6e3, flops=8192,
                      alone_ns=20e3)
    red = KernelTime("matmul 1x8x8x64 [split-K sum] +relu", calls=2, total_ns=2e3,
                     estimated=True)
    vec = KernelTime("matmul x4 1x8x8x32 [split-K sum]", calls=2, total_ns=2e3,  # the vec4 sum
                     plan_label="matmul 1x8x8x32 [split-K sum]")
    part2 = KernelTime("matmul 1x8x8x32 [split-K 2]", calls=2, total_ns=4e3, flops=4096)
    other = KernelTime("matmul 1x8x8x8", calls=2, total_ns=1e3, flops=1024)
    prof = Profile("d", 2, [part, red, other, vec, part2], 1.0, 1.0, 5)
    g, g2 = prof.split_k_groups()
    assert (g2["label"], g2["dispatches"], g2["mean_us"]) == ("matmul 1x8x8x32", 2, 3.0)
    assert (g["label"], g["calls"], g["dispatches"], g["estimated"]) == \
        ("matmul 1x8x8x64", 2, 2, True)
    assert g["mean_us"] == pytest.approx(4.0)  # (6 + 2) µs over 2 calls
    assert g["tflops"] == pytest.approx(8192 / 4e-6 / 1e12)
    assert "split-K GEMMs, partials + sum per call" in str(prof)
    assert prof.alone_ms_per_step == pytest.approx(0.01)


def test_a_profiled_split_gemm_is_one_group_with_its_vec4_sum(gpu):
    """A real split-K matmul whose sum runs as the vec4 pointwise kernel (its row label then
    carries the variant tag): the partials and the sum still form one GEMM row."""
    g = mn.Graph("split")
    a, b = g.param("a", (8, 3000)), g.param("b", (12, 3000))
    s = mn.compile(g, outputs={"y": a @ b.T})
    labels = [d.label for d in s.infer.stream.dispatches]
    assert any("[split-K sum]" in lb for lb in labels), labels
    s.set_params({"a": np.ones((8, 3000), np.float32), "b": np.ones((12, 3000), np.float32)})
    prof = s.profile(steps=1, inference=True, repeats=1)
    assert any(k.label.startswith("matmul x4 ") for k in prof.kernels), \
        [k.label for k in prof.kernels]
    (grp,) = prof.split_k_groups()
    assert (grp["label"], grp["dispatches"]) == ("matmul 1x8x12x3000", 2)
