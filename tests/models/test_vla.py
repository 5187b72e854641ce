"""SmolVLA action expert: velocity, MSE loss and gradients against the PyTorch twin on the GPU
session; a few training steps; the SmolVLA preset."""

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura import optim
from meganeura.models.vla import SMOLVLA_EXPERT, action_expert, tiny_vla

from .twins_transformer import ActionExpert, grads_of, params_of
from .util_transformer import check_gates, grad_session


def _feeds(m, seed=0):
    r = np.random.default_rng(seed)
    feeds = {n: r.normal(size=v.shape).astype(np.float32) for n, v in m.graph.inputs.items()}
    feeds["time"] = r.uniform(0.0, 1.0, m.time.shape).astype(np.float32)
    return feeds


def _twin_run(tw, cfg, feeds):
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    kv = {i: (t[f"vlm_k.{i}"], t[f"vlm_v.{i}"]) for i in cfg.cross_layers}
    return tw(t["x_t"], t["time"], kv, t.get("target"))


@pytest.mark.parametrize("impl", ["op", "composite"])
def test_forward_and_gradients_match_twin(gpu, impl):
    cfg = tiny_vla()  # 4 layers: self, cross, self, cross; GQA 4/2
    m = action_expert(cfg, 2, impl=impl)
    s = grad_session(m.graph, m.loss, {"velocity": m.velocity})
    torch.manual_seed(0)
    tw = ActionExpert(cfg)
    s.set_params(params_of(tw), strict=True)
    feeds = _feeds(m)
    out = s.run(**feeds)
    vel, loss = _twin_run(tw, cfg, feeds)
    loss.backward()
    check_gates(out, {"velocity": vel.detach().numpy(), "loss": loss.detach().numpy()},
                grads_of(tw))


def test_training_reduces_the_flow_matching_loss(gpu):
    cfg = tiny_vla()
    m = action_expert(cfg, 2)
    s = mn.compile(m.graph, loss=m.loss, outputs={"velocity": m.velocity},
                        optimizer=optim.AdamW(lr=3e-3))
    s.init_params(seed=0)
    feeds = _feeds(m, seed=1)
    losses = [s.step(**feeds).loss for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_smolvla_expert_preset_builds():
    cfg = SMOLVLA_EXPERT
    m = action_expert(cfg, 1)
    assert cfg.cross_layers == list(range(1, 16, 2))
    assert m.velocity.shape == (1, 50, 32)
    assert m.graph.inputs["vlm_k.1"].shape == (1, 16, 320)
    p = m.graph.params
    assert p["lm_expert.layers.0.self_attn.q_proj.weight"].shape == (960, 720)
    assert p["lm_expert.layers.0.self_attn.k_proj.weight"].shape == (320, 720)
    assert p["lm_expert.layers.1.self_attn.k_proj.weight"].shape == (320, 320)  # from the VLM
    assert p["lm_expert.layers.15.mlp.down_proj.weight"].shape == (720, 2048)
    assert p["action_time_mlp_in.weight"].shape == (720, 1440)
    n = sum(v.size for v in p.values())
    assert n == 99_849_312  # ~0.1B, as SmolVLA's expert
    with pytest.raises(mn.GraphBuildError, match="multiple"):
        tiny_vla(num_key_value_heads=3)
