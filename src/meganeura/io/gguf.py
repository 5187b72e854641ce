"""GGUF model files (llama.cpp's format), read through the ``gguf`` package — llama.cpp's own
reader and dequantizer — so the format is never re-implemented here.

:func:`load_gguf` turns a file into what :mod:`meganeura.io.hf` gives for a folder: a
:class:`~meganeura.models.llama.LlamaConfig` from the metadata, our (HF-named) f32 parameters,
plus the tokenizer and chat template stored in the file.

Three things differ from an HF checkpoint and are undone here:

* names: ``blk.{i}.attn_q.weight`` → ``model.layers.{i}.self_attn.q_proj.weight`` etc.;
* quantization: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K blocks are
  dequantized to f32 with ``gguf.quants.dequantize``;
* the Q/K row order: llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` so its
  RoPE kernel can rotate adjacent pairs; we use HF's half-split RoPE, so the permutation is
  inverted (:func:`unpermute_qk`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError
from .tokenizer import TextTokenizer, TokenizerError, byte_level_bpe, require

__all__ = ["GGUFError", "GGUFModel", "load_gguf", "gguf_config", "unpermute_qk",
           "SUPPORTED_TYPES", "read_gguf"]

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                   "Q5_K", "Q6_K")
ARCHITECTURES = ("llama",)

_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(CheckpointError):
    """A GGUF file is unreadable, incomplete, or holds something we cannot run."""


@dataclass
class GGUFModel:
    """What :func:`load_gguf` returns (``kind`` "llama", as :class:`~meganeura.io.hf.HFModel`)."""

    kind: str
    config: object
    params: dict[str, np.ndarray]
    tokenizer: TextTokenizer | None
    metadata: dict = field(default_factory=dict)
    path: str = ""


def read_gguf(path):
    """A ``gguf.GGUFReader`` over ``path``; any failure (absent file, bad magic, truncated
    header or tensor data) is a :class:`GGUFError` naming the file."""
    gguf = require("gguf")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # ValueError for bad magic/versions, numpy errors when truncated
        raise GGUFError(f"{path}: not a readable GGUF file — truncated or corrupt "
                        f"({type(e).__name__}: {str(e)[:200]})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{path}: truncated — tensor {t.name!r} ends at byte "
                            f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def _meta(reader, path: str, key: str, default=KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise GGUFError(f"{path}: metadata key {key!r} is missing")
        return default
    try:
        return f.contents()
    except Exception as e:
        raise GGUFError(f"{path}: metadata key {key!r} is unreadable ({e})") from None


def gguf_config(reader, path: str):
    """The LlamaConfig the metadata describes; architectures, RoPE scalings and partial
    rotary dimensions we do not implement are refused by name."""
    from ..models.llama import LlamaConfig

    arch = _meta(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture general.architecture={arch!r} "
                        f"(supported: {', '.join(ARCHITECTURES)})")

    def m(key, default=KeyError):
        return _meta(reader, path, f"{arch}.{key}", default)

    heads = m("attention.head_count")
    kv = m("attention.head_count_kv", heads)
    for key, v in (("attention.head_count", heads), ("attention.head_count_kv", kv)):
        if not isinstance(v, int):
            raise GGUFError(f"{path}: {arch}.{key}={v!r} (per-layer head counts are not "
                            "supported)")
    hidden = m("embedding_length")
    head_dim = m("attention.key_length", hidden // heads)
    rope_dim = m("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"{path}: {arch}.rope.dimension_count={rope_dim} differs from the head "
                        f"dimension {head_dim} (partial rotary embeddings are not supported)")
    scaling = m("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{path}: RoPE scaling {arch}.rope.scaling.type={scaling!r} is not "
                        "supported (only plain RoPE)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' (llama3 RoPE frequency scaling) "
                        "is not supported")
    vocab = m("vocab_size", None)
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data) \
            if "tokenizer.ggml.tokens" in reader.fields else _embd_rows(reader, path)
    try:
        return LlamaConfig(
            vocab_size=int(vocab), hidden_size=int(hidden), num_hidden_layers=m("block_count"),
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=int(head_dim),
            intermediate_size=m("feed_forward_length"),
            rms_norm_eps=_f32(m("attention.layer_norm_rms_epsilon")),
            rope_theta=_f32(m("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=m("context_length", 2048))
    except CheckpointError:
        raise
    except Exception as e:
        raise GGUFError(f"{path}: inconsistent model metadata ({e})") from None


def _f32(x) -> float:
    """The decimal a float32 metadata value was written from (1e-5, not 9.99999974e-06): its
    shortest round-tripping repr."""
    return float(str(np.float32(x)))


def _embd_rows(reader, path: str) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K projection rows: it stores each head's rows as
    interleaved (re, im) pairs for its adjacent-pair RoPE; HF's half-split RoPE wants the two
    halves.  ``n_head``: query heads for q_proj, KV heads for k_proj."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _hf_name(name: str) -> str | None:
    """Our (HF) parameter name of a GGUF tensor name, or None when unknown."""
    parts = name.split(".")
    if parts[-1] != "weight":
        return None
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    return None


def _dequantize(t, path: str) -> np.ndarray:
    from gguf import quants

    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {t.name!r} has quantization type {kind}, which is not "
                        f"supported (supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 first
    return np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type),
                                dtype=np.float32).reshape(shape)


def _tensors(reader, path: str, cfg) -> dict[str, np.ndarray]:
    out, unknown = {}, []
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        w = _dequantize(t, path)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        out[name] = w
    if unknown:
        raise GGUFError(f"{path}: tensors this llama model does not have: {sorted(unknown)}")
    return out


def gguf_tokenizer(reader, path: str) -> TextTokenizer:
    """The tokenizer stored in the metadata (byte-level BPE, ``tokenizer.ggml.model`` gpt2)
    with its special ids and chat template."""
    model = _meta(reader, path, "tokenizer.ggml.model", None)
    if model is None:
        raise GGUFError(f"{path}: no tokenizer (metadata key 'tokenizer.ggml.model' is "
                        "missing)")
    if model != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model={model!r} is not supported (only "
                        "byte-level BPE, 'gpt2')")
    tokens = _meta(reader, path, "tokenizer.ggml.tokens")
    merges = _meta(reader, path, "tokenizer.ggml.merges")
    types = _meta(reader, path, "tokenizer.ggml.token_type", None)
    pre = _meta(reader, path, "tokenizer.ggml.pre", "default")
    try:
        tok = byte_level_bpe(tokens, merges, pre, types, path)
    except TokenizerError as e:
        raise GGUFError(str(e)) from None
    tok.bos_id = _meta(reader, path, "tokenizer.ggml.bos_token_id", None)
    tok.eos_id = _meta(reader, path, "tokenizer.ggml.eos_token_id", None)
    tok.pad_id = _meta(reader, path, "tokenizer.ggml.padding_token_id", tok.eos_id)
    tok.add_bos = bool(_meta(reader, path, "tokenizer.ggml.add_bos_token", False))
    tok.chat_template = _meta(reader, path, "tokenizer.chat_template", None)
    tok.special = {k: tokens[i] for k, i in (("bos_token", tok.bos_id),
                                              ("eos_token", tok.eos_id))
                   if i is not None and 0 <= i < len(tokens)}
    return tok


def load_gguf(path, tokenizer: bool = True) -> GGUFModel:
    """Config, f32 parameters (HF names) and tokenizer of a llama-architecture GGUF file.
    Every failure is a :class:`GGUFError` naming the file and what is wrong or missing."""
    from ..io.hf import HFCheckpointError, map_params
    from ..models.llama import llama_lm

    path = os.fspath(path)
    reader = read_gguf(path)
    cfg = gguf_config(reader, path)
    tok = gguf_tokenizer(reader, path) if tokenizer else None
    tensors = _tensors(reader, path, cfg)
    expected = {n: v.shape for n, v in llama_lm(cfg, 1, 2, loss=False).graph.params.items()}
    try:
        params = map_params(tensors, expected)
    except HFCheckpointError as e:
        raise GGUFError(f"{path}: {e}") from None
    meta = {k: _meta(reader, path, k, None) for k in reader.fields
            if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}
    return GGUFModel("llama", cfg, params, tok, meta, path)
