"""Benchmark workloads: our graph + its PyTorch twin with identical weights and inputs.

Each factory ``(quick, variant) -> Workload``; ``variant`` is "main" (the paper's sizes) or
"minlat" (batch / sequence / chunk 1).  ``quick`` gives tiny configs for lavapipe/CPU runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import meganeura as mn
from meganeura.init import init_leaves


@dataclass
class Workload:
    name: str
    graph: Any
    loss: Any
    outputs: dict
    feeds: dict  # numpy, by our input names
    params: dict  # numpy, our names (seed 0)
    torch_model: Callable[[], Any]
    torch_feeds: Callable[[Any], dict]
    torch_loss: Callable[[Any, dict], tuple]  # (module, feeds) -> (loss, {name: tensor})
    load_torch: Callable[[Any, dict], None]
    torch_grads: Callable[[Any], dict]


def _params(graph, seed=0):
    return {k: v for k, v in init_leaves(graph, seed).items() if k in graph.params}


def _named_twin_io():
    """Copy by parameter name (our names == the twin's state-dict names)."""
    import torch

    def load(m, params):
        sd = m.state_dict()
        with torch.no_grad():
            for k, v in params.items():
                sd[k].copy_(torch.from_numpy(np.asarray(v)).to(sd[k].dtype))

    def grads(m):
        return {k: p.grad.detach().double().cpu().numpy() for k, p in m.named_parameters()
                if p.grad is not None}
    return load, grads


def mlp(quick: bool, variant: str) -> Workload:
    """The digits MLP (also the harness's own smoke test in CI)."""
    import torch
    from torch import nn

    from meganeura.models.mlp import mlp_classifier

    batch = 1 if variant == "minlat" else 64
    hidden = (32,) if quick else (128,)
    m = mlp_classifier(batch, hidden=hidden)
    r = np.random.default_rng(0)
    feeds = {"x": r.random((batch, 64), dtype=np.float32),
             "y": r.integers(0, 10, batch).astype(np.int32)}

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            sizes = (64, *hidden, 10)
            self.mlp = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

        def forward(self, x):
            for i, lin in enumerate(self.mlp):
                x = lin(x)
                if i < len(self.mlp) - 1:
                    x = torch.relu(x)
            return x

    def tloss(model, f):
        logits = model(f["x"])
        return nn.functional.cross_entropy(logits, f["y"]), {"logits": logits}

    load, grads = _named_twin_io()
    return Workload("mlp", m.graph, m.loss, {"logits": m.logits}, feeds, _params(m.graph), Twin,
                    lambda d: {"x": torch.from_numpy(feeds["x"]).to(d),
                               "y": torch.from_numpy(feeds["y"]).long().to(d)},
                    tloss, load, grads)


def _twin_workload(name, graph, loss, outputs, feeds, make_twin, twin_loss, skip=()):
    """A workload whose weights come from a seeded PyTorch twin (HF-style init)."""
    import torch
    from tests.models.twins_transformer import grads_of, load_into, params_of

    torch.manual_seed(0)
    tw = make_twin()
    params = params_of(tw, skip)
    params = {k: v for k, v in params.items() if k in graph.params}

    def tfeeds(d):
        out = {}
        for k, v in feeds.items():
            t = torch.from_numpy(v)
            out[k] = (t.long() if v.dtype == np.int32 else t).to(d)
        return out

    def grads(m):
        return {k: v.astype(np.float64) for k, v in grads_of(m, skip).items()}

    return Workload(name, graph, loss, outputs, feeds, params, make_twin, tfeeds, twin_loss,
                    lambda m, p: load_into(m, p, skip), grads)


def llama(quick: bool, variant: str) -> Workload:
    """SmolLM2-135M, batch 1, seq 128 (minlat: seq 2, the shortest next-token step)."""
    from tests.models.twins_transformer import LlamaForCausalLM

    from meganeura.models.llama import SMOLLM2_135M, llama_lm, tiny_llama

    cfg = tiny_llama() if quick else SMOLLM2_135M
    S = 2 if variant == "minlat" else (16 if quick else 128)
    m = llama_lm(cfg, 1, S)
    r = np.random.default_rng(0)
    ids = r.integers(0, cfg.vocab_size, (1, S)).astype(np.int32)
    feeds = {"ids": ids, "labels": ids.copy()}

    def make():
        tw = LlamaForCausalLM(cfg)
        with __import__("torch").no_grad():
            tw.model.embed_tokens.weight.normal_(0.0, 0.5 if quick else 0.02)
        return tw

    def tloss(model, f):
        logits, loss = model(f["ids"], f["labels"])
        return loss, {"logits": logits}

    skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    return _twin_workload("smollm2", m.graph, m.loss, {"logits": m.logits}, feeds, make, tloss,
                          skip)


def vla(quick: bool, variant: str) -> Workload:
    """SmolVLA action expert: chunk 50, VLM context 16, batch 1 (minlat: chunk 1)."""
    from dataclasses import replace

    from tests.models.twins_transformer import ActionExpert

    from meganeura.models.vla import SMOLVLA_EXPERT, action_expert, tiny_vla

    cfg = tiny_vla() if quick else SMOLVLA_EXPERT
    if variant == "minlat":
        cfg = replace(cfg, chunk_size=1)
    m = action_expert(cfg, 1)
    r = np.random.default_rng(0)
    feeds = {"x_t": r.standard_normal((1, cfg.chunk_size, cfg.action_dim), np.float32),
             "time": r.random(1, np.float32),
             "target": r.standard_normal((1, cfg.chunk_size, cfg.action_dim), np.float32)}
    for i in cfg.cross_layers:
        for kv in "kv":
            feeds[f"vlm_{kv}.{i}"] = r.standard_normal((1, cfg.vlm_context, cfg.vlm_kv_dim),
                                                       np.float32)

    def tloss(model, f):
        kv = {i: (f[f"vlm_k.{i}"], f[f"vlm_v.{i}"]) for i in cfg.cross_layers}
        v, loss = model(f["x_t"], f["time"], kv, f["target"])
        return loss, {"velocity": v}

    return _twin_workload("smolvla", m.graph, m.loss, {"velocity": m.velocity}, feeds,
                          lambda: ActionExpert(cfg), tloss)


def whisper(quick: bool, variant: str) -> Workload:
    """Whisper-tiny encoder, 80 mels x 3000 frames, batch 1, 64-class head."""
    from tests.models.twins_transformer import WhisperClassifier

    from meganeura.models.whisper import (
        WHISPER_TINY,
        position_table,
        tiny_whisper,
        whisper_encoder,
    )

    cfg = tiny_whisper() if quick else WHISPER_TINY
    m = whisper_encoder(cfg, 1)
    r = np.random.default_rng(0)
    feeds = {"mel": r.standard_normal((1, cfg.num_mel_bins, cfg.frames), np.float32),
             "labels": r.integers(0, cfg.num_classes, 1).astype(np.int32)}

    def tloss(model, f):
        h, logits, loss = model(f["mel"], f["labels"])
        return loss, {"logits": logits}

    def make():
        import torch

        tw = WhisperClassifier(cfg)
        with torch.no_grad():  # our encoder has the sinusoid table as a constant
            tw.encoder.embed_positions.weight.copy_(torch.from_numpy(position_table(cfg)))
        return tw

    w = _twin_workload("whisper", m.graph, m.loss, {"logits": m.logits}, feeds, make, tloss,
                       WhisperClassifier.skip)
    load = w.load_torch

    def load_with_positions(model, params):
        import torch

        load(model, params)
        with torch.no_grad():
            model.encoder.embed_positions.weight.copy_(torch.from_numpy(position_table(cfg)))
    w.load_torch = load_with_positions
    return w


def _vision_workload(name, m, feeds, make_twin, twin_loss, outputs):
    import torch
    from tests.models.twins_vision import grads_of, load_into, to_numpy

    torch.manual_seed(0)
    full = to_numpy(make_twin())  # parameters and running statistics (torch defaults)
    params = {k: v for k, v in full.items() if k in m.graph.params}

    def tfeeds(d):
        return {k: (torch.from_numpy(v).long() if v.dtype == np.int32
                    else torch.from_numpy(v)).to(d) for k, v in feeds.items()}

    return Workload(name, m.graph, m.loss, outputs, feeds, params, make_twin, tfeeds, twin_loss,
                    lambda mod, p: load_into(mod, {**full, **p}),
                    lambda mod: {k: v.astype(np.float64) for k, v in grads_of(mod).items()})


def resnet50(quick: bool, variant: str) -> Workload:
    """ResNet-50, batch 4, 224x224, 1000 classes, training-mode batch norm (minlat: batch 1)."""
    from tests.models.twins_vision import TorchResNet
    from torch.nn import functional as F

    from meganeura.models import resnet

    batch = 1 if variant == "minlat" else (2 if quick else 4)
    m = resnet.resnet("resnet50-tiny" if quick else "resnet50", batch, training=True)
    r = np.random.default_rng(0)
    feeds = {"x": r.standard_normal(m.x.shape, np.float32),
             "y": r.integers(0, m.config.num_classes, m.y.shape).astype(np.int32)}

    def tloss(model, f):
        logits = model(f["x"])
        return F.cross_entropy(logits, f["y"]), {"logits": logits}

    return _vision_workload("resnet50", m, feeds, lambda: TorchResNet(m.config), tloss,
                            {"logits": m.logits})


def unet(quick: bool, variant: str) -> Workload:
    """SD-style U-Net (~2.5M parameters), batch 2, 32x32x4 latent, MSE (minlat: batch 1)."""
    from tests.models.twins_vision import TorchUNet
    from torch.nn import functional as F

    from meganeura.models import unet as unet_mod

    batch = 1 if variant == "minlat" else 2
    m = unet_mod.unet("sd-unet-tiny" if quick else "sd-unet", batch)
    r = np.random.default_rng(0)
    feeds = {"x": r.standard_normal(m.x.shape, np.float32),
             "target": r.standard_normal(m.target.shape, np.float32)}

    def tloss(model, f):
        out = model(f["x"])
        return F.mse_loss(out, f["target"]), {"out": out}

    return _vision_workload("unet", m, feeds, lambda: TorchUNet(m.config), tloss,
                            {"out": m.out})


# Workloads whose main configuration already is the minimal-latency one (not run twice).
MINLAT_IS_MAIN = {"whisper": "the encoder benchmark already runs batch 1 (80x3000 mel)"}

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mlp": mlp, "smollm2": llama, "smolvla": vla, "whisper": whisper, "resnet50": resnet50,
    "unet": unet,
}
del mn
