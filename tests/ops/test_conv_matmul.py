"""1×1 convolutions lowered as batched matmuls (``ops/conv.py``, ``Kernel.rewrite``): which
convolutions take the matmul form, that the expansion computes the op exactly (float64, on the
numpy interpreter: forward with and without bias, input gradient, every weight-gradient chunking
it accepts), and that compiled programs really run matmuls for them on the GPU and match the
float64 reference (fused epilogue, gradients, batch 1 and > 1, odd sizes)."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import ops, reference
from meganeura.graph import TensorType
from meganeura.ops import conv as C

from ..kernels._util import compiled_matches_float64

F32 = mn.f32


def _t(*shape):
    return TensorType(tuple(shape), F32)


def _attrs(stride=(1, 1), pad=((0, 0), (0, 0)), groups=1, **kw):
    return {"stride": stride, "padding": pad, "dilation": (1, 1), "groups": groups, **kw}


def test_which_convolutions_become_matmuls(monkeypatch):
    fwd = C._forward_rewrite
    big = [_t(4, 256, 14, 14), _t(1024, 256, 1, 1)]
    assert fwd(_attrs(), big, None) is C._forward_as_matmul
    assert fwd(_attrs(stride=(2, 2)), big, None) is None
    assert fwd(_attrs(pad=((1, 1), (1, 1))), big, None) is None
    assert fwd(_attrs(), [_t(4, 256, 14, 14), _t(1024, 256, 3, 3)], None) is None
    assert fwd(_attrs(groups=2), [_t(4, 256, 14, 14), _t(1024, 128, 1, 1)], None) is None
    # too few output tiles for the matmul (no batched split-K): the conv kernels keep it
    assert fwd(_attrs(), [_t(4, 1024, 14, 14), _t(256, 1024, 1, 1)], None) is None
    dgr = C._input_grad_rewrite
    assert dgr(_attrs(), [_t(4, 256, 14, 14), _t(256, 1024, 1, 1)], None) is not None
    assert dgr(_attrs(), [_t(4, 1024, 14, 14), _t(1024, 256, 1, 1)], None) is None
    wgr = C._weight_grad_rewrite
    x, dy = _t(4, 256, 14, 14), _t(4, 1024, 14, 14)
    assert wgr(_attrs(kernel_size=(1, 1), split=4), [x, dy], None) is not None
    assert wgr(_attrs(kernel_size=(1, 1), split=8), [x, dy], None) is None  # 2 chunks/image
    assert wgr(_attrs(kernel_size=(1, 1), split=1), [x, dy], None) is None  # K over images
    monkeypatch.setattr(C, "MATMUL_MIN_TILES", 1)
    assert fwd(_attrs(), [_t(4, 1024, 14, 14), _t(256, 1024, 1, 1)], None) is not None


@pytest.mark.parametrize("n, hw, split, want", [
    (4, 196, 4, 196), (1, 196, 4, 49), (1, 196, 1, 196), (4, 196, 1, None), (4, 196, 8, None),
    (4, 196, 16, None), (1, 196, 3, None), (3, 5, 3, 5)])
def test_weight_grad_chunks(n, hw, split, want):
    assert C.wgrad_chunk(n, hw, split) == want


def _expanded(g, out, ins):
    """``out`` (a conv op's value) and the matmul form of its node, evaluated in float64."""
    node = out.node
    low = node.opdef.lowering
    expand = low.rewrite(node.attrs, [v.type for v in node.inputs], [out.type])
    assert expand is not None, node.op
    (alt,) = expand(g, node)
    assert alt.type == out.type and alt.node.op != node.op
    return reference.evaluate(g, [out, alt], ins, np.float64)


@pytest.mark.parametrize("n, c, o, h, w, bias", [(2, 5, 7, 3, 5, True), (1, 6, 3, 4, 1, False),
                                                  (3, 1, 2, 2, 2, True)])
def test_expansion_is_the_op(monkeypatch, n, c, o, h, w, bias):
    monkeypatch.setattr(C, "MATMUL_MIN_TILES", 1)
    rng = np.random.default_rng(n * 100 + c)
    g = mn.Graph("mm")
    xv, wv = g.input("x", (n, c, h, w)), g.input("w", (o, c, 1, 1))
    dyv, bv = g.input("dy", (n, o, h, w)), g.input("b", (o,))
    env = {k: rng.normal(size=v.shape) for k, v in
           (("x", xv), ("w", wv), ("dy", dyv), ("b", bv))}
    y = ops.conv2d(xv, wv, bv if bias else None)
    got, want = _expanded(g, y, env)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    dx = ops.conv2d_input_grad(dyv, wv, (h, w))
    got, want = _expanded(g, dx, env)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for split in (1, n, h * w if n == 1 else n):
        if C.wgrad_chunk(n, h * w, split) is None:
            continue
        dw = g.apply("conv2d_weight_grad", xv, dyv, kernel_size=(1, 1), split=split,
                     **_attrs())
        got, want = _expanded(g, dw, env)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _labels(sess):
    return [c.label for c in sess.executable.infer.ops if hasattr(c, "label")]


@pytest.mark.parametrize("n, c, o, h, w", [(2, 12, 20, 3, 5), (1, 9, 16, 5, 5)])
def test_compiled_matmul_convolutions(gpu, monkeypatch, n, c, o, h, w):
    """Forward with bias and a fused ReLU + residual epilogue, a second (bias-free) 1×1 conv, and
    all gradients, compiled with the matmul form on (every 1×1 conv qualifies): the plan holds
    matmuls and no convolution kernel, and every result matches the float64 reference."""
    monkeypatch.setattr(C, "MATMUL_MIN_TILES", 1)
    rng = np.random.default_rng(7 + n)
    g = mn.Graph("conv1x1")
    x = g.param("x", (n, c, h, w))
    w1, b1 = g.param("w1", (c, c, 1, 1)), g.param("b1", (c,))
    w2 = g.param("w2", (o, c, 1, 1))
    hid = (ops.conv2d(x, w1, b1) + x).relu()
    y = ops.conv2d(hid, w2)
    ct = g.input("ct", y.shape)
    g2, grads = mn.grad(g, (y * ct).sum())
    outs = {"y": g2[y], **{f"d{k}": v for k, v in grads.items()}}
    # a weight gradient split inside the only image (batch 1) or one chunk per image
    outs["dw_split"] = ops.conv2d_weight_grad(g2[x], g2[ct], (1, 1), split=5 if n == 1 else n)
    env = {k: (rng.normal(size=v.shape) * 0.3).astype(np.float32)
           for k, v in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2), ("ct", ct))}
    sess = compiled_matches_float64(gpu, g2, outs, env, "ct")
    labels = _labels(sess)
    assert not any(s.startswith("conv2d") for s in labels), labels
    assert any(s.startswith("matmul") and "relu" in s for s in labels), labels


def test_matmul_convolutions_stay_f32_under_fast(monkeypatch):
    """Like every convolution, the 1×1 ones keep f32 under precision="fast": their matmul
    nodes say so (``f32_only``), the scheduled kernel carries ``tensor_cores=False``, and
    emission on a device with tensor cores keeps the f32 kernel — an ordinary matmul of the
    same shape goes to the tensor cores there."""
    import dataclasses

    from meganeura.compile.emit import emit_kernel
    from meganeura.kernels import MatmulKernel, Strided, make_target
    from meganeura.kernels.matmul import SG_FEATURE

    monkeypatch.setattr(C, "MATMUL_MIN_TILES", 1)
    g = mn.Graph("mm")
    xv, wv = g.input("x", (2, 8, 4, 4)), g.input("w", (16, 8, 1, 1))
    node = ops.conv2d(xv, wv).node
    (alt,) = node.opdef.lowering.rewrite(node.attrs, [v.type for v in node.inputs],
                                         None)(g, node)
    mm = alt
    while mm.node.op != "matmul":
        mm = mm.node.inputs[0]
    assert mm.node.attrs["f32_only"] is True
    target = make_target({"max_compute_workgroup_storage_size": 49152,
                          "max_compute_invocations_per_workgroup": 1024},
                         {"shader-f16", SG_FEATURE})
    desc = MatmulKernel(1, 512, 512, 64, Strided.contiguous(F32, (1, 512, 64)),
                        Strided.contiguous(F32, (1, 64, 512)))
    binds = [object(), object(), object()]
    fast = emit_kernel(desc, binds, target, "fast")
    kept = emit_kernel(dataclasses.replace(desc, tensor_cores=False), binds, target, "fast")
    assert fast.spec.meta["variant"].startswith("sgmat")
    assert kept.spec.meta["variant"].startswith("tiled")


def test_scheduled_conv_matmuls_carry_f32_only(monkeypatch):
    """Through the whole pipeline (build, passes, plan; no device): the matmuls a 1×1
    convolution and its gradients become are scheduled with ``tensor_cores=False``, fused
    epilogue and split-K included, while an ordinary matmul of the same graph keeps them."""
    from meganeura import optim
    from meganeura.compile.memory import KernelOp, make_plan
    from meganeura.compile.passes import run_pipeline
    from meganeura.kernels import MatmulKernel
    from meganeura.program import build_program

    monkeypatch.setattr(C, "MATMUL_MIN_TILES", 1)
    g = mn.Graph("mixed")
    x = g.input("x", (2, 8, 4, 4))
    w1, b1 = g.param("w1", (16, 8, 1, 1)), g.param("b1", (16,))
    wl = g.param("wl", (16 * 16, 10))
    h = ops.conv2d(x, w1, b1).relu()
    logits = ops.matmul(ops.reshape(h, (2, 16 * 16)), wl)
    loss = (logits * logits).mean()
    plan = make_plan(run_pipeline(build_program(g, loss, {}, optim.SGD(lr=0.1))), False)
    mms = [k for k in plan.kernels if isinstance(k, KernelOp)
           and isinstance(k.desc, MatmulKernel)]
    f32_only = [k for k in mms if not k.desc.tensor_cores]
    tc = [k for k in mms if k.desc.tensor_cores]
    # the conv's forward (bias + ReLU epilogue) and weight gradient; x is an input, so no
    # input gradient
    assert len(f32_only) == 2 and any("relu" in k.label for k in f32_only), \
        [k.label for k in mms]
    # the linear layer: forward, weight gradient and the gradient flowing back into h
    assert len(tc) == 3, [k.label for k in mms]
