"""Where a step's wall time goes besides kernels: the same compiled step timed in several
submit modes ``PREENCODE/SEGMENTS`` (``$MEGANEURA_PREENCODE``: 1 encodes the next step while
the GPU runs this one, 0 encodes on demand; ``$MEGANEURA_SUBMIT_SEGMENTS``: the cuts, 0 one
command buffer, ``default`` unset), against the sum of its kernels' GPU times, the wall of
pre-encoded steps submitted back to back (``sess.profile``) and the host encode time.

  python bench/step_overhead.py [workloads] [--impl dawn] [--modes 0/12,96 1/default 1/0 ...]

Prints per workload and mode: wall ms per step (median of ``--steps``, sync each step,
inputs resident, two interleaved rounds), kernel-sum ms, back-to-back ms, encode µs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import meganeura as mn  # noqa: E402
from meganeura import optim  # noqa: E402


def measure(w, dev, inference: bool, modes: list[str], steps: int) -> dict:
    from harness import ours_step_times

    kw = dict(outputs=w.outputs) if inference else dict(loss=w.loss,
                                                         optimizer=optim.SGD(lr=1e-4))
    sess = mn.compile(w.graph, device=dev, **kw)
    sess.set_params(w.params)
    feeds = sess.program.inference_feeds() if inference else sess.program.feeds
    prof = sess.profile(steps=3, inference=inference,
                        **{k: v for k, v in w.feeds.items() if k in feeds})
    ex = sess.infer if inference else sess.train
    res = {"kernel_ms": prof.gpu_ms_per_step, "encode_us": prof.encode_us_per_step,
           "b2b_ms": prof.step_wall_ms, "dispatches": len(ex.commands), "wall_ms": {}}
    for _ in range(2):  # two interleaved rounds: drift shows as disagreement
        for mode in modes:
            with _mode(mode):
                t = ours_step_times(sess, inference, w.feeds, 3, steps)
            res["wall_ms"].setdefault(mode, []).append(float(np.median(t)) * 1e3)
    return res


@contextlib.contextmanager
def _mode(mode: str):
    """``PREENCODE/SEGMENTS`` as the two environment variables (``default``: unset)."""
    ahead, _, seg = mode.partition("/")
    env = {"MEGANEURA_PREENCODE": ahead, "MEGANEURA_SUBMIT_SEGMENTS": seg}
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v in ("", "default"):
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None) -> None:
    from workloads import WORKLOADS

    from meganeura.runtime.device import get_device

    p = argparse.ArgumentParser()
    p.add_argument("workloads", nargs="?", default="whisper,resnet50")
    p.add_argument("--impl", default="dawn")
    # PREENCODE/SEGMENTS: encoded on demand in the old default cuts and in cuts that grow
    # with the step (bench/step_split.py: the host encodes 4-10 µs per dispatch on Dawn, so
    # with 12,96 the GPU starves while the last segment is encoded; docs/benchmarks.md
    # sixteenth session); encoded ahead in the default PREPARED_SEGMENTS, one command buffer
    # and finer cuts
    p.add_argument("--modes", nargs="+", default=[
        "0/12,96", "0/8,20,40,80,160,320,640", "1/default", "1/0", "1/4,12,36,108,324"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev = get_device(a.impl)
    out = {}
    for name in a.workloads.split(","):
        w = WORKLOADS[name](a.quick, "main")
        for inference in (True, False):
            key = f"{name}/{'infer' if inference else 'train'}"
            out[key] = measure(w, dev, inference, a.modes, a.steps)
            r = out[key]
            walls = "  ".join(f"[{s}] " + "/".join(f"{x:.3f}" for x in v)
                              for s, v in r["wall_ms"].items())
            print(f"{key:22s} kernels {r['kernel_ms']:.3f} ms, back to back "
                  f"{r['b2b_ms']:.3f} ms, {r['dispatches']} cmds, encode "
                  f"{r['encode_us']:.0f} µs | wall {walls}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
