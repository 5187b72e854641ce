"""Tensor-core matmul variants (``precision="fast"``: operands rounded to f16, f32 accumulation
on Dawn's f16 subgroup matrices).  The emitted-code checks run everywhere; the device checks
need an adapter with f16 subgroup matrices (Dawn on NVIDIA: ``bash bench/gpu_check.sh`` runs
them on the H200) and compare with numpy float64 on the f16-rounded operands."""

import re

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import f16, f32
from meganeura.errors import LimitError
from meganeura.kernels import CodegenError, Instr, MatmulKernel, Strided
from meganeura.kernels.matmul import (
    GEMV,
    NAMED,
    SG_FEATURE,
    SGMAT,
    TC_EXTRAS,
    TC_LADDER,
    Cfg,
    choose_config,
    choose_variant,
    config_name,
    with_b_layout,
)

from ._util import assert_close, no_subgroup_matrix_reason, view_of
from .test_matmul import BIAS_RELU, _operand

TC_LIMITS = {"max_compute_workgroup_storage_size": 49152,
             "max_compute_invocations_per_workgroup": 1024,
             "max_storage_buffers_per_shader_stage": 16}
TC_FEATURES = {"shader-f16", SG_FEATURE}


def _desc(b, m, n, k, **kw):
    sa = Strided.contiguous(f32, (b, m, k))
    sb = Strided.contiguous(f32, (b, k, n))
    return MatmulKernel(b, m, n, k, sa, sb, precision="fast", **kw)


def test_fast_picks_tensor_cores_only_where_the_device_has_them():
    spec = codegen.emit(_desc(1, 512, 512, 64), TC_LIMITS, TC_FEATURES)
    assert spec.meta["variant"].startswith("sgmat")
    assert "subgroupMatrixMultiplyAccumulate" in spec.wgsl
    assert spec.wgsl.index("enable chromium_experimental_subgroup_matrix;") < spec.wgsl.index(
        "@group")
    assert spec.meta["workgroup_storage"] <= TC_LIMITS["max_compute_workgroup_storage_size"]
    # no subgroup matrices (wgpu-native, lavapipe): the strict f32 kernel, identical code
    plain = codegen.emit(_desc(1, 256, 256, 64), TC_LIMITS, {"shader-f16"})
    strict = codegen.emit(MatmulKernel(1, 256, 256, 64, Strided.contiguous(f32, (1, 256, 64)),
                                       Strided.contiguous(f32, (1, 64, 256))),
                          TC_LIMITS, {"shader-f16"})
    assert plain.wgsl == strict.wgsl and plain.meta["variant"].startswith("tiled")
    # strict never uses them, even where they exist
    s = codegen.emit(MatmulKernel(1, 512, 512, 64, Strided.contiguous(f32, (1, 512, 64)),
                                  Strided.contiguous(f32, (1, 64, 512))), TC_LIMITS, TC_FEATURES)
    assert s.meta["variant"].startswith("tiled")
    # gemv shapes stay gemv (memory-bound; tensor cores do not help)
    assert codegen.emit(_desc(1, 1, 512, 64), TC_LIMITS, TC_FEATURES).meta["variant"] == "gemv"


def test_short_k_keeps_big_gemms_strict():
    """K of at most TC_SHORT_K on a tensor-core tile bigger than 64x64 takes the strict tiles
    (SmolLM2's LM-head weight gradient); short-K GEMMs on the small tensor-core tiles and
    long-K ones keep tensor cores."""
    from meganeura.kernels.matmul import TC_SHORT_K

    assert choose_config(1, 49152, 576, 128, tensor_cores=True).kind == "tiled"
    assert choose_config(1, 4096, 720, 50, tensor_cores=True).kind == "tiled"
    assert choose_config(1, 720, 2048, 50, tensor_cores=True) == NAMED["sgmat64"]
    assert choose_config(1, 49152, 576, TC_SHORT_K + 1, tensor_cores=True).kind == "sgmat"
    assert choose_config(1, 4096, 4096, 4096, tensor_cores=True).tm == 128
    spec = codegen.emit(_desc(1, 4096, 720, 50), TC_LIMITS, TC_FEATURES)
    assert spec.meta["variant"].startswith("tiled")


def test_variant_choice_and_errors():
    assert choose_variant(1, 4096, 4096, 4096, tensor_cores=True) == "sgmat128x128_2x2k32g"
    assert choose_variant(1, 2048, 2048, 2048, tensor_cores=True) == "sgmat128x128_2x2k32g"
    assert choose_variant(1, 1024, 2048, 2048, tensor_cores=True) == "sgmat128x64_2x2k32"
    assert choose_variant(1, 512, 512, 4096, tensor_cores=True).startswith("sgmat")
    assert choose_variant(1, 3, 512, 64, tensor_cores=True) == "gemv"
    # below TC_MIN_TILES 64×64 output tiles the strict kernels (split-K) are faster
    assert choose_variant(1, 128, 960, 576, tensor_cores=True).startswith("tiled")
    assert choose_variant(1, 448, 512, 64, tensor_cores=True).startswith("tiled")
    assert choose_variant(4, 256, 256, 64, tensor_cores=True).startswith("sgmat")
    with pytest.raises(CodegenError, match="needs f16 subgroup matrices"):
        codegen.emit(_desc(1, 64, 64, 64, variant="sgmat64"), TC_LIMITS, {"shader-f16"})
    with pytest.raises(CodegenError, match="precision must be"):
        codegen.emit(_desc(1, 64, 64, 64).__class__(
            1, 64, 64, 64, Strided.contiguous(f32, (1, 64, 64)),
            Strided.contiguous(f32, (1, 64, 64)), precision="bf16"), TC_LIMITS, TC_FEATURES)


@pytest.mark.parametrize("variant", list(SGMAT))
def test_workgroup_storage_fits_every_variant(variant):
    spec = codegen.emit(_desc(2, 300, 260, 200, variant=variant), TC_LIMITS, TC_FEATURES)
    assert spec.meta["workgroup_storage"] <= 48 * 1024
    assert spec.meta["workgroup_size"] == 32 * SGMAT[variant][2] * SGMAT[variant][3]


# configurations with the option bits (matmul_sgmat: 1 double buffering, 2 rasterization,
# 4 two K steps per iteration)
OPTION_CFGS = [Cfg("sgmat", 128, 128, 2, 4, 32, 1), Cfg("sgmat", 64, 64, 2, 2, 32, 7),
               Cfg("sgmat", 128, 128, 2, 2, 16, 3), Cfg("sgmat", 128, 256, 2, 4, 16, 5),
               Cfg("sgmat", 64, 64, 2, 2, 32, 24), Cfg("sgmat", 128, 256, 2, 4, 48, 8),
               Cfg("sgmat", 64, 64, 2, 2, 32, 32), Cfg("sgmat", 64, 64, 2, 2, 16, 37),
               Cfg("sgmat", 64, 128, 2, 2, 32, 96), Cfg("sgmat", 128, 64, 2, 2, 16, 99),
               Cfg("sgmat", 128, 256, 2, 4, 32, 256), Cfg("sgmat", 64, 64, 2, 2, 16, 257 | 36),
               Cfg("sgmat", 128, 256, 2, 4, 32, 512), Cfg("sgmat", 64, 64, 2, 2, 32, 512 | 258),
               Cfg("sgmat", 128, 256, 2, 4, 32, 1024), Cfg("sgmat", 64, 64, 2, 2, 16, 1024 | 258),
               Cfg("sgmat", 128, 128, 2, 2, 32, 64), Cfg("sgmat", 64, 128, 2, 2, 16, 64 | 7),
               Cfg("sgmat", 128, 128, 2, 2, 32, 2048 | 2), Cfg("sgmat", 64, 64, 2, 2, 16, 6144),
               Cfg("sgmat", 64, 128, 2, 2, 16, 2048 | 64), Cfg("sgmat", 128, 128, 2, 2, 32, 34),
               Cfg("sgmat", 128, 128, 2, 2, 32, 8192 | 2), Cfg("sgmat", 128, 128, 2, 2, 32, 8226),
               Cfg("sgmat", 64, 128, 2, 2, 32, 8192 | 64 | 32)]


def _loop_body(wgsl: str) -> str:
    body = wgsl[wgsl.index("for (var k0"):]
    return body[:body.index("\n    }\n")]


@pytest.mark.parametrize("vr", [0, 1, 2, 3, 5, 7])
def test_option_bits_shape_the_code(vr):
    """Double buffering: one barrier per K step and twice the staging memory (unrolled: two
    steps per iteration, constant buffer offsets); rasterization: grouped tile order only where
    there are more tile rows than one group."""
    g = Cfg("sgmat", 128, 128, 2, 4, 32, vr)
    spec = codegen.emit(_desc(1, 2048, 256, 96, config=g), TC_LIMITS, TC_FEATURES)
    single = 2 * (128 * 40 + 32 * 136)
    body = _loop_body(spec.wgsl)
    assert body.count("workgroupBarrier") == (1 if vr & 5 == 1 else 2)
    assert ("let ca = " in body) == (vr & 5 == 1)  # a computed buffer offset
    if vr & 4:  # 3 steps: the second of each pair is guarded
        assert "k0 = k0 + 64u" in body and "if (k1 < 96u)" in body
    assert spec.meta["workgroup_storage"] == single * (2 if vr & 1 else 1)
    assert ("let gs = min(" in spec.wgsl) == bool(vr & 2)
    suffix = ("d" if vr & 1 else "") + ("u" if vr & 4 else "") + ("g" if vr & 2 else "")
    assert spec.meta["variant"] == config_name(g) == (
        f"sgmat128x128_2x4k32{suffix}" if vr else "sgmat128")
    few_rows = codegen.emit(_desc(1, 1024, 256, 96, config=g), TC_LIMITS, TC_FEATURES)
    assert "let gs = min(" not in few_rows.wgsl  # 8 tile rows: one group, plain order
    for bad in (4, 6, 128):  # unrolling without double buffering; global fragments with
        # BK 32
        with pytest.raises(CodegenError, match="option bits"):
            codegen.emit(_desc(1, 256, 256, 64, config=g._replace(vr=bad)), TC_LIMITS,
                         TC_FEATURES)


@pytest.mark.parametrize("vr", [256, 256 | 3, 256 | 32])
def test_b_fragments_streamed(vr):
    """Option bit 256: per 16-deep slice the A fragments are loaded first, then each B
    fragment right before the products that use it, so only one B fragment is live."""
    g = Cfg("sgmat", 128, 256, 2, 4, 16 if vr & 1 else 32, vr)
    spec = codegen.emit(_desc(1, 2048, 512, 96, config=g), TC_LIMITS, TC_FEATURES)
    body = [ln.strip() for ln in _loop_body(spec.wgsl).splitlines()]
    ops = [("a" if "matrix_left" in ln else "b" if "matrix_right" in ln else "m")
           for ln in body if "subgroupMatrix" in ln]
    slice_ops = "aaaa" + "bmmmm" * 4  # FM = FN = 4
    assert "".join(ops) == slice_ops * (g.bk // 16)
    assert spec.meta["variant"] == config_name(g) and config_name(g).endswith("o")
    with pytest.raises(CodegenError, match="option bits"):  # not with one-at-a-time A
        codegen.emit(_desc(1, 256, 256, 64, config=g._replace(vr=vr | 16)), TC_LIMITS,
                     TC_FEATURES)


@pytest.mark.parametrize("f16_ops", [False, True])
def test_loads_before_the_barrier(f16_ops):
    """Option bit 512: the next step's global loads come between the staging stores and the
    first barrier (without it: after that barrier); not with double buffering."""
    for vr in (0, 512):
        g = Cfg("sgmat", 128, 256, 2, 4, 32, vr)
        d = (_f16_desc(1, 2048, 512, 96, g, False, False) if f16_ops
             else _desc(1, 2048, 512, 96, config=g))
        body = _loop_body(codegen.emit(d, TC_LIMITS, TC_FEATURES).wgsl)
        first_load = re.search(r"\bar0 = b0\[", body).start()
        assert (first_load < body.index("workgroupBarrier")) == bool(vr), vr
    with pytest.raises(CodegenError, match="option bits"):
        codegen.emit(_desc(1, 256, 256, 64, config=Cfg("sgmat", 128, 256, 2, 4, 16, 513)),
                     TC_LIMITS, TC_FEATURES)


@pytest.mark.parametrize("k", [96, 128, 80])
def test_two_register_sets(k):
    """Option bit 1024: registers ``r`` serve even steps and ``q`` odd ones; each step stores
    its set, then (after the barrier) loads step k + 2 into it; an odd step count guards the
    second half of the unrolled pair."""
    g = Cfg("sgmat", 128, 256, 2, 4, 32, 1024)
    wgsl = codegen.emit(_desc(1, 2048, 512, k, config=g), TC_LIMITS, TC_FEATURES).wgsl
    assert "var aq0: vec4<f32>;" in wgsl and "var ar0: vec4<f32>;" in wgsl
    head, body = wgsl.split("for (var k0", 1)
    assert "let kb = 0u;" in head and "let kb = 32u;" in head  # both sets loaded up front
    assert "k0 = k0 + 64u" in body and "let kb = k0 + 64u;" in body
    assert "let kb = k1 + 64u;" in body
    assert ("if (k1 < " in body) == bool(-(-k // 32) % 2)
    first_half, second_half = body.split("let k1 = k0 + 32u;", 1)
    assert "aq0" not in first_half and "ar0" not in second_half.split("\n    }\n")[0]
    for bad in (1025, 1536):
        with pytest.raises(CodegenError, match="option bits"):
            codegen.emit(_desc(1, 256, 256, 64, config=g._replace(vr=bad)), TC_LIMITS,
                         TC_FEATURES)


@pytest.mark.parametrize("k,far", [(128, False), (96, False), (4096, True)])
def test_touch_loads(k, far):
    """Option bit 2048: besides its real loads each step issues one touch per 32-byte sector
    of the tiles ``TOUCH_AHEAD`` (+2 with 4096) steps ahead, clamped to the last whole step,
    into set x (even steps) or y (odd); each set is summed after the other step's products,
    and the sum reaches a workgroup element after the loop.  K < 2 BK: the plain loop."""
    from meganeura.kernels.matmul_sgmat import TOUCH_AHEAD

    g = Cfg("sgmat", 128, 128, 2, 2, 32, 2 | 2048 | (4096 if far else 0))
    sa, sb = Strided.contiguous(f16, (1, 256, k)), Strided.contiguous(f16, (1, k, 256))
    desc = MatmulKernel(1, 256, 256, k, sa, sb, out_dtype=f32, precision="fast", config=g)
    wgsl = codegen.emit(desc, TC_LIMITS, TC_FEATURES).wgsl
    ahead = 32 * (TOUCH_AHEAD + (2 if far else 0))
    body = wgsl.split("for (var k0", 1)[1]
    first, second = body.split("let k1 = k0 + 32u;", 1)
    assert f"let ktx = min(k0 + {ahead}u, {k - 32}u);" in first
    assert f"let kty = min(k1 + {ahead}u, {k - 32}u);" in second
    # A: 128 rows x 64 bytes, B: 32 rows x 256 bytes -> 256 sectors each, 2 per invocation
    for st, part in (("x", first), ("y", second)):
        assert part.count(f"t{st}a") == 2 and part.count(f"t{st}b") == 2  # issued
        other = "y" if st == "x" else "x"
        assert part.count(f"tacc = tacc + f32(t{other}") == 4  # the other set consumed
        assert part.index(f"t{st}a0 = ") < part.index("subgroupMatrixMultiplyAccumulate")
    assert ("if (k1 < " in body) == bool(-(-k // 32) % 2)
    assert "= f16(tacc);" in wgsl.split("for (var k0", 1)[1].rsplit("workgroupBarrier", 1)[1]
    short = MatmulKernel(1, 256, 256, 48, Strided.contiguous(f16, (1, 256, 48)),
                         Strided.contiguous(f16, (1, 48, 256)), out_dtype=f32,
                         precision="fast", config=g)
    assert "tacc" not in codegen.emit(short, TC_LIMITS, TC_FEATURES).wgsl
    with pytest.raises(CodegenError, match="2048"):
        codegen.emit(desc.__class__(1, 256, 256, k, sa, sb, out_dtype=f32, precision="fast",
                                    config=g._replace(vr=2048 | 1)), TC_LIMITS, TC_FEATURES)


def test_results_go_straight_to_c_only_where_they_can():
    """Whole tiles without an epilogue store fragments into C (no scratch); edge tiles and
    epilogues go through the per-subgroup scratch."""
    g = Cfg("sgmat", 64, 64, 2, 2, 32, 1)
    whole = codegen.emit(_desc(2, 128, 192, 64, config=g), TC_LIMITS, TC_FEATURES)
    assert "subgroupMatrixStore(&b2" in whole.wgsl and "Cs" not in whole.wgsl
    edge = codegen.emit(_desc(2, 100, 192, 64, config=g), TC_LIMITS, TC_FEATURES)
    assert "subgroupMatrixStore(&b2" in edge.wgsl and "var<workgroup> Cs" in edge.wgsl
    epi = codegen.emit(_desc(1, 128, 192, 64, config=g, epilogue=BIAS_RELU,
                             extra=(Strided(f32, (1, 1, 192), (0, 0, 1), 0, 192),)),
                       TC_LIMITS, TC_FEATURES)
    assert "subgroupMatrixStore(&b3" not in epi.wgsl and "var<workgroup> Cs" in epi.wgsl
    # rows a matrix store cannot stride over (Dawn: ≥ 64 bytes) or unaligned to 16 bytes
    for n in (10, 49):
        narrow = codegen.emit(_desc(2, 128, n, 64, config=g), TC_LIMITS, TC_FEATURES)
        assert "subgroupMatrixStore(&b2" not in narrow.wgsl, n


@pytest.mark.parametrize("vr", [32, 96, 33, 37, 101, 34 | 8])
def test_constant_fragment_offsets(vr):
    """Option bit 32: every matrix load is a pointer to one fragment block with a constant
    offset and stride (so Dawn's robustness needs no bounds branch), the block index carries
    the subgroup and buffer; 64: B blocks stored transposed, loaded column-major.  The sizes
    are the layouts' (A: 16-row blocks of BK + 8; B: strips of BK rows of 24 + 16, or like A)."""
    g = Cfg("sgmat", 128, 128, 2, 4, 16 if vr & 1 else 32, vr)
    spec = codegen.emit(_desc(1, 512, 256, 96, config=g), TC_LIMITS, TC_FEATURES)
    loads = [ln.strip() for ln in spec.wgsl.splitlines() if "subgroupMatrixLoad" in ln]
    assert loads and all(re.search(r"\(&[AB]s\[[^]]*\], \d+u, (true|false), \d+u\);$", ln)
                         for ln in loads), loads[:2]
    bk, nb = g.bk, 2 if vr & 1 else 1
    b_blk = 16 * (bk + 8) if vr & 64 else bk * 24 + 16
    assert f"var<workgroup> As: array<array<f16, {16 * (bk + 8)}>, {nb * 8}>;" in spec.wgsl
    assert f"var<workgroup> Bs: array<array<f16, {b_blk}>, {nb * 8}>;" in spec.wgsl
    assert spec.meta["workgroup_storage"] == 2 * nb * (8 * 16 * (bk + 8) + 8 * b_blk)
    assert ("true, " in " ".join(loads)) == bool(vr & 64)
    assert ("let ca = " in spec.wgsl) == (vr & 5 == 1)  # runtime buffer: in the block index
    assert config_name(g).endswith({32: "k32c", 96: "k32ct", 33: "k16dc", 37: "k16duc",
                                    101: "k16duct", 42: "k32ghc"}[vr])


@pytest.mark.parametrize("shape", [(1, 4096, 4096, 4096), (2, 300, 260, 200), (1, 70, 65, 33)])
def test_tuner_configs_fit_the_h200(shape):
    """Every tensor-core configuration the tuner may time (ladder and extras) emits at big,
    edge and K-tail shapes within the H200's 48 KiB of workgroup memory, under a distinct
    name that parses back to it (``config_name`` is the tuning cache's key)."""
    cfgs = list(dict.fromkeys(TC_LADDER + TC_EXTRAS))
    names = [config_name(g) for g in cfgs]
    assert len(set(names)) == len(cfgs)
    for g, name in zip(cfgs, names):
        spec = codegen.emit(_desc(*shape, config=g), TC_LIMITS, TC_FEATURES)
        assert spec.meta["variant"] == name and spec.meta["config"] == tuple(g)
        assert spec.meta["workgroup_storage"] <= 48 * 1024, name
    assert Cfg("sgmat", 256, 128, 4, 2, 32, 32) in TC_EXTRAS  # the constant-offset winner
    # double-buffered 128x128 with constant offsets fits whole tiles only (edges add 8 KiB of
    # result scratch): a clear error, which the tuner skips
    g = Cfg("sgmat", 128, 128, 2, 4, 32, 33)
    if shape[1] % 128 or shape[2] % 128:
        with pytest.raises(LimitError, match="workgroup storage"):
            codegen.emit(_desc(*shape, config=g), TC_LIMITS, TC_FEATURES)
        assert g not in {d.config for d in codegen.candidates(
            _desc(*shape), codegen.make_target(TC_LIMITS, TC_FEATURES))}
    else:
        assert codegen.emit(_desc(*shape, config=g), TC_LIMITS, TC_FEATURES).meta[
            "workgroup_storage"] == 45568


def _f16_desc(b, m, n, k, g, ta=False, tb=False):
    """f16 operands, A (and B) stored transposed when ``ta`` (``tb``)."""
    sa = (Strided(f16, (b, m, k), (m * k, 1, m), 0, b * m * k) if ta
          else Strided.contiguous(f16, (b, m, k)))
    sb = (Strided(f16, (b, k, n), (k * n, 1, k), 0, b * k * n) if tb
          else Strided.contiguous(f16, (b, k, n)))
    return MatmulKernel(b, m, n, k, sa, sb, precision="fast", out_dtype=f32, config=g)


def test_global_fragments():
    """Option bit 128: no workgroup memory, every fragment loaded from the operand bindings
    (column-major where the operand is transposed), one slice ahead; only where it applies."""
    g = Cfg("sgmat", 128, 128, 2, 2, 16, 128)
    spec = codegen.emit(_f16_desc(2, 256, 128, 48, g), TC_LIMITS, TC_FEATURES)
    assert spec.meta["workgroup_storage"] == 0 and "var<workgroup>" not in spec.wgsl
    assert "workgroupBarrier" not in spec.wgsl and spec.meta["variant"] == "sgmat128x128_2x2k16x"
    assert "let ya0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&b0, abase + " \
           "(row0 + fr + 0u) * 48u + kn * 1u, false, 48u);" in spec.wgsl
    assert "let kn = min(k0 + 16u, 32u);" in spec.wgsl
    t = codegen.emit(_f16_desc(2, 256, 128, 48, g, True, True), TC_LIMITS, TC_FEATURES).wgsl
    assert "(row0 + fr + 0u) * 1u + kn * 256u, true, 256u)" in t
    assert "(col0 + fc + 16u) * 48u + kn * 1u, true, 48u)" in t
    for bad in (_desc(1, 256, 128, 48, config=g),  # f32 operands
                _f16_desc(1, 200, 128, 48, g),  # an edge tile
                _f16_desc(1, 256, 128, 40, g)):  # K not a multiple of 16
        with pytest.raises(CodegenError, match="fragments from global memory"):
            codegen.emit(bad, TC_LIMITS, TC_FEATURES)
    for vr, bk in ((129, 16), (160, 16), (128, 32)):  # with double buffering / CONST; BK 32
        with pytest.raises(CodegenError, match="option bits"):
            codegen.emit(_f16_desc(1, 256, 128, 48, g._replace(vr=vr, bk=bk)), TC_LIMITS,
                         TC_FEATURES)


@pytest.mark.parametrize("bk, vr", [(32, 0), (32, 8), (16, 3)])
def test_packed_staging_through_buffer_views(bk, vr):
    """Where the device's WGSL has ``buffer_view``, the flat layouts stage every vec4 register
    with one ``vec2<u32>`` store through a packed view (f32 registers: ``pack2x16float``, f16
    registers with option bit 8: a bitcast) and load fragments from the f16 view; without the
    feature, and for constant-offset layouts, the f16 arrays and their element stores stay."""
    from meganeura.kernels.common import BUFFER_VIEW_FEATURE as BV

    g = Cfg("sgmat", 128, 256, 2, 4, bk, vr)
    desc = _desc(1, 1024, 1024, 256, config=g)
    packed = codegen.emit(desc, TC_LIMITS, TC_FEATURES | {BV})
    plain = codegen.emit(desc, TC_LIMITS, TC_FEATURES)
    w = packed.wgsl
    assert w.startswith("requires buffer_view;") and "buffer_view" not in plain.wgsl
    assert "var<workgroup> AsB: buffer<" in w and "= f16(" not in _loop_body(w)
    assert ("bitcast<vec2<u32>>(ar0)" in w) == bool(vr & 8)
    assert ("pack2x16float(ar0.xy)" in w) == (not vr & 8)
    assert "subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(As, " in w
    assert "(&As, " in plain.wgsl and "= f16(" in _loop_body(plain.wgsl)
    assert packed.meta["workgroup_storage"] == plain.meta["workgroup_storage"]
    blocks = codegen.emit(_desc(1, 1024, 1024, 256, config=g._replace(vr=32)), TC_LIMITS,
                          TC_FEATURES | {BV})
    # constant offsets: block views of the same buffers, packed stores too
    bw, astr, bsz = blocks.wgsl, bk + 8, bk * 24 + 16
    assert f"let As = bufferView<array<array<f16, {16 * astr}>, 8>>(&AsB, 0u);" in bw
    assert f"let Bs = bufferView<array<array<f16, {bsz}>, 16>>(&BsB, 0u);" in bw
    assert f"Aw[(((ax0) / 16u) * {16 * astr}u + (ax0) % 16u * {astr}u + ak0) / 4u] = " in bw
    assert f"Bw[(((bx0) / 16u) * {bsz}u + bk0 * 24u + (bx0) % 16u) / 4u] = " in bw
    assert f"(&(*As)[fb + 0u], 0u, false, {astr}u)" in bw and "= f16(" not in _loop_body(bw)
    assert blocks.meta["workgroup_storage"] == codegen.emit(
        _desc(1, 1024, 1024, 256, config=g._replace(vr=32)), TC_LIMITS,
        TC_FEATURES).meta["workgroup_storage"]
    # transposed operands: A's vec4 registers run along M, B's along K, so neither is four
    # adjacent staged elements and both keep their element stores
    rng = np.random.default_rng(0)
    _, _, sa = _operand(rng, 1, 256, 128, True)
    _, _, sb = _operand(rng, 1, 128, 256, True)
    t = codegen.emit(MatmulKernel(1, 256, 256, 128, sa, sb, precision="fast", config=g),
                     TC_LIMITS, TC_FEATURES | {BV}).wgsl
    assert "Aw[" not in t and "Bw[" not in t and "As[" in t and "Bs[" in t



def _wgsl_int(expr: str, lid: int) -> int:
    """Evaluate one of the kernels' integer ``let`` expressions (u32 arithmetic) for ``lid``."""
    py = re.sub(r"(\d+)u\b", r"\1", expr).replace("/", "//").replace("~7", "~7 & 0xffffffff")
    return eval(py, {"lid": lid})  # noqa: S307 - our own generated code, digits and operators


def _store_wavefronts(addrs: list[int], nbytes: int) -> int:
    """Shared-memory wavefronts of one subgroup's stores of ``nbytes`` at ``addrs``: the most
    distinct 4-byte words any of the 32 banks is asked for (the hardware's replay count)."""
    words: dict[int, set] = {}
    for a in addrs:
        for w in range(a // 4, (a + nbytes) // 4):
            words.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in words.values())


@pytest.mark.parametrize("vr", [2, 34])
def test_interleaved_rows_stage_without_bank_conflicts(vr):
    """Option bit 8192: A's staged rows are interleaved within groups of eight, so each
    subgroup's 8-byte stores hit every bank twice (the minimum for 256 bytes) instead of some
    bank three times; every (row, K chunk) of the tile is still staged exactly once."""
    from meganeura.kernels.common import BUFFER_VIEW_FEATURE as BV

    waves = {}
    for ilv in (0, 8192):
        g = Cfg("sgmat", 128, 128, 2, 2, 32, vr | ilv)
        w = codegen.emit(_f16_desc(1, 512, 512, 256, g), TC_LIMITS, TC_FEATURES | {BV}).wgsl
        lets = dict(re.findall(r"let (a[xk]\d+) = (.*);", w))
        cells = [(_wgsl_int(lets[f"ax{l}"], lid), _wgsl_int(lets[f"ak{l}"], lid))
                 for l in range(8) for lid in range(128)]
        assert sorted(cells) == [(r, k) for r in range(128) for k in range(0, 32, 4)]
        assert config_name(g).endswith("i" if ilv else "g" if vr == 2 else "gc")
        # byte address of each subgroup's first store: rows of 40 f16 in both layouts
        waves[ilv] = max(_store_wavefronts([2 * (r * 40 + k) for r, k in
                                            cells[32 * s: 32 * s + 32]], 8) for s in range(32))
    assert waves == {0: 3, 8192: 2}


@pytest.mark.parametrize("packed", [True, False])
def test_flat_transposed_b(packed):
    """Option bit 64 without 32: B staged like A (TN rows of BK + 8, K-contiguous) and loaded
    column-major, so a B stored (N, K) (a Linear weight) is staged with the same packed
    K-contiguous stores as A; a (K, N) B still works (element stores)."""
    from meganeura.kernels.common import BUFFER_VIEW_FEATURE as BV

    g = Cfg("sgmat", 128, 128, 2, 2, 32, 64)
    rng = np.random.default_rng(0)
    _, _, sb = _operand(rng, 1, 256, 512, True)  # (N, K) storage
    feats = TC_FEATURES | ({BV} if packed else set())
    spec = codegen.emit(MatmulKernel(1, 512, 512, 256, Strided.contiguous(f32, (1, 512, 256)),
                                     sb, precision="fast", config=g), TC_LIMITS, feats)
    w = spec.wgsl
    assert spec.meta["workgroup_storage"] == 2 * (128 * 40 + 128 * 40)
    right = [ln for ln in w.splitlines() if "subgroup_matrix_right<f16, 16, 16>>(" in ln]
    assert right and all(ln.rstrip().endswith("true, 40u);") for ln in right), right[:1]
    assert "(fc + 16u) * 40u + 16u" in " ".join(right)  # fragment 1 at depth 16
    assert ("Bw[((bx0) * 40u + bk0) / 4u]" in w) == packed
    assert packed or "Bs[(bx0) * 40u + bk0] = f16(br0.x);" in w
    kn = codegen.emit(_desc(1, 512, 512, 256, config=g), TC_LIMITS, feats).wgsl
    assert "Bw[" not in kn and "* 40u + " in kn
    assert config_name(g).endswith("k32t")


def test_k_contiguous_b_is_staged_transposed_by_default():
    """The heuristic and the tuner's candidates stage a K-contiguous B (stored (N, K))
    transposed (option bit 64) on flat tensor-core tiles; a (K, N) B, explicit configurations
    and the constant-offset / global-fragment tiles keep their layout."""
    rng = np.random.default_rng(0)
    _, _, nk = _operand(rng, 1, 1024, 2048, True)
    a = Strided.contiguous(f32, (1, 2048, 1024))
    desc = MatmulKernel(1, 2048, 2048, 1024, a, nk, precision="fast")
    target = codegen.make_target(TC_LIMITS, TC_FEATURES)
    spec = codegen.emit(desc, TC_LIMITS, TC_FEATURES)
    assert spec.meta["variant"] == "sgmat128x128_2x2k32gt"
    cands = [d.config for d in codegen.candidates(desc, target)]
    assert all(Cfg(*g).vr & 64 for g in cands if g[0] == "sgmat" and not g[6] & 160), cands
    assert Cfg("sgmat", 256, 128, 4, 2, 32, 32) in cands  # constant offsets: unchanged
    kn = codegen.emit(_desc(1, 2048, 2048, 1024), TC_LIMITS, TC_FEATURES)
    assert kn.meta["variant"] == "sgmat128x128_2x2k32g"
    forced = MatmulKernel(1, 2048, 2048, 1024, a, nk, precision="fast",
                          config=Cfg("sgmat", 128, 128, 2, 2, 32, 2))
    assert codegen.emit(forced, TC_LIMITS, TC_FEATURES).meta["variant"] == "sgmat128x128_2x2k32g"
    assert with_b_layout(GEMV, True) == GEMV


def test_f16_operands_load_eight_at_once_with_packed_staging(monkeypatch):
    """``matmul_sgmat.WIDE`` (off by default: slower on the H200) with f16 operands and packed
    staging: eight elements per 16-byte ``vec4<u32>`` load (A along K, B along N), stored as
    they are into the ``vec4<u32>`` view; a transposed operand keeps four per load and element
    stores."""
    from meganeura.kernels import matmul_sgmat
    from meganeura.kernels.common import BUFFER_VIEW_FEATURE as BV

    monkeypatch.setattr(matmul_sgmat, "WIDE", True)

    def emit(ta: bool):
        rng = np.random.default_rng(0)
        _, _, sa = _operand(rng, 1, 512, 256, ta, dtype=np.float16)
        _, _, sb = _operand(rng, 1, 256, 512, False, dtype=np.float16)
        return codegen.emit(MatmulKernel(1, 512, 512, 256, sa, sb, precision="fast",
                                         out_dtype=f32), TC_LIMITS, TC_FEATURES | {BV}).wgsl

    w = emit(False)
    assert w.count("array<vec4<u32>>;") == 2 and "Aq[" in w and "Bq[" in w
    assert re.search(r"ar0 = b0\[\(.*\) / 8u\];", w)
    t = emit(True)
    assert "Aq[" not in t and "Bq[" in t and "var ar0: vec4<f16>;" in t


def test_half_staging_registers():
    """Option bit 8: f32 operands rounded to f16 as they are loaded (registers vec4<f16>, the
    binding still vec4<f32>); scalar loads keep f32 registers."""
    g = Cfg("sgmat", 64, 64, 2, 2, 32, 8)
    wgsl = codegen.emit(_desc(1, 64, 64, 64, config=g), TC_LIMITS, TC_FEATURES).wgsl
    assert wgsl.count("array<vec4<f32>>") == 2 and "var ar0: vec4<f16>;" in wgsl
    assert "ar0 = vec4<f16>(b0[" in wgsl
    odd = codegen.emit(_desc(1, 64, 64, 66, config=g), TC_LIMITS, TC_FEATURES).wgsl
    assert "var ar0: f32;" in odd and "var br0: vec4<f16>;" in odd
    assert config_name(g) == "sgmat64x64_2x2k32h"


def test_lean_fragment_order():
    """Option bit 16: each A fragment loaded right before its row of products."""
    def order(vr):
        g = Cfg("sgmat", 64, 64, 2, 2, 16, vr)
        body = _loop_body(codegen.emit(_desc(1, 64, 64, 64, config=g), TC_LIMITS,
                                       TC_FEATURES).wgsl)
        return [ln.split()[0] if ln.startswith("c") else ln.split()[1][0]
                for ln in (x.strip() for x in body.splitlines())
                if "subgroupMatrix" in ln and "Store" not in ln]
    assert order(0) == ["a", "a", "b", "b"] + ["c0_0", "c0_1", "c1_0", "c1_1"]
    assert order(16) == ["b", "b", "a", "c0_0", "c0_1", "a", "c1_0", "c1_1"]


def test_f16_operands_load_as_vec4_without_conversion():
    """The tensor-core tile reads f16 operands four at a time and keeps them f16 (the strict
    tile converts them to f32 one by one)."""
    desc = MatmulKernel(1, 128, 64, 48, Strided.contiguous(f16, (1, 128, 48)),
                        Strided.contiguous(f16, (1, 48, 64)), out_dtype=f32, precision="fast",
                        variant="sgmat64")
    wgsl = codegen.emit(desc, TC_LIMITS, TC_FEATURES).wgsl
    assert wgsl.count("array<vec4<f16>>") == 2 and "var ar0: vec4<f16>;" in wgsl
    odd = desc.__class__(1, 128, 64, 50, Strided.contiguous(f16, (1, 128, 50)),
                         Strided.contiguous(f16, (1, 50, 64)), out_dtype=f32, precision="fast",
                         variant="sgmat64")
    assert codegen.emit(odd, TC_LIMITS, TC_FEATURES).wgsl.count("array<vec4<f16>>") == 1


# --------------------------------------------------------------------------- on the device


@pytest.fixture
def tc_run(run, dev):
    reason = no_subgroup_matrix_reason(dev)
    if reason:
        pytest.skip(reason)
    return run


def _r16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


TC_CASES = [
    # batch, m, n, k, trans_a, trans_b, variant
    (1, 70, 65, 33, False, False, ""),
    (2, 64, 64, 16, True, False, ""),
    (3, 17, 130, 50, False, True, ""),
    (1, 100, 90, 41, True, True, ""),
    (1, 128, 256, 64, False, False, "sgmat64"),  # whole tiles: no bounds checks
    (1, 256, 384, 96, False, True, "sgmat128"),  # (no longer a default: forced by name)
    (2, 300, 260, 200, True, False, "sgmat128"),  # edges of big tiles, K tail
    (1, 33, 47, 5, False, False, ""),  # K smaller than one fragment
]


@pytest.mark.parametrize("b,m,n,k,ta,tb,variant", TC_CASES)
def test_tensor_core_matmul(tc_run, rng, b, m, n, k, ta, tb, variant):
    am, a, sa = _operand(rng, b, m, k, ta)
    bm, bb, sb = _operand(rng, b, k, n, tb)
    # shapes this small take the strict kernels by default (TC_MIN_TILES): forced here
    desc = MatmulKernel(b, m, n, k, sa, sb, variant=variant or "sgmat64", precision="fast")
    (y,) = tc_run(desc, [am, bm], [((b, m, n), f32)])
    assert tc_run.last_spec.meta["variant"].startswith("sgmat")
    ref = _r16(a) @ _r16(bb)
    assert_close(y, ref, 1e-4, 1e-5 * np.sqrt(k), what=tc_run.last_spec.meta["variant"])
    # and it really rounded: f32 operands give a different product
    exact = a.astype(np.float64) @ bb.astype(np.float64)
    assert np.abs(y - exact).max() > 1e-6 * np.abs(exact).max()


def test_tensor_core_epilogue_broadcast_and_offsets(tc_run, rng):
    B, m, n, k = 3, 50, 70, 24
    am, a, sa = _operand(rng, B, m, k, False)
    wm, w, sw = _operand(rng, B, k, n, True, bcast=True)
    bias = rng.standard_normal(n).astype(np.float32)
    desc = MatmulKernel(B, m, n, k, sa, sw, (Strided(f32, (1, 1, n), (0, 0, 1), 0, n),),
                        BIAS_RELU, precision="fast", variant="sgmat64")
    (y,) = tc_run(desc, [am, wm, bias], [((B, m, n), f32)])
    assert_close(y, np.maximum(_r16(a) @ _r16(w) + bias, 0), 1e-4, 1e-5, what="bias+relu")
    abuf = rng.standard_normal(1500).astype(np.float32)
    a2 = abuf[7: 7 + 2 * 33 * 19].reshape(2, 33, 19)
    bbuf = rng.standard_normal(3000).astype(np.float32)
    b2 = bbuf[100: 100 + 2 * 40 * 19].reshape(2, 40, 19).transpose(0, 2, 1)
    res = rng.standard_normal((2, 33, 40)).astype(np.float32)
    epi = (Instr("({0} * f32(0.5))", (("acc", 0),), f32),
           Instr("({0} + {1})", (("t", 0), ("x", 0)), f32))
    desc = MatmulKernel(2, 33, 40, 19, view_of(abuf, a2), view_of(bbuf, b2),
                        (Strided.contiguous(f32, (2, 33, 40)),), epi, precision="fast",
                        variant="sgmat64")
    (y,) = tc_run(desc, [abuf, bbuf, res], [((2, 33, 40), f32)])
    assert_close(y, 0.5 * (_r16(a2) @ _r16(b2)) + res, 1e-4, 1e-5, what="residual")


def test_tensor_core_f16_operands(tc_run, rng):
    a = rng.standard_normal((1, 80, 48)).astype(np.float16)
    b = rng.standard_normal((1, 48, 72)).astype(np.float16)
    desc = MatmulKernel(1, 80, 72, 48, Strided.contiguous(f16, (1, 80, 48)),
                        Strided.contiguous(f16, (1, 48, 72)), out_dtype=f32, precision="fast",
                        variant="sgmat64")
    (y,) = tc_run(desc, [a, b], [((1, 80, 72), f32)])
    assert tc_run.last_spec.meta["variant"].startswith("sgmat")
    assert "array<vec4<f16>>" in tc_run.last_spec.wgsl
    assert_close(y, a.astype(np.float64) @ b.astype(np.float64), 1e-4, 1e-4, what="f16 in")


@pytest.mark.parametrize("g", list(dict.fromkeys(TC_LADDER + TC_EXTRAS + tuple(OPTION_CFGS))),
                         ids=config_name)
def test_tensor_core_configs(tc_run, rng, g):
    """Every tensor-core configuration on edges, a K tail, transposes and vec4/scalar loads."""
    for b, m, n, k, ta, tb in ((2, 300, 260, 200, True, False), (1, 70, 65, 33, False, True),
                               (1, 96, 136, 48, False, True)):
        am, a, sa = _operand(rng, b, m, k, ta)
        bm, bb, sb = _operand(rng, b, k, n, tb)
        desc = MatmulKernel(b, m, n, k, sa, sb, precision="fast", config=g)
        (y,) = tc_run(desc, [am, bm], [((b, m, n), f32)])
        assert tc_run.last_spec.meta["config"] == tuple(g)
        assert_close(y, _r16(a) @ _r16(bb), 1e-4, 1e-5 * np.sqrt(k), what=str(g))


@pytest.mark.parametrize("ta,tb", [(False, False), (True, True), (False, True)])
def test_tensor_core_global_fragments(tc_run, rng, ta, tb):
    """Fragments straight from global memory (option bit 128), batched, transposed operands,
    grouped rasterization (16 tile rows: two groups)."""
    for g in (Cfg("sgmat", 64, 64, 2, 2, 16, 128), Cfg("sgmat", 64, 128, 1, 2, 16, 130)):
        b, m, n, k = 2, 1024, 256, 48
        a = rng.standard_normal((b, m, k)).astype(np.float16)
        bb = rng.standard_normal((b, k, n)).astype(np.float16)
        am = np.ascontiguousarray(a.transpose(0, 2, 1)) if ta else a
        bm = np.ascontiguousarray(bb.transpose(0, 2, 1)) if tb else bb
        (y,) = tc_run(_f16_desc(b, m, n, k, g, ta, tb), [am, bm], [((b, m, n), f32)])
        assert tc_run.last_spec.meta["workgroup_storage"] == 0
        assert_close(y, a.astype(np.float64) @ bb.astype(np.float64), 1e-4, 1e-4,
                     what=config_name(g))


@pytest.mark.parametrize("b,m,n,k", [(1, 600, 70, 40), (2, 640, 128, 64)])
def test_tensor_core_rasterized_groups(tc_run, rng, b, m, n, k):
    """Grouped rasterization with a partial last group (10 tile rows: 8 + 2), edges, batches;
    the second case has whole tiles only (direct fragment stores)."""
    g = Cfg("sgmat", 64, 64, 2, 2, 32, 3)
    am, a, sa = _operand(rng, b, m, k, False)
    bm, bb, sb = _operand(rng, b, k, n, False)
    (y,) = tc_run(MatmulKernel(b, m, n, k, sa, sb, precision="fast", config=g), [am, bm],
                  [((b, m, n), f32)])
    assert "let gs = min(" in tc_run.last_spec.wgsl
    assert_close(y, _r16(a) @ _r16(bb), 1e-4, 1e-5 * np.sqrt(k), what=config_name(g))
