"""Imported vs native: torchvision's ResNet-50 through ``mn.from_torch`` against our own
``models.resnet`` (the same architecture, same weights), step times on one device.

  python bench/torch_import_bench.py --impl dawn --out torch_import.json          (H200)
  python bench/torch_import_bench.py --quick --impl wgpu                           (lavapipe)

Both graphs are training-mode (batch statistics), batch 4, 224², cross-entropy; the imported
one gets its weights from the module, the native one the same arrays (the parameter names
are torchvision's in both).  Per graph: the import time (export + decompositions + build),
compile times, dispatches per step, median step time (inference and SGD training; warm-ups
first, GPU synchronized) and the gate between the two (logits, loss).  torchvision's model is
used where torchvision imports, else the torchvision-layout twin of the tests (recorded)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import rel_l2, time_ours  # noqa: E402

import meganeura as mn  # noqa: E402


def _torch_model(cfg, quick: bool):
    """torchvision's resnet50 when available (and not --quick), else the tests' twin."""
    if not quick:
        try:
            import torchvision

            return torchvision.models.resnet50(), f"torchvision {torchvision.__version__}"
        except Exception as e:  # noqa: BLE001  (recorded: which model was measured)
            print(f"torchvision unavailable ({type(e).__name__}: {e}); using the twin")
    from tests.models.twins_vision import TorchResNet

    return TorchResNet(cfg), "tests/models/twins_vision.TorchResNet"


def _measure(name, graph, loss, logits, weights, feeds, dev, args) -> dict:
    rec = {}
    t0 = time.perf_counter()
    inf = mn.compile(graph, outputs={"logits": logits}, device=dev)
    rec["compile_infer_s"] = time.perf_counter() - t0
    inf.set_params({k: v for k, v in weights.items() if k in inf.program.persistent})
    rec["logits"] = inf.run(x=feeds["x"])["logits"]
    rec["infer"] = time_ours(inf, True, feeds, args.warmup, args.steps)
    rec["infer"]["dispatches"] = inf.memory_report()["infer"]["dispatches"]
    del inf
    t0 = time.perf_counter()
    tr = mn.compile(graph, loss=loss, outputs={}, optimizer=mn.optim.SGD(lr=1e-4), device=dev)
    rec["compile_train_s"] = time.perf_counter() - t0
    tr.set_params({k: v for k, v in weights.items() if k in tr.program.persistent})
    rec["loss"] = float(tr.step(**feeds).loss)
    rec["train_sgd"] = time_ours(tr, False, feeds, args.warmup, args.steps)
    rec["train_sgd"]["dispatches"] = tr.memory_report()["train"]["dispatches"]
    del tr
    print(f"{name}: infer {rec['infer']['median_ms']:.2f} ms, train "
          f"{rec['train_sgd']['median_ms']:.2f} ms", flush=True)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="dawn", help="wgpu | dawn")
    ap.add_argument("--quick", action="store_true", help="resnet50-tiny, batch 2 (lavapipe)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from torch.nn import functional as F

    from meganeura.models import resnet
    from meganeura.runtime.device import get_device

    batch = 2 if args.quick else 4
    native = resnet.resnet("resnet50-tiny" if args.quick else "resnet50", batch, training=True)
    torch.manual_seed(0)
    module, source = _torch_model(native.config, args.quick)
    module.train()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(native.x.shape, np.float32),
             "y": rng.integers(0, native.config.num_classes, native.y.shape).astype(np.int32)}
    t0 = time.perf_counter()
    imp = mn.from_torch(module, torch.from_numpy(feeds["x"]), loss=F.cross_entropy,
                        loss_inputs=(torch.from_numpy(feeds["y"]).long(),))
    rec = {"model": source, "import_s": time.perf_counter() - t0, "batch": batch,
           "image": native.x.shape[-1], "torch": torch.__version__}
    dev = get_device(args.impl)
    rec.update(impl=args.impl, device=dev.adapter_name)
    rec["native"] = _measure("native", native.graph, native.loss, native.logits, imp.weights,
                             feeds, dev, args)
    rec["imported"] = _measure("imported", imp.graph, imp.loss, imp.outputs["output"],
                               imp.weights, {"x": feeds["x"], "target": feeds["y"]}, dev, args)
    rec["gate_logits_rel_l2"] = rel_l2(rec["imported"].pop("logits"), rec["native"].pop("logits"))
    rec["gate_loss_rel_l2"] = rel_l2(rec["imported"]["loss"], rec["native"]["loss"])
    for mode in ("infer", "train_sgd"):
        rec[f"ratio_{mode}"] = rec["imported"][mode]["median_ms"] / rec["native"][mode]["median_ms"]
    print("| graph | infer ms | train SGD ms | dispatches (infer/train) | compile train s |")
    print("|---|---|---|---|---|")
    for k in ("native", "imported"):
        r = rec[k]
        print(f"| {k} | {r['infer']['median_ms']:.2f} | {r['train_sgd']['median_ms']:.2f} | "
              f"{r['infer']['dispatches']}/{r['train_sgd']['dispatches']} | "
              f"{r['compile_train_s']:.2f} |")
    print(f"ratio imported/native: infer {rec['ratio_infer']:.3f}, train "
          f"{rec['ratio_train_sgd']:.3f}; import {rec['import_s']:.1f} s; gates logits "
          f"{rec['gate_logits_rel_l2']:.1e} loss {rec['gate_loss_rel_l2']:.1e}; {source}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
