"""Sentence embeddings with BERT-family encoders, as sentence-transformers computes them.

:class:`SentenceEncoder` reads an HF/sentence-transformers folder (``config.json``,
``model.safetensors``, ``tokenizer.json``; optionally ``modules.json``,
``1_Pooling/config.json`` and ``sentence_bert_config.json``), tokenizes a batch with padding,
and runs one compiled encoder graph per (batch, padded length).  Lengths are rounded up to a
multiple of 8 so that a handful of compiled graphs serve every batch (padding is masked, so
it changes nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from .compile import compile
from .io.hf import HFCheckpointError, load_hf
from .io.tokenizer import from_tokenizer_json
from .models.bert import bert_encoder

__all__ = ["SentenceEncoder", "sentence_settings"]


def _json(path: str, default):
    if not os.path.exists(path):
        return default
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{path}: unreadable ({e})") from None


def sentence_settings(folder) -> tuple[str, bool, int | None]:
    """(pooling "mean"|"cls", normalize, max_seq_length) from sentence-transformers' files;
    a plain HF folder gets what sentence-transformers builds for one: mean pooling, no
    normalisation."""
    folder = os.fspath(folder)
    modules = _json(os.path.join(folder, "modules.json"), [])
    kinds = [m.get("type", "") for m in modules if isinstance(m, dict)]
    normalize = any(k.endswith(".Normalize") for k in kinds)
    pool_dir = next((m.get("path") for m in modules
                     if isinstance(m, dict) and m.get("type", "").endswith(".Pooling")), None)
    pool = _json(os.path.join(folder, pool_dir or "1_Pooling", "config.json"), {})
    modes = [k[len("pooling_mode_"):] for k, v in pool.items()
             if k.startswith("pooling_mode_") and v]
    if not modes or modes == ["mean_tokens"]:
        pooling = "mean"
    elif modes == ["cls_token"]:
        pooling = "cls"
    else:
        raise HFCheckpointError(f"{folder}: pooling {modes} is not supported (mean_tokens or "
                                "cls_token)")
    max_len = _json(os.path.join(folder, "sentence_bert_config.json"), {}).get("max_seq_length")
    return pooling, normalize, max_len


class SentenceEncoder:
    """Sentence embeddings (N, hidden) of a list of texts.

    >>> enc = SentenceEncoder("all-MiniLM-L6-v2/")
    >>> vecs = enc.encode(["A cat.", "A dog sat on the mat."])      # L2-normalised rows

    ``compile_options`` go to :func:`meganeura.compile` (``backend``, ``device``, …)."""

    def __init__(self, folder, batch_size: int = 32, **compile_options):
        model = load_hf(folder)
        if model.kind != "bert":
            raise HFCheckpointError(f"{folder}: model_type {model.kind!r} is not an encoder "
                                    "for sentence embeddings (bert)")
        self.config, self.params = model.config, model.params
        self.tokenizer = from_tokenizer_json(folder, model.hf_config)
        self.pooling, self.normalize, max_len = sentence_settings(folder)
        self.max_length = min(max_len or self.config.max_position_embeddings,
                              self.config.max_position_embeddings)
        self.batch_size, self.options = batch_size, compile_options
        self._sessions: dict[tuple[int, int], object] = {}

    def session(self, batch: int, seq: int):
        """The compiled encoder for this shape (compiled on first use, then kept)."""
        key = (batch, seq)
        if key not in self._sessions:
            m = bert_encoder(self.config, batch, seq, self.pooling, self.normalize)
            s = compile(m.graph, outputs={"embedding": m.embedding}, **self.options)
            s.set_params(self.params, strict=True)
            self._sessions[key] = s
        return self._sessions[key]

    def encode(self, sentences: Sequence[str]) -> np.ndarray:
        """Embeddings (N, hidden), f32, in the order given."""
        if isinstance(sentences, str):
            sentences = [sentences]
        out = []
        for i in range(0, len(sentences), self.batch_size):
            ids, mask = self.tokenizer.encode_batch(sentences[i: i + self.batch_size],
                                                    self.max_length)
            seq = min(-(-ids.shape[1] // 8) * 8, self.max_length)
            pad = seq - ids.shape[1]
            ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=self.tokenizer.pad_id or 0)
            mask = np.pad(mask, ((0, 0), (0, pad)))
            res = self.session(*ids.shape).run(ids=ids, mask=mask,
                                               token_type_ids=np.zeros_like(ids))
            out.append(np.asarray(res["embedding"], dtype=np.float32))
        return np.concatenate(out, 0)
