"""Decode speed of SmolLM2-135M-Instruct: meganeura (Dawn, wgpu-native) against transformers'
``generate`` (eager; static KV cache + torch.compile) on the same GPU, same weights, same run.

Both sides get the same chat prompts (batch 8: eight different questions, left-padded with an
attention mask) and generate exactly ``--new`` tokens greedily (no early stop).  Reported:
end-to-end tokens/s (batch x new tokens / wall time of the whole generate call: prefill, every
decode step, the host-side argmax) for both, and for meganeura also the decode-only rate
(after the first token).  transformers runs in f32 with TF32 off (our strict f32 contract);
its model is built from the very parameters our GGUF loader produced (tests/io/test_gguf.py
shows they equal transformers' own GGUF loader to 1e-6), and the prompt logits of both sides
are compared first.

``--artifact DIR``: also export the batch-1 decode program (max_len 256) with f32 and f16
weights and time ``mn.load_program`` (size on disk, load, first step).

    python bench/generate_bench.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --impls dawn,wgpu \
        --torch eager,compile --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

QUESTIONS = ["What is the capital of France?", "Hi", "Name three colors.",
             "Why is the sky blue? Explain briefly.", "Write a haiku about the sea.",
             "What is 12 times 7?", "Give me a tip for learning Python.", "Describe a cat."]
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def chat_ids(tok, batch: int) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            for q in QUESTIONS[:batch]]


def ours(cfg, params, backend: str, prompts, new: int) -> dict:
    """Tokens/s of LlamaGenerator (compile and a short warm-up first, not timed)."""
    from meganeura.generate import LlamaGenerator

    t = time.perf_counter()
    gen = LlamaGenerator(cfg, params, batch=len(prompts), max_len=max(map(len, prompts)) + new,
                         backend=backend)
    gen.generate_batch(prompts, 4)  # compiles prefill and decode, warms the pipelines
    compile_s = time.perf_counter() - t
    t1, first = time.perf_counter(), None
    rows = [[] for _ in prompts]
    from meganeura.generate import left_pad

    ids, start = left_pad(prompts)
    for tok in gen.stream(ids, new, start=start):
        first = first or time.perf_counter()
        for b, r in enumerate(rows):
            r.append(int(tok[b]))
    total = time.perf_counter() - t1
    B = len(prompts)
    return {"tokens_s": B * new / total, "decode_tokens_s": B * (new - 1) / (time.perf_counter()
            - first), "ttft_ms": (first - t1) * 1e3, "compile_s": compile_s, "tokens": rows}


DEV = "cuda"


def _sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def hf_model(cfg, params):
    """transformers' LlamaForCausalLM (f32, TF32 off, SDPA) holding our parameters."""
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hcfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items()
                                       if k not in ("rope_scaling", "torch_dtype")})
    model = transformers.LlamaForCausalLM(hcfg)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                                                 params.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.to(DEV, torch.float32).eval()


def hf_generate(model, prompts, new: int, compiled: bool) -> dict:
    import torch

    from meganeura.generate import left_pad

    ids, start = left_pad(prompts)
    mask = (np.arange(ids.shape[1])[None] >= start[:, None]).astype(np.int64)
    kw = dict(input_ids=torch.from_numpy(ids).long().to(DEV),
              attention_mask=torch.from_numpy(mask).to(DEV), max_new_tokens=new,
              min_new_tokens=new, do_sample=False, pad_token_id=0)
    if compiled:
        kw.update(cache_implementation="static")
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(2 if compiled else 1):  # warm-up (compiles / records graphs)
            model.generate(**kw)
        _sync()
        warm = time.perf_counter() - t
        t1 = time.perf_counter()
        out = model.generate(**kw)
        _sync()
    total = time.perf_counter() - t1
    return {"tokens_s": len(prompts) * new / total, "warmup_s": warm,
            "tokens": out[:, ids.shape[1]:].cpu().numpy().tolist()}


def check_logits(cfg, params, model, prompt) -> float:
    """Relative L2 of our GPU prefill logits vs transformers' on one prompt."""
    import torch

    from meganeura.generate import LlamaGenerator

    gen = LlamaGenerator(cfg, params, max_len=len(prompt) + 1)
    ours_lg = gen.prefill(np.array([prompt]))[0]
    with torch.no_grad():
        theirs = model(torch.tensor([prompt]).to(DEV)).logits[0, -1].float().cpu().numpy()
    return float(np.linalg.norm(ours_lg - theirs) / np.linalg.norm(theirs))


def artifacts(cfg, params, backend: str, folder: str) -> list[dict]:
    """Export the batch-1 decode program with f32 and f16 weights; size, load, first step."""
    import meganeura as mn
    from meganeura.generate import LlamaGenerator

    gen = LlamaGenerator(cfg, params, max_len=256, backend=backend)
    rows = []
    for w in ("f32", "f16"):
        path = os.path.join(folder, f"smollm2-decode-{w}")
        t = time.perf_counter()
        gen.decoder.export(path, weights=w)
        export_s = time.perf_counter() - t
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        t = time.perf_counter()
        prog = mn.load_program(path, backend=backend)
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        prog.step(ids=np.array([[1]], np.int32), pos=np.array(0, np.int32))["logits"]
        rows.append({"weights": w, "bytes": size, "export_s": export_s, "load_s": load_s,
                     "first_step_s": time.perf_counter() - t, "backend": backend})
        log(f"artifact {w}: {size / 2**20:.1f} MiB, load_program {load_s:.2f} s")
        del prog
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--impls", default="dawn,wgpu")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new", type=int, default=64, help="tokens generated per row")
    p.add_argument("--torch", default="eager,compile", help="transformers modes ('' = none)")
    p.add_argument("--artifact", default=None, help="folder for the artifact timing")
    p.add_argument("--deadline", type=float, default=1e9,
                   help="skip cells that would start after this many seconds")
    p.add_argument("--torch-device", default="cuda", help="cpu for a dry run")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    global DEV
    DEV = a.torch_device
    from meganeura.io.gguf import load_gguf

    m = load_gguf(a.gguf)
    log(f"loaded {a.gguf}")
    res = {"cells": [], "artifact": [], "gguf": os.path.basename(a.gguf), "new": a.new}
    save = lambda: open(a.out, "w").write(json.dumps(res, indent=1))  # noqa: E731
    impls = [s for s in a.impls.split(",") if s]
    modes = [s for s in a.torch.split(",") if s]
    model = hf_model(m.config, m.params) if modes else None
    if model is not None:
        res["logits_rel_l2"] = check_logits(m.config, m.params, model, chat_ids(m.tokenizer, 1)[0])
        log(f"prompt logits ours vs transformers: rel L2 {res['logits_rel_l2']:.2e}")
    for B in (int(b) for b in a.batches.split(",") if b):
        prompts = chat_ids(m.tokenizer, B)
        cells = [("meganeura", i) for i in impls] + [("transformers", md) for md in modes]
        for who, how in cells:
            if time.perf_counter() - T0 > a.deadline:
                res["cells"].append({"who": who, "how": how, "batch": B, "skipped": "deadline"})
                continue
            r = (ours(m.config, m.params, how, prompts, a.new) if who == "meganeura"
                 else hf_generate(model, prompts, a.new, how == "compile"))
            res["cells"].append({"who": who, "how": how, "batch": B, **r})
            log(f"batch {B} {who} {how}: {r['tokens_s']:.1f} tokens/s")
            save()
    if a.artifact:
        res["artifact"] = artifacts(m.config, m.params, impls[0], a.artifact)
    save()
    print(table(res))
    return 0


def table(res: dict) -> str:
    lines = ["| batch | who | how | tokens/s (end to end) | decode tokens/s | first token ms |",
             "|---|---|---|---|---|---|"]
    for c in res["cells"]:
        if "skipped" in c:
            lines.append(f"| {c['batch']} | {c['who']} | {c['how']} | skipped | | |")
            continue
        lines.append(f"| {c['batch']} | {c['who']} | {c['how']} | {c['tokens_s']:.1f} | "
                     f"{c.get('decode_tokens_s', float('nan')):.1f} | "
                     f"{c.get('ttft_ms', float('nan')):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
