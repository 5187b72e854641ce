"""ResNet against its PyTorch twin (torchvision layout).  Real configs: parameter names, shapes
and counts (ResNet-50 25,557,032; ResNet-18 11,689,512).  Tiny configs on the GPU session
(lavapipe in CI), DESIGN.md §5 strict gates: forward relative L2 ≤ 1e-4, every parameter
gradient ≤ 1e-3, plus the batch-norm running statistics after a training-mode forward; eval
mode; batch-norm folding equal to the unfolded eval graph; weights copied both ways."""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import meganeura as mn
from meganeura import optim
from meganeura.models import resnet

from .twins_vision import (
    TorchResNet,
    check_gates,
    grad_session,
    grads_of,
    load_into,
    rel_l2,
    to_numpy,
)

BATCH = 2


def _randomize_bn(tw, seed):
    """Non-trivial batch-norm affine parameters and running statistics in the twin."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in tw.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                c = mod.num_features
                mod.weight.copy_(0.5 + torch.rand(c, generator=g))
                mod.bias.copy_(0.1 * torch.randn(c, generator=g))
                mod.running_mean.copy_(0.1 * torch.randn(c, generator=g))
                mod.running_var.copy_(0.5 + torch.rand(c, generator=g))


def _data(m, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=m.x.shape).astype(np.float32)
    y = rng.integers(0, m.config.num_classes, m.y.shape).astype(np.int32)
    return x, y


@pytest.mark.parametrize("name,expected", [("resnet50", 25_557_032), ("resnet18", 11_689_512)])
def test_real_configs_match_torchvision_layout(name, expected):
    m = resnet.resnet(name, 1)
    assert sum(p.size for p in m.graph.params.values()) == expected
    ours = {k: v.shape for k, v in {**m.graph.params, **m.graph.states}.items()}
    theirs = {k: v.shape for k, v in to_numpy(TorchResNet(m.config)).items()}
    assert ours == theirs
    assert m.logits.shape == (1, 1000) and m.x.shape == (1, 3, 224, 224)


@pytest.mark.parametrize("name,direction", [("resnet50-tiny", "ours->torch"),
                                            ("resnet18-tiny", "torch->ours")])
def test_training_mode_gates_on_gpu(gpu, name, direction):
    m = resnet.resnet(name, BATCH, training=True)
    sess = grad_session(m.graph, m.loss, {"logits": m.logits}, device=gpu)
    tw = TorchResNet(m.config).double()
    if direction == "ours->torch":
        sess.init_params(seed=1)
        load_into(tw, sess.get_state())
    else:
        torch.manual_seed(1)
        tw = TorchResNet(m.config)
        _randomize_bn(tw, 1)
        sess.set_params(to_numpy(tw))
        tw = tw.double()
    x, y = _data(m, 2)
    out = sess.run(x=x, y=y)
    tw.train()
    logits = tw(torch.tensor(x, dtype=torch.float64))
    loss = F.cross_entropy(logits, torch.tensor(y, dtype=torch.int64))
    loss.backward()
    fwd = {"logits": logits.detach().numpy(), "loss": loss.detach().numpy()}
    worst_f, worst_b = check_gates(out, fwd, grads_of(tw))
    assert worst_f < 1e-4 and worst_b < 1e-3
    # running statistics after the training-mode forward (momentum, unbiased variance)
    sd = to_numpy(tw)
    stats = [k for k in sd if "running" in k]
    assert stats and all(f"update:{k}" in out for k in stats)
    for k in stats:
        assert rel_l2(out[f"update:{k}"], sd[k]) < 1e-5, k


def test_eval_mode_and_bn_folding(gpu):
    cfg = resnet.PRESETS["resnet50-tiny"]
    torch.manual_seed(3)
    tw = TorchResNet(cfg)
    _randomize_bn(tw, 3)
    state = to_numpy(tw)
    tw = tw.double().eval()
    m = resnet.resnet(cfg, BATCH, training=False)
    assert not m.graph.updates
    x, _ = _data(m, 4)
    want = tw(torch.tensor(x, dtype=torch.float64)).detach().numpy()
    sess = mn.compile(m.graph, outputs={"logits": m.logits}, device=gpu)
    sess.set_params(state)
    got = sess.run(x=x)["logits"]
    assert rel_l2(got, want) < 1e-4
    # folding: same function, no batch norm left (float64 reference: exact up to rounding)
    mf = resnet.resnet(cfg, BATCH, training=False, fold_bn=True)
    assert not mf.graph.states and all("bn" not in k for k in mf.graph.params)
    folded = resnet.fold_params(cfg, state)
    assert set(folded) == set(mf.graph.params)
    ref = mn.compile(m.graph, outputs={"logits": m.logits}, backend="reference",
                     dtype=np.float64)
    ref.set_params(state)
    reff = mn.compile(mf.graph, outputs={"logits": mf.logits}, backend="reference",
                      dtype=np.float64)
    reff.set_params(folded)
    a, b = ref.run(x=x)["logits"], reff.run(x=x)["logits"]
    assert rel_l2(b, a) < 1e-6  # folded weights are rounded to f32 once
    assert rel_l2(a, want) < 1e-6


def test_training_step_updates_running_stats_and_weights():
    """One SGD step on the reference backend (float64) equals PyTorch's: parameters and the
    running statistics applied by the step."""
    cfg = resnet.PRESETS["resnet18-tiny"]
    m = resnet.resnet(cfg, BATCH, training=True)
    sess = mn.compile(m.graph, loss=m.loss, optimizer=optim.SGD(lr=0.1, momentum=0.9),
                      backend="reference", dtype=np.float64)
    torch.manual_seed(5)
    tw = TorchResNet(cfg)
    _randomize_bn(tw, 5)
    sess.set_params(to_numpy(tw))
    tw = tw.double().train()
    x, y = _data(m, 6)
    sess.step(x=x, y=y)
    opt = torch.optim.SGD(tw.parameters(), lr=0.1, momentum=0.9)
    loss = F.cross_entropy(tw(torch.tensor(x, dtype=torch.float64)),
                           torch.tensor(y, dtype=torch.int64))
    opt.zero_grad()
    loss.backward()
    opt.step()
    ours = sess.get_state()
    for k, v in to_numpy(tw).items():
        assert rel_l2(ours[k], v) < 1e-6, k
