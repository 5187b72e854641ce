"""Convolution and pooling kernels on the GPU (lavapipe in CI) against the numpy reference:
forward values and every gradient through the whole pipeline (passes → plan → codegen →
runtime), the split weight gradient, strided input views, and the kernel template directly
(forced tile shapes, fused bias + epilogue with a residual input, f16 operands).

Tolerance: max |got − want| / max |want| ≤ 1e-4 (convolutions and pooling gradients are
reductions), ≤ 1e-5 for max pooling's forward (a pure selection)."""

import zlib

import numpy as np
import pytest

import meganeura as mn
from meganeura import ops, reference
from meganeura.kernels.conv import (
    Conv2dInputGradKernel,
    Conv2dKernel,
    Conv2dWeightGradKernel,
    ConvGeom,
    conv2d_with_epilogue,
    emit_forward,
    emit_input_grad,
    emit_weight_grad,
)
from meganeura.kernels.ir import Instr, Strided
from meganeura.ops.conv import _conv2d_ref, _input_grad_ref, _weight_grad_ref

RED, EW = 1e-4, 1e-5


def _conv(st=1, pad=0, dil=1, g=1):
    def f(x, w, b=None):
        return ops.conv2d(x, w, b, stride=st, padding=pad, dilation=dil, groups=g)

    return f


# name -> (operand shapes, builder, tolerance)
CASES = {
    "conv3x3": ([(2, 3, 6, 5), (4, 3, 3, 3), (4,)], _conv(1, 1), RED),
    "conv_stride_asym_dil_groups": ([(2, 4, 7, 6), (6, 2, 3, 3), (6,)],
                                    _conv((2, 1), ((1, 0), (2, 1)), (1, 2), 2), RED),
    "depthwise": ([(2, 4, 6, 5), (8, 1, 3, 3), (8,)], _conv(1, 1, 1, 4), RED),
    "conv1x1_s2": ([(2, 5, 5, 4), (3, 5, 1, 1)], _conv(2), RED),
    "conv7x7_s2_p3": ([(1, 3, 10, 9), (4, 3, 7, 7)], _conv(2, 3), RED),
    "conv_dil2_s2": ([(1, 2, 9, 8), (3, 2, 3, 2), (3,)], _conv((2, 3), ((2, 1), (0, 2)), 2), RED),
    # several tiles along M and N, K not a multiple of 16 (tail step)
    "conv_multitile": ([(2, 9, 10, 10), (80, 9, 3, 3), (80,)], _conv(1, 1), RED),
    "conv_relu": ([(2, 3, 6, 6), (5, 3, 3, 3), (5,)], lambda x, w, b: _conv(1, 1)(x, w, b).relu(),
                  RED),
    "conv_permuted_input": ([(2, 6, 5, 3), (4, 3, 3, 3)],
                            lambda x, w: _conv(1, 1)(x.permute(0, 3, 1, 2), w), RED),
    "conv1d": ([(2, 4, 11), (6, 2, 3), (6,)],
               lambda x, w, b: ops.conv1d(x, w, b, stride=2, padding=1, dilation=2, groups=2),
               RED),
    "max_pool_3x3_s2_p1": ([(2, 3, 7, 6)], lambda x: ops.max_pool2d(x, 3, 2, 1), EW),
    "max_pool_2x2": ([(1, 2, 6, 8)], lambda x: ops.max_pool2d(x, 2), EW),
    "max_pool_dilated": ([(1, 2, 9, 8)], lambda x: ops.max_pool2d(x, 3, 2, 1, (2, 1)), EW),
    "avg_pool_cip": ([(2, 3, 7, 6)], lambda x: ops.avg_pool2d(x, 3, 2, 1), RED),
    "avg_pool_nocip": ([(2, 3, 7, 6)],
                       lambda x: ops.avg_pool2d(x, 3, 2, 1, count_include_pad=False), RED),
    "avg_pool_2x2": ([(1, 2, 6, 8)], lambda x: ops.avg_pool2d(x, 2), RED),
    "global_avg": ([(2, 3, 4, 5)], lambda x: ops.mean(x, (2, 3)), RED),
}


def _compare(got, want, tol, what):
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _session_check(gpu, g2, outs, env, tol, name, unfused=False):
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    params = {k: v for k, v in env.items() if k in g2.params}
    feeds = {k: v for k, v in env.items() if k not in g2.params}
    sess = mn.compile(g2, outputs=outs, device=gpu)
    sess.set_params(params)
    got = sess.run(**feeds)
    for k in outs:
        _compare(got[k], want[k], tol, f"{name}/{k}")
    if unfused:
        plain = mn.compile(g2, outputs=outs, device=gpu, fuse=False, plan_memory=False)
        plain.set_params(params)
        got2 = plain.run(**feeds)
        for k in outs:
            np.testing.assert_allclose(got2[k], got[k], rtol=1e-6, atol=1e-6 * max(
                1.0, float(np.abs(got[k]).max())), err_msg=f"{name}/{k} fused vs unfused")
    return sess


@pytest.mark.parametrize("case", sorted(CASES))
def test_conv_and_pool_forward_and_gradients_on_gpu(gpu, case):
    shapes, fn, tol = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    g = mn.Graph(case)
    ps = [g.param(f"p{i}", s) for i, s in enumerate(shapes)]
    y = fn(*ps)
    ct = g.input("ct", y.shape)
    g2, grads = mn.grad(g, (y * ct).sum())
    outs = {"y": g2[y], **{f"d{n}": v for n, v in grads.items()}}
    env = {f"p{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)}
    env["ct"] = rng.normal(size=y.shape).astype(np.float32)
    _session_check(gpu, g2, outs, env, tol, case, unfused=case in ("conv3x3", "max_pool_2x2"))


def test_max_pool_ties_on_gpu(gpu):
    """Integer-valued input (many ties): GPU gradient equals the reference exactly (both give
    the whole gradient to the first maximum of each window)."""
    rng = np.random.default_rng(5)
    g = mn.Graph()
    x = g.param("x", (2, 3, 7, 6))
    y, idx = ops.max_pool2d_with_indices(x, 3, 2, 1)
    ct = g.input("ct", y.shape)
    g2, grads = mn.grad(g, (y * ct).sum())
    outs = {"y": g2[y], "idx": g2[idx], "dx": grads["x"]}
    env = {"x": rng.integers(0, 3, (2, 3, 7, 6)).astype(np.float32),
           "ct": rng.normal(size=y.shape).astype(np.float32)}
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float32)))
    sess = mn.compile(g2, outputs=outs, device=gpu)
    sess.set_params({"x": env["x"]})
    got = sess.run(ct=env["ct"])
    np.testing.assert_array_equal(got["idx"], want["idx"])
    np.testing.assert_array_equal(got["y"], want["y"])
    np.testing.assert_allclose(got["dx"], want["dx"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [3, 5])
def test_split_weight_grad_on_gpu(gpu, split):
    rng = np.random.default_rng(split)
    kw = dict(stride=(2, 1), padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2)
    g = mn.Graph()
    x = g.input("x", (2, 4, 7, 6))
    dy = g.input("dy", (2, 6, 3, 5))
    dw = ops.conv2d_weight_grad(x, dy, (3, 3), split=split, **kw)
    part = dw.node.inputs[0]
    env = {"x": rng.normal(size=(2, 4, 7, 6)).astype(np.float32),
           "dy": rng.normal(size=(2, 6, 3, 5)).astype(np.float32)}
    _session_check(gpu, g, {"dw": dw, "partials": part}, env, RED, f"split{split}")


# ------------------------------------------------------------------ the kernel template


def _dispatch(dev, spec, inputs, out_shape, out_dtype=np.float32, n_out=1):
    bufs = [dev.upload(a) for a in inputs]
    n = int(np.prod(out_shape))
    for _ in range(n_out):  # further outputs of the same size (max_pool2d's indices)
        bufs.append(dev.create_buffer(n * 4))
    dev.dispatch(spec, bufs)
    bufs = bufs[: len(inputs) + 1]
    return dev.read_array(bufs[-1], out_shape, out_dtype)


def _geom(xs, ws, st=(1, 1), pad=((1, 1), (1, 1)), dil=(1, 1), g=1):
    n, c, h, w = xs
    o, _, kh, kw = ws
    oh = (h + sum(pad[0]) - dil[0] * (kh - 1) - 1) // st[0] + 1
    ow = (w + sum(pad[1]) - dil[1] * (kw - 1) - 1) // st[1] + 1
    return ConvGeom(n, c, h, w, o, kh, kw, oh, ow, st, pad, dil, g)


def _attrs(G):
    return {"stride": G.stride, "padding": G.pad, "dilation": G.dilation, "groups": G.groups}


@pytest.mark.parametrize("tile", [(8, 32), (8, 128), (16, 16), (32, 64), (64, 32), (64, 64)])
def test_forced_tiles_all_three_kernels(dev, tile):
    rng = np.random.default_rng(sum(tile))
    xs, ws = (2, 6, 9, 7), (40, 3, 3, 2)
    G = _geom(xs, ws, (2, 1), ((1, 2), (0, 1)), (1, 2), 2)
    x = rng.normal(size=xs).astype(np.float32)
    w = rng.normal(size=ws).astype(np.float32)
    b = rng.normal(size=(ws[0],)).astype(np.float32)
    dy = rng.normal(size=(G.n, G.o, G.oh, G.ow)).astype(np.float32)
    C = Strided.contiguous
    f32 = mn.f32
    lim, feats = dev.limits, dev.features
    a = _attrs(G)
    y = _dispatch(dev, emit_forward(Conv2dKernel(G, C(f32, xs), C(f32, ws), C(f32, (ws[0],)),
                                                 tile=tile), lim, feats),
                  [x, w, b], dy.shape)
    _compare(y, _conv2d_ref([x.astype(np.float64), w, b], a)[0], RED, "forward")
    dx = _dispatch(dev, emit_input_grad(Conv2dInputGradKernel(G, C(f32, dy.shape), C(f32, ws),
                                                              tile=tile), lim, feats),
                   [dy, w], xs)
    _compare(dx, _input_grad_ref([dy.astype(np.float64), w], dict(a, input_size=xs[2:]))[0],
             RED, "input grad")
    for split in (1, 4):
        wk = Conv2dWeightGradKernel(G, C(f32, xs), C(f32, dy.shape), split, tile=tile)
        shape = ((split,) if split > 1 else ()) + ws
        dw = _dispatch(dev, emit_weight_grad(wk, lim, feats), [x, dy], shape)
        want = _weight_grad_ref([x.astype(np.float64), dy],
                                dict(a, kernel_size=ws[2:], split=split))[0]
        _compare(dw, want, RED, f"weight grad split {split}")


def test_fused_epilogue_with_residual(dev):
    """Bias + relu(acc + residual) and silu(acc) computed inside the conv kernel (the planner
    hook ``conv2d_with_epilogue``), residual read through broadcast strides."""
    rng = np.random.default_rng(3)
    xs, ws = (2, 5, 6, 6), (7, 5, 3, 3)
    G = _geom(xs, ws)
    x = rng.normal(size=xs).astype(np.float32)
    w = rng.normal(size=ws).astype(np.float32)
    b = rng.normal(size=(7,)).astype(np.float32)
    res = rng.normal(size=(1, 7, 6, 6)).astype(np.float32)  # broadcast over the batch
    C = Strided.contiguous
    f32 = mn.f32
    base = Conv2dKernel(G, C(f32, xs), C(f32, ws), C(f32, (7,)))
    ref = _conv2d_ref([x.astype(np.float64), w, b], _attrs(G))[0]
    desc = conv2d_with_epilogue(base, (C(f32, (1, 7, 6, 6)),), (
        Instr("({0} + {1})", (("acc", 0), ("x", 0)), f32),
        Instr("max({0}, 0.0)", (("t", 0),), f32)), f32)
    got = _dispatch(dev, emit_forward(desc, dev.limits, dev.features), [x, w, b, res], ref.shape)
    _compare(got, np.maximum(ref + res, 0), EW * 10, "relu(conv + residual)")
    desc = conv2d_with_epilogue(base, (), (
        Instr("({0} * mn_sigmoid({0}))", (("acc", 0),), f32, ("mn_sigmoid",)),), f32)
    got = _dispatch(dev, emit_forward(desc, dev.limits, dev.features), [x, w, b], ref.shape)
    _compare(got, ref / (1 + np.exp(-ref)), EW * 10, "silu(conv)")


def test_f16_operands_accumulate_in_f32(dev):
    if not dev.has_f16:
        pytest.skip("no shader-f16")
    rng = np.random.default_rng(4)
    xs, ws = (1, 8, 6, 6), (8, 8, 3, 3)
    G = _geom(xs, ws)
    x = rng.normal(size=xs).astype(np.float16)
    w = rng.normal(size=ws).astype(np.float16)
    C = Strided.contiguous
    desc = Conv2dKernel(G, C(mn.f16, xs), C(mn.f16, ws), out_dtype=mn.f32)
    got = _dispatch(dev, emit_forward(desc, dev.limits, dev.features), [x, w],
                    (1, 8, 6, 6))
    want = _conv2d_ref([x.astype(np.float64), w.astype(np.float64)], _attrs(G))[0]
    _compare(got, want, RED, "f16 conv")


def test_conv_epilogue_fusion_through_the_planner(gpu):
    """With the planner's archetype-epilogue hook, a ReLU and a residual add + SiLU after a
    convolution run inside the conv kernel (inference graphs); results unchanged."""

    rng = np.random.default_rng(0)
    g = mn.Graph()
    x = g.input("x", (2, 3, 6, 6))
    w = g.param("w", (3, 3, 3, 3))
    b = g.param("b", (3,))
    w2 = g.param("w2", (4, 3, 3, 3))
    h = ops.conv2d(x, w, b, padding=1).relu()
    y = (ops.conv2d(h, w, b, padding=1) + h).silu()
    z = ops.conv2d(y, w2, padding=1)
    sess = mn.compile(g, outputs={"z": z}, device=gpu)
    labels = sess.kernel_labels(inference=True)
    assert sum("conv2d" in lab and "+" in lab for lab in labels) == 2, labels
    env = {"x": rng.normal(size=(2, 3, 6, 6)).astype(np.float32),
           "w": rng.normal(size=(3, 3, 3, 3)).astype(np.float32),
           "b": rng.normal(size=(3,)).astype(np.float32),
           "w2": rng.normal(size=(4, 3, 3, 3)).astype(np.float32)}
    sess.set_params({k: env[k] for k in ("w", "b", "w2")})
    got = sess.run(x=env["x"])["z"]
    (want,) = reference.evaluate(g, [z], env, np.float64)
    _compare(got, want, RED, "fused conv epilogues")


def test_wrapped_grids_and_dead_workgroups(dev):
    """A tiny per-dimension workgroup limit forces 2-D grids with more workgroups than tiles
    (their ``live`` flag is off): results unchanged, pooling included."""
    from meganeura.kernels.pool import MaxPoolKernel, PoolGeom, emit_max_pool

    rng = np.random.default_rng(9)
    lim = dict(dev.limits, max_compute_workgroups_per_dimension=3)
    xs, ws = (2, 4, 9, 7), (12, 2, 3, 3)
    G = _geom(xs, ws, g=2)
    x = rng.normal(size=xs).astype(np.float32)
    w = rng.normal(size=ws).astype(np.float32)
    dy = rng.normal(size=(G.n, G.o, G.oh, G.ow)).astype(np.float32)
    C = Strided.contiguous
    f32 = mn.f32
    a = _attrs(G)
    spec = emit_forward(Conv2dKernel(G, C(f32, xs), C(f32, ws), tile=(8, 32)), lim, dev.features)
    assert spec.workgroups[1] > 1
    y = _dispatch(dev, spec, [x, w], dy.shape)
    _compare(y, _conv2d_ref([x.astype(np.float64), w], a)[0], RED, "forward")
    wk = Conv2dWeightGradKernel(G, C(f32, xs), C(f32, dy.shape), 5, tile=(8, 32))
    dw = _dispatch(dev, emit_weight_grad(wk, lim, dev.features), [x, dy], (5,) + ws)
    want = _weight_grad_ref([x.astype(np.float64), dy], dict(a, kernel_size=ws[2:], split=5))[0]
    _compare(dw, want, RED, "weight grad")
    pg = PoolGeom(2, 4, 9, 7, 3, 3, 4, 3, (2, 2), (0, 0))
    spec = emit_max_pool(MaxPoolKernel(pg, C(f32, xs), f32), lim, dev.features)
    got = _dispatch(dev, spec, [x], (2, 4, 4, 3), n_out=2)
    ref = np.stack([x[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].max((2, 3))
                    for i in range(4) for j in range(3)], -1).reshape(2, 4, 4, 3)
    np.testing.assert_array_equal(got, ref)


def test_degenerate_shapes_on_gpu(gpu):
    """1x1 images, a kernel larger than the input (padding makes it fit), one channel per
    group, batch 1."""
    rng = np.random.default_rng(11)
    g = mn.Graph()
    a = g.param("a", (1, 2, 1, 1))
    wa = g.param("wa", (4, 1, 1, 1))
    b = g.param("b", (1, 3, 2, 3))
    wb = g.param("wb", (2, 3, 5, 5))
    ya = ops.conv2d(a, wa, groups=2)
    yb = ops.conv2d(b, wb, padding=2, stride=2)
    loss = (ya * ya).sum() + (yb * yb).sum()
    g2, grads = mn.grad(g, loss)
    outs = {"ya": g2[ya], "yb": g2[yb], **{f"d{k}": v for k, v in grads.items()}}
    env = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in g.params.items()}
    _session_check(gpu, g2, outs, env, RED, "degenerate")


@pytest.mark.parametrize("xs,ws,st,pad,dil", [
    ((2, 4, 7, 6), (6, 4, 1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1)),  # phases without taps
    ((1, 3, 8, 9), (5, 3, 2, 2), (3, 3), ((1, 2), (0, 1)), (1, 1)),  # kernel < stride
    ((1, 2, 9, 8), (3, 2, 3, 3), (2, 3), ((2, 1), (0, 2)), (2, 2)),  # dilation, gcd > 1
    ((2, 3, 2, 5), (4, 3, 3, 3), (4, 2), ((1, 1), (1, 1)), (1, 1)),  # H < stride
    ((1, 2, 11, 10), (2, 2, 7, 7), (2, 2), ((3, 3), (3, 3)), (1, 1)),  # ResNet stem
])
def test_strided_input_grad_phases_match_naive_and_reference(dev, xs, ws, st, pad, dil):
    rng = np.random.default_rng(len(xs) + sum(ws))
    G = _geom(xs, ws, st, pad, dil)
    dy = rng.normal(size=(G.n, G.o, G.oh, G.ow)).astype(np.float32)
    w = rng.normal(size=ws).astype(np.float32)
    C = Strided.contiguous
    want = _input_grad_ref([dy.astype(np.float64), w], dict(_attrs(G), input_size=xs[2:]))[0]
    for naive in (False, True):
        desc = Conv2dInputGradKernel(G, C(mn.f32, dy.shape), C(mn.f32, ws), naive=naive)
        spec = emit_input_grad(desc, dev.limits, dev.features)
        assert ("phases" in spec.meta) != naive
        _compare(_dispatch(dev, spec, [dy, w], xs), want, RED, f"naive={naive}")
