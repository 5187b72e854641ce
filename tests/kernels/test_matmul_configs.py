"""Every strict matmul configuration (``kernels.matmul.Cfg``: the heuristic ladder and the
tuner's extra candidates) forced on awkward cases against numpy float64: edges and K tails,
vec4 and scalar global loads, transposes, batch broadcast, offsets, epilogues, f16 operands,
wrapped grids; and the ``candidates`` hook."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import f16, f32
from meganeura.kernels import CodegenError, Instr, MatmulKernel, Strided
from meganeura.kernels.matmul import (
    GEMV,
    MAX_CANDIDATES,
    STRICT_EXTRAS,
    STRICT_LADDER,
    TC_EXTRAS,
    TC_LADDER,
    Cfg,
    choose_config,
    config_name,
)

from ._util import assert_close, view_of
from .test_matmul import BIAS_RELU, _operand

CONFIGS = list(dict.fromkeys(STRICT_LADDER + STRICT_EXTRAS))
IDS = [config_name(g) for g in CONFIGS]

SHAPES = [
    # batch, m, n, k, trans_a, trans_b, vec4 loads expected for (a, b)
    (2, 70, 65, 33, False, False, (False, False)),  # K and N not multiples of 4: scalar
    (1, 96, 136, 48, False, True, (True, True)),  # both k-contiguous, edge tiles
    (2, 68, 72, 40, True, False, (True, True)),  # A m-contiguous, B n-contiguous
    (1, 33, 47, 5, True, True, (False, False)),  # K shorter than one step
]


def _check(run, desc, inputs, ref, what, rtol=1e-4):
    (y,) = run(desc, inputs, [(ref.shape, f32)])
    assert_close(y, ref, rtol, 1e-5 * np.sqrt(desc.k), what=what)
    return run.last_spec


@pytest.mark.parametrize("g", CONFIGS, ids=IDS)
@pytest.mark.parametrize("b,m,n,k,ta,tb,vec", SHAPES)
def test_config_shapes(run, rng, g, b, m, n, k, ta, tb, vec):
    am, a, sa = _operand(rng, b, m, k, ta)
    bm, bb, sb = _operand(rng, b, k, n, tb)
    spec = _check(run, MatmulKernel(b, m, n, k, sa, sb, config=g), [am, bm],
                  a.astype(np.float64) @ bb.astype(np.float64), config_name(g))
    assert spec.meta["config"] == tuple(g)
    decl = [ln for ln in spec.wgsl.splitlines() if "@binding" in ln]
    assert ["vec4" in decl[0], "vec4" in decl[1]] == list(vec)


@pytest.mark.parametrize("g", CONFIGS, ids=IDS)
def test_config_epilogue_broadcast_offsets_f16(run, dev, rng, g):
    """bias + relu with a batch-broadcast transposed weight; operands at odd offsets; f16."""
    B, m, n, k = 3, 20, 36, 24
    am, a, sa = _operand(rng, B, m, k, False)
    wm, w, sw = _operand(rng, B, k, n, True, bcast=True)
    bias = rng.standard_normal(n).astype(np.float32)
    desc = MatmulKernel(B, m, n, k, sa, sw, (Strided(f32, (1, 1, n), (0, 0, 1), 0, n),),
                        BIAS_RELU, config=g)
    _check(run, desc, [am, wm, bias], np.maximum(a.astype(np.float64) @ w + bias, 0), "bias")
    abuf = rng.standard_normal(2000).astype(np.float32)
    a2 = abuf[5: 5 + 2 * 36 * 20].reshape(2, 36, 20)  # offset 5: no vec4 loads for A
    bbuf = rng.standard_normal(2000).astype(np.float32)
    b2 = bbuf[8: 8 + 2 * 20 * 44].reshape(2, 20, 44)
    spec = _check(run, MatmulKernel(2, 36, 44, 20, view_of(abuf, a2), view_of(bbuf, b2),
                                    config=g), [abuf, bbuf], a2.astype(np.float64) @ b2, "offs")
    assert "b0: array<f32>" in spec.wgsl
    if dev.has_f16:
        a3 = rng.standard_normal((1, 40, 48)).astype(np.float16)
        b3 = rng.standard_normal((1, 48, 36)).astype(np.float16)
        desc = MatmulKernel(1, 40, 36, 48, Strided.contiguous(f16, a3.shape),
                            Strided.contiguous(f16, b3.shape), out_dtype=f32, config=g)
        _check(run, desc, [a3, b3], a3.astype(np.float64) @ b3.astype(np.float64), "f16")


@pytest.mark.parametrize("g", CONFIGS[::2], ids=IDS[::2])
def test_config_wrapped_grid(run, dev, rng, g):
    B, m, n, k = 7, 40, 36, 8
    am, a, sa = _operand(rng, B, m, k, False)
    bm, bb, sb = _operand(rng, B, k, n, False)
    limits = dict(dev.limits, max_compute_workgroups_per_dimension=5)
    (y,) = run(MatmulKernel(B, m, n, k, sa, sb, config=g), [am, bm], [((B, m, n), f32)],
               limits=limits)
    assert max(run.last_spec.workgroups) <= 5
    assert_close(y, a.astype(np.float64) @ bb.astype(np.float64), 1e-4, 1e-5, what="wrap")


def test_candidates_hook(dev):
    s = Strided.contiguous(f32, (1, 128, 960))
    w = Strided(f32, (1, 960, 576), (0, 1, 960), 0, 576 * 960)
    desc = MatmulKernel(1, 128, 576, 960, s, w)
    found = codegen.candidates(desc, codegen.make_target(dev))
    assert 2 <= len(found) <= MAX_CANDIDATES
    assert found[0].config == choose_config(1, 128, 576, 960)
    assert len({d.config for d in found}) == len(found)
    for d in found:
        assert d.k == 960 and d.variant == "" and codegen.emit(d, dev).meta["variant"]
    gv = MatmulKernel(1, 1, 576, 960, Strided.contiguous(f32, (1, 1, 960)), w)
    assert [d.config for d in codegen.candidates(gv, codegen.make_target(dev))] == [GEMV]


def test_config_errors_and_tensor_core_configs_fit():
    s = Strided.contiguous(f32, (1, 64, 64))
    for bad in (Cfg("tiled", 64, 64, 3, 4, 16), Cfg("tiled", 64, 64, 2, 2, 16, 1),
                Cfg("sgmat", 64, 48, 2, 2, 32), Cfg("wide")):
        with pytest.raises(CodegenError, match="matmul config"):
            codegen.emit(MatmulKernel(1, 64, 64, 64, s, s, config=bad))
    feats = {"shader-f16", "meganeura-subgroup-matrix-f16-16x16x16-sg32"}
    lim = {"max_compute_workgroup_storage_size": 49152,
           "max_compute_invocations_per_workgroup": 1024}
    for g in TC_LADDER + TC_EXTRAS:
        spec = codegen.emit(MatmulKernel(2, 300, 260, 200, Strided.contiguous(f32, (2, 300, 200)),
                                         Strided.contiguous(f32, (2, 200, 260)),
                                         precision="fast", config=g), lim, feats)
        assert spec.meta["workgroup_storage"] <= 48 * 1024
        assert spec.meta["workgroup_size"] == 32 * g.rm * g.rn


@pytest.mark.parametrize("b,m,n,k,want", [
    (1, 1500, 1536, 384, 1),  # Whisper fc1: 288 128x64 workgroups < 396 at K >= LONG_K
    (1, 1500, 1536, 383, 0),  # shorter K: 288 fill the GPU
    (3, 1500, 384, 512, 1),  # Whisper fc2 split 3 (216 128x64 workgroups)
    (1, 1500, 1152, 384, 1), (1, 1500, 384, 384, 2),  # qkv, out projection: unchanged
    (4, 1024, 196, 512, 1),  # 64x64 tiles keep FILL_WORKGROUPS (exactly 256 here)
    (4, 256, 3136, 64, 0), (1, 4096, 4096, 4096, 0),
])
def test_choose_config_long_k_fill(b, m, n, k, want):
    """Strict tiles over 64x64 need FILL_WORKGROUPS_LONG_K workgroups once K >= LONG_K (the
    tail wave of long-running big tiles idles the GPU); smaller tiles and tensor cores keep
    FILL_WORKGROUPS."""
    from meganeura.kernels.matmul import FILL_WORKGROUPS_LONG_K, LONG_K

    g = choose_config(b, m, n, k)
    assert g == STRICT_LADDER[want]
    big = STRICT_LADDER[0]
    wg_big = b * -(-m // big.tm) * -(-n // big.tn)
    assert (want == 0) == (wg_big >= (FILL_WORKGROUPS_LONG_K if k >= LONG_K else 256))
    assert choose_config(1, 1500, 1536, 384, tensor_cores=True) == TC_LADDER[1]  # 288 of 128x64


BIAS_GELU = (
    Instr("({0} + {1})", (("acc", 0), ("x", 0)), f32),
    Instr("mn_gelu_erf({0})", (("t", 0),), f32, ("mn_gelu_erf",)),
)


@pytest.mark.parametrize("g,B,m,n,k,wrap", [
    (STRICT_LADDER[1], 1, 70, 68, 40, False),  # 8x4 vec4 reads, edge tiles
    (STRICT_LADDER[0], 2, 128, 64, 24, False),  # whole tiles: no edge path at all
    (Cfg("tiled", 64, 32, 4, 2, 16, 0), 3, 64, 40, 17, True),  # scalar reads, wrapped grid
])
def test_helper_epilogue_one_store_path(run, dev, rng, monkeypatch, g, B, m, n, k, wrap):
    """An epilogue calling a helper (bias + erf gelu) is emitted once per result, bounds
    checked, also for interior tiles; results equal numpy's at edges and on a wrapped grid
    (``live``); with the rule off, edge tiles get the second (unchecked interior) copy."""
    from scipy import special

    from meganeura.kernels import matmul

    am, a, sa = _operand(rng, B, m, k, False)
    wm, w, sw = _operand(rng, B, k, n, True, bcast=True)
    bias = rng.standard_normal(n).astype(np.float32)
    desc = MatmulKernel(B, m, n, k, sa, sw, (Strided(f32, (1, 1, n), (0, 0, 1), 0, n),),
                        BIAS_GELU, config=g)
    limits = dict(dev.limits, max_compute_workgroups_per_dimension=2) if wrap else None
    (y,) = run(desc, [am, wm, bias], [((B, m, n), f32)], limits=limits)
    h = a.astype(np.float64) @ w + bias
    assert_close(y, 0.5 * h * special.erfc(-h / np.sqrt(2)), 1e-4, 1e-5 * np.sqrt(k), what="ep")
    edges = bool(m % g.tm or n % g.tn or wrap)
    assert run.last_spec.wgsl.count("mn_gelu_erf(q") == g.rm * g.rn
    monkeypatch.setattr(matmul, "ONE_STORE_PATH_FOR_HELPERS", False)
    two = codegen.emit(desc, limits or dev.limits, dev.features).wgsl
    assert two.count("mn_gelu_erf(q") == (1 + edges) * g.rm * g.rn
    plain = MatmulKernel(B, m, n, k, sa, sw, (Strided(f32, (1, 1, n), (0, 0, 1), 0, n),),
                         BIAS_RELU, config=g)
    monkeypatch.setattr(matmul, "ONE_STORE_PATH_FOR_HELPERS", True)
    relu = codegen.emit(plain, limits or dev.limits, dev.features).wgsl
    assert relu.count("max(q0, 0.0)") == (1 + edges) * g.rm * g.rn  # no helper: both copies


def test_split_partials_default_and_first_candidate_know_their_gemm(dev):
    """Split-K partials carry the whole GEMM's K (``split_of``): the default tile and the
    tuner's first candidate are the small-M split tile for SmolLM2's 1x128x576x960 split 5,
    while the same batch of partials without ``split_of`` gets the ladder's tile."""
    from dataclasses import replace

    from meganeura.kernels.matmul import SMALL_M_SPLIT, config_name

    a = Strided(f32, (5, 128, 192), (192, 960, 1), 0, 128 * 960)
    b = Strided(f32, (5, 192, 576), (192 * 576, 576, 1), 0, 960 * 576)
    part = MatmulKernel(5, 128, 576, 192, a, b, name="matmul_splitk", split_of=960)
    assert codegen.emit(part, dev).meta["variant"] == config_name(SMALL_M_SPLIT)
    assert codegen.candidates(part, codegen.make_target(dev))[0].config == SMALL_M_SPLIT
    plain = replace(part, split_of=0)
    assert codegen.candidates(plain, codegen.make_target(dev))[0].config == \
        choose_config(5, 128, 576, 192) != SMALL_M_SPLIT
