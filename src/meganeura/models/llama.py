"""Llama-architecture causal LM (SmolLM2-135M and tiny test sizes).

Pre-norm decoder: ``x + attn(rmsnorm(x))`` then ``x + swiglu(rmsnorm(x))``; RoPE (HF half-split
convention); grouped-query attention; tied input/output embeddings by default.  Parameter
names are those of HF ``LlamaForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, …, ``model.norm.weight``; ``lm_head.weight`` only
when embeddings are untied), so HF checkpoints load as they are (:mod:`meganeura.io.hf`).

Graphs built here:
  * :func:`llama_lm` — training/inference on a (batch, seq) block: logits and next-token CE
    (HF semantics: ``labels`` aligned with ``ids``, shifted inside; ``ignore_index`` skipped).
  * :func:`llama_prefill` / :func:`llama_decode` — generation with a KV cache held on the GPU
    as graph states ``cache.{i}.k`` / ``cache.{i}.v`` of shape (batch, kv_heads, max_len,
    head_dim), written with ``dynamic_update_slice`` and ``Graph.set_update``
    (see :mod:`meganeura.generate`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from .. import ops
from ..dtypes import i32
from ..errors import GraphBuildError
from ..graph import Graph, Value
from ..nn.transformer import Attention, Embedding, RMSNorm, RoPE, SwiGLU, op_for

__all__ = ["LlamaConfig", "RopeScaling", "rope_settings", "rope_scaling_of", "SMOLLM2_135M",
           "tiny_llama", "LlamaGraph", "llama_lm", "llama_prefill", "llama_decode", "cache_names",
           "PRESETS"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of long-context checkpoints, HF ``rope_parameters`` names:
    ``linear`` (every frequency / factor) or ``llama3`` (long wavelengths / factor, short ones
    kept, a smooth blend between).  Both only change the inverse frequencies, so positions stay
    static tables; ``dynamic`` (depends on the sequence length at run time), ``yarn`` and
    ``longrope`` are refused by :func:`rope_scaling_of`."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float32 arithmetic, as transformers computes them)."""
        f32 = np.float32
        inv = np.asarray(inv_freq, f32)
        if self.rope_type == "linear":
            return (inv / f32(self.factor)).astype(f32)
        old = f32(self.original_max_position_embeddings)
        low_wavelen = old / f32(self.low_freq_factor)
        high_wavelen = old / f32(self.high_freq_factor)
        wavelen = f32(2 * np.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / f32(self.factor), inv).astype(f32)
        smooth = ((old / wavelen - f32(self.low_freq_factor))
                  / f32(self.high_freq_factor - self.low_freq_factor))
        blended = (1 - smooth) * scaled / f32(self.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, blended, scaled).astype(f32)

    def to_hf(self) -> dict:
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return asdict(self)


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters with HF ``LlamaConfig`` field names (defaults: SmolLM2-135M)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise GraphBuildError(f"num_attention_heads {self.num_attention_heads} is not a "
                                  f"multiple of num_key_value_heads {self.num_key_value_heads}")

    @classmethod
    def from_hf(cls, config: Mapping) -> LlamaConfig:
        """From an HF ``config.json`` dict (missing fields keep the defaults; ``head_dim``
        defaults to hidden_size / num_attention_heads as in HF).  RoPE settings are read from
        both layouts (see :func:`rope_settings`), so a transformers-5 folder does not silently
        fall back to the default theta."""
        names = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        kw = {k: config[k] for k in names if k in config and config[k] is not None}
        if "head_dim" not in kw and "hidden_size" in kw:
            kw["head_dim"] = kw["hidden_size"] // kw.get("num_attention_heads",
                                                         cls.num_attention_heads)
        if "num_key_value_heads" not in kw and "num_attention_heads" in kw:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
        theta = rope_settings(config)
        if theta is not None:
            kw["rope_theta"] = theta
        return cls(**kw, rope_scaling=rope_scaling_of(config))

    def to_hf(self) -> dict:
        """An HF-style ``config.json`` dict (LlamaForCausalLM)."""
        d = asdict(self)
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 attention_bias=False, mlp_bias=False,
                 rope_scaling=self.rope_scaling.to_hf() if self.rope_scaling else None,
                 torch_dtype="float32")
        return d

    @property
    def n_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h


SCALED_ROPE = ("linear", "llama3")


def _rope_params(config: Mapping) -> tuple[Mapping, str, str]:
    """(RoPE parameters, the key they came from, rope_type) of an HF config; a rope_type not
    implemented is refused rather than run with the wrong positions."""
    params = config.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = config.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, Mapping):
        raise GraphBuildError(f"{key} must be an object, got {params!r}")
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default",) + SCALED_ROPE:
        raise GraphBuildError(f"{key}.rope_type {kind!r} is not supported (implemented: "
                              f"default, {', '.join(SCALED_ROPE)}): {dict(params)!r}")
    return params, key, kind


def rope_scaling_of(config: Mapping) -> RopeScaling | None:
    """The ``linear``/``llama3`` frequency scaling of an HF config (either layout), or None."""
    params, key, kind = _rope_params(config)
    if kind == "default":
        return None
    names = ["factor"] + (["low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"] if kind == "llama3" else [])
    missing = [n for n in names if params.get(n) is None]
    if missing:
        raise GraphBuildError(f"{key}: {kind} RoPE scaling needs {missing}: {dict(params)!r}")
    vals = {n: params[n] for n in names}
    bad = [n for n, v in vals.items() if isinstance(v, bool) or not isinstance(v, (int, float))
           or not v > 0]
    if bad or (kind == "llama3" and vals["high_freq_factor"] <= vals["low_freq_factor"]):
        raise GraphBuildError(f"{key}: bad {kind} RoPE scaling values {vals!r} (positive "
                              "numbers; high_freq_factor > low_freq_factor)")
    if "original_max_position_embeddings" in vals:
        vals["original_max_position_embeddings"] = int(vals["original_max_position_embeddings"])
    return RopeScaling(kind, **{n: float(v) if n != "original_max_position_embeddings" else v
                                for n, v in vals.items()})


def rope_settings(config: Mapping) -> float | None:
    """RoPE theta of an HF config, from transformers 5's ``rope_parameters`` (``{"rope_theta",
    "rope_type", …}``) or the older top-level ``rope_theta`` + ``rope_scaling``; None when
    neither gives one.  Plain, linear and llama3 RoPE are implemented (see
    :func:`rope_scaling_of`); every other ``rope_type`` (dynamic, yarn, …) is refused rather than
    run with the wrong positions; two contradicting thetas are refused too."""
    params, key, _ = _rope_params(config)
    if key == "rope_parameters" and not ({"rope_theta", "rope_type", "type"} & set(params)):
        raise GraphBuildError(f"rope_parameters {dict(params)!r} has neither rope_theta nor "
                              "rope_type (per-layer-type RoPE is not supported)")
    top, nested = config.get("rope_theta"), params.get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise GraphBuildError(f"rope_theta {top!r} contradicts {key}.rope_theta {nested!r}")
    theta = nested if nested is not None else top
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                              or not theta > 0):
        raise GraphBuildError(f"rope_theta must be a positive number, got {theta!r}")
    return None if theta is None else float(theta)


SMOLLM2_135M = LlamaConfig()
PRESETS = {"smollm2-135m": SMOLLM2_135M}


def tiny_llama(**overrides) -> LlamaConfig:
    """A CI-sized config (2 layers, hidden 32, 4 heads / 2 KV heads, vocab 64)."""
    base = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, max_position_embeddings=256)
    return replace(base, **overrides)


# ------------------------------------------------------------------------------ the stack


@dataclass
class _ScaledRoPE(RoPE):
    """RoPE whose inverse frequencies carry the config's scaling (the tables follow)."""

    scaling: RopeScaling | None = None

    def inv_freq(self) -> np.ndarray:
        inv = super().inv_freq()
        return inv if self.scaling is None else self.scaling.apply(inv)


def _rope(cfg: LlamaConfig) -> RoPE:
    return _ScaledRoPE(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

# attend(layer, q, k, v) -> attention output (B, Hq, S, D); q/k after RoPE.
AttendFn = Callable[[int, Value, Value, Value], Value]


def _attn(cfg: LlamaConfig, i: int, impl: str = "auto", fuse: bool = True) -> Attention:
    return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.head_dim, name=f"model.layers.{i}.self_attn", impl=impl, fuse=fuse)


def _embedding(cfg: LlamaConfig, impl: str = "auto") -> Embedding:
    return Embedding(cfg.vocab_size, cfg.hidden_size, name="model.embed_tokens",
                     init_std=cfg.initializer_range, impl=impl)


def decoder(g: Graph, cfg: LlamaConfig, ids: Value, rope: tuple[Value, Value],
            attend: AttendFn, impl: str = "auto", fuse: bool = True) -> Value:
    """Embeddings through the final norm: (B, S) ids -> (B, S, hidden).  ``fuse``: q/k/v and
    gate/up projections as single GEMMs (see :func:`~meganeura.nn.transformer.fused_dense`)."""
    x = _embedding(cfg, impl)(g, ids)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        att = _attn(cfg, i, impl, fuse)
        h = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, name=f"{p}.input_layernorm")(g, x)
        q, k, v = att.project(g, h, rope=rope)
        x = x + att.output(g, attend(i, q, k, v))
        h = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, name=f"{p}.post_attention_layernorm")(g, x)
        x = x + SwiGLU(cfg.hidden_size, cfg.intermediate_size, name=f"{p}.mlp", fuse=fuse)(g, h)
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, name="model.norm")(g, x)


def lm_head(g: Graph, cfg: LlamaConfig, h: Value) -> Value:
    """Logits: ``h @ E.T`` with the tied embedding table, else the ``lm_head.weight`` param."""
    if cfg.tie_word_embeddings:
        w = g.leaves["model.embed_tokens.weight"].value
    else:
        from ..init import normal

        w = g.param("lm_head.weight", (cfg.vocab_size, cfg.hidden_size),
                    init=normal(cfg.initializer_range))
    return ops.matmul(h, w, transpose_b=True)


@dataclass
class LlamaGraph:
    graph: Graph
    ids: Value
    logits: Value
    labels: Value | None = None
    loss: Value | None = None
    config: LlamaConfig | None = None
    pos: Value | None = None  # decode graphs: the position input


def llama_lm(cfg: LlamaConfig, batch: int, seq: int, loss: bool = True,
             ignore_index: int = -100, impl: str = "auto",
             fuse: bool | None = None) -> LlamaGraph:
    """The causal LM on a (batch, seq) block of token ids (input ``ids``, i32).

    ``loss=True`` adds input ``labels`` (B, seq) aligned with ``ids`` (HF convention): the loss
    is the mean CE of ``logits[:, :-1]`` against ``labels[:, 1:]``, skipping ``ignore_index``.
    ``impl``: "auto"/"op" (attention, embedding ops) or "composite" (primitive ops only).
    ``fuse``: fused projection GEMMs; default: with the loss (training), not without."""
    fuse = loss if fuse is None else fuse
    g = Graph("llama")
    ids = g.input("ids", (batch, seq), dtype=i32)
    rope = _rope(cfg).tables(g, seq)

    def attend(i, q, k, v):
        return _attn(cfg, i, impl).attend(q, k, v, causal=True)

    h = decoder(g, cfg, ids, rope, attend, impl, fuse)
    logits = lm_head(g, cfg, h)
    out = LlamaGraph(g, ids, logits, config=cfg)
    if loss:
        if seq < 2:
            raise GraphBuildError("llama_lm: next-token loss needs seq >= 2")
        labels = g.input("labels", (batch, seq), dtype=i32)
        out.labels = labels
        out.loss = ops.cross_entropy(logits[:, :-1], labels[:, 1:], ignore_index=ignore_index)
    return out


# ------------------------------------------------------------------------------ KV cache


def cache_names(cfg: LlamaConfig) -> list[str]:
    return [f"cache.{i}.{kv}" for i in range(cfg.num_hidden_layers) for kv in ("k", "v")]


def _cache_states(g: Graph, cfg: LlamaConfig, batch: int, max_len: int):
    shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
    return [(g.state(f"cache.{i}.k", shape), g.state(f"cache.{i}.v", shape))
            for i in range(cfg.num_hidden_layers)]


def _write(cache: Value, new: Value, start: Value | int, impl: str = "auto") -> Value:
    """``cache`` with ``new`` written at ``start`` along the sequence axis (2)."""
    g = cache.graph
    fn = op_for("dynamic_update_slice", impl)
    if fn is not None:
        return fn(cache, new, start, 2)
    # composite: static start -> concat; dynamic start (one token) -> select.
    T, S = new.shape[2], cache.shape[2]
    if not isinstance(start, Value):
        parts = [cache[:, :, :start]] if start else []
        parts.append(new)
        if start + T < S:
            parts.append(cache[:, :, start + T:])
        return ops.concat(parts, 2)
    if T != 1:
        raise GraphBuildError("KV cache write at a dynamic position needs dynamic_update_slice "
                              "for more than one token")
    hit = g.const(np.arange(S, dtype=np.int32)).reshape(1, 1, S, 1).eq(start)
    return ops.where(hit, new, cache)


def _last_logits(g: Graph, cfg: LlamaConfig, h: Value) -> Value:
    return lm_head(g, cfg, ops.squeeze(h[:, -1:], 1))  # (B, V)


def _pad_mask(g: Graph, start: Value, kv_len: int) -> Value:
    """Additive (B, 1, 1, kv_len) mask hiding each row's left padding: key j of row b is
    visible only from ``start[b]`` (the row's first real token) on."""
    kidx = g.const(np.arange(kv_len, dtype=np.int32)).reshape(1, kv_len)
    visible = kidx >= ops.reshape(start, (start.shape[0], 1))
    return ops.where(visible, 0.0, float("-inf")).reshape(start.shape[0], 1, 1, kv_len)


def llama_prefill(cfg: LlamaConfig, batch: int, prompt_len: int, max_len: int,
                  impl: str = "auto", padded: bool = False) -> LlamaGraph:
    """Process a prompt (input ``ids`` (B, P)) from position 0: writes the KV cache rows 0..P-1
    and returns the logits of the last position (B, V).  Run it with ``Session.step``.

    ``padded``: prompts of different lengths, left-padded to P; input ``start`` (B,) i32 is
    each row's first real token.  Row b's tokens get positions 0, 1, … from ``start[b]`` (as
    HF derives them from the attention mask) and its padding is hidden from every query, so a
    row's logits are those of its prompt alone."""
    if not 0 < prompt_len <= max_len:
        raise GraphBuildError(f"prompt_len {prompt_len} must be in 1..max_len ({max_len})")
    g = Graph("llama_prefill")
    ids = g.input("ids", (batch, prompt_len), dtype=i32)
    caches = _cache_states(g, cfg, batch, max_len)
    mask = None
    if padded:
        start = g.input("start", (batch,), dtype=i32)
        steps = g.const(np.arange(prompt_len, dtype=np.int32)).reshape(1, 1, prompt_len)
        positions = steps - ops.reshape(start, (batch, 1, 1))  # (B, 1, P); < 0 on padding
        rope = _rope(cfg).tables(g, positions)
        mask = _pad_mask(g, start, prompt_len)
    else:
        rope = _rope(cfg).tables(g, prompt_len)

    def attend(i, q, k, v):
        ck, cv = caches[i]
        g.set_update(f"cache.{i}.k", _write(ck, k, 0, impl))
        g.set_update(f"cache.{i}.v", _write(cv, v, 0, impl))
        return _attn(cfg, i, impl).attend(q, k, v, causal=True, mask=mask)

    h = decoder(g, cfg, ids, rope, attend, impl, fuse=False)  # memory-bound: no weight copies
    return LlamaGraph(g, ids, _last_logits(g, cfg, h), config=cfg)


def llama_decode(cfg: LlamaConfig, batch: int, max_len: int,
                 impl: str = "auto", padded: bool = False) -> LlamaGraph:
    """One decode step: input ``ids`` (B, 1) at position ``pos`` (i32 scalar input) attends to
    cache rows 0..pos (the new token's K/V written at ``pos`` first); returns logits (B, V).

    ``padded``: after a padded prefill (see :func:`llama_prefill`); input ``start`` (B,) i32,
    row b's token sits at position ``pos - start[b]`` and never sees cache rows < start[b]."""
    g = Graph("llama_decode")
    ids = g.input("ids", (batch, 1), dtype=i32)
    pos = g.input("pos", (), dtype=i32)
    caches = _cache_states(g, cfg, batch, max_len)
    start = g.input("start", (batch,), dtype=i32) if padded else None
    positions = ops.reshape(pos - start, (batch, 1, 1)) if padded else ops.reshape(pos, (1,))
    rope = _rope(cfg).tables(g, positions)
    kidx = g.const(np.arange(max_len, dtype=np.int32))
    mask = ops.where(kidx <= pos, 0.0, float("-inf")).reshape(1, 1, 1, max_len)
    if padded:
        mask = mask + _pad_mask(g, start, max_len)

    def attend(i, q, k, v):
        ck, cv = caches[i]
        nk, nv = _write(ck, k, pos, impl), _write(cv, v, pos, impl)
        g.set_update(f"cache.{i}.k", nk)
        g.set_update(f"cache.{i}.v", nv)
        return _attn(cfg, i, impl).attend(q, nk, nv, mask=mask)

    h = decoder(g, cfg, ids, rope, attend, impl, fuse=False)  # memory-bound: no weight copies
    return LlamaGraph(g, ids, _last_logits(g, cfg, h), config=cfg, pos=pos)
