"""Compile time of every workload's programs, device-free: the host-side stages of
``mn.compile`` (autodiff + optimizer, graph passes, schedule + memory plan, WGSL emission) for
the inference run and the SGD training step, best of ``--repeat`` runs.

  python bench/compile_time.py [workloads] [--repeat 3] [--json out.json]

Pipeline creation (the driver compiling WGSL) is not included: it depends on the driver and
its cache (GPU-NOTES); ``bench/harness.py`` reports whole-compile times on a device.  Garbage
collection is paused as ``mn.compile`` pauses it.

On a device (each measurement in a fresh process with its own driver shader cache directory:
``cold`` = empty, ``warm`` = the same directory again; NVIDIA's ``__GL_SHADER_DISK_CACHE_PATH``,
Mesa's ``MESA_SHADER_CACHE_DIR``):

  python bench/compile_time.py --pipelines --out OUT [--impls dawn,wgpu] [--budget 80] [workloads]
      creation of the distinct pipelines of each workload's SGD training step: sequential,
      Dawn's async creation, thread pools of 2/4/8/16 (``Device.pipelines``)
  python bench/compile_time.py --sessions --out OUT [--impls dawn] [--budget 80] [workloads]
      whole ``mn.compile`` (graph → ready session), inference and SGD training, with
      ``MEGANEURA_PIPELINE_CREATE=sequential`` (before) and ``auto`` (after)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plan_memory import H200_LIMITS  # noqa: E402

from meganeura import optim  # noqa: E402
from meganeura.compile.emit import emit_stream  # noqa: E402
from meganeura.compile.memory import find_leaf_groups, make_plan  # noqa: E402
from meganeura.compile.passes import run_pipeline  # noqa: E402
from meganeura.kernels.common import make_target  # noqa: E402
from meganeura.program import build_program  # noqa: E402

STAGES = ("autodiff", "passes", "plan", "emit")


def time_stages(w, train: bool, target) -> dict[str, float]:
    """Seconds per stage for one compile of ``w`` (training step or inference run)."""
    opt = optim.SGD(lr=1e-3) if train else None
    t = [time.perf_counter()]
    prog = build_program(w.graph, w.loss, {} if train else w.outputs, opt)
    t.append(time.perf_counter())
    low = run_pipeline(prog)
    t.append(time.perf_counter())
    plan = make_plan(low, not train, groups=find_leaf_groups(low.graph, any_rank=not train),
                     align=32)
    t.append(time.perf_counter())
    emit_stream(plan, target, "strict", "train" if train else "infer")
    t.append(time.perf_counter())
    return {s: b - a for s, a, b in zip(STAGES, t, t[1:])}


def best_of(w, train: bool, target, repeat: int) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        gc.disable()
        try:
            runs.append(time_stages(w, train, target))
        finally:
            gc.enable()
            gc.collect()
    best = min(runs, key=lambda r: sum(r.values()))
    return {**{k: round(v, 3) for k, v in best.items()}, "total": round(sum(best.values()), 3)}


# ---------------------------------------------------------------------------------------------
# on a device: each measurement a fresh process (workers below), a driver cache dir of its own


def cache_env(cache_dir: str, **extra: str) -> dict:
    """The environment of a worker whose driver shader caches live in ``cache_dir`` (empty:
    cold; used before: warm).  NVIDIA reads ``__GL_SHADER_DISK_CACHE*``, Mesa
    ``MESA_SHADER_CACHE_DIR``; the tuning cache is ``$MEGANEURA_TUNE_CACHE`` when the caller
    set one (XDG_CACHE_HOME moves with the driver cache)."""
    env = dict(os.environ, __GL_SHADER_DISK_CACHE="1", __GL_SHADER_DISK_CACHE_PATH=cache_dir,
               __GL_SHADER_DISK_CACHE_SKIP_CLEANUP="1", MESA_SHADER_CACHE_DIR=cache_dir,
               XDG_CACHE_HOME=cache_dir)
    env.update(extra)
    return env


def run_worker(kind: str, args: dict, env: dict, timeout: float, on_line=None) -> dict:
    """One worker process (``--worker kind``), killed after ``timeout`` s: its last stdout
    JSON line, ``{"error": ...}`` when it failed or timed out (a crashed creation mode is a
    result too).  ``on_line`` sees every JSON line as it is printed, so a worker killed at
    the time limit keeps what it finished."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, json.dumps(args)]
    t0, last = time.perf_counter(), None
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(max(timeout, 0.1), proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    last = json.loads(line)
                    if on_line is not None:
                        on_line(last)
            rc = proc.wait()
        finally:
            timer.cancel()
        err.seek(0)
        tail = err.read().strip().splitlines()[-3:]
    if rc != 0 or last is None:
        why = f"timed out after {timeout:.0f} s" if rc == -9 else f"rc {rc}"
        return {"error": f"{why}: {' | '.join(tail)}"}
    return {**last, "process_s": round(time.perf_counter() - t0, 2)}


def _open(impl: str):
    from meganeura.runtime.device import get_device

    return get_device(impl)


def worker_specs(a: dict) -> dict:
    """The distinct pipelines (plan order) of each workload's SGD training step on the device
    ``a["impl"]`` (its own limits, features and tuning cache), saved to ``a["out"]``."""
    from workloads import WORKLOADS

    from meganeura import optim
    from meganeura.compile import _tuning
    from meganeura.compile.executable import Dispatch
    from meganeura.compile.pipeline import CompileOptions, binding_cap, compile_program
    from meganeura.runtime.device import pipeline_key

    dev, dump = _open(a["impl"]), {}
    for name in a["workloads"]:
        w = WORKLOADS[name](quick=a["quick"], variant="main")
        program = build_program(w.graph, w.loss, {}, optim.SGD(lr=1e-4))
        target = make_target(dev)
        opts = CompileOptions("strict", True, True, True, binding_cap(target), False)
        exe = compile_program(program, target, opts, tuning=_tuning(dev, None))
        seen = {}
        for op in exe.train.ops:
            if isinstance(op, Dispatch):
                seen.setdefault(pipeline_key(op.spec), op.spec)
        dump[name] = [{"name": sp.name, "wgsl": sp.wgsl, "entry": sp.entry,
                       "n_bindings": sp.n_bindings} for sp in seen.values()]
    with open(a["out"], "w") as f:
        json.dump(dump, f)
    return {name: len(v) for name, v in dump.items()}


def worker_create(a: dict) -> dict:
    """Seconds to create one workload's distinct pipelines in mode ``a["mode"]`` on a fresh
    device (``threads`` on Dawn goes around the refusal in ``Device.pipelines``: an
    experiment on an unsupported mode, counted, never used by meganeura)."""
    from meganeura.kernels import KernelSpec

    if a.get("threads"):
        os.environ["MEGANEURA_PIPELINE_THREADS"] = str(a["threads"])
    with open(a["specs"]) as f:
        raw = json.load(f)[a["workload"]]
    specs = [KernelSpec(d["name"], d["wgsl"], d["n_bindings"], (1, 1, 1), d["entry"])
             for d in raw]
    t0 = time.perf_counter()
    dev = _open(a["impl"])
    t1 = time.perf_counter()
    if a["mode"] == "threads" and dev.implementation == "dawn":
        made = dev._create_all(specs, "threads")
        errors = [str(m).splitlines()[0] for m in made if isinstance(m, Exception)]
    else:
        dev.pipelines(specs, mode=a["mode"])
        errors = []
    t2 = time.perf_counter()
    return {"n": len(specs), "open_s": round(t1 - t0, 3), "create_s": round(t2 - t1, 3),
            "errors": errors[:2], "n_errors": len(errors)}


def _session_times(sess, total: float) -> dict:
    """Compile seconds of one session and where they went (pipelines, commands = bind groups,
    per stream; the rest is host stages and buffers)."""
    out = {"total_s": round(total, 3)}
    for tag in ("train", "infer"):
        stream = getattr(sess, tag, None)
        if stream is not None:
            for k, v in stream.build_times.items():
                out[f"{tag}_{k}_s"] = round(v, 3)
    return out


def _compile_twice(dev, w) -> dict:
    """``mn.compile`` of ``w`` (inference, then the SGD training step) with our pipeline cache
    empty, then again after dropping both sessions (driver cache warm); and the first two
    training steps' wall times (the first one validates the encode)."""
    import meganeura as mn
    from meganeura import optim

    res = {}
    for tag in ("cold", "warm"):
        gc.collect()
        dev._pipelines.clear()
        t0 = time.perf_counter()
        inf = mn.compile(w.graph, outputs=w.outputs, device=dev)
        res[f"infer_{tag}"] = _session_times(inf, time.perf_counter() - t0)
        t0 = time.perf_counter()
        tr = mn.compile(w.graph, loss=w.loss, outputs={}, optimizer=optim.SGD(lr=1e-4),
                        device=dev)
        res[f"train_{tag}"] = _session_times(tr, time.perf_counter() - t0)
        if tag == "cold":
            feeds = {k: v for k, v in w.feeds.items() if k in tr.program.feeds}
            for i in range(2):
                t0 = time.perf_counter()
                tr.step(**feeds).loss  # noqa: B018 - reading it waits for the step
                res[f"step{i + 1}_s"] = round(time.perf_counter() - t0, 4)
        del inf, tr
    return res


def worker_session(a: dict) -> dict:
    """Whole compiles of several workloads in one process (one driver cache, as a user's
    process leaves it), a JSON line per workload as soon as it is done (a time-out keeps
    the finished ones)."""
    from workloads import WORKLOADS

    dev = _open(a["impl"])
    for name in a["workloads"]:
        t0 = time.perf_counter()
        w = WORKLOADS[name](quick=a["quick"], variant="main")
        res = {"workload": name, "build_s": round(time.perf_counter() - t0, 2),
               **_compile_twice(dev, w)}
        print(json.dumps(res), flush=True)
    return {"done": True}


class Budget:
    """Seconds left of a device call: measurements start only while enough remains."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def _fresh_dir(root: str, label: str) -> str:
    return tempfile.mkdtemp(prefix=label.replace(":", "") + "-", dir=root)


def _plan_pipelines(impls, workloads) -> list[tuple]:
    """(impl, workload, mode, threads, cache) in priority order: sequential vs the default
    concurrent mode, cold then warm, first; then the thread-count sweep; then Dawn with
    threads (unsupported, to see whether it is even safe)."""
    auto = {"dawn": ("async", 0), "wgpu": ("threads", 8)}
    plan = []
    for impl in impls:
        for wl in workloads:
            for cache in ("cold", "warm"):
                plan += [(impl, wl, "sequential", 0, cache), (impl, wl, *auto[impl], cache)]
    plan += [("wgpu", wl, "threads", n, "cold") for wl in workloads for n in (2, 4, 16)
             if "wgpu" in impls]
    plan += [("dawn", wl, "threads", 8, "cold") for wl in workloads if "dawn" in impls]
    return plan


class Recorder:
    """Results by key, printed and written to ``path`` as each arrives (a device call cut by
    its time limit keeps everything finished before)."""

    def __init__(self, path: str):
        self.path, self.results = path, {}
        with open(path, "w") as f:
            json.dump({}, f)

    def __call__(self, key: str, r: dict) -> None:
        self.results[key] = r
        print(f"{key}: {json.dumps(r)}", flush=True)
        with open(self.path, "w") as f:
            json.dump(self.results, f, indent=1)


def pipelines_matrix(rec: Recorder, out: str, impls, workloads, budget: Budget,
                     quick: bool) -> None:
    """Creation time of each workload's distinct training pipelines per implementation, mode
    and driver-cache state (``--pipelines``)."""
    root = tempfile.mkdtemp(prefix="mn-shadercache-")
    specs, dirs = {}, {}
    for impl in impls:
        specs[impl] = os.path.join(out, f"specs-{impl}.json")
        rec(f"specs-{impl}", run_worker(
            "specs", {"impl": impl, "workloads": workloads, "quick": quick, "out": specs[impl]},
            cache_env(_fresh_dir(root, "specs")), budget.left() - 2))
    for impl, wl, mode, threads, cache in _plan_pipelines(impls, workloads):
        label = f"{mode}:{threads}" if threads else mode
        if "error" in rec.results[f"specs-{impl}"] or budget.left() < 6:
            continue
        if cache == "cold":
            dirs[(impl, wl, label)] = _fresh_dir(root, label)
        rec(f"{impl}|{wl}|{label}|{cache}", run_worker(
            "create", {"impl": impl, "specs": specs[impl], "workload": wl, "mode": mode,
                       "threads": threads},
            cache_env(dirs[(impl, wl, label)]), budget.left() - 2))


def sessions_matrix(rec: Recorder, out: str, impls, workloads, budget: Budget,
                    quick: bool) -> None:
    """Whole compiles, ``MEGANEURA_PIPELINE_CREATE`` sequential (before) and auto (after), a
    fresh process with an empty driver cache for each workload and mode, pairs in turn
    (``--sessions``)."""
    root = tempfile.mkdtemp(prefix="mn-shadercache-")
    for wl in workloads:
        for impl in impls:
            for mode in ("sequential", "auto"):
                if budget.left() < 10:
                    continue
                env = cache_env(_fresh_dir(root, mode), MEGANEURA_PIPELINE_CREATE=mode)
                key = f"{impl}|{wl}|{mode}"
                r = run_worker("session", {"impl": impl, "workloads": [wl], "quick": quick},
                               env, budget.left() - 2,
                               on_line=lambda r, key=key: "workload" in r and rec(key, r))
                if "error" in r and key not in rec.results:
                    rec(key, r)


def print_pipelines(results: dict) -> None:
    print("| impl | workload | mode | cache | pipelines | create s |\n|---|---|---|---|---:|---:|")
    for key, r in results.items():
        if key.startswith("specs-"):
            continue
        impl, wl, label, cache = key.split("|")
        val = f"{r['create_s']:.3f}" if "create_s" in r else r.get("error", "?")[:60]
        print(f"| {impl} | {wl} | {label} | {cache} | {r.get('n', '')} | {val} |")


def print_sessions(results: dict) -> None:
    """Seconds, before/after rows side by side; the last columns split the warm training
    compile: pipeline creation and commands (bind groups)."""
    print("| impl | workload | mode | infer cold | train cold | infer warm | train warm | "
          "train warm: pipelines / commands | step 1 / step 2 |\n"
          "|---|---|---|---:|---:|---:|---:|---|---|")
    for key in sorted(results, key=lambda k: (k.split("|")[1], k)):
        impl, wl, mode = key.split("|")
        r = results[key]
        if "error" in r:
            print(f"| {impl} | {wl} | {mode} | {r['error'][:100]} |")
            continue
        tot = [r[k]["total_s"] for k in ("infer_cold", "train_cold", "infer_warm", "train_warm")]
        tw = r["train_warm"]
        print(f"| {impl} | {wl} | {mode} | " + " | ".join(f"{t:.2f}" for t in tot)
              + f" | {tw.get('train_pipelines_s', 0):.2f} / {tw.get('train_commands_s', 0):.2f}"
              f" | {r['step1_s']:.3f} / {r['step2_s']:.3f} |")


WORKERS = {"specs": worker_specs, "create": worker_create, "session": worker_session}


def device_main(args) -> int:
    """``--pipelines`` / ``--sessions``: the device measurements, JSON into the folder (written
    after every measurement), a markdown table at the end."""
    os.makedirs(args.out, exist_ok=True)
    budget, impls = Budget(args.budget), args.impls.split(",")
    workloads = args.workloads.split(",")
    kind = "pipelines" if args.pipelines else "sessions"
    rec = Recorder(os.path.join(args.out, f"{kind}.json"))
    matrix = pipelines_matrix if args.pipelines else sessions_matrix
    matrix(rec, args.out, impls, workloads, budget, args.quick)
    (print_pipelines if args.pipelines else print_sessions)(rec.results)
    return 0


def main(argv=None) -> int:
    from workloads import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workloads", nargs="?", default=",".join(WORKLOADS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--pipelines", action="store_true", help="device: pipeline creation modes")
    p.add_argument("--sessions", action="store_true", help="device: whole compiles, before/after")
    p.add_argument("--out", default="compile-time-out", help="folder for device results")
    p.add_argument("--impls", default="dawn,wgpu")
    p.add_argument("--budget", type=float, default=80.0, help="seconds for device measurements")
    p.add_argument("--quick", action="store_true", help="small workloads (dry runs)")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "ARGS_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker[0]](json.loads(args.worker[1]))))
        return 0
    if args.pipelines or args.sessions:
        return device_main(args)
    target = make_target(H200_LIMITS, {"shader-f16"})
    out = {}
    print("| workload | program | " + " | ".join(STAGES) + " | total s |")
    print("|---|---|" + "---:|" * (len(STAGES) + 1))
    for name in args.workloads.split(","):
        w = WORKLOADS[name](quick=False, variant="main")
        for mode in ("infer", "train"):
            r = best_of(w, mode == "train", target, args.repeat)
            out[f"{name}-{mode}"] = r
            print(f"| {name} | {mode} | " + " | ".join(f"{r[s]:.3f}" for s in STAGES)
                  + f" | {r['total']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
