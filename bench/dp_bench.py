"""Data-parallel throughput: samples/s with 1 vs N GPUs (meganeura.distributed over gloo),
with the communication it costs: bytes all-reduced per step, readback (waiting for a bucket's
backward segment + mapping, and the copy out of mapped memory), the all-reduce time of the
same buckets measured alone, the all-reduce time left exposed after the last readback, and the
overlap achieved (1 - exposed / alone).

  python bench/dp_bench.py --gpus 1,2 --workloads smollm2,resnet50 --accumulate 8 \\
      --backend dawn --out dp.json                                           (2 GPUs, H200)
  MEGANEURA_DP_SHARE_ADAPTER=1 python bench/dp_bench.py --quick --gpus 1,2 --steps 3 \\
      --warmup 1 --accumulate 2 --out dp-quick.json        (dry run: lavapipe, shared adapter)

The driver starts one ``torchrun --nproc-per-node G`` per entry of --gpus (the worker is this
file with --worker) plus a single-process baseline (a plain ``mn.compile`` training session at
the same per-GPU batch: the best one GPU does without data parallelism); speed-up = N-GPU
samples/s over the baseline's."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def build(name: str, quick: bool):
    """(graph, loss, feeds, samples per micro-batch) of one workload at its benchmark size:
    SmolLM2-135M batch 1 x seq 128, ResNet-50 batch 4 x 224² (--quick: tiny configs)."""
    rng = np.random.default_rng(0)
    if name == "smollm2":
        from meganeura.models.llama import SMOLLM2_135M, llama_lm, tiny_llama

        cfg, seq = (tiny_llama(), 16) if quick else (SMOLLM2_135M, 128)
        m = llama_lm(cfg, 1, seq)
        ids = rng.integers(0, cfg.vocab_size, (1, seq)).astype(np.int32)
        return m.graph, m.loss, {"ids": ids, "labels": ids.copy()}, 1
    if name == "resnet50":
        from meganeura.models import resnet

        batch = 2 if quick else 4
        m = resnet.resnet("resnet50-tiny" if quick else "resnet50", batch, training=True)
        feeds = {"x": rng.standard_normal(m.x.shape, np.float32),
                 "y": rng.integers(0, m.config.num_classes, m.y.shape).astype(np.int32)}
        return m.graph, m.loss, feeds, batch
    raise SystemExit(f"unknown workload {name!r} (smollm2, resnet50)")


def _optimizer():
    from meganeura import optim

    return optim.AdamW(lr=1e-4)


# ------------------------------------------------------------------------------ worker


def _alone_allreduce(dp, repeats: int = 3) -> float:
    """Seconds to all-reduce every bucket once, synchronously, with nothing else running."""
    import torch.distributed as dist

    best = float("inf")
    for _ in range(repeats):
        dp.ctx.barrier()
        t0 = time.perf_counter()
        for b in dp.buckets:
            dist.all_reduce(b.tensor)
        best = min(best, time.perf_counter() - t0)
    return best


def worker(args) -> None:
    from meganeura import distributed

    ctx = distributed.init(args.backend)
    result = {}
    for name in args.workloads.split(","):
        graph, loss, feeds, per_micro = build(name, args.quick)
        t0 = time.perf_counter()
        dp = distributed.DataParallel(ctx, graph, loss, _optimizer(), accumulate=args.accumulate,
                                      bucket_mb=args.bucket_mb, precision=args.precision)
        compile_s = time.perf_counter() - t0
        micro = [feeds] * args.accumulate
        for _ in range(args.warmup):
            dp.step_micro(micro)
        keys = ("map_wait_s", "copy_s", "allreduce_wait_s", "writeback_s", "step_s")
        sums, times = dict.fromkeys(keys, 0.0), []
        for _ in range(args.steps):
            dp.step_micro(micro)
            times.append(dp.stats.step_s)
            for k in keys:
                sums[k] += getattr(dp.stats, k)
        alone = _alone_allreduce(dp) if ctx.world_size > 1 else 0.0
        med = float(np.median(times))
        per = {k: v / args.steps for k, v in sums.items()}
        result[name] = {
            "ranks": ctx.world_size, "accumulate": args.accumulate, "compile_s": compile_s,
            "samples_per_s": ctx.world_size * args.accumulate * per_micro / med,
            "step_ms": med * 1e3, "bytes_allreduced": dp.stats.bytes_allreduced,
            "buckets": dp.stats.buckets, "segments": dp.stats.segments,
            "readback_wait_ms": per["map_wait_s"] * 1e3, "readback_copy_ms": per["copy_s"] * 1e3,
            "allreduce_alone_ms": alone * 1e3,
            "allreduce_exposed_ms": per["allreduce_wait_s"] * 1e3,
            "overlap": (max(0.0, 1.0 - per["allreduce_wait_s"] / alone) if alone > 0 else None),
            "writeback_ms": per["writeback_s"] * 1e3,
            "device": ctx.device.adapter_name, "implementation": ctx.device.implementation}
        del dp
    if ctx.rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(result, f)
    ctx.close()


def baseline(args) -> dict:
    """One process, one GPU, no data parallelism: a plain training session at the per-GPU
    batch, ``accumulate`` steps counted as one (the same samples as one DP step)."""
    import meganeura as mn

    result = {}
    for name in args.workloads.split(","):
        graph, loss, feeds, per_micro = build(name, args.quick)
        sess = mn.compile(graph, loss=loss, optimizer=_optimizer(), precision=args.precision,
                          backend=args.backend)
        for _ in range(args.warmup * args.accumulate):
            sess.step(**feeds)
        sess.dev.sync()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            for _ in range(args.accumulate):
                sess.step(**feeds)
            sess.dev.sync()
            times.append(time.perf_counter() - t0)
        med = float(np.median(times))
        result[name] = {"samples_per_s": args.accumulate * per_micro / med, "step_ms": med * 1e3,
                        "device": sess.dev.adapter_name}
    return result


# ------------------------------------------------------------------------------ driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, gpus: int) -> dict:
    """One torchrun job of ``gpus`` ranks; rank 0's results."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        cmd = [torchrun, "--nproc-per-node", str(gpus), "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), os.path.abspath(__file__), "--worker",
               "--worker-out", out, *_forwarded(args)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(ROOT, "src"), ROOT, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"dp_bench: the {gpus}-GPU run failed (status {proc.returncode})")
        with open(out) as f:
            return json.load(f)


def _forwarded(args) -> list[str]:
    out = ["--workloads", args.workloads, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--accumulate", str(args.accumulate), "--bucket-mb",
           str(args.bucket_mb), "--precision", args.precision]
    if args.backend:
        out += ["--backend", args.backend]
    if args.quick:
        out.append("--quick")
    return out


def table(runs: dict, base: dict) -> str:
    head = ("| workload | GPUs | accum. | samples/s | vs 1 GPU | step ms | MB all-reduced/step | "
            "readback wait ms | readback copy ms | all-reduce alone ms | exposed ms | overlap |")
    lines = [head, "|" + "---|" * 12]
    for name, b in base.items():
        lines.append(f"| {name} | 1 (plain session) | {b.get('accumulate', '-')} | "
                     f"{b['samples_per_s']:.2f} | 1.00× | {b['step_ms']:.1f} | – | – | – | – | – "
                     "| – |")
        for gpus, res in sorted(runs.items()):
            r = res[name]
            ov = "–" if r["overlap"] is None else f"{r['overlap'] * 100:.0f} %"
            lines.append(
                f"| {name} | {gpus} | {r['accumulate']} | {r['samples_per_s']:.2f} | "
                f"{r['samples_per_s'] / b['samples_per_s']:.2f}× | {r['step_ms']:.1f} | "
                f"{r['bytes_allreduced'] / 2**20:.2f} | {r['readback_wait_ms']:.2f} | "
                f"{r['readback_copy_ms']:.2f} | {r['allreduce_alone_ms']:.2f} | "
                f"{r['allreduce_exposed_ms']:.2f} | {ov} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="smollm2,resnet50")
    p.add_argument("--gpus", default="1,2", help="rank counts to run, e.g. 1,2")
    p.add_argument("--accumulate", type=int, default=8, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--precision", default="strict", choices=["strict", "fast"])
    p.add_argument("--backend", default=None, help="wgpu | dawn (default $MEGANEURA_WEBGPU)")
    p.add_argument("--quick", action="store_true", help="tiny configs (lavapipe dry run)")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    runs = {int(g): _launch(args, int(g)) for g in args.gpus.split(",")}
    base = baseline(args)
    for b in base.values():
        b["accumulate"] = args.accumulate
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "baseline": base, "runs": runs,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(table(runs, base))


if __name__ == "__main__":
    main()
