"""nn/vision.py layers against torch.nn on the float64 reference: BatchNorm2d (training:
batch statistics, gradients, running-stat updates with momentum and unbiased variance; eval),
GroupNorm, nearest upsampling, Conv2d/Conv1d (names, PyTorch default init bounds), batch-norm
folding."""

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import meganeura as mn
from meganeura import nn as mnn
from meganeura.errors import GraphBuildError, ShapeError
from meganeura.reference import evaluate

from .twins_vision import rel_l2

TOL = 1e-10


def _run(g, outs, env):
    return evaluate(g, outs, env, dtype=np.float64)


def _grads(g, loss, names, env):
    g2, grads = mn.grad(g, loss, wrt=names)
    return dict(zip(names, _run(g2, [grads[n] for n in names], env)))


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (3, 2, 7)])
def test_batchnorm_training_matches_torch(shape):
    rng = np.random.default_rng(0)
    C = shape[1]
    x = rng.normal(size=shape) * 2 + 1
    w, b = rng.uniform(0.5, 1.5, C), rng.normal(size=C)
    rm, rv = rng.normal(size=C) * 0.1, rng.uniform(0.5, 1.5, C)
    ct = rng.normal(size=shape)
    g = mn.Graph()
    xv = g.param("x", shape)
    y = mnn.BatchNorm2d(C, eps=1e-3, momentum=0.3, name="bn")(g, xv)
    loss = (y * g.input("ct", shape)).sum()
    env = {"x": x, "bn.weight": w, "bn.bias": b, "bn.running_mean": rm, "bn.running_var": rv,
           "ct": ct}
    ours = _run(g, [y, g.updates["bn.running_mean"], g.updates["bn.running_var"]], env)
    grads = _grads(g, loss, ["x", "bn.weight", "bn.bias"], env)

    bn = torch.nn.BatchNorm2d(C, eps=1e-3, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(w))
        bn.bias.copy_(torch.tensor(b))
        bn.running_mean.copy_(torch.tensor(rm))
        bn.running_var.copy_(torch.tensor(rv))
    tx = torch.tensor(x, requires_grad=True)
    ty = F.batch_norm(tx, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.3, 1e-3)
    (ty * torch.tensor(ct)).sum().backward()
    assert rel_l2(ours[0], ty.detach().numpy()) < TOL
    assert rel_l2(ours[1], bn.running_mean.numpy()) < TOL
    assert rel_l2(ours[2], bn.running_var.numpy()) < TOL
    assert rel_l2(grads["x"], tx.grad.numpy()) < 1e-9
    assert rel_l2(grads["bn.weight"], bn.weight.grad.numpy()) < 1e-9
    assert rel_l2(grads["bn.bias"], bn.bias.grad.numpy()) < 1e-9


def test_batchnorm_eval_matches_torch():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 4, 4))
    w, b = rng.uniform(0.5, 1.5, 3), rng.normal(size=3)
    rm, rv = rng.normal(size=3), rng.uniform(0.5, 1.5, 3)
    g = mn.Graph()
    y = mnn.BatchNorm2d(3, training=False, name="bn")(g, g.input("x", x.shape))
    assert not g.updates
    (ours,) = _run(g, [y], {"x": x, "bn.weight": w, "bn.bias": b, "bn.running_mean": rm,
                            "bn.running_var": rv})
    want = F.batch_norm(*(torch.tensor(a) for a in (x, rm, rv, w, b)), False, 0.1, 1e-5)
    assert rel_l2(ours, want.numpy()) < TOL


@pytest.mark.parametrize("groups", [1, 2, 6])
def test_groupnorm_matches_torch(groups):
    rng = np.random.default_rng(groups)
    x = rng.normal(size=(2, 6, 3, 5))
    w, b = rng.uniform(0.5, 1.5, 6), rng.normal(size=6)
    ct = rng.normal(size=x.shape)
    g = mn.Graph()
    xv = g.param("x", x.shape)
    y = mnn.GroupNorm(groups, 6, eps=1e-4, name="gn")(g, xv)
    loss = (y * g.input("ct", x.shape)).sum()
    env = {"x": x, "gn.weight": w, "gn.bias": b, "ct": ct}
    (ours,) = _run(g, [y], env)
    grads = _grads(g, loss, ["x", "gn.weight", "gn.bias"], env)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ty = F.group_norm(tx, groups, tw, tb, 1e-4)
    (ty * torch.tensor(ct)).sum().backward()
    assert rel_l2(ours, ty.detach().numpy()) < TOL
    for n, t in (("x", tx), ("gn.weight", tw), ("gn.bias", tb)):
        assert rel_l2(grads[n], t.grad.numpy()) < 1e-9, n


def test_upsample_nearest_matches_torch():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 4, 5))
    ct = rng.normal(size=(2, 3, 8, 10))
    g = mn.Graph()
    xv = g.param("x", x.shape)
    y = mnn.upsample_nearest2d(xv, 2)
    env = {"x": x, "ct": ct}
    (ours,) = _run(g, [y], env)
    grads = _grads(g, (y * g.input("ct", ct.shape)).sum(), ["x"], env)
    tx = torch.tensor(x, requires_grad=True)
    ty = F.interpolate(tx, scale_factor=2, mode="nearest")
    (ty * torch.tensor(ct)).sum().backward()
    np.testing.assert_array_equal(ours, ty.detach().numpy())
    assert rel_l2(grads["x"], tx.grad.numpy()) < TOL


def test_conv_layers_names_and_default_init():
    g = mn.Graph()
    y = mnn.Conv2d(4, 6, 3, padding=1, groups=2, name="c")(g, g.input("x", (1, 4, 5, 5)))
    z = mnn.Conv1d(3, 5, 3, stride=2, name="d")(g, g.input("s", (1, 3, 9)))
    assert y.shape == (1, 6, 5, 5) and z.shape == (1, 5, 4)
    shapes = {k: v.shape for k, v in g.params.items()}
    assert shapes == {"c.weight": (6, 2, 3, 3), "c.bias": (6,), "d.weight": (5, 3, 3),
                      "d.bias": (5,)}
    from meganeura.init import init_leaves

    vals = init_leaves(g, seed=0)
    bound = 1 / math.sqrt(2 * 9)  # PyTorch: U(±1/sqrt(fan_in)), fan_in = in/groups * k*k
    for k in ("c.weight", "c.bias"):
        assert np.abs(vals[k]).max() <= bound and np.abs(vals[k]).max() > 0.5 * bound
    with pytest.raises(GraphBuildError, match="groups=4 must divide"):
        mnn.Conv2d(6, 6, 3, groups=4)(g, g.input("x2", (1, 6, 5, 5)))
    with pytest.raises(ShapeError, match="expected"):
        mnn.BatchNorm2d(5)(g, g.input("x3", (1, 4, 5, 5)))
    with pytest.raises(GraphBuildError, match="num_groups=4 must divide"):
        mnn.GroupNorm(4, 6)(g, g.input("x4", (1, 6, 2, 2)))


def test_fold_batchnorm_equals_conv_then_bn():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 3, 6, 6))
    w, cb = rng.normal(size=(4, 3, 3, 3)), rng.normal(size=4)
    gam, bet = rng.uniform(0.5, 1.5, 4), rng.normal(size=4)
    rm, rv = rng.normal(size=4), rng.uniform(0.5, 1.5, 4)
    env = {"x": x, "conv.weight": w, "conv.bias": cb, "bn.weight": gam, "bn.bias": bet,
           "bn.running_mean": rm, "bn.running_var": rv}
    g = mn.Graph()
    xv = g.input("x", x.shape)
    y = mnn.BatchNorm2d(4, training=False, name="bn")(
        g, mnn.Conv2d(3, 4, 3, padding=1, name="conv")(g, xv))
    (want,) = _run(g, [y], env)
    folded = mnn.fold_conv_bn_params(env, "conv", "bn")
    g2 = mn.Graph()
    y2 = mnn.Conv2d(3, 4, 3, padding=1, name="conv")(g2, g2.input("x", x.shape))
    (got,) = _run(g2, [y2], {"x": x, **folded})
    assert rel_l2(got, want) < TOL
    w2, b2 = mnn.fold_batchnorm(w, None, gam, bet, rm, rv)
    assert w2.shape == w.shape and b2.shape == (4,)


def test_package_runs_without_torch():
    """torch is a test dependency only: build and run a tiny ResNet and U-Net (reference
    backend) in a fresh interpreter where importing torch fails."""
    import subprocess
    import sys

    code = """
import sys
sys.modules['torch'] = None
import numpy as np
import meganeura as mn
from meganeura.models import resnet, unet, cnn
m = resnet.resnet('resnet18-tiny', 1)
s = mn.compile(m.graph, outputs={'y': m.logits}, backend='reference')
assert s.run(x=np.zeros(m.x.shape, np.float32))['y'].shape == (1, 10)
u = unet.unet('sd-unet-tiny', 1)
cnn.digits_cnn(2)
assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]
"""
    subprocess.run([sys.executable, "-c", code], check=True)
