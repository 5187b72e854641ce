"""bench/probe_buffer_view.py: its runner computes on this device, and on a device without
WGSL buffer views (wgpu-native's naga) both probes report the compile error, no crash."""

import os
import sys

import numpy as np

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

DOUBLE = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> o: array<f32>;
@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) i: u32) { o[i] = 2.0 * x[i] + 1.0; }
"""


def test_probe_runner_and_report(gpu, capsys):
    sys.path.insert(0, BENCH)
    try:
        import probe_buffer_view as P

        x = np.arange(32, dtype=np.float32)
        np.testing.assert_array_equal(P._run(gpu, DOUBLE, [x], 32), 2 * x + 1)
        assert P.main(gpu.implementation) == 0
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("packed store", "subgroup"))]
    assert len(lines) == 2
    if gpu.implementation == "wgpu":  # naga has neither buffer views nor subgroup matrices
        assert all(": error:" in ln for ln in lines), lines
