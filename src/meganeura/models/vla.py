"""SmolVLA action expert (and tiny test sizes): a Llama-style transformer over a chunk of
action tokens that alternates self-attention layers with cross-attention to the VLM's
keys/values, trained with a flow-matching MSE.

Structure (names follow LeRobot's SmolVLA, ``lm_expert`` being the trimmed SmolLM2 stack):
  * ``action_in_proj``: noisy actions x_t (B, chunk, action_dim) -> hidden;
  * the flow time t (B,) as a sinusoidal embedding (periods 4e-3 … 4), concatenated with the
    action embedding, through ``action_time_mlp_in`` -> SiLU -> ``action_time_mlp_out``;
  * ``lm_expert.layers.{i}``: pre-RMSNorm attention + SwiGLU MLP.  Even layers (i % every == 0)
    are bidirectional self-attention over the chunk with RoPE at positions
    vlm_context … vlm_context + chunk - 1; odd layers cross-attend: queries (with RoPE) from the
    chunk, keys/values from the inputs ``vlm_k.{i}``/``vlm_v.{i}`` (B, vlm_context,
    vlm_kv_dim) — the VLM layer's key/value states — through the layer's own k_proj/v_proj
    (vlm_kv_dim -> kv_heads·head_dim);
  * ``lm_expert.norm``, then ``action_out_proj`` -> the velocity v (B, chunk, action_dim).
  * Loss: mean squared error against the input ``target`` (flow matching: noise - actions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .. import ops
from ..errors import GraphBuildError
from ..graph import Graph, Value
from ..nn.transformer import Attention, RMSNorm, RoPE, SwiGLU, dense

__all__ = ["ActionExpertConfig", "SMOLVLA_EXPERT", "tiny_vla", "VLAGraph", "action_expert",
           "time_embedding_scale", "PRESETS"]


@dataclass(frozen=True)
class ActionExpertConfig:
    """Defaults: SmolVLA's expert (0.75 × SmolVLM2-500M's width, 16 layers)."""

    hidden_size: int = 720
    num_hidden_layers: int = 16
    num_attention_heads: int = 15
    num_key_value_heads: int = 5
    head_dim: int = 64
    intermediate_size: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    action_dim: int = 32
    chunk_size: int = 50
    vlm_context: int = 16
    vlm_kv_dim: int = 320  # SmolVLM2-500M: 5 KV heads × 64
    self_attn_every_n_layers: int = 2
    min_period: float = 4e-3
    max_period: float = 4.0

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise GraphBuildError(f"num_attention_heads {self.num_attention_heads} is not a "
                                  f"multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_size % 2:
            raise GraphBuildError("hidden_size must be even (sinusoidal time embedding)")

    def is_cross(self, layer: int) -> bool:
        return self.self_attn_every_n_layers > 0 and layer % self.self_attn_every_n_layers != 0

    @property
    def cross_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_cross(i)]


SMOLVLA_EXPERT = ActionExpertConfig()
PRESETS = {"smolvla-expert": SMOLVLA_EXPERT}


def tiny_vla(**overrides) -> ActionExpertConfig:
    """CI size: hidden 32, 4 layers (2 cross), 4 heads / 2 KV heads, chunk 6, context 4."""
    base = ActionExpertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, intermediate_size=64,
                              action_dim=6, chunk_size=6, vlm_context=4, vlm_kv_dim=16)
    return replace(base, **overrides)


def time_embedding_scale(dim: int, min_period: float, max_period: float) -> np.ndarray:
    """2π / period for the dim/2 log-spaced periods (float64 then f32, as LeRobot)."""
    fraction = np.linspace(0.0, 1.0, dim // 2, dtype=np.float64)
    period = min_period * (max_period / min_period) ** fraction
    return (1.0 / period * 2 * math.pi).astype(np.float32)


@dataclass
class VLAGraph:
    graph: Graph
    x_t: Value
    time: Value
    vlm_kv: dict[int, tuple[Value, Value]]
    velocity: Value
    target: Value | None = None
    loss: Value | None = None
    config: ActionExpertConfig | None = None


def action_expert(cfg: ActionExpertConfig, batch: int, loss: bool = True,
                  impl: str = "auto", fuse: bool | None = None) -> VLAGraph:
    """Inputs: ``x_t`` (B, chunk, action_dim), ``time`` (B,), ``vlm_k.{i}``/``vlm_v.{i}``
    (B, vlm_context, vlm_kv_dim) for each cross-attention layer i, and with ``loss`` the
    ``target`` velocity.  Output: ``velocity`` (B, chunk, action_dim).  ``impl``/``fuse``: as
    in :func:`~meganeura.models.llama.llama_lm` (fused projections by default with the loss)."""
    fuse = loss if fuse is None else fuse
    g = Graph("vla_expert")
    B, T, H = batch, cfg.chunk_size, cfg.hidden_size
    x_t = g.input("x_t", (B, T, cfg.action_dim))
    time = g.input("time", (B,))
    vlm = {i: (g.input(f"vlm_k.{i}", (B, cfg.vlm_context, cfg.vlm_kv_dim)),
               g.input(f"vlm_v.{i}", (B, cfg.vlm_context, cfg.vlm_kv_dim)))
           for i in cfg.cross_layers}

    a = dense(g, x_t, "action_in_proj", cfg.action_dim, H)
    scale = g.const(time_embedding_scale(H, cfg.min_period, cfg.max_period))
    ang = ops.unsqueeze(time, 1) * scale  # (B, H/2)
    temb = ops.concat([ops.sin(ang), ops.cos(ang)], 1)
    temb = ops.broadcast_to(ops.unsqueeze(temb, 1), (B, T, H))
    x = dense(g, ops.concat([a, temb], 2), "action_time_mlp_in", 2 * H, H)
    x = dense(g, ops.silu(x), "action_time_mlp_out", H, H)

    rope = RoPE(cfg.head_dim, cfg.rope_theta).tables(g, T, offset=cfg.vlm_context)
    for i in range(cfg.num_hidden_layers):
        p = f"lm_expert.layers.{i}"
        cross = cfg.is_cross(i)
        att = Attention(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        name=f"{p}.self_attn", kv_in=cfg.vlm_kv_dim if cross else None,
                        impl=impl, fuse=fuse)
        h = RMSNorm(H, cfg.rms_norm_eps, name=f"{p}.input_layernorm")(g, x)
        # cross layers: keys/values from the VLM, RoPE on the queries only
        x = x + att(g, h, kv=vlm[i] if cross else None, rope=rope)
        h = RMSNorm(H, cfg.rms_norm_eps, name=f"{p}.post_attention_layernorm")(g, x)
        x = x + SwiGLU(H, cfg.intermediate_size, name=f"{p}.mlp", fuse=fuse)(g, h)
    x = RMSNorm(H, cfg.rms_norm_eps, name="lm_expert.norm")(g, x)
    vel = dense(g, x, "action_out_proj", H, cfg.action_dim)
    out = VLAGraph(g, x_t, time, vlm, vel, config=cfg)
    if loss:
        out.target = g.input("target", (B, T, cfg.action_dim))
        out.loss = ops.mse_loss(vel, out.target)
    return out
