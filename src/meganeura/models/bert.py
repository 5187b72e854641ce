"""BERT-family encoders (HF ``model_type`` bert; all-MiniLM-L6-v2 and kin) and the
sentence-transformers embedding head.

Post-LN encoder: ``x = LN(x + attn(x))`` then ``x = LN(x + fc2(gelu(fc1(x))))``; absolute
position embeddings and token-type embeddings summed with the word embeddings, then a
LayerNorm.  Padding is handled with an additive -inf key mask built from the attention mask,
so padded positions change nothing in the real ones.  Parameter names are HF ``BertModel``'s
(``embeddings.word_embeddings.weight``, ``encoder.layer.{i}.attention.self.query.weight``, …),
so checkpoints load as they are (:mod:`meganeura.io.hf`; the unused ``pooler`` is skipped).

:func:`bert_encoder` builds the graph: inputs ``ids``, ``mask`` (1 = token, 0 = padding) and
``token_type_ids`` (B, S) i32; outputs the last hidden state and the sentence embedding —
masked mean pooling (or the CLS vector) and optional L2 normalisation, as sentence-transformers'
``Pooling`` and ``Normalize`` modules compute them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from .. import ops
from ..dtypes import f32, i32
from ..errors import GraphBuildError
from ..graph import Graph, Value
from ..nn.transformer import LayerNorm, _heads, _merge_heads, attention, dense, embed

__all__ = ["BertConfig", "BertGraph", "bert_encoder", "tiny_bert", "GELU_APPROXIMATE"]

# HF hidden_act names → ops.gelu's ``approximate``
GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertConfig:
    """Hyperparameters with HF ``BertConfig`` field names (defaults: all-MiniLM-L6-v2)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise GraphBuildError(f"hidden_size {self.hidden_size} is not a multiple of "
                                  f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in GELU_APPROXIMATE:
            raise GraphBuildError(f"hidden_act {self.hidden_act!r} is not supported "
                                  f"(supported: {', '.join(GELU_APPROXIMATE)})")
        if self.position_embedding_type != "absolute":
            raise GraphBuildError(f"position_embedding_type {self.position_embedding_type!r} "
                                  "is not supported (only 'absolute')")

    @classmethod
    def from_hf(cls, config: Mapping) -> BertConfig:
        """From an HF ``config.json`` dict (missing fields keep the defaults)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: config[k] for k in names if k in config and config[k] is not None})

    def to_hf(self) -> dict:
        from dataclasses import asdict

        return asdict(self) | {"model_type": "bert", "architectures": ["BertModel"]}


def tiny_bert(**overrides) -> BertConfig:
    """A CI-sized config (2 layers, hidden 32, 4 heads, vocab 64)."""
    from dataclasses import replace

    base = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64)
    return replace(base, **overrides)


@dataclass
class BertGraph:
    graph: Graph
    ids: Value
    mask: Value
    token_type_ids: Value
    hidden: Value  # (B, S, H) last hidden state
    embedding: Value  # (B, H) pooled (and normalized) sentence embedding
    config: BertConfig | None = None


def _embeddings(g: Graph, cfg: BertConfig, ids: Value, types: Value) -> Value:
    """word + position + token-type embeddings, then LayerNorm (BertEmbeddings)."""
    B, S = ids.shape
    h = cfg.hidden_size
    p = "embeddings"
    table = g.param(f"{p}.word_embeddings.weight", (cfg.vocab_size, h))
    pos = g.param(f"{p}.position_embeddings.weight", (cfg.max_position_embeddings, h))
    tt = g.param(f"{p}.token_type_embeddings.weight", (cfg.type_vocab_size, h))
    x = embed(ids, table) + embed(g.const(np.arange(S, dtype=np.int32)), pos)
    x = x + embed(types, tt)
    return LayerNorm(h, cfg.layer_norm_eps, name=f"{p}.LayerNorm")(g, x)


def _layer(g: Graph, cfg: BertConfig, i: int, x: Value, key_mask: Value,
           impl: str) -> Value:
    """One post-LN encoder layer (BertLayer)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    d = h // n
    p = f"encoder.layer.{i}"
    q, k, v = (_heads(dense(g, x, f"{p}.attention.self.{w}", h, h), n, d)
               for w in ("query", "key", "value"))
    o = _merge_heads(attention(q, k, v, mask=key_mask, impl=impl))
    x = LayerNorm(h, cfg.layer_norm_eps, name=f"{p}.attention.output.LayerNorm")(
        g, x + dense(g, o, f"{p}.attention.output.dense", h, h))
    f = dense(g, x, f"{p}.intermediate.dense", h, cfg.intermediate_size)
    f = ops.gelu(f, GELU_APPROXIMATE[cfg.hidden_act])
    return LayerNorm(h, cfg.layer_norm_eps, name=f"{p}.output.LayerNorm")(
        g, x + dense(g, f, f"{p}.output.dense", cfg.intermediate_size, h))


def bert_encoder(cfg: BertConfig, batch: int, seq: int, pooling: str = "mean",
                 normalize: bool = True, impl: str = "auto") -> BertGraph:
    """The encoder on (batch, seq) token ids with an attention mask; ``pooling`` "mean"
    (masked mean over tokens, sentence-transformers' default) or "cls"; ``normalize``: L2
    normalisation of the pooled vector (``F.normalize``, eps 1e-12)."""
    if not 0 < seq <= cfg.max_position_embeddings:
        raise GraphBuildError(f"seq {seq} must be in 1..max_position_embeddings "
                              f"({cfg.max_position_embeddings})")
    if pooling not in ("mean", "cls"):
        raise GraphBuildError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    g = Graph("bert")
    ids = g.input("ids", (batch, seq), dtype=i32)
    mask = g.input("mask", (batch, seq), dtype=i32)
    types = g.input("token_type_ids", (batch, seq), dtype=i32)
    m = mask.cast(f32)
    key_mask = ops.where(m > 0.5, 0.0, float("-inf")).reshape(batch, 1, 1, seq)
    x = _embeddings(g, cfg, ids, types)
    for i in range(cfg.num_hidden_layers):
        x = _layer(g, cfg, i, x, key_mask, impl)
    if pooling == "cls":
        e = ops.squeeze(x[:, :1], 1)
    else:
        mm = ops.unsqueeze(m, -1)
        count = ops.maximum(ops.sum(mm, 1), 1e-9)
        e = ops.sum(x * mm, 1) / count
    if normalize:
        norm = ops.sqrt(ops.sum(ops.square(e), -1, keepdims=True))
        e = e / ops.maximum(norm, 1e-12)
    return BertGraph(g, ids, mask, types, x, e, cfg)
