"""Side-by-side benchmark: our compiled sessions vs PyTorch (eager, torch.compile, TF32/bf16),
per workload: gates (forward / per-parameter gradient, DESIGN.md §5), latencies (median + IQR
over timed steps after warm-ups, GPU synchronized), compile times and peak memory.

  python bench/harness.py --workloads all --impls wgpu,dawn --out results.json       (H200)
  python bench/harness.py --quick --workloads mlp --impls wgpu --out quick.json      (lavapipe)

A cell whose gate fails is recorded as failed with the reason and is not reported as a valid
time.  Workload definitions live in bench/workloads.py."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402

STRICT = {"fwd": 1e-4, "bwd": 1e-3}
FAST = {"fwd": 1e-2, "bwd": 5e-2, "cos": 0.99}


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


def cosine(a, b) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    d = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / d) if d > 0 else 1.0


def stats(ts) -> dict:
    ts = np.asarray(ts) * 1e3
    q1, med, q3 = np.percentile(ts, [25, 50, 75])
    return {"median_ms": float(med), "iqr_ms": float(q3 - q1), "n": len(ts)}


# ------------------------------------------------------------------------------ ours


def step_seconds(step, sync, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls ``step(); sync()`` after ``warmup`` untimed ones:
    the one timing loop of ours and PyTorch's cells (here and in ``paired.py``)."""
    ts = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return ts


def time_ours(sess, inference: bool, feeds: dict, warmup: int, steps: int) -> dict:
    """Per step: submit the step encoded ahead, encode the next one while the GPU runs
    (``GPUStream.submit``; ``$MEGANEURA_PREENCODE=0``: encode and submit in segments), wait
    (no readback).
    The feeds are uploaded once before the timed steps, as PyTorch's timed steps read
    tensors already on the GPU; ``feed_upload_ms`` is that upload on its own (write +
    wait), so neither side's step includes a host → device copy."""
    res = stats(ours_step_times(sess, inference, feeds, warmup, steps))
    res["feed_upload_ms"] = feed_upload_ms(sess, inference, feeds)
    return res


def _feed_arrays(sess, inference: bool, feeds: dict) -> dict:
    from meganeura.runtime.session import check_feeds

    expected = sess.program.inference_feeds() if inference else sess.program.feeds
    return check_feeds(expected, {k: v for k, v in feeds.items() if k in expected})


def feed_upload_ms(sess, inference: bool, feeds: dict, reps: int = 5) -> float:
    """Median ms to write the step's feeds to the GPU and wait for them."""
    arrays = _feed_arrays(sess, inference, feeds)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess._upload_feeds(arrays)
        sess.dev.sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def ours_step_times(sess, inference: bool, feeds: dict, warmup: int, steps: int) -> list:
    """Seconds per timed step (see ``time_ours``)."""
    ex = sess.infer if inference else sess.train
    sess._upload_feeds(_feed_arrays(sess, inference, feeds))  # resident, like PyTorch's
    return step_seconds(lambda: ex.submit(fetch=False), sess.dev.sync, warmup, steps)


def ours_peak_bytes(sess, inference: bool) -> int:
    rep = sess.memory_report()
    part = rep["infer" if inference else "train"]
    return int(rep["persistent_bytes"] + rep["input_bytes"] + part["planned_peak_bytes"])


def gate_outputs(w, dev, precision: str = "strict") -> dict:
    """Forward outputs, loss and every parameter gradient, from one compiled graph."""
    g2, grads = mn.grad(w.graph, w.loss)
    outs = {f"out:{k}": g2[v] for k, v in w.outputs.items()}
    outs["loss"] = g2[w.loss]
    outs.update({f"grad:{k}": v for k, v in grads.items()})
    gs = mn.compile(g2, outputs=outs, device=dev, precision=precision)
    gs.set_params(w.params)
    got = gs.run(**{k: v for k, v in w.feeds.items() if k in gs.program.inference_feeds()})
    res = {k: got[k] for k in outs}
    del gs
    gc.collect()
    return res


def run_ours_fast(w, dev, args) -> dict:
    """precision="fast" (tensor-core matmuls): gates, inference and SGD training step."""
    from meganeura.kernels.matmul import SG_FEATURE

    if SG_FEATURE not in dev.features:
        return {"skipped": f"{dev.implementation} on {dev.adapter_name}: no f16 subgroup "
                           "matrices, so fast compiles to the strict program"}
    res = {"outputs": gate_outputs(w, dev, "fast")}
    t0 = time.perf_counter()
    inf = mn.compile(w.graph, outputs=w.outputs, device=dev, precision="fast")
    res["compile_infer_s"] = time.perf_counter() - t0
    inf.set_params(w.params)
    res["infer"] = time_ours(inf, True, w.feeds, args.warmup, args.steps)
    res["infer"]["tensor_core_kernels"] = sum(
        n for k, n in inf.kernel_variants()["infer"].items() if k.startswith("sgmat"))
    del inf
    t0 = time.perf_counter()
    tr = mn.compile(w.graph, loss=w.loss, outputs={}, optimizer=optim.SGD(lr=1e-4), device=dev,
                    precision="fast")
    res["compile_train_sgd_s"] = time.perf_counter() - t0
    tr.set_params(w.params)
    res["train_sgd"] = time_ours(tr, False, w.feeds, args.warmup, args.steps)
    res["train_sgd"]["tensor_core_kernels"] = sum(
        n for k, n in tr.kernel_variants()["train"].items() if k.startswith("sgmat"))
    del tr
    gc.collect()
    return res


def run_ours(w, impl: str, args) -> dict:
    from meganeura.runtime.device import get_device

    dev = get_device(impl)
    res = {"impl": impl, "device": dev.adapter_name}
    params = w.params
    res["outputs"] = gate_outputs(w, dev)
    # compile time "cold": our per-process pipeline cache emptied first (the driver's own
    # shader cache, as in a new process, may still help); "warm": built again right after
    dev._pipelines.clear()
    t0 = time.perf_counter()
    inf = mn.compile(w.graph, outputs=w.outputs, device=dev)
    res["compile_infer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mn.compile(w.graph, outputs=w.outputs, device=dev)
    res["compile_infer_warm_s"] = time.perf_counter() - t0
    inf.set_params(params)
    res["infer"] = time_ours(inf, True, w.feeds, args.warmup, args.steps)
    res["infer"]["peak_bytes"] = ours_peak_bytes(inf, True)
    res["infer"]["dispatches"] = inf.memory_report()["infer"]["dispatches"]
    del inf
    for name, make in (("sgd", lambda: optim.SGD(lr=1e-4)),
                       ("adamw", lambda: optim.AdamW(lr=1e-4))):
        dev._pipelines.clear()
        t0 = time.perf_counter()
        tr = mn.compile(w.graph, loss=w.loss, outputs={}, optimizer=make(), device=dev)
        res[f"compile_train_{name}_s"] = time.perf_counter() - t0
        tr.set_params(params)
        res[f"train_{name}"] = time_ours(tr, False, w.feeds, args.warmup, args.steps)
        res[f"train_{name}"]["peak_bytes"] = ours_peak_bytes(tr, False)
        res[f"train_{name}"]["dispatches"] = tr.memory_report()["train"]["dispatches"]
        if name == "sgd" and args.profile:
            prof = tr.profile(steps=3, **{k: v for k, v in w.feeds.items()
                                          if k in tr.program.feeds})
            res["profile"] = {"table": str(prof), "gpu_ms_per_step": prof.gpu_ms_per_step,
                              "encode_us_per_step": prof.encode_us_per_step,
                              "dispatches": prof.dispatches_per_step}
            if args.trace_dir:
                path = os.path.join(args.trace_dir, f"trace-{w.name}-{impl}.json")
                prof.export_trace(path)
                res["trace"] = path
        del tr
        gc.collect()
    if args.fast:
        res["fast"] = run_ours_fast(w, dev, args)
    return res


# ------------------------------------------------------------------------------ PyTorch


def torch_reference(w, args):
    """The PyTorch twin on the benchmark device with the workload's weights, and the gate
    reference (f32, TF32 off): forward outputs, loss, every parameter gradient."""
    import torch

    dev = torch.device(args.torch_device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.set_default_device(dev)  # twins make position tables/masks inside forward()
    m = w.torch_model().to(dev).float()
    w.load_torch(m, w.params)
    feeds = w.torch_feeds(dev)
    m.zero_grad(set_to_none=True)
    loss, outs = w.torch_loss(m, feeds)
    loss.backward()
    ref = {"loss": loss.detach().double().cpu().numpy(),
           **{f"out:{k}": v.detach().double().cpu().numpy() for k, v in outs.items()},
           **{f"grad:{k}": v for k, v in w.torch_grads(m).items()}}
    return m, feeds, ref


def torch_release():
    import torch

    torch.set_default_device("cpu")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_torch(w, args) -> dict:
    import torch

    dev = torch.device(args.torch_device)
    cuda = dev.type == "cuda"
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, warmup, steps):
        return stats(step_seconds(fn, sync, warmup, steps))

    def peak(fn):
        if not cuda:
            return None
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return int(torch.cuda.max_memory_allocated())

    m, feeds, res["ref"] = torch_reference(w, args)

    def fwd():
        with torch.no_grad():
            w.torch_loss(m, feeds)

    def make_train(opt_name, model, loss_fn):
        opt = (torch.optim.SGD(model.parameters(), lr=1e-4) if opt_name == "sgd" else
               torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model, feeds)[0].backward()
            opt.step()
        return step

    cells = {}
    cells["eager_f32"] = {"infer": timed(fwd, args.warmup, args.steps), "infer_peak": peak(fwd)}
    for o in ("sgd", "adamw"):
        st = make_train(o, m, w.torch_loss)
        cells["eager_f32"][f"train_{o}"] = timed(st, args.warmup, args.steps)
        cells["eager_f32"][f"train_{o}_peak"] = peak(st)
    if args.torch_compile:
        try:
            torch._dynamo.reset()
            cm = torch.compile(m)
            t0 = time.perf_counter()

            def cfwd():
                with torch.no_grad():
                    w.torch_loss(cm, feeds)
            cfwd()
            sync()
            c = {"compile_infer_s": time.perf_counter() - t0,
                 "infer": timed(cfwd, args.warmup, args.steps)}
            st = make_train("sgd", cm, w.torch_loss)
            t0 = time.perf_counter()
            st()
            sync()
            c["compile_train_s"] = time.perf_counter() - t0
            c["train_sgd"] = timed(st, args.warmup, args.steps)
            st = make_train("adamw", cm, w.torch_loss)
            c["train_adamw"] = timed(st, args.warmup, args.steps)
            cells["compile_f32"] = c
        except Exception as e:  # noqa: BLE001 - record, don't hide
            cells["compile_f32"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    if cuda and not args.no_cuda_graph:
        cells["cuda_graph_f32"] = cuda_graph_cells(w, m, feeds, args, timed)
    if cuda:  # fast comparison: TF32, bf16 autocast (eager)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        cells["eager_tf32"] = {"infer": timed(fwd, args.warmup, args.steps)}
        st = make_train("sgd", m, w.torch_loss)
        cells["eager_tf32"]["train_sgd"] = timed(st, args.warmup, args.steps)

        def bf16_loss(model, f):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return w.torch_loss(model, f)

        def bfwd():
            with torch.no_grad():
                bf16_loss(m, feeds)
        cells["eager_bf16"] = {"infer": timed(bfwd, args.warmup, args.steps)}
        st = make_train("sgd", m, bf16_loss)
        cells["eager_bf16"]["train_sgd"] = timed(st, args.warmup, args.steps)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    res["cells"] = cells
    m = None  # free the model before the next workload
    torch_release()
    return res


def cuda_graph_cells(w, m, feeds, args, timed) -> dict:
    """PyTorch's GPU-only floor for the same work: the inference forward and the SGD training
    step (forward, backward, update) captured once in a CUDA graph and replayed, so no Python,
    dispatcher or launch overhead remains (``cuda_graph_steps``), timed."""
    try:
        steps = cuda_graph_steps(w, m, feeds)
        return {k: timed(fn, args.warmup, args.steps) for k, fn in steps.items()}
    except Exception as e:  # noqa: BLE001 - record, don't hide (some models cannot be captured)
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def cuda_graph_steps(w, m, feeds) -> dict:
    """``{"infer": replay, "train_sgd": replay}``: the forward and the SGD step captured in CUDA
    graphs (the recipe of PyTorch's CUDA-graph docs: warm-up on a side stream, static inputs,
    gradients kept allocated)."""
    import torch

    def warm(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)

    def capture(fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def fwd():
        with torch.no_grad():
            w.torch_loss(m, feeds)
    warm(fwd)
    g_fwd = capture(fwd)
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)

    def step():
        w.torch_loss(m, feeds)[0].backward()
        opt.step()
    warm(lambda: (opt.zero_grad(set_to_none=True), step()))
    opt.zero_grad(set_to_none=False)  # the graph accumulates into these gradient buffers
    g_train = capture(step)

    def replay_train():
        opt.zero_grad(set_to_none=False)
        g_train.replay()
    return {"infer": g_fwd.replay, "train_sgd": replay_train}


def gates(ours_out: dict, ref: dict, tol=STRICT) -> dict:
    fwd = max((rel_l2(ours_out[k], ref[k]) for k in ref if not k.startswith("grad:")),
              default=0.0)
    gk = [k for k in ref if k.startswith("grad:")]
    bwd = max((rel_l2(ours_out[k], ref[k]) for k in gk), default=0.0)
    cos = min((cosine(ours_out[k], ref[k]) for k in gk), default=1.0)
    worst = max(gk, key=lambda k: rel_l2(ours_out[k], ref[k])) if gk else None
    return {"fwd_rel_l2": fwd, "bwd_rel_l2": bwd, "bwd_min_cos": cos, "worst_param": worst,
            "fwd_pass": fwd <= tol["fwd"],
            "bwd_pass": bwd <= tol["bwd"] and cos >= tol.get("cos", -1.0)}


def run_all_ours(w, args, ref) -> dict:
    """Ours on every implementation, with gates (strict, and fast where measured)."""
    res = {}
    for impl in args.impls.split(","):
        try:
            o = run_ours(w, impl, args)
            o["gates"] = gates(o.pop("outputs"), ref)
            if "outputs" in o.get("fast", {}):
                o["fast"]["gates"] = gates(o["fast"].pop("outputs"), ref, FAST)
            res[impl] = o
        except Exception as e:  # noqa: BLE001
            res[impl] = {"error": f"{type(e).__name__}: {e}"[:600],
                         "tb": traceback.format_exc()[-1500:]}
    return res


def main(argv=None) -> int:
    from workloads import MINLAT_IS_MAIN, WORKLOADS

    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="all")
    p.add_argument("--impls", default="wgpu")
    p.add_argument("--quick", action="store_true", help="tiny configs (lavapipe/CPU)")
    p.add_argument("--minlat", action="store_true", help="batch/seq/chunk 1 variants too")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--torch-device", default=None)
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="skip PyTorch's CUDA-graph replay cells (timed by default on CUDA)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--fast", action="store_true", help="also our precision='fast' cells")
    p.add_argument("--refresh-ours", default=None, metavar="TAG",
                   help="re-measure our cells of records already in --out (PyTorch's timings "
                        "kept; its gate reference recomputed); records marked TAG are done")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.torch_device is None:
        import torch

        args.torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    names = list(WORKLOADS) if args.workloads == "all" else args.workloads.split(",")
    variants = ["main", "minlat"] if args.minlat else ["main"]
    results = []
    if os.path.exists(args.out):
        results = json.load(open(args.out))
    for name in names:
        if name not in WORKLOADS:
            print(f"{name}: no such workload (known: {', '.join(WORKLOADS)}); skipped", flush=True)
            continue
        for variant in variants:
            key = f"{name}/{variant}"
            if variant == "minlat" and name in MINLAT_IS_MAIN:
                continue
            old = next((r for r in results if r["key"] == key), None)
            if old is not None and args.refresh_ours and "error" not in old \
                    and old.get("refresh") != args.refresh_ours:
                t0 = time.perf_counter()
                w = WORKLOADS[name](quick=args.quick, variant=variant)
                ref = torch_reference(w, args)[2]  # the twin itself is dropped right away
                torch_release()
                old["ours"] = run_all_ours(w, args, ref)
                old.update(refresh=args.refresh_ours, ours_date=time.strftime("%Y-%m-%d"),
                           ours_seconds=time.perf_counter() - t0)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1, default=float)
                print(summary_line(old), flush=True)
                continue
            if old is not None:
                continue
            rec = {"key": key, "workload": name, "variant": variant,
                   "date": time.strftime("%Y-%m-%d"), "quick": args.quick}
            t0 = time.perf_counter()
            try:
                w = WORKLOADS[name](quick=args.quick, variant=variant)
                rec["params"] = int(sum(v.size for v in w.params.values()))
                rec["torch"] = run_torch(w, args)
                ref = rec["torch"].pop("ref")
                rec["ours"] = run_all_ours(w, args, ref)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:600]
                rec["tb"] = traceback.format_exc()[-1500:]
            rec["seconds"] = time.perf_counter() - t0
            results.append(rec)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=float)
            print(summary_line(rec), flush=True)
    return 0


def summary_line(rec) -> str:
    if "error" in rec:
        return f"{rec['key']}: ERROR {rec['error'][:200]}"
    parts = [rec["key"]]
    eager = rec["torch"]["cells"]["eager_f32"]
    graph = rec["torch"]["cells"].get("cuda_graph_f32", {})
    if "train_sgd" in graph:
        parts.append(f"torch CUDA graph: fwd {graph['infer']['median_ms']:.2f} train-sgd "
                     f"{graph['train_sgd']['median_ms']:.2f}")
    elif "error" in graph:
        parts.append(f"torch CUDA graph: {graph['error'][:100]}")
    for impl, o in rec["ours"].items():
        if "error" in o:
            parts.append(f"{impl}: ERROR {o['error'][:150]}")
            continue
        g = o["gates"]
        parts.append(f"{impl}: fwd {o['infer']['median_ms']:.2f} ms (eager "
                     f"{eager['infer']['median_ms']:.2f}) train-sgd "
                     f"{o['train_sgd']['median_ms']:.2f} (eager "
                     f"{eager['train_sgd']['median_ms']:.2f}) gates fwd {g['fwd_rel_l2']:.1e} "
                     f"bwd {g['bwd_rel_l2']:.1e} "
                     f"{'PASS' if g['fwd_pass'] and g['bwd_pass'] else 'FAIL'}")
        f = o.get("fast", {})
        if "gates" in f:
            fg = f["gates"]
            parts.append(f"{impl} fast: fwd {f['infer']['median_ms']:.2f} train-sgd "
                         f"{f['train_sgd']['median_ms']:.2f} gates {fg['fwd_rel_l2']:.1e}/"
                         f"{fg['bwd_rel_l2']:.1e} "
                         f"{'PASS' if fg['fwd_pass'] and fg['bwd_pass'] else 'FAIL'}")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
