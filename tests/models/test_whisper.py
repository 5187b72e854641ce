"""Whisper encoder + classification head: features, loss and gradients against the PyTorch
twin on the GPU session; the composite conv stem against torch's conv1d; whisper-tiny preset."""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import meganeura as mn
from meganeura.models.whisper import (
    WHISPER_TINY,
    WhisperEncoderConfig,
    conv1d,
    position_table,
    tiny_whisper,
    whisper_encoder,
)

from .twins_transformer import WhisperClassifier, grads_of, params_of
from .util_transformer import check_gates, grad_session, rel_l2


def _twin(cfg, seed=0):
    torch.manual_seed(seed)
    tw = WhisperClassifier(cfg)
    with torch.no_grad():
        tw.encoder.embed_positions.weight.copy_(torch.from_numpy(position_table(cfg)))
    return tw


@pytest.mark.parametrize("impl", ["op", "composite"])
def test_forward_and_gradients_match_twin(gpu, impl):
    cfg = tiny_whisper()
    B = 2
    m = whisper_encoder(cfg, B, impl=impl)
    s = grad_session(m.graph, m.loss, {"features": m.features, "logits": m.logits})
    tw = _twin(cfg)
    s.set_params(params_of(tw, tw.skip), strict=True)
    r = np.random.default_rng(0)
    mel = r.normal(size=(B, cfg.num_mel_bins, cfg.frames)).astype(np.float32)
    labels = np.array([1, 6], np.int32)
    out = s.run(mel=mel, labels=labels)
    h, logits, loss = tw(torch.from_numpy(mel), torch.from_numpy(labels))
    loss.backward()
    check_gates(out, {"features": h.detach().numpy(), "logits": logits.detach().numpy(),
                      "loss": loss.detach().numpy()}, grads_of(tw))


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), (2, 0), (3, 2)])
def test_composite_conv1d_matches_torch(stride, padding):
    g = mn.Graph()
    x = g.input("x", (2, 11, 5))  # time-major (B, T, C)
    w = g.param("w", (4, 5, 3))
    b = g.param("b", (4,))
    y = conv1d(x, w, b, stride, padding)
    r = np.random.default_rng(stride)
    xs, ws, bs = (r.normal(size=s).astype(np.float32) for s in ((2, 11, 5), (4, 5, 3), (4,)))
    s = mn.compile(g, outputs={"y": y}, backend="reference")
    s.set_params({"w": ws, "b": bs})
    got = s.run(x=xs)["y"]
    ref = F.conv1d(torch.from_numpy(xs).transpose(1, 2), torch.from_numpy(ws),
                   torch.from_numpy(bs), stride=stride, padding=padding).transpose(1, 2)
    assert got.shape == tuple(ref.shape)
    assert rel_l2(got, ref.numpy()) <= 1e-6


def test_whisper_tiny_preset_builds_with_hf_names():
    cfg = WHISPER_TINY
    m = whisper_encoder(cfg, 1)
    assert m.mel.shape == (1, 80, 3000) and m.features.shape == (1, 1500, 384)
    p = m.graph.params
    assert p["encoder.conv1.weight"].shape == (384, 80, 3)
    assert p["encoder.conv2.weight"].shape == (384, 384, 3)
    assert p["encoder.layers.3.self_attn.out_proj.weight"].shape == (384, 384)
    assert "encoder.layers.0.self_attn.k_proj.bias" not in p  # Whisper: no bias on k
    assert p["encoder.layers.3.fc1.weight"].shape == (1536, 384)
    assert p["head.weight"].shape == (64, 384)
    enc = sum(v.size for k, v in p.items() if not k.startswith("head."))
    assert enc == 7_632_384  # whisper-tiny encoder without the position table
    assert m.logits.shape == (1, 64)
    hf = WHISPER_TINY.to_hf()
    assert WhisperEncoderConfig.from_hf(hf) == cfg
    with pytest.raises(mn.GraphBuildError, match="multiple"):
        tiny_whisper(encoder_attention_heads=5)
