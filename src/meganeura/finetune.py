"""Supervised fine-tuning of a loaded Llama model on prompt/response pairs (``meganeura
finetune``; docs/real-models.md).

Each pair is rendered the way ``meganeura generate`` will later see it: the prompt through the
model's chat template (with the generation prompt), then the response and the end of the turn.
The prompt is tokenized on its own, exactly as at generation time, so the model learns to
continue the very token sequence it will be given.  Labels are the token ids on the response
and ``IGNORE`` elsewhere (prompt and padding): the loss teaches the answers, not the
questions.  The checkpoint holds the parameters under their HF names, so ``generate
--checkpoint`` (or any HF-named loader) takes them as they are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import MeganeuraError

__all__ = ["IGNORE", "DataError", "Example", "read_pairs", "encode_pair", "encode_pairs",
           "build_session", "load_finetuned"]

IGNORE = -100  # HF's ignore_index: labels that carry no loss


class DataError(MeganeuraError):
    """A fine-tuning data file that cannot be used (one line: file, line number, why)."""


@dataclass
class Example:
    ids: list[int]
    n_prompt: int  # tokens before the response (no loss on them)


def read_pairs(path: str) -> list[tuple[str, str]]:
    """(prompt, response) of every non-blank line of a JSON-lines file; the first bad line is
    an error naming the file and the line, since a silently skipped pair is a silently
    different fine-tune."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise DataError(f"--data {path!r}: {e.strerror or e}") from None
    pairs = [_pair(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not pairs:
        raise DataError(f"{path}: no examples (expected JSON lines with \"prompt\" and "
                        "\"response\")")
    return pairs


def _pair(path: str, n: int, line: str) -> tuple[str, str]:
    """One line's pair, or a DataError that says what is wrong with it."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
    for key in ("prompt", "response"):
        if key not in obj:
            raise DataError(f"{path}:{n}: missing key {key!r}")
        if not isinstance(obj[key], str) or not obj[key]:
            raise DataError(f"{path}:{n}: {key!r} must be a non-empty string")
    return obj["prompt"], obj["response"]


def _raw_ids(tok, text: str) -> list[int]:
    """Token ids of a continuation (no BOS: it is not the start of the sequence)."""
    return list(tok.backend.encode(text, add_special_tokens=False).ids)


def prompt_text(tok, prompt: str) -> str:
    """The prompt as ``meganeura generate`` feeds it (chat template when the model has one)."""
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": prompt}])
    return prompt


def encode_pair(tok, prompt: str, response: str) -> Example:
    """Token ids of prompt + response + end of turn, and where the response starts.  With a
    chat template the end of turn is the template's own text after the assistant message (for
    ChatML ``<|im_end|>``, SmolLM2's EOS); without one it is the EOS token."""
    head = prompt_text(tok, prompt)
    ids = tok.encode(head)
    if tok.chat_template:
        full = tok.apply_chat_template([{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": response}],
                                       add_generation_prompt=False)
        tail = full[len(head):] if full.startswith(head) else response
        rest = _raw_ids(tok, tail)
    else:
        rest = _raw_ids(tok, response)
    if tok.eos_id is not None and tok.eos_id not in rest:
        rest.append(tok.eos_id)
    return Example(ids + rest, len(ids))


def encode_pairs(tok, pairs: Sequence[tuple[str, str]], seq_len: int, path: str = "data",
                 pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids, labels) of shape (N, seq_len) — right-padded, truncated to ``seq_len`` — and how
    many responses were cut.  A prompt that leaves no room for a response is an error (it
    would train nothing and silently shrink the data)."""
    ids = np.full((len(pairs), seq_len), pad_id, dtype=np.int32)
    labels = np.full((len(pairs), seq_len), IGNORE, dtype=np.int32)
    cut = 0
    for i, (p, r) in enumerate(pairs):
        ex = encode_pair(tok, p, r)
        if ex.n_prompt >= seq_len:
            raise DataError(f"{path}: example {i + 1}: the prompt is {ex.n_prompt} tokens, "
                            f"too long for --seq-len {seq_len} (no room for the response)")
        row = ex.ids[:seq_len]
        cut += len(ex.ids) > seq_len
        ids[i, :len(row)] = row
        labels[i, ex.n_prompt:len(row)] = row[ex.n_prompt:]
    return ids, labels, cut


def build_session(cfg, params: Mapping[str, np.ndarray], batch: int, seq_len: int,
                  optimizer, backend: str | None = None):
    """A training session of the causal LM on (batch, seq_len) blocks, started from
    ``params`` (every parameter required: fine-tuning from a partial model is a mistake)."""
    from .compile import compile
    from .models.llama import llama_lm

    m = llama_lm(cfg, batch, seq_len, loss=True, ignore_index=IGNORE)
    sess = compile(m.graph, loss=m.loss, optimizer=optimizer, backend=backend)
    sess.set_params({k: v for k, v in params.items() if k in sess.param_names}, strict=True)
    return sess


def load_finetuned(path: str, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``params`` with the checkpoint's tensors in place of the base weights; every parameter
    must be there with its shape, so a checkpoint of another model is refused, not mixed."""
    from .checkpoint import read_checkpoint

    if not os.path.isfile(path):
        raise DataError(f"--checkpoint {path!r} does not exist (write one with "
                        "'meganeura finetune')")
    tensors, _ = read_checkpoint(path)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise DataError(f"--checkpoint {path!r} lacks {len(missing)} parameters of this model "
                        f"(e.g. {missing[0]!r}): it was fine-tuned from another model")
    for k, v in params.items():
        if tensors[k].shape != np.shape(v):
            raise DataError(f"--checkpoint {path!r}: {k!r} has shape {tensors[k].shape}, this "
                            f"model's is {np.shape(v)}: it was fine-tuned from another model")
    return {k: tensors[k].astype(np.float32) for k in params}
