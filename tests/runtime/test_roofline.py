"""The roofline profile: each kernel's flops and compulsory bytes come from its description,
achieved rates from GPU timestamps, and the bound from the adapter's peaks."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
from meganeura.runtime.profile import KernelTime
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
    assert 0 < prof.pass_floor_us <= 2 * np.median([r["mean_us"] for r in rows])
    assert f"floor of this timing: {prof.pass_floor_us:.1f} µs" in str(prof)
