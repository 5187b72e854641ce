"""PyTorch twins (plain torch.nn, written from the HF formulas) of the transformer models, with
weight copying both ways.  Module paths equal HF's, so ``state_dict()`` keys are the HF
parameter names (and ours).  Test-only: torch is not a dependency of meganeura."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

# ------------------------------------------------------------------------------ weights


def params_of(module: nn.Module, skip=()) -> dict[str, np.ndarray]:
    """Twin parameters as float32 numpy, by name (HF names)."""
    return {k: v.detach().cpu().numpy().astype(np.float32)
            for k, v in module.state_dict().items() if k not in skip}


def load_into(module: nn.Module, params: dict[str, np.ndarray], skip=()) -> None:
    """Copy our parameters into the twin (every twin parameter must be given)."""
    sd = module.state_dict()
    missing = [k for k in sd if k not in params and k not in skip]
    assert not missing, f"missing {missing}"
    with torch.no_grad():
        for k, t in sd.items():
            if k in params:
                t.copy_(torch.from_numpy(np.asarray(params[k])).to(t.dtype))


def grads_of(module: nn.Module, skip=()) -> dict[str, np.ndarray]:
    return {k: p.grad.detach().cpu().numpy() for k, p in module.named_parameters()
            if k not in skip and p.grad is not None}


# ------------------------------------------------------------------------------ pieces


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(head_dim, theta, positions, dtype=torch.float32):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def eager_attention(q, k, v, scale, mask=None):
    """q (B,Hq,S,D), k/v (B,Hkv,Skv,D): HF repeat_kv + eager softmax."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


def causal(sq, skv, offset=0, dtype=torch.float32, device=None):
    i = torch.arange(sq, device=device)[:, None] + offset
    j = torch.arange(skv, device=device)[None, :]
    return torch.where(j <= i, 0.0, float("-inf")).to(dtype)


class GQAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, kv_in=None, out_name="o_proj",
                 q_bias=False, k_bias=False, v_bias=False, o_bias=False):
        super().__init__()
        self.h, self.kvh, self.d = heads, kv_heads, head_dim
        kv_in = kv_in or hidden
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=q_bias)
        self.k_proj = nn.Linear(kv_in, kv_heads * head_dim, bias=k_bias)
        self.v_proj = nn.Linear(kv_in, kv_heads * head_dim, bias=v_bias)
        setattr(self, out_name, nn.Linear(heads * head_dim, hidden, bias=o_bias))
        self.out_name = out_name

    def forward(self, x, kv=None, rope=None, rope_q_only=False, mask=None):
        B, S, _ = x.shape
        ks, vs = (x, x) if kv is None else (kv if isinstance(kv, tuple) else (kv, kv))
        q = self.q_proj(x).view(B, S, self.h, self.d).transpose(1, 2)
        k = self.k_proj(ks).view(B, ks.shape[1], self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(vs).view(B, vs.shape[1], self.kvh, self.d).transpose(1, 2)
        if rope is not None:
            q = apply_rope(q, *rope)
            if not rope_q_only:
                k = apply_rope(k, *rope)
        o = eager_attention(q, k, v, self.d ** -0.5, mask)
        o = o.transpose(1, 2).reshape(B, S, self.h * self.d)
        return getattr(self, self.out_name)(o)


class SwiGLU(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ------------------------------------------------------------------------------ Llama


class LlamaLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads,
                                     c.num_key_value_heads, c.head_dim)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, rope, mask):
        x = x + self.self_attn(self.input_layernorm(x), rope=rope, mask=mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """HF LlamaForCausalLM's forward (eager attention) with HF parameter names."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_skip(self):
        return ("lm_head.weight",) if self.config.tie_word_embeddings else ()

    def forward(self, ids, labels=None, ignore_index=-100):
        c = self.config
        S = ids.shape[1]
        rope = rope_cos_sin(c.head_dim, c.rope_theta, torch.arange(S, device=ids.device))
        x = self.model.embed_tokens(ids)
        mask = causal(S, S, device=ids.device)
        for layer in self.model.layers:
            x = layer(x, rope, mask)
        logits = self.lm_head(self.model.norm(x))
        if labels is None:
            return logits, None
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, c.vocab_size),
                               labels[:, 1:].reshape(-1).long(), ignore_index=ignore_index)
        return logits, loss


# ------------------------------------------------------------------------------ Whisper encoder


class WhisperLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.d_model
        self.self_attn = GQAttention(d, c.encoder_attention_heads, c.encoder_attention_heads,
                                     d // c.encoder_attention_heads, out_name="out_proj",
                                     q_bias=True, v_bias=True, o_bias=True)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.d_model
        self.conv1 = nn.Conv1d(c.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, d)
        self.embed_positions.requires_grad_(False)
        self.layers = nn.ModuleList(WhisperLayer(c) for _ in range(c.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel):
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperClassifier(nn.Module):
    """Encoder + mean pool + linear head (our training task)."""

    skip = ("encoder.embed_positions.weight",)

    def __init__(self, c):
        super().__init__()
        self.encoder = WhisperEncoder(c)
        self.head = nn.Linear(c.d_model, c.num_classes)

    def forward(self, mel, labels=None):
        h = self.encoder(mel)
        logits = self.head(h.mean(1))
        loss = None if labels is None else F.cross_entropy(logits, labels.long())
        return h, logits, loss


# ------------------------------------------------------------------------------ VLA expert


def time_embedding(time, dim, min_period, max_period):
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    scale = (1.0 / period * 2 * math.pi).to(torch.float32)
    x = scale[None, :] * time[:, None]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=1)


class ExpertLayer(nn.Module):
    def __init__(self, c, cross):
        super().__init__()
        self.cross = cross
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads,
                                     c.num_key_value_heads, c.head_dim,
                                     kv_in=c.vlm_kv_dim if cross else None)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, rope, kv):
        h = self.input_layernorm(x)
        if self.cross:
            x = x + self.self_attn(h, kv=kv, rope=rope, rope_q_only=True)
        else:
            x = x + self.self_attn(h, rope=rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LMExpert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layers = nn.ModuleList(ExpertLayer(c, c.is_cross(i))
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class ActionExpert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        h = c.hidden_size
        self.action_in_proj = nn.Linear(c.action_dim, h)
        self.action_time_mlp_in = nn.Linear(2 * h, h)
        self.action_time_mlp_out = nn.Linear(h, h)
        self.lm_expert = LMExpert(c)
        self.action_out_proj = nn.Linear(h, c.action_dim)

    def forward(self, x_t, time, vlm_kv, target=None):
        """vlm_kv: {layer index: (k, v)} with (B, ctx, vlm_kv_dim) tensors."""
        c = self.config
        B, T, _ = x_t.shape
        a = self.action_in_proj(x_t)
        te = time_embedding(time, c.hidden_size, c.min_period, c.max_period)
        te = te[:, None, :].expand(B, T, c.hidden_size)
        x = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, te], -1))))
        rope = rope_cos_sin(c.head_dim, c.rope_theta,
                            torch.arange(T, device=x_t.device) + c.vlm_context)
        for i, layer in enumerate(self.lm_expert.layers):
            x = layer(x, rope, vlm_kv.get(i))
        v = self.action_out_proj(self.lm_expert.norm(x))
        loss = None if target is None else F.mse_loss(v, target)
        return v, loss
