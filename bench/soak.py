"""Soak test: many training steps of a tiny model, watching for leaks.

  python bench/soak.py                          # 10,000 steps on wgpu (lavapipe in CI)
  python bench/soak.py --steps 2000 --backend reference --json soak.json

A leak that costs a few kilobytes per step (a readback buffer never returned to its pool, a
bind group rebuilt every step, a growing Python cache) is invisible in the unit tests and
fatal after a day of training.  Every ``--every`` steps this samples the host's resident set
size and, on the GPU backends, the number of live WebGPU buffers and bind groups (wgpu's
diagnostics); after ``--warmup`` steps the resident set may grow by at most ``--max-growth-mb``
and the GPU object counts must not grow at all, else the exit status is 1.

The loop exercises what a training script does: ``step`` with its loss read (most steps), steps
whose results are never read (every 7th), inference ``run`` (every 50th) and a checkpoint save
and load (every ``--every`` steps)."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meganeura as mn  # noqa: E402


def rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc; peak RSS elsewhere, which only grows,
    so the check stays conservative)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def gpu_objects() -> dict[str, int] | None:
    """Live wgpu-py objects by type (None where the diagnostics are unavailable)."""
    try:
        from wgpu import diagnostics

        counts = diagnostics.object_counts.get_dict()
    except Exception:
        return None
    return {k: counts[k]["count"] for k in ("Buffer", "BindGroup", "CommandBuffer")
            if k in counts}


def tiny_session(backend: str, batch: int = 32):
    """A two-layer classifier with AdamW and a warm-up/cosine schedule: every kind of update
    (parameters, flat optimizer states, the step counter) runs each step."""
    g = mn.Graph("soak")
    x = g.input("x", (batch, 16))
    y = g.input("y", (batch,), dtype=mn.i32)
    h = mn.nn.Linear(16, 32, name="fc1")(g, x).relu()
    logits = mn.nn.Linear(32, 4, name="fc2")(g, h)
    loss = mn.ops.cross_entropy(logits, y)
    sched = mn.optim.WarmupCosine(1e-2, warmup_steps=100, total_steps=100_000, min_lr=1e-4)
    sess = mn.compile(g, loss=loss, outputs={"logits": logits}, backend=backend,
                      optimizer=mn.optim.AdamW(lr=sched, weight_decay=0.01))
    sess.init_params(seed=0)
    return sess


def _batches(batch: int, n: int = 16):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch, 16)).astype(np.float32)
        out.append((x, (x[:, :4].argmax(1)).astype(np.int32)))
    return out


def workload_session(name: str, backend: str):
    """A benchmark workload (bench/workloads.py, main size) with AdamW: the real model's step
    (SmolLM2-135M on the H200), its fixed feeds as the only batch."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workloads import WORKLOADS

    w = WORKLOADS[name](quick=False, variant="main")
    sess = mn.compile(w.graph, loss=w.loss, outputs=w.outputs, backend=backend,
                      optimizer=mn.optim.AdamW(lr=1e-5, weight_decay=0.01))
    sess.set_params(w.params)
    feeds = {k: v for k, v in w.feeds.items() if k in sess.program.feeds}
    return sess, [feeds]


def soak(steps: int, backend: str, every: int, warmup: int, batch: int = 32,
         workload: str | None = None, save_every: int | None = None) -> dict:
    """Run the loop; return the samples and the verdict inputs."""
    if workload:
        sess, data = workload_session(workload, backend)
    else:
        sess = tiny_session(backend, batch)
        data = [{"x": x, "y": y} for x, y in _batches(batch)]
    infer_names = set(sess.program.inference_feeds())
    save_every = save_every or every
    ckpt = os.path.join(tempfile.mkdtemp(prefix="mn-soak-"), "soak.safetensors")
    samples, loss, t0 = [], float("nan"), time.perf_counter()
    for i in range(1, steps + 1):
        feeds = data[i % len(data)]
        res = sess.step(**feeds)
        if i % 7:
            loss = res.loss
        if i % 50 == 0:
            sess.run(**{k: v for k, v in feeds.items() if k in infer_names})
        if i % every == 0 or i == steps:  # sampled before the save: outside its transient
            samples.append(_sample(i, loss, t0))
            print(f"soak: step {i}: {samples[-1]}", flush=True)  # progress of long runs
        if i % save_every == 0 or i == steps:
            sess.save(ckpt)
            sess.load(ckpt)
    return {"steps": steps, "backend": backend, "warmup": warmup, "samples": samples,
            "device": _device_name(sess), "model": workload or "tiny classifier"}


def _release_free_heap() -> None:
    """Collect garbage and hand glibc's free heap pages back to the OS.  A checkpoint save of a
    large model (1.6 GB for SmolLM2 with AdamW) leaves freed arenas mapped, which reads as
    tens of MiB of RSS growth although nothing is referenced; a real leak stays after this."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS then includes retained free pages (conservative)


def _sample(step: int, loss: float, t0: float) -> dict:
    _release_free_heap()
    return {"step": step, "rss_mb": round(rss_mb(), 2), "gpu": gpu_objects(),
            "loss": round(float(loss), 5), "seconds": round(time.perf_counter() - t0, 1)}


def _device_name(sess) -> str:
    dev = getattr(sess, "dev", None)
    if dev is None:
        return "numpy reference"
    try:
        d = dev.describe()
        impl = f"{d.get('implementation', '?')}, {d.get('description', '')}"
        return f"{d.get('adapter', '?')} ({impl})"
    except Exception:
        return "?"


def verdict(result: dict, max_growth_mb: float) -> list[str]:
    """Problems found: a resident-set trend beyond the bound after warm-up, any growth of the
    GPU object counts after warm-up, a non-finite loss.

    The RSS trend is the median of the last third of the post-warm-up samples minus the median
    of the first third: a leak grows with the step count and moves the median, while a
    bounded excursion (a 24 MiB logits readback staging buffer that happens to be resident at
    one sample) does not.  The largest excursion is reported too."""
    after = [s for s in result["samples"] if s["step"] >= result["warmup"]]
    if len(after) < 3:
        return [f"too few samples after the {result['warmup']}-step warm-up to judge"]
    rss = [s["rss_mb"] for s in after]
    third = max(1, len(rss) // 3)
    growth = float(np.median(rss[-third:]) - np.median(rss[:third]))
    result["rss_growth_mb"] = round(growth, 2)
    result["rss_excursion_mb"] = round(max(rss) - min(rss), 2)
    problems = []
    if growth > max_growth_mb:
        problems.append(f"resident set grew {growth:.1f} MiB after warm-up "
                        f"(median of the last third vs the first; bound {max_growth_mb} MiB)")
    if after[0]["gpu"] is not None:
        for kind, n0 in after[0]["gpu"].items():
            peak = max(s["gpu"][kind] for s in after)
            if peak > n0:
                problems.append(f"live GPU {kind} objects grew from {n0} to {peak}")
    if not np.isfinite(result["samples"][-1]["loss"]):
        problems.append("the loss is not finite")
    return problems


def table(result: dict) -> str:
    lines = ["| step | RSS MiB | GPU buffers | bind groups | loss | seconds |",
             "|---:|---:|---:|---:|---:|---:|"]
    for s in result["samples"]:
        gpu = s["gpu"] or {}
        lines.append(f"| {s['step']} | {s['rss_mb']:.1f} | {gpu.get('Buffer', '–')} | "
                     f"{gpu.get('BindGroup', '–')} | {s['loss']:.4f} | {s['seconds']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--backend", default="wgpu", help="wgpu, dawn, auto or reference")
    ap.add_argument("--every", type=int, default=500, help="sample every N steps")
    ap.add_argument("--warmup", type=int, default=1000, help="steps before the baseline")
    ap.add_argument("--max-growth-mb", type=float, default=8.0)
    ap.add_argument("--json", help="write the samples and verdict here")
    ap.add_argument("--workload", default=None,
                    help="a bench/workloads.py model instead of the tiny classifier (smollm2…)")
    ap.add_argument("--save-every", type=int, default=None,
                    help="checkpoint save+load every N steps (default: --every)")
    ap.add_argument("--rejudge", metavar="JSON",
                    help="judge the samples of an earlier run's --json again (with --warmup and "
                         "--max-growth-mb) instead of running")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        ap.error("--steps and --every must be at least 1")
    if args.rejudge:
        with open(args.rejudge) as f:
            result = json.load(f)
        result["warmup"] = args.warmup
    else:
        result = soak(args.steps, args.backend, args.every, args.warmup, workload=args.workload,
                      save_every=args.save_every)
        result["date"] = datetime.date.today().isoformat()
    problems = verdict(result, args.max_growth_mb)
    result.update(problems=problems, max_growth_mb=args.max_growth_mb)
    print(f"soak: {result['steps']} steps of {result['model']} on {result['device']}, "
          f"{result['date']}")
    print(table(result))
    print(f"RSS trend after warm-up: {result.get('rss_growth_mb', '?')} MiB "
          f"(bound {args.max_growth_mb} MiB); largest excursion "
          f"{result.get('rss_excursion_mb', '?')} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    for p in problems:
        print(f"soak: FAIL: {p}")
    print("soak: OK" if not problems else "soak: FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
