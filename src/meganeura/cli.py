"""``meganeura`` command line: ``info`` (WebGPU implementations, adapter, features, limits),
``train`` (a model on the embedded digits dataset, with progress bar, checkpoint and loss plot)
and ``profile`` (per-kernel GPU times of a training step)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _model(name: str, batch: int):
    from .models.mlp import mlp_classifier

    if name == "mlp":
        return mlp_classifier(batch)
    if name == "cnn":
        from .models.cnn import digits_cnn

        return digits_cnn(batch)
    raise SystemExit(f"unknown model {name!r}; choose mlp or cnn")


def _optimizer(args, steps_total: int):
    from . import optim

    sched = optim.WarmupCosine(args.lr, warmup_steps=min(20, steps_total // 10),
                               total_steps=steps_total, min_lr=args.lr * 0.05)
    return optim.AdamW(lr=sched, weight_decay=args.weight_decay)


def cmd_info(args) -> int:
    from .runtime.device import get_device

    try:
        dev = get_device(args.backend)
    except Exception as e:  # noqa: BLE001 - report any adapter failure plainly
        print(f"no usable WebGPU adapter: {e}", file=sys.stderr)
        return 1
    print(json.dumps(dev.describe(), indent=2, default=str))
    return 0


def _accuracy(sess_infer, params, x, y) -> float:
    sess_infer.set_params(params)
    logits = sess_infer.run(x=x)["logits"]
    return float((logits.argmax(-1) == y).mean())


def cmd_train(args) -> int:
    from tqdm import tqdm

    from . import compile
    from .io.datasets import batches, load_digits

    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    steps_per_epoch = len(xtr) // args.batch_size
    total = steps_per_epoch * args.epochs
    m = _model(args.model, args.batch_size)
    backend = args.backend
    t0 = time.perf_counter()
    sess = compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=_optimizer(args, total), precision=args.precision, backend=backend)
    me = _model(args.model, len(xte))
    evals = compile(me.graph, outputs={"logits": me.logits}, precision=args.precision,
                    backend=backend)
    compile_s = time.perf_counter() - t0
    sess.init_params(args.seed)
    dev = getattr(sess, "dev", None)
    where = dev.describe().get("adapter", "?") if dev else "numpy reference"
    print(f"model {args.model}: {sum(p.size for p in m.graph.params.values())} parameters; "
          f"device: {where}; compile {compile_s:.2f} s")
    if args.precision == "fast" and hasattr(sess, "kernel_variants"):
        kinds = sess.kernel_variants()["train"]
        n_tc = sum(n for k, n in kinds.items() if k.startswith("sgmat"))
        print(f"precision fast: {n_tc} matmuls of the training step on tensor cores"
              if n_tc else "precision fast: this device has no f16 subgroup matrices, so the "
              "program is the strict one (try --backend dawn on an NVIDIA GPU)")
    losses = []
    bar = tqdm(total=total, desc="train", unit="step", disable=args.quiet)
    step = 0
    for epoch in range(args.epochs):
        pending = []
        for xb, yb in batches(xtr, ytr, args.batch_size, shuffle=True, seed=args.seed + epoch,
                              drop_last=True):
            pending.append(sess.step(x=xb, y=yb))
            step += 1
            bar.update(1)
        for r in pending:  # read losses once per epoch: no GPU sync inside the loop
            losses.append(r.loss)
        bar.set_postfix(epoch=epoch + 1, loss=f"{np.mean(losses[-steps_per_epoch:]):.4f}")
    bar.close()
    acc = _accuracy(evals, sess.get_params(), xte, yte)
    train_s = time.perf_counter() - t0 - compile_s
    print(f"final loss {np.mean(losses[-steps_per_epoch:]):.4f}; test accuracy {acc * 100:.2f}% "
          f"({len(xte)} images); {step} steps in {train_s:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, f"{args.model}.safetensors")
    sess.save(ckpt)
    png = os.path.join(args.out, f"{args.model}-loss.png")
    _plot(losses, png, f"{args.model} on digits — test accuracy {acc * 100:.1f}%")
    print(f"saved {ckpt} and {png}")
    return 0 if acc >= args.min_accuracy else 3


def _plot(losses, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_profile(args) -> int:
    from . import compile
    from .io.datasets import load_digits

    xtr, ytr = load_digits("train")
    m = _model(args.model, args.batch_size)
    sess = compile(m.graph, loss=m.loss, optimizer=_optimizer(args, 100), backend=args.backend)
    xb, yb = xtr[: args.batch_size], ytr[: args.batch_size]
    if not hasattr(sess, "profile"):
        print("profiling needs a GPU backend", file=sys.stderr)
        return 1
    table = sess.profile(steps=args.steps, x=xb, y=yb.astype(np.int32))
    print(table)
    if args.trace:
        sess.export_trace(args.trace)
        print(f"trace written to {args.trace}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="meganeura", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    pi = sub.add_parser("info", help="WebGPU implementations, adapter, features and limits")
    pi.add_argument("--backend", default=None, help="wgpu | dawn | auto")
    pt = sub.add_parser("train", help="train a model on the embedded digits dataset")
    pt.add_argument("--model", default="mlp", help="mlp (default) or cnn")
    pt.add_argument("--epochs", type=int, default=20)
    pt.add_argument("--batch-size", type=int, default=64)
    pt.add_argument("--lr", type=float, default=3e-3)
    pt.add_argument("--weight-decay", type=float, default=0.01)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--backend", default=None, help="wgpu (default) | dawn | auto | reference")
    pt.add_argument("--precision", default="strict", choices=["strict", "fast"])
    pt.add_argument("--out", default="runs", help="directory for checkpoint and loss plot")
    pt.add_argument("--min-accuracy", type=float, default=0.0,
                    help="exit with status 3 if the test accuracy is below this fraction")
    pt.add_argument("--quiet", action="store_true")
    pp = sub.add_parser("profile", help="per-kernel GPU times of a training step")
    pp.add_argument("--model", default="mlp")
    pp.add_argument("--batch-size", type=int, default=64)
    pp.add_argument("--steps", type=int, default=10)
    pp.add_argument("--lr", type=float, default=3e-3)
    pp.add_argument("--weight-decay", type=float, default=0.01)
    pp.add_argument("--backend", default=None)
    pp.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help()
        return 2
    return {"info": cmd_info, "train": cmd_train, "profile": cmd_profile}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
