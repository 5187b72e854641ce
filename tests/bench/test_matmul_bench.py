"""bench/matmul_bench.py: the ``--cfg-ab`` configuration list and the interleaved timing loop
(on this device with strict tiles; the tensor-core configurations need Dawn)."""

import numpy as np
import pytest

from ._util import load_bench


@pytest.fixture
def mb():
    return load_bench("matmul_bench")


def test_parse_cfgs(mb):
    from meganeura.kernels.matmul import Cfg

    assert mb.parse_cfgs("heur; 128,256,2,4,32,256 ;;64,64,2,2,16,1") == [
        None, Cfg("sgmat", 128, 256, 2, 4, 32, 256), Cfg("sgmat", 64, 64, 2, 2, 16, 1)]
    with pytest.raises(ValueError):
        mb.parse_cfgs("128,256,x")


def test_interleaved_times_every_spec_against_the_reference(mb, gpu, capsys):
    """Two strict tiles on a small problem: one line per spec, both timed every round, the
    error against float64 that of f32 arithmetic."""
    from dataclasses import replace

    from meganeura import kernels as codegen
    from meganeura.dtypes import f32
    from meganeura.kernels import MatmulKernel, Strided
    from meganeura.kernels.matmul import Cfg

    rng = np.random.default_rng(0)
    B, M, N, K = 1, 64, 48, 40
    a = rng.standard_normal((B, M, K), dtype=np.float32)
    b = rng.standard_normal((B, K, N), dtype=np.float32)
    rows = np.arange(0, M, 5)
    ref = (a[:, rows].astype(np.float64) @ b.astype(np.float64))
    desc = MatmulKernel(B, M, N, K, Strided.contiguous(f32, (B, M, K)),
                        Strided.contiguous(f32, (B, K, N)))
    bufs = [gpu.upload(a), gpu.upload(b), gpu.create_buffer(4 * B * M * N)]
    specs = {(g, ""): codegen.emit(replace(desc, config=g), gpu)
             for g in (Cfg("tiled", 64, 64, 4, 4, 16, 0), Cfg("tiled", 32, 32, 2, 2, 8, 0))}
    timer = mb.Timer(gpu)
    timer.warm = lambda calls, seconds=0.0: None  # lavapipe: no clocks to warm up
    best = mb._interleaved(gpu, timer, "1x64x48x40", specs, bufs, ref, rows, (B, M, N, K), 2)
    assert set(best) == set(specs) and all(t > 0 for t in best.values())
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "TFLOP/s" in ln]
    assert len(lines) == 2
    for ln in lines:
        err = float(ln.rsplit("err ", 1)[1])
        assert err < 1e-5, ln
        assert len(ln.split("rounds ")[1].split(" err")[0].split(",")) == 2  # both rounds


def test_ablations_remove_what_they_say(mb):
    """``_ablated`` on the heuristic tensor-core tile at 4096³ (emitted for a target with f16
    subgroup matrices; no device needed): each variant keeps the products and the results'
    stores and removes its parts of the K loop only."""
    from meganeura import kernels as codegen
    from meganeura.dtypes import f16, f32
    from meganeura.kernels import MatmulKernel, Strided
    from meganeura.kernels.common import BUFFER_VIEW_FEATURE
    from meganeura.kernels.matmul import SG_FEATURE

    t = codegen.make_target({"max_compute_workgroup_storage_size": 49152,
                             "max_compute_invocations_per_workgroup": 1024},
                            frozenset({"shader-f16", SG_FEATURE, BUFFER_VIEW_FEATURE}))
    n = 4096
    spec = codegen.emit(MatmulKernel(1, n, n, n, Strided.contiguous(f16, (1, n, n)),
                                     Strided.contiguous(f16, (1, n, n)), precision="fast",
                                     out_dtype=f32), t)

    def counts(wgsl):
        head, rest = wgsl.split("for (var k0", 1)
        loop, tail = rest.split("subgroupMatrixStore", 1)
        return (loop.count("= b0["), loop.count("Aw["), loop.count("subgroupMatrixLoad"),
                loop.count("workgroupBarrier"), loop.count("MultiplyAccumulate"),
                head.count("subgroupMatrixLoad"), wgsl.count("subgroupMatrixStore"))

    whole = counts(spec.wgsl)
    loads, stores, frags, bars, mma, hoisted, out = whole
    assert min(loads, stores, frags, bars, mma, out) > 0 and hoisted == 0
    assert [counts(mb._ablated(spec, w).wgsl) for w in mb.ABLATIONS] == [
        (0, stores, frags, bars, mma, 0, out), (0, 0, frags, bars, mma, 0, out),
        (0, 0, 0, bars, mma, frags, out), (0, 0, 0, 0, mma, frags, out),
        whole, whole,  # l1hit / l2hit: the same instructions, K wrapped
        (loads, stores, 0, bars, mma, frags, out), (loads, stores, frags, 0, mma, 0, out)]
    for what, wrap in mb.WRAP_K.items():
        loop = mb._ablated(spec, what).wgsl.split("for (var k0", 1)[1]
        assert loop.count(f"(kb % {wrap}u)") == loads + loop.count("= b1[")


def test_b_stored_nk_reads_the_same_product(mb, gpu):
    """``_tc_problem(b_nk=True)`` uploads B as (N, K) and reads it through a transposed view:
    the same product as the (K, N) problem of the same numbers (on this device the strict tile
    runs it; the reference is of f16-rounded operands, so about 1e-3 apart)."""
    from meganeura import kernels as codegen
    from meganeura.dtypes import f32

    timer = mb.Timer(gpu)
    for b_nk in (False, True):
        desc, bufs, ref, rows = mb._tc_problem(gpu, np.random.default_rng(0), 70, 48, 40, 2,
                                               f32, b_nk)
        assert (desc.b.strides[1] == 1) == b_nk
        timer([(codegen.emit(desc, gpu), bufs)])  # runs the kernel
        y = gpu.read_array(bufs[-1], (2, 70, 48), f32)[:, rows].astype(np.float64)
        assert np.abs(y - ref).max() / np.abs(ref).max() < 5e-3, b_nk
