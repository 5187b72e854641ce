"""Conv implicit-GEMM template: every tile configuration the tuner may pick (register blocks,
in-workgroup split-K), all three kernels, on awkward shapes (groups, stride, asymmetric
padding, dilation, K tails, partial tiles, fused bias + epilogue) against float64 numpy; and
the heuristic/candidates hook staying inside the target's limits."""

import dataclasses

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import f32
from meganeura.kernels import CodegenError, Instr, Strided, make_target
from meganeura.kernels.conv import (
    CONFIGS,
    Conv2dInputGradKernel,
    Conv2dKernel,
    Conv2dWeightGradKernel,
    ConvGeom,
    choose_cfg,
    conv2d_with_epilogue,
    gemm_shape,
    staging,
    tile_cfg,
)
from meganeura.ops.conv import _conv2d_ref, _input_grad_ref, _weight_grad_ref

from ._util import assert_close

RELU = (Instr("max({0}, 0.0)", (("acc", 0),), f32),)
C = Strided.contiguous


def _geom(xs, ws, st, pad, dil, g):
    n, c, h, w = xs
    o, _, kh, kw = ws
    oh = (h + sum(pad[0]) - dil[0] * (kh - 1) - 1) // st[0] + 1
    ow = (w + sum(pad[1]) - dil[1] * (kw - 1) - 1) // st[1] + 1
    return ConvGeom(n, c, h, w, o, kh, kw, oh, ow, st, pad, dil, g)


# (x shape, w shape, stride, padding, dilation, groups): K = 72 (several 64-deep steps + tail
# for KS·BK = 64), M and N not multiples of the tiles
SHAPES = [
    ((2, 24, 9, 7), (36, 12, 3, 2), (1, 1), ((1, 2), (0, 1)), (1, 2), 2),
    ((1, 10, 11, 9), (70, 10, 3, 3), (2, 2), ((1, 1), (1, 0)), (1, 1), 1),
    # channels a multiple of every staged step: K ordered (tap, channel), taps uniform per step
    ((1, 64, 6, 5), (64, 64, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 2), 1),
]


def _check_all(run, G, cfg, rng):
    xs, ws = (G.n, G.c, G.h, G.w), (G.o, G.cg, G.kh, G.kw)
    ys = (G.n, G.o, G.oh, G.ow)
    x = rng.normal(size=xs).astype(np.float32)
    w = rng.normal(size=ws).astype(np.float32)
    b = rng.normal(size=(G.o,)).astype(np.float32)
    dy = rng.normal(size=ys).astype(np.float32)
    a = {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": G.groups}
    t = cfg.tuple()
    fwd = conv2d_with_epilogue(Conv2dKernel(G, C(f32, xs), C(f32, ws), C(f32, (G.o,)), tile=t),
                               (), RELU, f32)
    (y,) = run(fwd, [x, w, b], [(ys, f32)])
    want = np.maximum(_conv2d_ref([x.astype(np.float64), w, b], a)[0], 0)
    assert_close(y, want, 1e-4, 1e-4, f"forward {t}")
    for naive in (False, True):
        (dx,) = run(Conv2dInputGradKernel(G, C(f32, ys), C(f32, ws), tile=t, naive=naive),
                    [dy, w], [(xs, f32)])
        want = _input_grad_ref([dy.astype(np.float64), w], dict(a, input_size=xs[2:]))[0]
        assert_close(dx, want, 1e-4, 1e-4, f"input grad {t} naive={naive}")
    for split in (1, 3):
        shape = ((split,) if split > 1 else ()) + ws
        (dw,) = run(Conv2dWeightGradKernel(G, C(f32, xs), C(f32, ys), split, tile=t),
                    [x, dy], [(shape, f32)])
        want = _weight_grad_ref([x.astype(np.float64), dy],
                                dict(a, kernel_size=ws[2:], split=split))[0]
        assert_close(dw, want, 1e-4, 1e-4, f"weight grad {t} split {split}")


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c.tuple())))
def test_every_config_all_three_kernels(run, cfg):
    rng = np.random.default_rng(sum(cfg.tuple()))
    lim = run.dev.limits
    if cfg.storage() > lim.get("max_compute_workgroup_storage_size", 16384):
        pytest.skip("more workgroup memory than this device has")
    for shape in SHAPES:
        _check_all(run, _geom(*shape), cfg, rng)


def test_heuristic_fits_default_limits_and_candidates_are_valid():
    """The default configuration fits WebGPU's guaranteed limits for every shape, candidates
    start with it, stay within the target's limits and keep the computation."""
    t = make_target(None, None)
    for M, N, K, GB in [(4, 2048, 36, 1), (128, 128, 1152, 1), (256, 784, 2304, 1),
                        (64, 12544, 576, 1), (512, 4608, 196, 1), (2048, 196, 512, 1),
                        (1, 1, 1, 1), (300, 7, 5000, 3)]:
        c = choose_cfg(M, N, K, GB)
        assert c.storage() <= 16384 and c.threads <= 256, (M, N, K, c)
    G = _geom((4, 256, 14, 14), (256, 256, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    k = Conv2dKernel(G, C(f32, (4, 256, 14, 14)), C(f32, (256, 256, 3, 3)))
    cands = codegen.candidates(k, t)
    M, N, K, GB = gemm_shape(k)
    assert cands[0].tile == choose_cfg(M, N, K, GB, (), *staging(k)).tuple()
    assert {tile_cfg(d.tile).ST for d in cands} == {0, 1, 2, 3, 4}  # every staging mode is tried
    assert 2 <= len(cands) <= 8
    for d in cands:
        assert dataclasses.replace(d, tile=()) == k
        assert tile_cfg(d.tile).storage() <= 16384
        codegen.emit(d, None, None)


def test_bad_tiles_are_refused():
    for bad in [(24, 24), (64, 64, 5, 4, 1, 16), (64, 64, 4, 4, 1, 6), (64, 64, 1, 1, 1, 16)]:
        with pytest.raises(CodegenError):
            tile_cfg(bad)
