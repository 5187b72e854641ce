"""Each layer of ``mn.nn`` against its ``torch.nn`` counterpart with identical parameters, in
float64: the forward value and the gradient of every parameter and of the input (a dropped
bias gradient or a transposed weight fails here, not only in a whole-model twin)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn


def _compare(layer, tmod, x_shape, seed=0):
    """Run ``layer`` on the reference backend (float64) and ``tmod`` in torch float64 with the
    same parameters and input; compare y and d(sum(y·ct))/d(everything)."""
    rng = np.random.default_rng(seed)
    g = mn.Graph("layer")
    x = g.param("x", x_shape)  # a param, so its gradient is reported too
    y = layer(g, x)
    # values representable in f32 (the graph's dtype, which set_params and feeds round to);
    # the reference then computes in float64 like torch
    ct = rng.normal(size=y.shape).astype(np.float32).astype(np.float64)
    g2, grads = mn.grad(g, (y * g.input("ct", y.shape)).sum())
    params = {n: rng.normal(size=v.shape).astype(np.float32).astype(np.float64)
              for n, v in g.params.items()}
    tmod = tmod.double()
    with torch.no_grad():
        for n, p in tmod.named_parameters():
            p.copy_(torch.from_numpy(params[f"{layer.name}.{n}"]))
    s = mn.compile(g2, outputs={"y": g2[y], **{f"d{n}": v for n, v in grads.items()}},
                   backend="reference", dtype=np.float64)
    s.set_params(params)
    got = s.run(ct=ct)
    tx = torch.from_numpy(params["x"]).requires_grad_(True)
    ty = tmod(tx)
    (ty * torch.from_numpy(ct)).sum().backward()
    np.testing.assert_allclose(got["y"], ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got["dx"], tx.grad.numpy(), rtol=1e-9, atol=1e-10)
    for n, p in tmod.named_parameters():
        np.testing.assert_allclose(got[f"d{layer.name}.{n}"], p.grad.numpy(), rtol=1e-9,
                                   atol=1e-10, err_msg=n)
    assert {f"d{layer.name}.{n}" for n, _ in tmod.named_parameters()} <= set(got)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    _compare(mn.nn.Linear(6, 4, bias=bias, name="fc"), torch.nn.Linear(6, 4, bias=bias), (3, 6))


@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1), dict(padding=2, dilation=2),
                                dict(groups=2, padding=1)])
def test_conv2d(kw):
    _compare(mn.nn.Conv2d(4, 6, 3, name="conv", **kw), torch.nn.Conv2d(4, 6, 3, **kw),
             (2, 4, 7, 7))


def test_layer_norm():
    _compare(mn.nn.LayerNorm(5, name="ln"), torch.nn.LayerNorm(5), (3, 5))


def test_rms_norm():
    _compare(mn.nn.RMSNorm(5, eps=1e-6, name="rms"), torch.nn.RMSNorm(5, eps=1e-6), (3, 5))


def test_group_norm():
    _compare(mn.nn.GroupNorm(2, 4, name="gn"), torch.nn.GroupNorm(2, 4), (2, 4, 3, 3))
