"""Text tokenizers for the real models, built on Hugging Face's ``tokenizers`` library (the
``[models]`` extra): we never re-implement BPE or WordPiece, we only assemble the library's
pieces from what a model file stores.

* :func:`from_tokenizer_json` — an HF folder's ``tokenizer.json`` (BERT's WordPiece, …);
* :func:`byte_level_bpe` — a byte-level BPE from a vocabulary and merges (what a GGUF file
  stores as ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.merges``; see :mod:`meganeura.io.gguf`).

Both give a :class:`TextTokenizer`: encode/decode, the BOS/EOS ids generation needs, padded
batches for encoders, and the model's Jinja chat template.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError

__all__ = ["TokenizerError", "TextTokenizer", "from_tokenizer_json", "byte_level_bpe",
           "PRE_TOKENIZERS", "require"]


class TokenizerError(CheckpointError):
    """A tokenizer is missing, unreadable, or of a kind we cannot build."""


def require(module: str):
    """Import an optional dependency of the ``[models]`` extra, or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TokenizerError(f"the Python package {module!r} is needed for real models: "
                             "pip install 'meganeura[models]'") from None


# llama.cpp's digit-and-word splits, by the name its converter writes to tokenizer.ggml.pre
# (llama-vocab.cpp).  Each is (split regex or None, digits one by one).
_GPT2_SPLIT = None  # ByteLevel's own regex: 's|'t|… ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (_GPT2_SPLIT, False), "gpt-2": (_GPT2_SPLIT, False),
    "gpt2": (_GPT2_SPLIT, False),
    # STARCODER-style: each digit alone, then the GPT-2 split
    "smollm": (_GPT2_SPLIT, True), "starcoder": (_GPT2_SPLIT, True),
    "refact": (_GPT2_SPLIT, True), "codeshell": (_GPT2_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, False), "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False), "smaug-bpe": (_LLAMA3_SPLIT, False),
}


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the model-level settings the file gives: whether BOS is
    prepended, the EOS/pad ids, and the chat template (Jinja, as HF renders it)."""

    backend: object  # tokenizers.Tokenizer
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    source: str = ""
    special: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (BOS first when the model wants it; special tokens written in
        the text, such as ``<|im_start|>``, stay whole)."""
        ids = self.backend.encode(text, add_special_tokens=True).ids
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids],
                                   skip_special_tokens=skip_special_tokens)

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, attention mask) of shape (B, longest) — padded on the right with ``pad_id``,
        truncated to ``max_length`` — the way HF batches encoder inputs."""
        if max_length:  # the library truncates around the special tokens ([CLS] … [SEP])
            self.backend.enable_truncation(max_length)
        else:
            self.backend.no_truncation()
        rows = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=True)]
        n = max(len(r) for r in rows)
        ids = np.full((len(rows), n), self.pad_id or 0, dtype=np.int32)
        mask = np.zeros((len(rows), n), dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        return ids, mask

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, rendered by the model's own template in a
        sandboxed Jinja environment (as transformers renders it)."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the model has no chat template")
        jinja = require("jinja2.sandbox")
        env = jinja.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise TokenizerError(f"{self.source}: chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **self.special)


def from_tokenizer_json(folder, config: Mapping | None = None) -> TextTokenizer:
    """The tokenizer of an HF folder (``tokenizer.json``, plus ``tokenizer_config.json`` for
    the chat template and special tokens when present)."""
    import json

    tk = require("tokenizers")
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise TokenizerError(f"{folder}: no tokenizer.json (the model folder has no tokenizer)")
    try:
        backend = tk.Tokenizer.from_file(path)
    except Exception as e:  # the library raises plain Exceptions for corrupt files
        raise TokenizerError(f"{path}: unreadable tokenizer ({str(e)[:200]})") from None
    backend.no_padding()  # padding and truncation are ours (encode_batch)
    backend.no_truncation()
    tc: dict = {}
    tc_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(tc_path):
        try:
            with open(tc_path) as f:
                tc = json.load(f)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{tc_path}: unreadable ({e})") from None
    config = config or {}

    def tid(name):
        tok = tc.get(name)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        return backend.token_to_id(tok) if isinstance(tok, str) else None

    pad = tid("pad_token")
    pad = config.get("pad_token_id", 0) if pad is None else pad
    special = {k: tc[k] for k in ("bos_token", "eos_token") if isinstance(tc.get(k), str)}
    return TextTokenizer(backend, bos_id=tid("bos_token"), eos_id=tid("eos_token"), pad_id=pad,
                         chat_template=tc.get("chat_template"), source=path, special=special)


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str,
                   token_types: Sequence[int] | None, source: str) -> TextTokenizer:
    """A byte-level BPE (GPT-2 family) from its vocabulary (tokens already spelled in the
    GPT-2 byte alphabet, id = position), merges ("a b" strings, best first) and llama.cpp's
    pre-tokenizer name.  Tokens typed CONTROL (3) become special tokens, USER_DEFINED (4)
    added tokens, so neither is ever split."""
    tk = require("tokenizers")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{source}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not "
                             f"supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    split, digits = PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tk.Tokenizer(tk.models.BPE(vocab, pairs, fuse_unk=False))
    parts = [tk.pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        parts.append(tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        parts += [tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated"),
                  tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = tk.pre_tokenizers.Sequence(parts)
    backend.decoder = tk.decoders.ByteLevel()
    types = list(token_types or ())
    control = [tk.AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]
    user = [tk.AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == 4]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    return TextTokenizer(backend, source=source)
