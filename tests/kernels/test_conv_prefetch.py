"""Register prefetch in the conv implicit-GEMM template (``TileCfg.PF``): the next K step's
loads issued before the current step's FMAs must not change any result — all three kernels on
the awkward shapes of ``test_conv`` (K tails, partial staging rounds, runtime K ranges of split
chunks and stride phases), with in-workgroup split-K and the global split-K, against float64."""

import numpy as np
import pytest

from meganeura.dtypes import f32
from meganeura.kernels import CodegenError, Strided
from meganeura.kernels.conv import Conv2dKernel, TileCfg, tile_cfg
from meganeura.ops.conv import _conv2d_ref
from tests.kernels.test_conv import SHAPES, _check_all, _geom

from ._util import assert_close

PF_CONFIGS = [TileCfg(64, 64, 4, 4, 1, 16, 1), TileCfg(32, 32, 4, 4, 4, 8, 1),
              TileCfg(8, 64, 2, 4, 4, 8, 1)]


@pytest.mark.parametrize("cfg", PF_CONFIGS, ids=lambda c: "x".join(map(str, c.tuple())))
def test_prefetch_all_three_kernels(run, cfg):
    rng = np.random.default_rng(sum(cfg.tuple()))
    for shape in SHAPES:
        _check_all(run, _geom(*shape), cfg, rng)


def test_prefetch_with_global_split_k(run, rng):
    G = _geom((2, 33, 5, 5), (40, 33, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    xs, ws, ys = (2, 33, 5, 5), (40, 33, 3, 3), (2, 40, 5, 5)
    x, w = (rng.normal(size=s).astype(np.float32) for s in (xs, ws))
    a = {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": 1}
    C = Strided.contiguous
    for S in (2, 5):  # chunks of 160 and 64 of K = 297: whole steps, a tail, an empty-ish end
        k = Conv2dKernel(G, C(f32, xs), C(f32, ws), tile=(64, 64, 4, 4, 1, 16, 1), split_k=S)
        (parts,) = run(k, [x, w], [((S,) + ys, f32)])
        want = _conv2d_ref([x.astype(np.float64), w], a)[0]
        assert_close(parts.sum(0), want, 1e-4, 1e-4, f"split {S}")


def test_prefetch_flag_is_checked():
    assert tile_cfg((64, 64, 4, 4, 1, 16, 1)).PF == 1
    assert tile_cfg((64, 64, 4, 4, 1, 16)).tuple() == (64, 64, 4, 4, 1, 16)
    with pytest.raises(CodegenError):
        tile_cfg((64, 64, 4, 4, 1, 16, 3))
