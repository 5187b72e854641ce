"""Global split-K of the conv forward and input-gradient kernels: the partial sums (one slice
per K chunk) add up to the float64 reference on awkward shapes (groups, strides with the phase
decomposition, dilation, asymmetric padding, K not a multiple of the chunk, more chunks than
non-empty K ranges), the bias lands in chunk 0 only, and the heuristic stays within bounds."""

import dataclasses

import numpy as np
import pytest

from meganeura.dtypes import f32
from meganeura.kernels import CodegenError, Instr, Strided, emit
from meganeura.kernels.conv import (
    SPLIT_K_MAX,
    Conv2dInputGradKernel,
    Conv2dKernel,
    choose_split_k,
    conv2d_with_epilogue,
    gemm_shape,
    split_chunk,
    with_split_k,
)
from meganeura.ops.conv import _conv2d_ref, _input_grad_ref
from tests.kernels.test_conv import _geom

from ._util import assert_close, compiled_matches_float64

C = Strided.contiguous

# (x shape, w shape, stride, padding, dilation, groups, split_k, tile)
CASES = [
    ((2, 24, 9, 7), (36, 12, 3, 2), (1, 1), ((1, 2), (0, 1)), (1, 2), 2, 3, (32, 32, 4, 4, 4, 8)),
    ((1, 10, 11, 9), (70, 10, 3, 3), (2, 2), ((1, 1), (1, 0)), (1, 1), 1, 4, (64, 64, 4, 4, 1, 16)),
    ((1, 64, 6, 5), (64, 64, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 2), 1, 5, (16, 32, 4, 4, 8, 8)),
    ((2, 33, 5, 5), (40, 33, 1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1, 2, (64, 64, 4, 4, 1, 16)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c[6]}-st{c[2][0]}-g{c[5]}")
def test_split_partials_sum_to_reference(run, case, rng):
    *shape, S, tile = case
    G = _geom(*shape)
    xs, ws, ys = (G.n, G.c, G.h, G.w), (G.o, G.cg, G.kh, G.kw), (G.n, G.o, G.oh, G.ow)
    x, w, dy = (rng.normal(size=s).astype(np.float32) for s in (xs, ws, ys))
    b = rng.normal(size=(G.o,)).astype(np.float32)
    a = {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": G.groups}
    fwd = Conv2dKernel(G, C(f32, xs), C(f32, ws), C(f32, (G.o,)), tile=tile, split_k=S)
    (parts,) = run(fwd, [x, w, b], [((S,) + ys, f32)])
    want = _conv2d_ref([x.astype(np.float64), w, b], a)[0]
    assert_close(parts.sum(0), want, 1e-4, 1e-4, f"forward split {S}")
    # the bias is added once (chunk 0): the other chunks are bias-free convolutions
    nob = _conv2d_ref([x.astype(np.float64), w], a)[0]
    assert_close(parts[1:].sum(0) + parts[0] - b.reshape(1, -1, 1, 1), nob, 1e-4, 1e-4, "bias")
    for naive in (False, True):
        d = Conv2dInputGradKernel(G, C(f32, ys), C(f32, ws), tile=tile, naive=naive, split_k=S)
        (dparts,) = run(d, [dy, w], [((S,) + xs, f32)])
        want = _input_grad_ref([dy.astype(np.float64), w], dict(a, input_size=xs[2:]))[0]
        assert_close(dparts.sum(0), want, 1e-4, 1e-4, f"input grad split {S} naive={naive}")


def test_split_k_heuristic_and_refusals():
    """Small grids with a long K are split into non-empty chunks of bounded count; big grids
    and short K are not; a split partial refuses an epilogue and a bad split_k."""
    assert choose_split_k(512, 196, 4608, 1) > 1  # (4,512,7,7) 3x3: 32 tiles
    assert choose_split_k(1024, 784, 256, 1) == 1  # enough tiles
    assert choose_split_k(256, 196, 128, 1) == 1  # K too short
    for M, N, K in [(512, 196, 4608), (256, 784, 2304), (64, 3136, 576), (2048, 49, 512)]:
        S = choose_split_k(M, N, K, 1)
        assert 1 <= S <= SPLIT_K_MAX
        assert (S - 1) * split_chunk(K, S) < K  # the last chunk is not empty
    G = _geom((4, 512, 7, 7), (512, 512, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    k = with_split_k(Conv2dKernel(G, C(f32, (4, 512, 7, 7)), C(f32, (512, 512, 3, 3))))
    assert k.split_k > 1 and gemm_shape(k)[3] == k.split_k
    spec = emit(k, None, None)
    assert spec.meta["split_k"] == k.split_k
    relu = (Instr("max({0}, 0.0)", (("acc", 0),), f32),)
    with pytest.raises(CodegenError, match="epilogue"):
        emit(conv2d_with_epilogue(k, (), relu, f32), None, None)
    with pytest.raises(CodegenError, match="split_k"):
        emit(dataclasses.replace(k, split_k=0), None, None)
    # strided input gradient: whole output-channel chunks
    G2 = _geom((4, 256, 28, 28), (512, 256, 1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1), 1)
    d = with_split_k(Conv2dInputGradKernel(G2, C(f32, (4, 512, 14, 14)), C(f32, (512, 256, 1, 1))))
    S = d.split_k
    assert S == 1 or (S - 1) * -(-512 // S) < 512


def test_split_convolutions_through_compile(gpu):
    """A graph whose convolutions are split (forward with bias and a fused ReLU + residual
    epilogue, input gradients plain and strided): its outputs and gradients match the
    float64 reference, and the plan really holds split-K partial and sum kernels."""
    import meganeura as mn
    from meganeura import ops

    rng = np.random.default_rng(5)
    g = mn.Graph("split")
    x = g.param("x", (2, 64, 4, 4))
    w1, b1 = g.param("w1", (64, 64, 3, 3)), g.param("b1", (64,))
    w2 = g.param("w2", (64, 64, 3, 3))
    h = (ops.conv2d(x, w1, b1, padding=1) + x).relu()
    y = ops.conv2d(h, w2, stride=2, padding=1)
    ct = g.input("ct", y.shape)
    g2, grads = mn.grad(g, (y * ct).sum())
    outs = {"y": g2[y], **{f"d{k}": v for k, v in grads.items()}}
    env = {k: (rng.normal(size=v.shape) * 0.2).astype(np.float32)
           for k, v in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2), ("ct", ct))}
    sess = compiled_matches_float64(gpu, g2, outs, env, "ct")
    labels = [c.label for c in sess.executable.infer.ops if hasattr(c, "label")]
    assert any("conv2d (2, 64, 4, 4) [split-K sum] +" in s for s in labels), labels
    assert any(s.startswith("conv2d_input_grad") and "[split-K" in s for s in labels), labels


def test_strided_1x1_input_grad_splits_by_its_one_live_phase(run, rng):
    """A 1×1 stride-2 input gradient has taps in one phase of four: split-K and tiles are sized
    by that phase alone (the other three only store zeros), the result stays exact, and the
    flops counted are the taps that land (not four phases' worth)."""
    G = _geom((2, 40, 9, 8), (136, 40, 1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1), 1)
    xs, ws, ys = (2, 40, 9, 8), (136, 40, 1, 1), (2, 136, 5, 4)
    big = _geom((4, 1024, 14, 14), (2048, 1024, 1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1), 1)
    k = with_split_k(Conv2dInputGradKernel(big, C(f32, (4, 2048, 7, 7)),
                                           C(f32, (2048, 1024, 1, 1))))
    assert k.split_k == 8 and gemm_shape(k)[3] == 8  # 64 live tiles, K = 2048 in chunks of 256
    dy, w = rng.normal(size=ys).astype(np.float32), rng.normal(size=ws).astype(np.float32)
    a = {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": 1}
    want = _input_grad_ref([dy.astype(np.float64), w], dict(a, input_size=xs[2:]))[0]
    for S in (1, 3):
        d = Conv2dInputGradKernel(G, C(f32, ys), C(f32, ws), split_k=S)
        (parts,) = run(d, [dy, w], [(((S,) if S > 1 else ()) + xs, f32)])
        got = parts.sum(0) if S > 1 else parts
        assert_close(got, want, 1e-4, 1e-4, f"1x1 stride 2, split {S}")
    assert run.last_spec.meta["flops"] == 2 * 40 * 136 * 2 * 5 * 4
