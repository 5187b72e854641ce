"""Matmul emitter on the device vs numpy (float64): tiled and gemv variants, odd and tiny sizes,
transposed operands read in place, batch broadcast, offsets, epilogues with extra inputs,
wrapped grids, f16 operands, limits."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import f16, f32, i32
from meganeura.errors import LimitError
from meganeura.kernels import CodegenError, Instr, MatmulKernel, Strided

from ._util import assert_close, view_of

BIAS_RELU = (
    Instr("({0} + {1})", (("acc", 0), ("x", 0)), f32),
    Instr("max({0}, 0.0)", (("t", 0),), f32),
)


def _operand(rng, batch, rows, cols, transposed, bcast=False, dtype=np.float32):
    """Logical (batch, rows, cols) operand, stored transposed if asked, batch broadcast if
    asked (one stored matrix read with batch stride 0).  Returns (buffer, logical, Strided)."""
    nb = 1 if bcast else batch
    logical = rng.standard_normal((nb, rows, cols)).astype(dtype)
    mem = np.ascontiguousarray(logical.transpose(0, 2, 1)) if transposed else logical
    v = mem.transpose(0, 2, 1) if transposed else mem
    s = view_of(mem, v)
    if bcast:
        s = Strided(s.dtype, (batch, rows, cols), (0,) + s.strides[1:], s.offset, s.extent)
    return mem, np.broadcast_to(logical, (batch, rows, cols)), s


CASES = [
    # batch, m, n, k, trans_a, trans_b
    (1, 70, 65, 33, False, False),
    (2, 64, 64, 16, True, False),
    (3, 17, 130, 50, False, True),
    (1, 100, 90, 41, True, True),
    (1, 5, 5, 1, False, False),  # K = 1
    (1, 1, 100, 37, False, False),  # M = 1: gemv
    (2, 3, 257, 64, False, True),  # M = 3, B k-major: gemv, k-fast lanes
    (1, 4, 70, 300, True, False),  # M = 4, long K
    (1, 300, 2, 45, False, False),  # N = 2: gemv over rows
    (2, 129, 1, 45, True, True),  # N = 1
    (1, 1, 1, 1, False, False),
    (1, 1, 1, 1000, False, False),  # a dot product
    (1, 2, 50, 1000, False, True),  # gemv, k-contiguous matrix, unrolled K loop
]


@pytest.mark.parametrize("b,m,n,k,ta,tb", CASES)
def test_matmul(run, rng, b, m, n, k, ta, tb):
    am, a, sa = _operand(rng, b, m, k, ta)
    bm, bb, sb = _operand(rng, b, k, n, tb)
    desc = MatmulKernel(b, m, n, k, sa, sb)
    (y,) = run(desc, [am, bm], [((b, m, n), f32)])
    ref = a.astype(np.float64) @ bb.astype(np.float64)
    assert_close(y, ref, 1e-4, 1e-5 * np.sqrt(k), what=f"{run.last_spec.meta['variant']}")
    assert run.last_spec.meta["variant"].startswith("gemv" if min(m, n) <= 4 else "tiled")


@pytest.mark.parametrize("variant", ["tiled128", "tiled64", "tiled128v", "tiled64v", "gemv"])
def test_forced_variants(run, rng, variant):
    b, m, n, k = 2, 133 if variant != "gemv" else 7, 140, 37
    am, a, sa = _operand(rng, b, m, k, True)
    bm, bb, sb = _operand(rng, b, k, n, False)
    (y,) = run(MatmulKernel(b, m, n, k, sa, sb, variant=variant), [am, bm], [((b, m, n), f32)])
    assert run.last_spec.meta["variant"].startswith(variant)
    assert_close(y, a.astype(np.float64) @ bb.astype(np.float64), 1e-4, 1e-4, what=variant)


@pytest.mark.parametrize("variant", ["tiled128", "tiled64", "tiled128v"])
def test_full_tiles_no_bounds_checks(run, rng, variant):
    b, m, n, k = 2, 128, 256, 32
    am, a, sa = _operand(rng, b, m, k, False)
    bm, bb, sb = _operand(rng, b, k, n, True)
    (y,) = run(MatmulKernel(b, m, n, k, sa, sb, variant=variant), [am, bm], [((b, m, n), f32)])
    assert " < 128u" not in run.last_spec.wgsl and " < 256u" not in run.last_spec.wgsl
    assert_close(y, a.astype(np.float64) @ bb.astype(np.float64), 1e-4, 1e-4, what=variant)


def test_variant_choice():
    assert codegen.matmul.choose_variant(1, 4, 4096, 4096) == "gemv"
    assert codegen.matmul.choose_variant(1, 4096, 4096, 4096) == "tiled128x64_8x4k16v"
    # few output tiles: a smaller tile, so the workgroups still fill a big GPU
    small = codegen.matmul.choose_config(1, 128, 576, 960)
    assert small.kind == "tiled" and small.tm * small.tn <= 64 * 64
    with pytest.raises(CodegenError, match="unknown matmul variant"):
        codegen.matmul.choose_variant(1, 8, 8, 8, "tiled32")
    with pytest.raises(CodegenError, match="needs M or N"):
        codegen.matmul.choose_variant(1, 100, 100, 8, "gemv")


@pytest.mark.parametrize("m", [1, 50])
def test_epilogue_bias_relu_batch_broadcast(run, rng, m):
    """x @ W + bias then relu; W shared by all batches (stride 0), W read transposed."""
    B, n, k = 3, 70, 24
    am, a, sa = _operand(rng, B, m, k, False)
    wm, w, sw = _operand(rng, B, k, n, True, bcast=True)
    bias = rng.standard_normal(n).astype(np.float32)
    desc = MatmulKernel(B, m, n, k, sa, sw, (Strided(f32, (1, 1, n), (0, 0, 1), 0, n),),
                        BIAS_RELU)
    (y,) = run(desc, [am, wm, bias], [((B, m, n), f32)])
    ref = np.maximum(a.astype(np.float64) @ w.astype(np.float64) + bias, 0)
    assert_close(y, ref, 1e-4, 1e-5, what="bias+relu")


def test_epilogue_residual_and_offsets(run, rng):
    """Operands at offsets inside bigger buffers; a residual (B, M, N) extra and a scale."""
    B, m, n, k = 2, 33, 40, 19
    abuf = rng.standard_normal(1500).astype(np.float32)
    a = abuf[7 : 7 + B * m * k].reshape(B, m, k)
    bbuf = rng.standard_normal(3000).astype(np.float32)
    bview = bbuf[100 : 100 + B * n * k].reshape(B, n, k).transpose(0, 2, 1)
    res = rng.standard_normal((B, m, n)).astype(np.float32)
    epi = (Instr("({0} * f32(0.5))", (("acc", 0),), f32),
           Instr("({0} + {1})", (("t", 0), ("x", 0)), f32))
    desc = MatmulKernel(B, m, n, k, view_of(abuf, a), view_of(bbuf, bview),
                        (Strided.contiguous(f32, (B, m, n)),), epi)
    (y,) = run(desc, [abuf, bbuf, res], [((B, m, n), f32)])
    ref = 0.5 * (a.astype(np.float64) @ bview.astype(np.float64)) + res
    assert_close(y, ref, 1e-4, 1e-5, what="residual")


def test_gemv_epilogue_and_rank2_views(run, rng):
    k, n = 50, 33
    x = rng.standard_normal((1, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)  # Linear weight layout: x @ w.T
    bias = rng.standard_normal(n).astype(np.float32)
    desc = MatmulKernel(1, 1, n, k, Strided.contiguous(f32, (1, k)),
                        Strided(f32, (k, n), (1, k), 0, n * k),
                        (Strided(f32, (n,), (1,), 0, n),), BIAS_RELU)
    (y,) = run(desc, [x, w, bias], [((1, 1, n), f32)])
    ref = np.maximum(x.astype(np.float64) @ w.T.astype(np.float64) + bias, 0)
    assert_close(y[0], ref, 1e-4, 1e-5, what="gemv x @ W.T + b")


def test_batch_grid_wrap(run, dev, rng):
    B, m, n, k = 7, 9, 10, 5
    am, a, sa = _operand(rng, B, m, k, False)
    bm, bb, sb = _operand(rng, B, k, n, False)
    limits = dict(dev.limits, max_compute_workgroups_per_dimension=3)
    for mm in (m, 1):
        desc = MatmulKernel(B, mm, n, k, sa if mm == m else Strided(f32, (B, 1, k), sa.strides,
                                                                    0, sa.extent), sb)
        (y,) = run(desc, [am, bm], [((B, mm, n), f32)], limits=limits)
        assert max(run.last_spec.workgroups) <= 3
        ref = a[:, :mm].astype(np.float64) @ bb.astype(np.float64)
        assert_close(y, ref, 1e-4, 1e-5, what="wrapped batch")


def test_int_matmul(run, rng):
    a = rng.integers(-5, 5, (1, 6, 7)).astype(np.int32)
    b = rng.integers(-5, 5, (1, 7, 9)).astype(np.int32)
    desc = MatmulKernel(1, 6, 9, 7, Strided.contiguous(i32, a.shape),
                        Strided.contiguous(i32, b.shape))
    (y,) = run(desc, [a, b], [((1, 6, 9), i32)])
    np.testing.assert_array_equal(y, a @ b)


def test_f16_operands(run, dev, rng):
    if not dev.has_f16:
        pytest.skip("device has no shader-f16")
    for m in (20, 1):
        a = rng.standard_normal((1, m, 40)).astype(np.float16)
        b = rng.standard_normal((1, 40, 30)).astype(np.float16)
        desc = MatmulKernel(1, m, 30, 40, Strided.contiguous(f16, a.shape),
                            Strided.contiguous(f16, b.shape), out_dtype=f32)
        (y,) = run(desc, [a, b], [((1, m, 30), f32)])
        assert_close(y, a.astype(np.float64) @ b.astype(np.float64), 1e-4, 1e-4, what="f16 in")


def test_limits_and_errors(dev):
    s = Strided.contiguous(f32, (1, 100, 100))
    desc = MatmulKernel(1, 100, 100, 100, s, s, variant="tiled64v")
    spec = codegen.emit(desc, dev)
    # 16 x 64 f32 tiles of A (rows padded by 4: its staging walks K) and B
    assert spec.meta["workgroup_storage"] == 4 * 16 * (68 + 64) and spec.workgroups == (4, 1, 1)
    with pytest.raises(LimitError, match="workgroup storage"):
        codegen.emit(desc, {"max_compute_workgroup_storage_size": 4096})
    with pytest.raises(LimitError, match="storage buffers"):
        codegen.emit(MatmulKernel(1, 100, 100, 100, s, s, (s, s), ()),
                     {"max_storage_buffers_per_shader_stage": 4})
    with pytest.raises(CodegenError, match="binding holds"):
        codegen.emit(MatmulKernel(1, 100, 100, 100, Strided(f32, (1, 100, 100), (0, 101, 1), 0,
                                                            100 * 100), s))
    with pytest.raises(CodegenError, match="does not broadcast"):
        codegen.emit(MatmulKernel(1, 100, 100, 101, s, s))
    with pytest.raises(CodegenError, match="dtypes differ"):
        codegen.emit(MatmulKernel(1, 2, 2, 2, Strided.contiguous(i32, (1, 2, 2)),
                                  Strided.contiguous(f32, (1, 2, 2))))
