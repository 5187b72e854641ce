"""bench/pipeline_stats.py stays working: on lavapipe (no pipeline statistics there) the layer
is built, every kernel of a small training step has its SPIR-V dumped, and that SPIR-V makes a
pipeline again on the tool's own Vulkan device with the bindings the kernel declares."""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


@pytest.mark.gpu
def test_smoke_set_on_lavapipe(tmp_path):
    env = dict(os.environ, MEGANEURA_WEBGPU="wgpu")
    r = subprocess.run([sys.executable, os.path.join(BENCH, "pipeline_stats.py"),
                        str(tmp_path), "smoke", "--backend", "wgpu"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(tmp_path / "stats.json"))["rows"]
    assert len(rows) >= 3, rows  # matmul, its gradient, the update at least
    assert all("error" not in row for row in rows), rows
    # each kernel's own module: one storage binding per kernel binding, all in set 0
    for row in rows:
        want = [[0, i, 7] for i in range(row["n_bindings"])]
        assert row["spirv_bindings"] == want, row
    spv = [p for p in os.listdir(tmp_path) if p.endswith(".spv")]
    assert len(spv) == len(rows)


def test_spirv_bindings_of_a_handmade_module():
    """The SPIR-V reader finds (set, binding, type) and push constants of a module written
    word by word (OpDecorate / OpVariable only: what the reader looks at)."""
    import struct

    sys.path.insert(0, BENCH)
    try:
        from vk_stats import DESC_STORAGE, DESC_UNIFORM, spirv_bindings
    finally:
        sys.path.remove(BENCH)

    def op(code, *words):
        return struct.pack(f"<{len(words) + 1}I", ((len(words) + 1) << 16) | code, *words)

    head = struct.pack("<5I", 0x07230203, 0x00010300, 0, 100, 0)
    body = (op(71, 10, 34, 0) + op(71, 10, 33, 2) + op(71, 11, 34, 1) + op(71, 11, 33, 0)
            + op(59, 5, 10, 12) + op(59, 6, 11, 2) + op(59, 7, 12, 9))
    binds, push = spirv_bindings(head + body)
    assert binds == [(0, 2, DESC_STORAGE), (1, 0, DESC_UNIFORM)]
    assert push


def test_mm_set_takes_the_given_tiles_and_operand_type():
    """``--mm-cfgs`` / ``--mm-f16``: the mm set emits exactly the given tensor-core tiles at
    4096³ with f16 bindings (emitted for a target with subgroup matrices; no device needed)."""
    from types import SimpleNamespace

    from meganeura.kernels.common import SG_FEATURE
    from meganeura.kernels.matmul import Cfg

    sys.path.insert(0, BENCH)
    try:
        import pipeline_stats as P
    finally:
        sys.path.remove(BENCH)
    dev = SimpleNamespace(limits={"max_compute_workgroup_storage_size": 49152,
                                  "max_compute_invocations_per_workgroup": 1024},
                          features={"shader-f16", "subgroups", SG_FEATURE})
    tiles = [Cfg("sgmat", 128, 256, 2, 4, 32, 256), Cfg("sgmat", 128, 128, 2, 4, 32, 0)]
    out = P.mm_specs(dev, tiles, "f16")
    assert [spec.meta["config"] for _, spec in out] == [tuple(t) for t in tiles]
    assert all("-f16-cfg" in label and "array<vec4<f16>>" in spec.wgsl for label, spec in out)
    default = P.mm_specs(dev)
    assert len(default) == len(P.MM_TILES) and all("-f32-" in lb for lb, _ in default)
