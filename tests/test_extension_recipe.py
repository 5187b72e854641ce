"""The recipe of docs/architecture.md, end to end: a new op with its own kernel family, added
only through the public extension points (the op registry and the kernel registry), trains on
the GPU and matches the reference interpreter, gradients included.

If this test needs more than ``defop`` + one ``kernel_family`` registration, the recipe in the
docs is no longer true."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import meganeura as mn
from meganeura import kernels
from meganeura.graph import TensorType
from meganeura.kernels.common import (
    WG,
    Bindings,
    flat_index,
    make_grid,
    make_target,
    module_header,
    module_source,
)
from meganeura.ops._common import defop
from meganeura.ops.lowering import Kernel

# -- the kernel family: one description type, one emitter, one registration ------------------


@dataclass(frozen=True)
class SoftClipKernel:
    """y = c · x / (c + |x|) for a contiguous f32 tensor of ``n`` elements."""

    n: int
    c: float
    name: str = "toy_softclip"


def _make(attrs, inputs, outputs):
    return SoftClipKernel(max(outputs[0].size, 1), attrs["c"])


def _emit(k: SoftClipKernel, limits=None, features=None, alias=None):
    t = make_target(limits, features)
    bd = Bindings([mn.f32, mn.f32], alias)
    grid = make_grid(k.name, -(-k.n // WG), t)
    body = flat_index(grid, k.n, "    ")
    body.append(f"    let x = {bd.name(0)}[i];")
    body.append(f"    {bd.name(1)}[i] = {k.c!r} * x / ({k.c!r} + abs(x));")
    return kernels.KernelSpec(k.name, module_source(module_header(False) + bd.decls(), (), WG,
                                                    body), bd.n, grid.workgroups,
                              meta={"archetype": "toy_softclip"})


def _register_once():
    if "toy_softclip" in kernels.families():
        return
    kernels.register("toy_softclip", SoftClipKernel, _emit, make=_make, contiguous_inputs=True)

    def infer(types, attrs):
        return [TensorType(types[0].shape, types[0].dtype)]

    def reference(xs, attrs):
        c = attrs["c"]
        return [(c * xs[0] / (c + np.abs(xs[0]))).astype(xs[0].dtype)]

    def vjp(node, cts):  # d/dx c·x/(c+|x|) = c² / (c+|x|)²
        x, c = node.inputs[0], node.attrs["c"]
        d = x.abs() + c
        return [cts[0] * (c * c) / (d * d)]

    defop("toy_softclip", infer, reference, vjp, Kernel("toy_softclip"))


def test_a_new_op_with_its_own_kernel_trains_like_the_reference(gpu):
    _register_once()
    g = mn.Graph("toy")
    x = g.input("x", (8, 16))
    w = g.param("w", (16, 32))
    h = g.apply("toy_softclip", x @ w, c=2.0)
    loss = (h * h).mean()
    sess = {be: mn.compile(g, loss=loss, outputs={"h": h}, optimizer=mn.optim.SGD(lr=0.5),
                           backend=be) for be in ("wgpu", "reference")}
    init = {"w": np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)}
    for s in sess.values():
        s.set_params(init)
    assert any(lbl.startswith("toy_softclip") for lbl in sess["wgpu"].kernel_labels())
    xb = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32) * 3
    for _ in range(3):
        got, want = (sess[be].step(x=xb) for be in ("wgpu", "reference"))
        np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
        np.testing.assert_allclose(got["h"], want["h"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sess["wgpu"].get_params()["w"], sess["reference"].get_params()["w"],
                               rtol=1e-5, atol=1e-6)
    # the training moved the weights: the gradient path through the new op is live
    assert not np.allclose(sess["wgpu"].get_params()["w"], init["w"])
