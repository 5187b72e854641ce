"""A real fine-tune of SmolLM2-135M-Instruct on examples/data/style.jsonl (pirate speak), for
docs/real-models.md: loss curve (PNG), wall time, tokens/s, planned and measured peak device
memory, and the chat answers to held-out prompts before and after (greedy, batched).

The last ``--held-out`` pairs of the data file are never trained on: their prompts are the
chat questions.  Training stops after ``--epochs`` or ``--max-seconds`` of steps, whichever
comes first (the LR schedule is planned for the epochs).  Measured peak memory is the GPU's
``nvidia-smi`` memory.used sampled every 0.2 s, minus its value before the session existed
(None without nvidia-smi).

    python bench/finetune_h200.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --backend dawn \
        --out-dir results/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class GPUMemory:
    """Peak of nvidia-smi's memory.used (MiB) over the ``with`` block, minus the baseline."""

    def __init__(self):
        self.base = self.peak = self._read()
        self._stop = threading.Event()

    @staticmethod
    def _read() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=5).stdout
            return float(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            v = self._read()
            if v is not None:
                self.peak = max(self.peak or 0.0, v)

    def __enter__(self):
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def used_mib(self) -> float | None:
        return None if self.base is None else self.peak - self.base


def chat(gen, tok, prompts: list[str], new: int) -> list[str]:
    """Greedy answers of the batched generator (one left-padded batch)."""
    from meganeura.finetune import prompt_text

    ids = [tok.encode(prompt_text(tok, p)) for p in prompts]
    rows = gen.generate_batch(ids, new, eos_token_id=tok.eos_id, pad_id=tok.eos_id)
    return [tok.decode([int(t) for t in r]) for r in rows]


def train(sess, ids, labels, a) -> tuple[list[float], float, int]:
    """Shuffled epochs until ``--epochs`` or ``--max-seconds``: (losses, seconds, steps)."""
    per_epoch = len(ids) // a.batch
    losses: list[float] = []
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        order = np.random.default_rng([a.seed, epoch]).permutation(len(ids))
        for b in range(per_epoch):
            sel = order[b * a.batch:(b + 1) * a.batch]
            losses.append(float(sess.step(ids=ids[sel], labels=labels[sel]).loss))
            if len(losses) % 20 == 0:
                print(f"  step {len(losses)}: loss {losses[-1]:.4f} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
            if time.perf_counter() - t0 > a.max_seconds:
                return losses, time.perf_counter() - t0, len(losses)
    return losses, time.perf_counter() - t0, len(losses)


def plot(losses: list[float], per_epoch: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.8, label="step loss")
    k = min(per_epoch, len(losses))
    ax.plot(np.arange(k, len(losses) + 1), np.convolve(losses, np.ones(k) / k, "valid"),
            lw=2, label=f"mean of {k} steps (one epoch)")
    ax.set(xlabel="step", ylabel="cross-entropy (response tokens)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--data", default="examples/data/style.jsonl")
    p.add_argument("--backend", default="dawn")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-seconds", type=float, default=75.0)
    p.add_argument("--held-out", type=int, default=4)
    p.add_argument("--new", type=int, default=40, help="tokens per chat answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", required=True)
    a = p.parse_args(argv)
    from meganeura import optim
    from meganeura.finetune import build_session, encode_pairs, read_pairs
    from meganeura.generate import LlamaGenerator
    from meganeura.io.gguf import load_gguf

    m = load_gguf(a.gguf)
    tok = m.tokenizer
    pairs = read_pairs(a.data)
    held, pairs = pairs[-a.held_out:], pairs[:-a.held_out]
    ids, labels, cut = encode_pairs(tok, pairs, a.seq_len, a.data, tok.eos_id)
    per_epoch = len(ids) // a.batch
    questions = [q for q, _ in held]
    gen = LlamaGenerator(m.config, m.params, batch=len(questions), max_len=a.seq_len,
                         backend=a.backend)
    before = chat(gen, tok, questions, a.new)
    sched = optim.WarmupCosine(a.lr, warmup_steps=10, total_steps=per_epoch * a.epochs,
                               min_lr=a.lr * 0.05)
    with GPUMemory() as mem:
        t = time.perf_counter()
        sess = build_session(m.config, m.params, a.batch, a.seq_len,
                             optim.AdamW(lr=sched, weight_decay=0.0), a.backend)
        compile_s = time.perf_counter() - t
        losses, secs, steps = train(sess, ids, labels, a)
    planned = sess.memory_report() if hasattr(sess, "memory_report") else {}
    gen.set_params(sess.get_params())
    after = chat(gen, tok, questions, a.new)
    res = {"backend": a.backend, "device": getattr(getattr(sess, "dev", None), "adapter_name",
                                                    "numpy"),
           "examples": len(ids), "held_out": len(held), "cut": cut, "seq_len": a.seq_len,
           "batch": a.batch, "lr": a.lr, "steps": steps, "epochs_planned": a.epochs,
           "per_epoch": per_epoch, "compile_s": compile_s, "train_s": secs,
           "tokens_s": steps * a.batch * a.seq_len / secs, "ms_per_step": 1e3 * secs / steps,
           "loss_first_epoch": float(np.mean(losses[:per_epoch])),
           "loss_last_epoch": float(np.mean(losses[-per_epoch:])),
           "measured_peak_mib": mem.used_mib(), "planned": planned,
           "chat": [{"prompt": q, "want_style": r, "before": b, "after": f}
                    for (q, r), b, f in zip(held, before, after)], "losses": losses}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "finetune.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    plot(losses, per_epoch, os.path.join(a.out_dir, "finetune-smollm2-loss.png"),
         f"SmolLM2-135M fine-tune, {a.backend}, batch {a.batch} x seq {a.seq_len}")
    print(f"{steps} steps in {secs:.1f} s ({res['ms_per_step']:.0f} ms/step, "
          f"{res['tokens_s']:.0f} tokens/s); loss {res['loss_first_epoch']:.3f} -> "
          f"{res['loss_last_epoch']:.3f}; compile {compile_s:.1f} s; measured peak "
          f"{res['measured_peak_mib']} MiB")
    for c in res["chat"]:
        print(f"Q: {c['prompt']}\n  before: {c['before']!r}\n  after:  {c['after']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
