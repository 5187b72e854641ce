"""Registers, spills and shared memory the GPU driver gives our kernels (what WebGPU hides).

  python3 bench/pipeline_stats.py OUTDIR [attn,mm,whisper] [--layer DIR] [--spirv-dis PATH]

1. A small Vulkan layer (``bench/spirv_dump_layer.c``, built with gcc unless ``--layer`` names
   a built one) writes every SPIR-V module the process creates; Dawn's pipelines are created one
   by one, so each kernel's module is the one written while its pipeline was made.
2. ``bench/vk_stats.py`` creates the same pipeline on its own Vulkan device with
   ``VK_KHR_pipeline_executable_properties`` and records the driver's statistics (and its
   internal representation, when it gives one: OUTDIR/<kernel>.<name>.ir.txt).
3. ``spirv-dis`` (SPIRV-Tools), when there is one, writes the module as text
   (OUTDIR/<kernel>.spvasm).

Writes OUTDIR/stats.json and prints a table (one row per kernel, a column per statistic) last.
Kernel sets: ``attn`` the tensor-core attention forward at Whisper's shape (its layout
variants) and the strict one; ``mm`` tensor-core matmul tiles at 4096³ whose speeds are in
docs/benchmarks.md; ``whisper`` every kernel of Whisper-tiny's fast inference step.
Dawn (default) on the GPU machine; ``--backend wgpu`` runs the same path on lavapipe (no
statistics there: Mesa 22's lavapipe lacks the extension)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

LAYER = "VK_LAYER_MN_spirv_dump"
LAYER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spirv_dump_layer.c")


def build_layer(out_dir: str) -> str:
    """Compile ``spirv_dump_layer.c`` (gcc, Vulkan headers: apt libvulkan-dev) into
    ``out_dir`` with its loader manifest; returns ``out_dir`` (a ``VK_LAYER_PATH``)."""
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(out_dir, "libmn_spirv_dump.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-o", lib,
                    LAYER_SRC], check=True)
    manifest = {"file_format_version": "1.1.2", "layer": {
        "name": LAYER, "type": "GLOBAL", "library_path": "./libmn_spirv_dump.so",
        "api_version": "1.3.0", "implementation_version": "1",
        "description": "writes every SPIR-V module to $MN_SPIRV_DUMP"}}
    json.dump(manifest, open(os.path.join(out_dir, "VkLayer_mn_spirv_dump.json"), "w"))
    return out_dir


class LayerCapture:
    """The SPIR-V module the layer dumped (``$MN_SPIRV_DUMP``) while each pipeline was created
    (``Device._create_caught`` wrapped), by the kernel's WGSL."""

    def __init__(self, dev, dump_dir: str) -> None:
        self.dir = dump_dir
        self.seen: set[str] = set(os.listdir(dump_dir))
        self.by_wgsl: dict[str, bytes] = {}
        orig = dev._create_caught

        def create(spec):
            try:
                return orig(spec)
            finally:
                new = sorted(set(os.listdir(self.dir)) - self.seen)
                self.seen.update(new)
                if new:
                    self.by_wgsl[spec.wgsl] = open(os.path.join(self.dir, new[-1]), "rb").read()

        dev._create_caught = create

    def take(self, spec) -> bytes | None:
        """The module of ``spec``'s pipeline (shared by every kernel with the same WGSL)."""
        return self.by_wgsl.get(spec.wgsl)


def open_device(layer_dir: str, dump_dir: str, backend: str = "dawn"):
    """Meganeura's device with the SPIR-V dump layer and pipelines created one by one."""
    os.environ.update({"MEGANEURA_PIPELINE_CREATE": "sequential", "MN_SPIRV_DUMP": dump_dir,
                       "VK_LAYER_PATH": os.path.abspath(layer_dir),
                       "VK_INSTANCE_LAYERS": LAYER, "VK_LOADER_LAYERS_ENABLE": LAYER})
    from meganeura.runtime import device as devmod

    dev = devmod.get_device(backend)
    return dev, LayerCapture(dev, dump_dir)


def attn_specs(dev):
    """(label, spec): the fast attention forward at Whisper's shape per layout variant and
    chunk count, and the strict forward."""
    import attention_bench as ab

    from meganeura import kernels
    from meganeura.kernels import CodegenError

    x, a, _ = ab.problem(ab.SHAPES["whisper"])
    base = ab.describe("fwd", x, a)
    out = [("strict-x6", kernels.emit(dataclasses.replace(base, splits=6), dev.limits,
                                      dev.features))]
    for name in ("main", "oshared", "splitpf", "oshared-splitpf", "rows1", "rows1-splitpf",
                 "no-prefetch", "no-softmax"):
        for n, cfg in ((3, (4, 64)), (6, (4, 64)), (3, (4, 32))):
            d = dataclasses.replace(base, splits=n, config=cfg, precision="fast")
            with ab.variant(ab.FAST_VARIANTS[name]):
                try:
                    spec = kernels.emit(d, dev.limits, dev.features)
                except CodegenError:  # (4, 64) does not fit 48 KiB with O in workgroup memory
                    continue
            out.append((f"fast-{name}-{cfg[1]}x{n}", spec))
    return out


# tensor-core tiles at 4096³ with their measured TFLOP/s (docs/benchmarks.md, 2026-12-01)
MM_TILES = {(128, 256, 2, 4, 32, 0): 219.2, (128, 256, 2, 4, 32, 8): 164.2,
            (128, 128, 2, 4, 32, 0): 145.4, (256, 128, 4, 2, 32, 32): 198.6,
            (256, 128, 4, 2, 32, 0): 81.9, (128, 256, 2, 4, 16, 5): 134.3,
            (128, 256, 2, 4, 32, 32): 82.4}


def mm_specs(dev, tiles=None, dtype: str = "f32"):
    """(label, spec) of the tensor-core matmul tiles of ``MM_TILES`` (or ``tiles``: sgmat
    ``Cfg``s, ``--mm-cfgs``) at 4096³, f32 operands (or ``dtype`` "f16": ``--mm-f16``)."""
    from meganeura import dtypes, kernels
    from meganeura.kernels import MatmulKernel, Strided
    from meganeura.kernels.matmul import Cfg

    n, dt = 4096, getattr(dtypes, dtype)
    desc = MatmulKernel(1, n, n, n, Strided.contiguous(dt, (1, n, n)),
                        Strided.contiguous(dt, (1, n, n)), precision="fast",
                        out_dtype=dtypes.f32)
    notes = ({c: "cfg" for c in tiles} if tiles else
             {Cfg("sgmat", *c): f"{tf}TF" for c, tf in MM_TILES.items()})
    out = []
    for cfg, note in notes.items():
        d = dataclasses.replace(desc, config=cfg)
        out.append((f"sgmat{tuple(cfg)[1:]}-{dt.name}-{note}",
                    kernels.emit(d, dev.limits, dev.features)))
    return out


def smoke_specs(dev):
    """(label, spec) of a small training step's kernels (matmuls, pointwise, reductions): the
    set the test runs on lavapipe."""
    import meganeura as mn
    from meganeura import optim

    g = mn.Graph("smoke")
    x, w = g.input("x", (64, 32)), g.param("w", (32, 16))
    loss = ((x @ w).relu() * 0.5).mean()
    sess = mn.compile(g, loss=loss, optimizer=optim.SGD(lr=0.1), device=dev)
    return _session_specs(sess)


def _session_specs(sess) -> list[tuple]:
    """(label, spec) of every distinct kernel (by WGSL) of a compiled session."""
    seen: dict[str, tuple] = {}
    for _, s in sess._streams():
        for d in s.stream.dispatches:
            seen.setdefault(d.spec.wgsl, (d.label, d.spec))
    return list(seen.values())


def whisper_specs(dev):
    """(label, spec) of every kernel of Whisper-tiny's fast inference step."""
    from workloads import WORKLOADS

    import meganeura as mn

    w = WORKLOADS["whisper"](quick=False, variant="main")
    sess = mn.compile(w.graph, outputs=w.outputs, precision="fast", device=dev)
    return _session_specs(sess)


def disassemble(code: bytes, tool: str) -> str:
    """``spirv-dis`` text of a module (for reading), or a note when the tool is missing."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.spv")
        open(src, "wb").write(code)
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(os.path.abspath(tool)))
        try:
            r = subprocess.run([tool, src], capture_output=True, text=True, env=env)
        except OSError as e:
            return f"; no spirv-dis ({e})"
        return r.stdout if r.returncode == 0 else f"; spirv-dis failed: {r.stderr[:300]}"


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:120]


def entry_point(code: bytes) -> str:
    """The name of the module's (first) entry point (OpEntryPoint: model, id, literal name)."""
    words = struct.unpack(f"<{len(code) // 4}I", code)
    i = 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if op == 15:
            raw = struct.pack(f"<{n - 3}I", *words[i + 3:i + n])
            return raw.split(b"\0")[0].decode()
        i += max(n, 1)
    return "main"


def collect(dev, cap, vk, specs, out_dir: str, dis: str) -> list[dict]:
    """Create each spec's pipeline on Dawn, take its SPIR-V, measure it on ``vk``."""
    from vk_stats import spirv_bindings

    rows = []
    for label, spec in specs:
        spec = dataclasses.replace(spec, name=label)
        row = {"kernel": label, "workgroups": list(spec.workgroups)}
        try:
            dev.pipeline(spec)
            code = cap.take(spec)
            if code is None:
                raise RuntimeError("no SPIR-V dumped for it (is the layer loaded?)")
            open(os.path.join(out_dir, _safe(label) + ".spv"), "wb").write(code)
            open(os.path.join(out_dir, _safe(label) + ".spvasm"), "w").write(
                disassemble(code, dis))
            row["n_bindings"] = spec.n_bindings
            row["spirv_bindings"] = [list(b) for b in spirv_bindings(code)[0]]
            os.environ.pop("MN_SPIRV_DUMP", None)  # our own modules are not Dawn's
            try:
                pipe = vk.pipeline(code, entry_point(code))
            finally:
                os.environ["MN_SPIRV_DUMP"] = cap.dir
            row["stats"] = vk.statistics(pipe)
            for name, ir in vk.internal(pipe).items():
                open(os.path.join(out_dir, f"{_safe(label)}.{_safe(name)}.ir.txt"), "w").write(ir)
        except Exception as e:  # one bad kernel does not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        print(label, row.get("stats", row.get("error")), flush=True)
    return rows


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("sets", nargs="?", default="attn,mm",
                    help="attn, mm, whisper, smoke (commas)")
    ap.add_argument("--layer", help="a directory with the built layer (default: build it "
                    "into OUT/layer with gcc)")
    ap.add_argument("--spirv-dis", default=os.environ.get("SPIRV_DIS", "spirv-dis"))
    ap.add_argument("--backend", default="dawn", help="dawn, or wgpu (lavapipe checks)")
    ap.add_argument("--toggles", default="", help="extra Dawn toggles, comma-separated (e.g. "
                    "disable_robustness)")
    ap.add_argument("--mm-cfgs", help="mm set: these tensor-core configurations "
                    "('tm,tn,rm,rn,bk,vr;...') instead of MM_TILES")
    ap.add_argument("--mm-f16", action="store_true", help="mm set: f16 operands")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    tiles = None
    if a.mm_cfgs:
        from matmul_bench import parse_cfgs

        tiles = [c for c in parse_cfgs(a.mm_cfgs) if c is not None]
    from vk_stats import VulkanStats

    dump = tempfile.mkdtemp(prefix="mn-spirv-")
    if a.toggles:
        from meganeura.runtime import device as devmod

        devmod._DAWN_TOGGLES += tuple(a.toggles.split(","))
    dev, cap = open_device(a.layer or build_layer(os.path.join(a.out, "layer")), dump,
                           a.backend)
    os.environ.pop("MN_SPIRV_DUMP")
    vk = VulkanStats()
    os.environ["MN_SPIRV_DUMP"] = dump
    print(f"vulkan device {vk.name}; extensions {vk.extensions}", flush=True)
    make = {"attn": attn_specs, "whisper": whisper_specs, "smoke": smoke_specs,
            "mm": lambda dev: mm_specs(dev, tiles, "f16" if a.mm_f16 else "f32")}
    rows = []
    for s in a.sets.split(","):
        rows += collect(dev, cap, vk, make[s](dev), a.out, a.spirv_dis)
        json.dump({"device": vk.name, "rows": rows}, open(os.path.join(a.out, "stats.json"),
                                                            "w"), indent=1)
    print(table(rows))


def table(rows) -> str:
    """Markdown table: one row per kernel, one column per statistic the driver gave."""
    keys = sorted({k for r in rows for k in r.get("stats", {})})
    out = ["| kernel | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        st = r.get("stats")
        vals = [f"{st.get(k, ''):g}" if st and k in st else "" for k in keys]
        out.append(f"| {r['kernel']} | " + (" | ".join(vals) if st else r.get("error", "")) +
                   " |")
    return "\n".join(out)


if __name__ == "__main__":
    main(sys.argv[1:])
