"""Autoregressive generation for the Llama models with a KV cache kept on the device.

Two compiled graphs share their parameters and the cache (``compile(share=...)``):

* prefill (one per prompt length): the whole prompt in one pass, writing cache rows 0..P-1;
* decode: one token at position ``pos`` (an i32 scalar input), writing row ``pos`` with
  ``dynamic_update_slice`` and attending to rows 0..pos under an additive mask.

Both are graphs whose only updates are the cache states (``Graph.set_update``) and no loss:
``Session.step`` runs them once and applies the updates, so the cache never leaves the GPU and
the prefix is never recomputed.  Sampling (greedy, temperature, top-k) runs on the host from
the returned logits (B, vocab): greedy, temperature, top-k, top-p.

Prompts of different lengths in one batch are left-padded (:func:`left_pad`) and run through
the padded variants of both graphs (input ``start`` (B,): per-row positions and a padding
mask), so every row generates what its prompt alone would (:meth:`LlamaGenerator.generate_batch`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .compile import compile
from .errors import FeedError
from .models.llama import LlamaConfig, cache_names, llama_decode, llama_prefill

__all__ = ["LlamaGenerator", "left_pad", "sample"]


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: int | None = None,
           rng: np.random.Generator | None = None, top_p: float | None = None) -> np.ndarray:
    """Next tokens (B,) from logits (B, V): argmax when ``temperature <= 0``, else a draw from
    softmax(logits / temperature) restricted to the ``top_k`` largest logits (if given) and
    then to the smallest set of most likely tokens whose probability reaches ``top_p``
    (nucleus sampling, if given and < 1)."""
    z = np.asarray(logits, dtype=np.float64)
    if temperature is None or temperature <= 0:
        return np.argmax(z, axis=-1).astype(np.int32)
    z = z / float(temperature)
    if top_k is not None and 0 < top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[..., -top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, -1)
        drop = np.cumsum(sp, -1) - sp >= top_p  # tokens after the nucleus is complete
        np.put_along_axis(sp, order, np.where(drop, 0.0, sp), -1)
        p = sp / sp.sum(axis=-1, keepdims=True)
    rng = rng if rng is not None else np.random.default_rng()
    u = rng.random(p.shape[:-1])[..., None]
    idx = (np.cumsum(p, axis=-1) < u).sum(axis=-1)
    return np.minimum(idx, p.shape[-1] - 1).astype(np.int32)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of different lengths as one batch: ``ids`` (B, P) left-padded with ``pad_id`` to
    the longest prompt, and ``start`` (B,), each row's first real token.  Left padding puts every
    row's last prompt token in the same column, so all rows decode at one cache position."""
    rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    if not rows:
        raise FeedError("left_pad: no prompts")
    empty = [i for i, r in enumerate(rows) if r.size == 0]
    if empty:
        raise FeedError(f"left_pad: prompt {empty[0]} is empty")
    P = max(r.size for r in rows)
    ids = np.full((len(rows), P), pad_id, dtype=np.int32)
    start = np.array([P - r.size for r in rows], dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, start[i]:] = r
    return ids, start


class LlamaGenerator:
    """Prefill + single-token decode over a device-resident KV cache.

    >>> gen = LlamaGenerator(cfg, params, max_len=64)
    >>> out = gen.generate(prompt_ids, max_new_tokens=20)             # greedy
    >>> out = gen.generate(prompt_ids, 20, temperature=0.8, top_k=40, seed=0)
    >>> new = LlamaGenerator(cfg, params, batch=3).generate_batch([[1, 2], [3], [4, 5, 6]], 20)

    ``batch`` prompts are decoded together; prompts of different lengths are left-padded
    (:func:`left_pad`) and run through the padded graphs (per-row positions, padding masked),
    compiled on first use and sharing parameters and cache with the plain ones.
    ``compile_options`` go to :func:`meganeura.compile` (``backend``, ``device``, …); ``impl``
    to the model builders."""

    def __init__(self, cfg: LlamaConfig, params: Mapping[str, np.ndarray] | None = None, *,
                 batch: int = 1, max_len: int = 256, impl: str = "auto", **compile_options):
        self.cfg, self.batch, self.max_len, self.impl = cfg, batch, max_len, impl
        self.options = compile_options
        dg = llama_decode(cfg, batch, max_len, impl=impl)
        self.decoder = compile(dg.graph, outputs={"logits": dg.logits}, **compile_options)
        self._padded_decoder = None
        self._prefill: dict[tuple[int, bool], object] = {}
        self.pos = 0
        self.start: np.ndarray | None = None  # per-row first real token after a padded prefill
        if params is not None:
            self.set_params(params)

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Model parameters by HF name (every one is required)."""
        self.decoder.set_params(params, strict=True)

    def prefill_session(self, prompt_len: int, padded: bool = False):
        """The compiled prefill for this prompt length (compiled on first use, then kept)."""
        key = (prompt_len, padded)
        if key not in self._prefill:
            pg = llama_prefill(self.cfg, self.batch, prompt_len, self.max_len, impl=self.impl,
                               padded=padded)
            self._prefill[key] = compile(pg.graph, outputs={"logits": pg.logits},
                                         share=self.decoder, **self.options)
        return self._prefill[key]

    def padded_decoder(self):
        """The decode step with per-row start positions (compiled on first use)."""
        if self._padded_decoder is None:
            dg = llama_decode(self.cfg, self.batch, self.max_len, impl=self.impl, padded=True)
            self._padded_decoder = compile(dg.graph, outputs={"logits": dg.logits},
                                           share=self.decoder, **self.options)
        return self._padded_decoder

    def prefill(self, ids: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        """Run the prompt ``ids`` (B, P) from position 0; returns the last position's logits.
        ``start`` (B,): left padding, row b's prompt begins at column ``start[b]``."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[0] != self.batch:
            raise FeedError(f"prefill: ids must be ({self.batch}, prompt_len), got {ids.shape}")
        P = ids.shape[1]
        if not 0 < P <= self.max_len:
            raise FeedError(f"prefill: prompt length {P} not in 1..{self.max_len}")
        feeds = {"ids": ids.astype(np.int32)}
        self.start = None
        if start is not None and np.any(start):
            start = np.asarray(start, dtype=np.int32)
            if start.shape != (self.batch,) or start.min() < 0 or start.max() >= P:
                raise FeedError(f"prefill: start must be ({self.batch},) in 0..{P - 1} (each "
                                f"row keeps at least one token), got {start.tolist()}")
            feeds["start"] = self.start = start
        out = self.prefill_session(P, self.start is not None).step(**feeds)
        self.pos = P
        return out["logits"]

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per sequence (B,) at the current position; returns logits (B, V)."""
        if self.pos >= self.max_len:
            raise FeedError(f"decode: the KV cache is full (max_len={self.max_len})")
        feeds = {"ids": np.asarray(tokens, dtype=np.int32).reshape(self.batch, 1),
                 "pos": np.array(self.pos, dtype=np.int32)}
        sess = self.decoder
        if self.start is not None:
            sess, feeds["start"] = self.padded_decoder(), self.start
        out = sess.step(**feeds)
        self.pos += 1
        return out["logits"]

    def generate(self, prompt: np.ndarray, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, seed: int | None = None,
                 eos_token_id: int | None = None, top_p: float | None = None) -> np.ndarray:
        """Prompt (B, P) followed by up to ``max_new_tokens`` generated tokens (B, P + n).
        Generation stops early once every sequence has produced ``eos_token_id``.  Prompts
        of different lengths: :meth:`generate_batch`."""
        prompt = self._rectangular(prompt)
        out = [prompt] + [t[:, None] for t in self.stream(
            prompt, max_new_tokens, temperature, top_k, seed, eos_token_id, top_p)]
        return np.concatenate(out, axis=1)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       temperature: float = 0.0, top_k: int | None = None,
                       seed: int | None = None, eos_token_id: int | None = None,
                       top_p: float | None = None, pad_id: int = 0) -> list[np.ndarray]:
        """One list of token ids per prompt (``batch`` prompts of any lengths, decoded
        together): each row's new tokens, ending at its first ``eos_token_id`` (included)."""
        ids, start = left_pad(prompts, pad_id)
        rows = [[] for _ in range(len(ids))]
        done = np.zeros(len(ids), dtype=bool)
        for tok in self.stream(ids, max_new_tokens, temperature, top_k, seed, eos_token_id,
                               top_p, start=start):
            for b in np.flatnonzero(~done):
                rows[b].append(int(tok[b]))
            if eos_token_id is not None:
                done |= tok == eos_token_id
        return [np.array(r, dtype=np.int32) for r in rows]

    def stream(self, prompt: np.ndarray, max_new_tokens: int, temperature: float = 0.0,
               top_k: int | None = None, seed: int | None = None,
               eos_token_id: int | None = None, top_p: float | None = None,
               start: np.ndarray | None = None):
        """:meth:`generate` one step at a time: yields each new token (B,) as soon as it is
        sampled (for streaming output); sequences that ended keep yielding ``eos_token_id``.
        ``start``: left padding of ``prompt`` (see :func:`left_pad`)."""
        prompt = self._rectangular(prompt)
        if prompt.shape[1] + max_new_tokens > self.max_len + 1:
            raise FeedError(f"generate: prompt {prompt.shape[1]} + {max_new_tokens} new tokens "
                            f"exceed max_len={self.max_len}")
        rng = np.random.default_rng(seed)
        logits = self.prefill(prompt, start)
        done = np.zeros(self.batch, dtype=bool)
        for i in range(max_new_tokens):
            tok = sample(logits, temperature, top_k, rng, top_p)
            if eos_token_id is not None:
                tok = np.where(done, eos_token_id, tok).astype(np.int32)
                done |= tok == eos_token_id
            yield tok
            if done.all() or i == max_new_tokens - 1:
                return
            logits = self.decode(tok)

    @staticmethod
    def _rectangular(prompt) -> np.ndarray:
        """(B, P) int32 token ids; ragged lists are refused with the way to run them."""
        try:
            prompt = np.asarray(prompt, dtype=np.int32)
        except ValueError:
            raise FeedError("generate: prompts of different lengths need generate_batch() "
                            "(left padding), not a ragged array") from None
        return prompt[None] if prompt.ndim == 1 else prompt

    def cache(self) -> dict[str, np.ndarray]:
        """The KV cache as numpy (for inspection; it lives on the device)."""
        return self.decoder._read(cache_names(self.cfg))
