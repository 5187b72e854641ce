"""Tiny GGUF files written with the ``gguf`` package's writer, laid out as llama.cpp's
converter lays out a Llama: tensor names, permuted Q/K rows, quantized blocks, BPE metadata."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

GGUF_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
              "Q6_K"]
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82)}  # f16 d, dmin


def package_file(package: str, *parts: str) -> str | None:
    """A file inside an installed package, found without importing it (the model packages
    import their own plugin hosts)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    return path if os.path.exists(path) else None


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's ``permute`` (what the loader must undo)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _quantized(w: np.ndarray, kind: str, rng) -> tuple[np.ndarray, object]:
    """(raw data, type) of ``w`` stored as ``kind``.  K-quants, which gguf-py cannot encode,
    get random blocks with sane f16 scales: any block is a valid encoding of something."""
    import gguf
    from gguf import quants

    qt = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return w.astype(np.float32), qt
    if kind == "F16":
        return w.astype(np.float16), qt
    if kind not in _K_SCALE_OFFSETS:
        return quants.quantize(w.astype(np.float32), qt), qt
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n_blocks = w.size // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS[kind]:
        raw[:, off:off + 2] = (rng.uniform(0.002, 0.01, n_blocks).astype(np.float16)
                               .view(np.uint8).reshape(n_blocks, 2))
    return raw.reshape(w.shape[0], -1), qt


VOCAB = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "abc", "Ġa", "<s>",
                                                            "</s>"]
MERGES = ["a b", "ab c", "Ġ a"]


def write_tiny_llama(path, sd: dict, cfg, types: dict | None = None, arch: str = "llama",
                     tokenizer: bool = True, extra=None, seed: int = 0) -> None:
    """A GGUF of an HF-named Llama state dict ``sd`` (numpy) and its LlamaConfig ``cfg``;
    ``types`` maps HF names to a GGUF type (default F32); ``extra(writer)`` adds metadata."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(VOCAB)
        w.add_token_types([3 if t.startswith("<") else 1 for t in VOCAB])
        w.add_token_merges(MERGES)
        w.add_bos_token_id(VOCAB.index("<s>"))
        w.add_eos_token_id(VOCAB.index("</s>"))
    if extra:
        extra(w)
    for name, arr in _gguf_tensors(sd, cfg):
        data, qt = _quantized(arr, (types or {}).get(name[1], "F32"), rng)
        w.add_tensor(name[0], data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_tensors(sd: dict, cfg):
    """((gguf name, hf name), array) pairs, Q/K rows permuted the way llama.cpp stores them."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, arr in sd.items():
        arr = np.asarray(arr, dtype=np.float32)
        if name in top:
            yield (top[name], name), arr
            continue
        i, rest = name[len("model.layers."):].split(".", 1)
        key = rest[: -len(".weight")]
        if key == "self_attn.q_proj":
            arr = permute(arr, cfg.num_attention_heads)
        elif key == "self_attn.k_proj":
            arr = permute(arr, cfg.num_key_value_heads)
        yield (f"blk.{i}.{layer[key]}.weight", name), arr


def write_tiny_chat_llama(path) -> str:
    """A tiny Llama GGUF over ``VOCAB`` with random weights (embeddings at unit scale so the
    greedy tokens vary): the model of the finetune and batched-generate CLI tests."""
    from meganeura.init import init_leaves
    from meganeura.models.llama import llama_lm, tiny_llama

    cfg = tiny_llama(vocab_size=len(VOCAB), max_position_embeddings=64)
    sd = init_leaves(llama_lm(cfg, 1, 2, loss=False).graph, 0)
    sd["model.embed_tokens.weight"] = np.random.default_rng(0).normal(
        0, 1.0, sd["model.embed_tokens.weight"].shape)
    write_tiny_llama(path, sd, cfg)
    return str(path)
