"""K slices inside the workgroup (``Cfg.ks``): several groups of invocations share one tile's K
loop and add their partial sums in slice order.  Against numpy float64 on odd shapes, K tails,
transposes, batch broadcast and epilogues; the exchange buffer's rounds; config errors; and the
strict heuristic (``choose_config``, ``split_k``) at the workload GEMMs of the sweep."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.compile.schedule import split_k
from meganeura.dtypes import f32
from meganeura.kernels import CodegenError, MatmulKernel, Strided
from meganeura.kernels.matmul import (
    FILL_WORKGROUPS,
    SMALL_M_SLICED,
    SMALL_M_SPLIT,
    STRICT_LADDER,
    Cfg,
    choose_config,
    partials_config,
    small_m_sliced,
    small_m_split,
)

from ._util import assert_close
from .test_matmul import BIAS_RELU, _operand

SLICED = [Cfg("tiled", 32, 32, 4, 4, 16, 1, 1, 4), Cfg("tiled", 32, 64, 4, 4, 16, 1, 1, 2),
          Cfg("tiled", 32, 32, 2, 2, 8, 0, 1, 2),  # vec4 reads, and scalar reads
          SMALL_M_SLICED, Cfg("tiled", 16, 32, 4, 4, 4, 1, 1, 16)]  # two and sixteen slices


@pytest.mark.parametrize("g", SLICED, ids=lambda g: f"{g.tm}x{g.tn}_{g.rm}x{g.rn}ks{g.ks}")
@pytest.mark.parametrize("b,m,n,k,ta,tb", [
    (2, 70, 65, 100, False, True),  # edges, K tail inside the staged step
    (1, 33, 47, 5, True, False),  # K shorter than one slice
    (1, 64, 64, 256, True, True),  # whole tiles, many steps
])
def test_k_slices_match_float64(run, rng, g, b, m, n, k, ta, tb):
    am, a, sa = _operand(rng, b, m, k, ta)
    bm, bb, sb = _operand(rng, b, k, n, tb)
    (y,) = run(MatmulKernel(b, m, n, k, sa, sb, config=g), [am, bm], [((b, m, n), f32)])
    assert run.last_spec.meta["workgroup_size"] == g.ks * (g.tm // g.rm) * (g.tn // g.rn)
    assert_close(y, a.astype(np.float64) @ bb.astype(np.float64), 1e-4, 1e-5 * np.sqrt(k),
                 what=str(g))


def test_k_slices_epilogue_broadcast_and_rounds(run, rng):
    """bias + relu over a batch-broadcast transposed weight; a 64x64 tile of 8x4 blocks whose
    partial sums cross in two rounds (the exchange buffer holds half of them)."""
    g = Cfg("tiled", 64, 64, 8, 4, 16, 1, 1, 2)
    B, m, n, k = 3, 70, 72, 88
    am, a, sa = _operand(rng, B, m, k, False)
    wm, w, sw = _operand(rng, B, k, n, True, bcast=True)
    bias = rng.standard_normal(n).astype(np.float32)
    desc = MatmulKernel(B, m, n, k, sa, sw, (Strided(f32, (1, 1, n), (0, 0, 1), 0, n),),
                        BIAS_RELU, config=g)
    (y,) = run(desc, [am, wm, bias], [((B, m, n), f32)])
    assert_close(y, np.maximum(a.astype(np.float64) @ w + bias, 0), 1e-4, 1e-4, what="bias")
    spec = run.last_spec
    assert spec.wgsl.count("if (sl > 0u)") == 2
    assert spec.meta["workgroup_storage"] <= 32 * 1024


def test_k_slice_config_errors():
    s = Strided.contiguous(f32, (1, 64, 64))
    for bad in (Cfg("tiled", 64, 64, 4, 4, 16, 1, 1, 3),  # not a power of two ≤ 16
                Cfg("tiled", 16, 16, 4, 4, 16, 1, 1, 2),  # 16 invocations per slice
                Cfg("sgmat", 64, 64, 2, 2, 32, 0, 1, 2)):
        with pytest.raises(CodegenError, match="K slices"):
            codegen.emit(MatmulKernel(1, 64, 64, 64, s, s, config=bad))


@pytest.mark.parametrize("b,m,n,k,want", [
    (4, 512, 784, 128, 1), (4, 256, 1024, 196, 1), (1, 3072, 576, 128, 1), (1, 1500, 1152, 384, 1),
    (1, 1500, 1536, 384, 1),  # K >= LONG_K: 288 128x64 tiles are too few
    (4, 256, 3136, 64, 0),  # 128x64 fills the GPU
    (1, 1500, 384, 384, 2), (4, 64, 3136, 256, 2), (1, 128, 3072, 576, 2),  # too few 128-wide
])
def test_heuristic_rungs(b, m, n, k, want):
    """The strict ladder at the workload GEMMs of the sweep: 64x64 tiles of 8x4 blocks only
    where they give ``FILL_WORKGROUPS`` workgroups (with fewer, 4x4 blocks on 256 invocations
    keep more warps per SM); the biggest tile wherever it fills the GPU."""
    g = choose_config(b, m, n, k)
    assert g == STRICT_LADDER[want]
    if want < 2:
        assert b * -(-m // g.tm) * -(-n // g.tn) >= FILL_WORKGROUPS


def test_split_k_where_it_was():
    """split_k is unchanged by the new rung: long-K GEMMs of few tiles still split."""
    def sk(m, n, k):
        return split_k(MatmulKernel(1, m, n, k, Strided.contiguous(f32, (1, m, k)),
                                    Strided.contiguous(f32, (1, k, n))))

    assert (sk(1500, 384, 1536), sk(1536, 384, 1500), sk(128, 576, 1536)) == (3, 3, 12)
    assert sk(1500, 1536, 384) == 1 and sk(4, 576, 3000) == 1  # many tiles; gemv
    assert choose_config(1, 4096, 4096, 4096) == STRICT_LADDER[0]


def _sk(m, n, k):
    return split_k(MatmulKernel(1, m, n, k, Strided.contiguous(f32, (1, m, k)),
                                Strided.contiguous(f32, (1, k, n))))


@pytest.mark.parametrize("m,n,k,sliced", [
    (128, 576, 576, True), (128, 960, 576, True), (128, 1536, 576, True),  # measured wins
    (128, 576, 960, False), (128, 576, 1536, False),  # K 960+: split-K stays
    (128, 3072, 576, False),  # 96 64x64 tiles: the unsplit 64x64 tile
    (128, 576, 128, False), (512, 576, 576, False), (4, 576, 576, False),  # K, M, gemv
    (50, 960, 720, False), (16, 320, 320, False),  # SmolVLA's: these lost
])
def test_small_m_sliced_replaces_split_k(m, n, k, sliced):
    """Small-M GEMMs of moderate K run as one dispatch of 16x32 K-sliced tiles and are not
    split; the rest keep the ladder and split-K as before."""
    assert small_m_sliced(1, m, n, k) is sliced
    assert (choose_config(1, m, n, k) == SMALL_M_SLICED) is sliced
    if sliced:
        assert _sk(m, n, k) == 1
        assert not small_m_sliced(2, m, n, k)  # batched GEMMs (and split-K partials) unchanged
    elif (m, n, k) == (128, 576, 960):  # the small-M split rule: chunks of about 192
        assert small_m_split(1, m, n, k) and _sk(m, n, k) == 5
        assert partials_config(5, m, n, k) == SMALL_M_SPLIT
    elif (m, n, k) == (128, 576, 1536):  # past it (lost in the step): split 12 of 64x64
        assert not small_m_split(1, m, n, k) and _sk(m, n, k) == 12
        assert partials_config(12, m, n, k) == choose_config(12, m, n, 128)
