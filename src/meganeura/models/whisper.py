"""Whisper encoder (whisper-tiny and tiny test sizes) with a classification head.

HF ``WhisperEncoder``: ``gelu(conv1(mel))`` (k3, pad 1), ``gelu(conv2(·))`` (k3, stride 2,
pad 1), plus the sinusoidal position table (a graph constant), then pre-LN layers
``x + attn(ln(x))``, ``x + fc2(gelu(fc1(ln(x))))`` and a final LayerNorm.  Attention has biases
on q/v/out and none on k (as in Whisper).  Parameter names are HF's without the
``model.`` prefix (``encoder.conv1.weight``, ``encoder.layers.{i}.self_attn.q_proj.weight``,
``encoder.layers.{i}.self_attn.out_proj.weight``, ``encoder.layer_norm.weight``…).

The training task (our benchmark's): mean-pool the encoder features over time, a linear head
``head`` to ``num_classes`` classes, cross-entropy against integer labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import numpy as np

from .. import ops
from ..dtypes import i32
from ..errors import GraphBuildError
from ..graph import Graph, Value
from ..init import fan_in_uniform, kaiming_uniform
from ..nn import Linear
from ..nn.transformer import Attention, GeluMLP, LayerNorm, op_for, sinusoids

__all__ = ["WhisperEncoderConfig", "WHISPER_TINY", "tiny_whisper", "WhisperGraph",
           "whisper_encoder", "conv1d", "PRESETS"]


@dataclass(frozen=True)
class WhisperEncoderConfig:
    """HF ``WhisperConfig`` encoder fields (defaults: whisper-tiny) plus our head size."""

    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    layer_norm_eps: float = 1e-5
    num_classes: int = 64  # our classification head (not part of HF Whisper)

    def __post_init__(self):
        if self.d_model % self.encoder_attention_heads:
            raise GraphBuildError(f"d_model {self.d_model} is not a multiple of "
                                  f"encoder_attention_heads {self.encoder_attention_heads}")

    @property
    def frames(self) -> int:
        """Mel frames per input (conv2 halves them into max_source_positions positions)."""
        return 2 * self.max_source_positions

    @classmethod
    def from_hf(cls, config: Mapping, num_classes: int = 64) -> WhisperEncoderConfig:
        names = {f.name for f in fields(cls)} - {"num_classes", "layer_norm_eps"}
        kw = {k: config[k] for k in names if k in config and config[k] is not None}
        return cls(num_classes=num_classes, **kw)

    def to_hf(self) -> dict:
        return {"model_type": "whisper", "architectures": ["WhisperModel"],
                "num_mel_bins": self.num_mel_bins, "d_model": self.d_model,
                "encoder_layers": self.encoder_layers,
                "encoder_attention_heads": self.encoder_attention_heads,
                "encoder_ffn_dim": self.encoder_ffn_dim,
                "max_source_positions": self.max_source_positions,
                "activation_function": "gelu", "torch_dtype": "float32"}


WHISPER_TINY = WhisperEncoderConfig()
PRESETS = {"whisper-tiny": WHISPER_TINY}


def tiny_whisper(**overrides) -> WhisperEncoderConfig:
    """CI size: 8 mels × 16 frames -> 8 positions, d 32, 4 heads, 2 layers, 8 classes."""
    base = WhisperEncoderConfig(num_mel_bins=8, d_model=32, encoder_layers=2,
                                encoder_attention_heads=4, encoder_ffn_dim=64,
                                max_source_positions=8, num_classes=8)
    return replace(base, **overrides)


def conv1d(x: Value, w: Value, b: Value | None, stride: int = 1, padding: int = 0) -> Value:
    """The stem's convolution for ``impl="composite"``: 1-D convolution in time-major layout,
    x (B, T, Cin), w (Cout, Cin, K) (PyTorch layout) -> (B, Tout, Cout), as an implicit GEMM:
    the K shifted (strided) slices of the zero-padded input are stacked into (B, Tout, Cin·K)
    columns and multiplied by w reshaped to (Cout, Cin·K)."""
    B, T, C = x.shape
    Cout, Cin, K = w.shape
    if Cin != C:
        raise GraphBuildError(f"conv1d: input has {C} channels, weight expects {Cin}")
    g = x.graph
    if padding:
        z = g.full((B, padding, C), 0.0, x.dtype)
        x = ops.concat([z, x, z], 1)
    Tp = T + 2 * padding
    Tout = (Tp - K) // stride + 1
    cols = [ops.unsqueeze(ops.slice_(x, 1, k, k + stride * (Tout - 1) + 1, stride), 3)
            for k in range(K)]
    cols = ops.reshape(ops.concat(cols, 3), (B, Tout, C * K))  # column index c·K + k
    y = ops.matmul(cols, ops.reshape(w, (Cout, Cin * K)), transpose_b=True)
    return y + b if b is not None else y


@dataclass
class WhisperGraph:
    graph: Graph
    mel: Value
    features: Value
    logits: Value
    labels: Value | None = None
    loss: Value | None = None
    config: WhisperEncoderConfig | None = None


def _conv_params(g: Graph, name: str, cout: int, cin: int, k: int):
    w = g.param(f"{name}.weight", (cout, cin, k), init=kaiming_uniform())
    b = g.param(f"{name}.bias", (cout,), init=fan_in_uniform(cin * k))
    return w, b


def encoder(g: Graph, cfg: WhisperEncoderConfig, mel: Value, impl: str = "auto",
            fuse: bool = True) -> Value:
    """mel (B, n_mels, frames) -> features (B, positions, d_model)."""
    d = cfg.d_model
    w1, b1 = _conv_params(g, "encoder.conv1", d, cfg.num_mel_bins, 3)
    w2, b2 = _conv_params(g, "encoder.conv2", d, d, 3)
    conv_op = op_for("conv1d", impl)
    if conv_op is not None:  # the conv kernels, channel-major (B, C, T)
        x = ops.gelu(conv_op(mel, w1, b1, stride=1, padding=1))
        x = ops.transpose(ops.gelu(conv_op(x, w2, b2, stride=2, padding=1)), 1, 2)
    else:  # time-major implicit GEMM from slices + matmul
        x = ops.transpose(mel, 1, 2)
        x = ops.gelu(conv1d(x, w1, b1, 1, 1))
        x = ops.gelu(conv1d(x, w2, b2, 2, 1))
    if x.shape[1] != cfg.max_source_positions:
        raise GraphBuildError(f"whisper: {mel.shape[2]} frames give {x.shape[1]} positions, "
                              f"expected max_source_positions={cfg.max_source_positions}")
    x = x + g.const(sinusoids(cfg.max_source_positions, d), name="encoder.embed_positions")
    h = cfg.encoder_attention_heads
    for i in range(cfg.encoder_layers):
        p = f"encoder.layers.{i}"
        att = Attention(d, h, h, d // h, name=f"{p}.self_attn", q_bias=True, v_bias=True,
                        o_bias=True, out_name="out_proj", impl=impl, fuse=fuse)
        x = x + att(g, LayerNorm(d, cfg.layer_norm_eps, name=f"{p}.self_attn_layer_norm")(g, x))
        y = LayerNorm(d, cfg.layer_norm_eps, name=f"{p}.final_layer_norm")(g, x)
        x = x + GeluMLP(d, cfg.encoder_ffn_dim, name=p)(g, y)
    return LayerNorm(d, cfg.layer_norm_eps, name="encoder.layer_norm")(g, x)


def whisper_encoder(cfg: WhisperEncoderConfig, batch: int, loss: bool = True,
                    impl: str = "auto", fuse: bool | None = None) -> WhisperGraph:
    """Inputs ``mel`` (B, n_mels, 2·positions) and, with ``loss``, ``labels`` (B,) i32.
    Outputs: ``features`` (B, positions, d_model), ``logits`` (B, num_classes).
    ``impl``/``fuse``: as in :func:`~meganeura.models.llama.llama_lm`."""
    fuse = loss if fuse is None else fuse
    g = Graph("whisper_encoder")
    mel = g.input("mel", (batch, cfg.num_mel_bins, cfg.frames))
    feats = encoder(g, cfg, mel, impl, fuse)
    logits = Linear(cfg.d_model, cfg.num_classes, name="head")(g, ops.mean(feats, 1))
    out = WhisperGraph(g, mel, feats, logits, config=cfg)
    if loss:
        out.labels = g.input("labels", (batch,), dtype=i32)
        out.loss = ops.cross_entropy(logits, out.labels)
    return out


def position_table(cfg: WhisperEncoderConfig) -> np.ndarray:
    """The constant sinusoidal table the graph adds (HF ``encoder.embed_positions.weight``)."""
    return sinusoids(cfg.max_source_positions, cfg.d_model)
