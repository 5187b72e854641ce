"""The SD-style U-Net against its PyTorch twin.  Real config: names, shapes and parameter count
(2,493,124).  Tiny config on the GPU session (lavapipe in CI), DESIGN.md §5 strict gates:
forward relative L2 ≤ 1e-4, every parameter gradient ≤ 1e-3; weights copied both ways."""

import numpy as np
import torch
from torch.nn import functional as F

from meganeura.models import unet

from .twins_vision import TorchUNet, check_gates, grad_session, grads_of, load_into, to_numpy

BATCH = 2


def test_real_config_matches_twin():
    m = unet.unet("sd-unet", BATCH)
    assert sum(p.size for p in m.graph.params.values()) == 2_493_124
    assert m.x.shape == (2, 4, 32, 32) and m.out.shape == (2, 4, 32, 32)
    ours = {k: v.shape for k, v in m.graph.params.items()}
    assert ours == {k: v.shape for k, v in to_numpy(TorchUNet(m.config)).items()}
    assert not m.graph.states


def _randomize_norms(tw, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in tw.modules():
            if isinstance(mod, torch.nn.GroupNorm):
                mod.weight.copy_(0.5 + torch.rand(mod.num_channels, generator=g))
                mod.bias.copy_(0.1 * torch.randn(mod.num_channels, generator=g))


def test_tiny_unet_gates_on_gpu(gpu):
    m = unet.unet("sd-unet-tiny", BATCH)
    sess = grad_session(m.graph, m.loss, {"out": m.out}, device=gpu)
    torch.manual_seed(0)
    tw = TorchUNet(m.config)
    _randomize_norms(tw, 0)
    sess.set_params(to_numpy(tw))
    tw = tw.double()
    # and back: our copy of the weights loads into a fresh twin unchanged
    tw2 = TorchUNet(m.config)
    load_into(tw2, sess.get_params())
    for k, v in to_numpy(tw2).items():
        np.testing.assert_array_equal(v, to_numpy(tw)[k].astype(np.float32))
    rng = np.random.default_rng(1)
    x = rng.normal(size=m.x.shape).astype(np.float32)
    target = rng.normal(size=m.target.shape).astype(np.float32)
    out = sess.run(x=x, target=target)
    o = tw(torch.tensor(x, dtype=torch.float64))
    loss = F.mse_loss(o, torch.tensor(target, dtype=torch.float64))
    loss.backward()
    worst_f, worst_b = check_gates(out, {"out": o.detach().numpy(),
                                         "loss": loss.detach().numpy()}, grads_of(tw))
    assert worst_f < 1e-4 and worst_b < 1e-3
