"""What data parallel compiles, per workload of ``bench/dp_bench.py`` (docs/distributed.md):
the gradient program's host-side compile seconds with and without the inference stream (plus
the GPU memory that stream's arena and result buffers would take), and the update program's
dispatches and copies with and without parameter groups.  No device run: the compile uses the
portable target (the limits every WebGPU device has).

  python bench/dp_streams.py --workloads resnet50,smollm2 --quick
  python bench/dp_streams.py --workloads resnet50          (ResNet-50, batch 4 × 224²)"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _mib(stream) -> float:
    return (stream.arena_bytes + sum(stream.out_buffers.values())) / 2**20 if stream else 0.0


def gradient_rows(name: str, graph, loss, repeats: int) -> list[str]:
    """Best-of-``repeats`` compile seconds of the gradient program, both streams vs training
    only (what ``DataParallel`` compiles for a graph with state updates)."""
    from meganeura.compile.pipeline import CompileOptions, compile_program
    from meganeura.distributed import gradient_program
    from meganeura.kernels.common import make_target

    gp = gradient_program(graph, loss)
    best, mem = {}, {}
    for _ in range(repeats):
        for inference in (True, False):
            exe = compile_program(gp, make_target(None),
                                  CompileOptions(group_params=False, inference=inference))
            best[inference] = min(best.get(inference, 1e9), exe.compile_seconds)
            mem[inference] = _mib(exe.infer)
    return [f"| {name} | {gp.training} | {best[True]:.2f} s | {best[False]:.2f} s | "
            f"{mem[True] - mem[False]:.1f} MiB |"]


def update_rows(name: str, graph, loss) -> list[str]:
    """Dispatches and copies of one optimizer update, without groups (as data parallel runs
    it: the parameters are shared with the gradient program) and with groups."""
    from meganeura import optim
    from meganeura.compile.pipeline import CompileOptions, compile_program
    from meganeura.distributed import gradient_program, update_program
    from meganeura.kernels.common import make_target

    names = list(gradient_program(graph, loss).grads)
    rows = []
    for label, opt in (("AdamW", optim.AdamW(lr=1e-4)),
                       ("SGD momentum", optim.SGD(lr=0.1, momentum=0.9))):
        cells = []
        for groups in (False, True):
            exe = compile_program(update_program(graph, names, opt, 0.5), make_target(None),
                                  CompileOptions(group_params=groups))
            n_disp = len(exe.train.dispatches)
            cells.append(f"{n_disp} dispatches + {len(exe.train.ops) - n_disp} copies")
        rows.append(f"| {name} | {label} | {len(names)} | {cells[0]} | {cells[1]} |")
    return rows


def main() -> None:
    import dp_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="resnet50,smollm2")
    ap.add_argument("--quick", action="store_true", help="the tiny configurations")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    grad, upd = [], []
    for name in args.workloads.split(","):
        graph, loss, _, _ = dp_bench.build(name, args.quick)
        grad += gradient_rows(name, graph, loss, args.repeats)
        upd += update_rows(name, graph, loss)
    print("| workload | state updates | compile, both streams | training only | "
          "inference-stream memory |\n|---|---|---|---|---|")
    print("\n".join(grad))
    print("\n| workload | optimizer | parameters | no groups (as run) | with groups |\n"
          "|---|---|---|---|---|")
    print("\n".join(upd))


if __name__ == "__main__":
    main()
