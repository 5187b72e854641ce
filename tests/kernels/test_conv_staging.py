"""Staging modes of the conv implicit-GEMM template (``TileCfg.ST``): branch-free staging
with all reads of a step before its stores (ST = 1), the forward's im2col offset table
(ST = 2) and vec4 loads (ST = 3) must not change any result — all three kernels on the awkward
shapes of ``test_conv`` (K tails, partial staging rounds, groups, strides, dilation,
asymmetric padding), with and without register prefetch, the global split-K (the table covers
each chunk's K range), and the shapes where the table or vec4 loads do not apply (1×1, more
than 32 taps, K or H·W not a multiple of 4), against float64."""

import dataclasses

import numpy as np
import pytest

from meganeura.dtypes import f32
from meganeura.kernels import CodegenError, Strided, emit
from meganeura.kernels.conv import Conv2dKernel, TileCfg, tile_cfg
from meganeura.ops.conv import _conv2d_ref
from tests.kernels.test_conv import SHAPES, _check_all, _geom

from ._util import assert_close

C = Strided.contiguous
# the plan's tile with prefetch and the table (the gradients stage as ST = 1); a legacy 8×64
# tile whose A operand fills only half a staging round (the partial-round condition); vec4
# and gathered quads with an in-workgroup split; double-buffered staging (PF = 2), also
# before an in-workgroup split's reduction in workgroup memory
ST_CONFIGS = [(TileCfg(64, 64, 4, 4, 1, 16, 1, 2), SHAPES),
              (TileCfg(8, 64, 1, 2, 1, 16, 0, 1), SHAPES[:1]),
              (TileCfg(32, 32, 4, 4, 4, 8, 0, 4), SHAPES),
              (TileCfg(64, 64, 4, 4, 1, 16, 2, 4), SHAPES),
              (TileCfg(32, 32, 4, 4, 4, 8, 2, 1), SHAPES[1:2])]


@pytest.mark.parametrize("cfg,shapes", ST_CONFIGS,
                         ids=["plan-tile-pf-table", "8x64-partial", "ks4-quads",
                              "double-buffer-quads", "double-buffer-ks4"])
def test_staging_modes_all_three_kernels(run, cfg, shapes):
    rng = np.random.default_rng(sum(cfg.tuple()))
    for shape in shapes:
        _check_all(run, _geom(*shape), cfg, rng)


# (x shape, w shape, stride, padding, split_k, ST, vec4 bindings): the table per chunk with a
# K tail (297 = 5·64 − 23), a 1×1 stride-2 conv (no table) and a 7×7 stem-like kernel (49
# taps: no table); ST 3: vec4 weights (K = 288, 1×1 K = 24 split in chunks of 16) and vec4
# input columns (1×1 stride 1, 16 positions per image), none where K or H·W is not a multiple
# of 4; ST 4: gathered column quads (crossing rows and images, stride 2, partial last tile;
# without a table: 1×1 stride 2, 49 taps)
SPLIT_CASES = [
    ((2, 33, 5, 5), (40, 33, 3, 3), 1, 1, 2, 2, 0),
    ((2, 33, 5, 5), (40, 33, 3, 3), 1, 1, 5, 2, 0),
    ((1, 12, 7, 6), (20, 12, 1, 1), 2, 0, 1, 2, 0),
    ((1, 3, 11, 11), (8, 3, 7, 7), 2, 3, 1, 2, 0),
    ((2, 32, 5, 5), (40, 32, 3, 3), 1, 1, 3, 3, 1),
    ((2, 24, 4, 4), (36, 24, 1, 1), 1, 0, 2, 3, 2),
    ((2, 24, 3, 5), (36, 24, 1, 1), 1, 0, 1, 3, 1),
    ((1, 3, 11, 11), (8, 3, 7, 7), 2, 3, 1, 3, 0),
    ((2, 32, 5, 5), (40, 32, 3, 3), 1, 1, 3, 4, 1),
    ((1, 20, 6, 7), (12, 20, 3, 3), 2, 1, 2, 4, 1),
    ((1, 12, 7, 6), (20, 12, 1, 1), 2, 0, 1, 4, 1),
    ((1, 3, 11, 11), (8, 3, 7, 7), 2, 3, 1, 4, 0),
]


@pytest.mark.parametrize("case", SPLIT_CASES,
                         ids=lambda c: f"k{c[1][2]}-s{c[2]}-split{c[4]}-st{c[5]}")
def test_table_with_split_chunks_and_fallbacks(run, rng, case):
    xs, ws, st, p, S, mode, n_vec4 = case
    pf = (S % 2) * (1 + mode % 2)  # without prefetch, with it, and double-buffered
    G = _geom(xs, ws, (st, st), ((p, p), (p, p)), (1, 1), 1)
    ys = (G.n, G.o, G.oh, G.ow)
    x, w = (rng.normal(size=s).astype(np.float32) for s in (xs, ws))
    b = rng.normal(size=(G.o,)).astype(np.float32)
    a = {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": 1}
    k = Conv2dKernel(G, C(f32, xs), C(f32, ws), C(f32, (G.o,)),
                     tile=(64, 64, 4, 4, 1, 16, pf, mode), split_k=S)
    wgsl = emit(k, run.dev).wgsl
    text = wgsl if isinstance(wgsl, str) else "\n".join(wgsl)
    assert ("Kt[" in text) == (G.kh == 3), "the table is used exactly where 1 < taps <= 32"
    assert text.count("array<vec4<f32>>;") == n_vec4
    (parts,) = run(k, [x, w, b], [(((S,) if S > 1 else ()) + ys, f32)])
    got = parts.sum(0) if S > 1 else parts
    want = _conv2d_ref([x.astype(np.float64), w, b], a)[0]
    assert_close(got, want, 1e-4, 1e-4, f"split {S} pf {pf}")


def test_staging_flag_round_trips_and_is_checked():
    c = tile_cfg((64, 64, 4, 4, 1, 16, 0, 2))
    assert (c.PF, c.ST) == (0, 2) and tile_cfg(c.tuple()) == c
    d = tile_cfg((64, 64, 4, 4, 1, 16, 2))
    assert d.PF == 2 and d.storage() == 2 * c.storage()
    assert tile_cfg((64, 64, 4, 4, 1, 16, 1)).ST == 0
    assert dataclasses.replace(c, ST=0).tuple() == (64, 64, 4, 4, 1, 16)
    for bad in [(64, 64, 4, 4, 1, 16, 0, 5), (64, 64, 4, 4, 1, 16, 3, 1)]:
        with pytest.raises(CodegenError):
            tile_cfg(bad)


def test_double_buffered_default_falls_back_where_it_does_not_fit(monkeypatch):
    """A (ST, PF = 2) default keeps two staging buffers only where the device has the room:
    WebGPU's guaranteed 16 KiB does not hold two 64×64 buffers, 48 KiB does."""
    from meganeura.kernels import conv as K

    monkeypatch.setitem(K.STAGING, "conv2d", (4, 2))
    G = _geom((2, 16, 40, 40), (128, 16, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    k = Conv2dKernel(G, C(f32, (2, 16, 40, 40)), C(f32, (128, 16, 3, 3)))  # 100 tiles
    small = emit(k, None).meta["tile"]
    big = emit(k, {"max_compute_workgroup_storage_size": 49152}).meta["tile"]
    assert small[:6] == big[:6] == (64, 64, 4, 4, 1, 16)
    assert (small[6:], big[6:]) == ((1, 4), (2, 4))


def test_pointwise_forward_defaults():
    """1×1 forwards: K chunks of 512 (K = 512 stays whole where a 3×3 GEMM of that K would be
    split in two) and K step 32 where the device has the room; the gradients stage
    branch-free (ST 4 / 1), every forward with ST 4."""
    from meganeura.kernels.conv import (
        Conv2dInputGradKernel,
        Conv2dWeightGradKernel,
        staging,
        with_split_k,
    )

    def fwd(xs, ws, p):
        G = _geom(xs, ws, (1, 1), ((p, p), (p, p)), (1, 1), 1)
        return Conv2dKernel(G, C(f32, xs), C(f32, ws))

    pw = fwd((4, 512, 7, 7), (2048, 512, 1, 1), 0)
    assert with_split_k(pw).split_k == 1
    assert with_split_k(fwd((4, 1024, 14, 14), (256, 1024, 1, 1), 0)).split_k == 2
    assert with_split_k(fwd((4, 57, 7, 7), (2048, 57, 3, 3), 1)).split_k == 2  # K = 513
    big = emit(pw, {"max_compute_workgroup_storage_size": 49152}).meta["tile"]
    assert big == (64, 64, 4, 4, 1, 32, 0, 4)
    assert emit(pw, None).meta["tile"] == (64, 64, 4, 4, 1, 16, 0, 4)  # 16 KiB: base K step
    G = pw.geom
    ys = (G.n, G.o, G.oh, G.ow)
    assert staging(Conv2dInputGradKernel(G, C(f32, ys), pw.w))[:2] == (4, 0)
    assert staging(Conv2dWeightGradKernel(G, pw.x, C(f32, ys)))[:2] == (1, 0)
