"""The GPU session: buffers, pipelines and bind groups built once from the Plan; ``step`` encodes
the fixed kernel list into one command buffer and submits once.

The runtime sees only the Plan (and the Program's interface: feed types, persistent tensors);
it never looks at ops, autodiff or passes beyond calling the pipeline once at construction."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections import Counter

import numpy as np

from .. import kernels
from ..compile.passes import run_pipeline
from ..compile.schedule import (
    NO_GROUPS,
    Loc,
    Plan,
    PlannedCopy,
    PlannedKernel,
    find_leaf_groups,
    make_plan,
)
from ..errors import GraphBuildError
from ..kernels.archetypes import emitter_for
from ..kernels.ir import PRECISIONS
from ..program import Program
from ..session import Session
from .device import get_device

_DEBUG = set(filter(None, os.environ.get("MEGANEURA_DEBUG", "").split(",")))


def _emit(desc, dev, precision: str = "strict"):
    if precision != "strict" and isinstance(desc, kernels.MatmulKernel):
        desc = dataclasses.replace(desc, precision=precision)
    special = emitter_for(desc)
    if special is not None:
        return special(desc, dev.limits, dev.features)
    return kernels.emit(desc, dev.limits, dev.features)


class _Executable:
    """One plan made concrete: pipelines, bind groups, arena and result buffers."""

    def __init__(self, sess: GPUSession, plan: Plan, tag: str):
        import wgpu

        self.plan = plan
        dev = sess.dev
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        _check_buffer(dev, plan.arena_bytes, f"the {tag} plan's intermediate arena")
        self.arena = dev.device.create_buffer(size=max(plan.arena_bytes, 256), usage=usage,
                                              label=f"{tag}-arena")
        self.outs: dict[str, object] = {}
        for k in plan.kernels:
            locs = k.binds if isinstance(k, PlannedKernel) else [k.src, k.dst]
            for loc in locs:
                if loc.pool == "out" and loc.name not in self.outs:
                    self.outs[loc.name] = dev.device.create_buffer(
                        size=_round4(loc.nbytes), usage=usage, label=f"{tag}-{loc.name}")
        for loc, _t in plan.fetch.values():
            if loc.pool == "out" and loc.name not in self.outs:
                self.outs[loc.name] = dev.device.create_buffer(
                    size=_round4(loc.offset + loc.nbytes), usage=usage)
        self.ops: list[tuple] = []
        self.specs = []
        self.checked = False  # set once an encode of this fixed stream passed validation
        self._raw_runs = None  # the stream with native handles, built at the first raw encode
        # fetched results: copied into a readback buffer at the end of each submit
        self.fetch_layout, self.fetch_copies, self.fetch_bytes = [], [], 0
        for name, (loc, t) in plan.fetch.items():
            n = _round4(loc.nbytes)
            self.fetch_layout.append((name, self.fetch_bytes, t))
            self.fetch_copies.append((sess._buffer(self, loc), loc.offset, self.fetch_bytes, n))
            self.fetch_bytes += n
        self.readback_pool: list = []
        self.variants: Counter = Counter()  # kernel variants of this stream (which ran fast)
        for k in plan.kernels:
            if isinstance(k, PlannedCopy):
                self.ops.append(("copy", sess._buffer(self, k.src), k.src.offset,
                                 sess._buffer(self, k.dst), k.dst.offset, _round4(k.src.nbytes)))
                continue
            spec = _emit(k.desc, dev, sess.precision)
            self.variants[spec.meta.get("variant") or spec.meta.get("archetype", "?")] += 1
            binds = list(k.binds)
            spec, binds = _share_bindings(spec, binds)
            if "wgsl" in _DEBUG:
                print(f"// ---- {k.label}\n{spec.wgsl}")
            pipeline = dev.pipeline(spec)
            layout = dev.bind_group_layout(spec.n_bindings)[0]
            entries = [{"binding": i, "resource": {"buffer": sess._buffer(self, loc),
                                                   "offset": loc.offset,
                                                   "size": _round4(loc.nbytes)}}
                       for i, loc in enumerate(binds)]
            bg = dev.device.create_bind_group(layout=layout, entries=entries)
            self.ops.append(("dispatch", pipeline, bg, spec.workgroups))
            self.specs.append((spec, k.label))

    def encode(self, dev, staging=None):
        enc = dev.device.create_command_encoder()
        raw = _raw_calls(dev) if self.checked else None
        if raw is not None:
            self._encode_raw(enc, raw)
        else:
            cp = last = None
            for op in self.ops:
                if op[0] == "dispatch":
                    if cp is None:
                        cp, last = enc.begin_compute_pass(), None
                    if op[1] is not last:
                        cp.set_pipeline(op[1])
                    cp.set_bind_group(0, op[2])
                    cp.dispatch_workgroups(*op[3])
                    last = op[1]
                else:
                    if cp is not None:
                        cp.end()
                        cp = None
                    enc.copy_buffer_to_buffer(op[1], op[2], op[3], op[4], op[5])
            if cp is not None:
                cp.end()
        if staging is not None:
            for src, off, dst, doff, n in staging:
                enc.copy_buffer_to_buffer(src, off, dst, doff, n)
        cb = enc.finish()
        self.checked = True
        return cb

    def _encode_raw(self, enc, raw) -> None:
        """The checked stream again through wgpu-native's C calls, with every handle looked
        up once (runs of dispatches between copies; a pipeline set only when it changes)."""
        lib, null = raw
        if self._raw_runs is None:
            runs, run, last = [], None, None
            for op in self.ops:
                if op[0] == "dispatch":
                    if run is None:
                        run, last = [], None
                        runs.append(("pass", run))
                    pipe = op[1]._internal if op[1] is not last else None
                    run.append((pipe, op[2]._internal, *op[3]))
                    last = op[1]
                else:
                    run = None
                    runs.append(("copy", op[1:]))
            self._raw_runs = runs
        set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
        for kind, item in self._raw_runs:
            if kind == "copy":
                enc.copy_buffer_to_buffer(*item)
                continue
            cp = enc.begin_compute_pass()
            h = cp._internal
            for pipe, bg, x, y, z in item:
                if pipe is not None:
                    set_pipeline(h, pipe)
                set_bind_group(h, 0, bg, 0, null)
                dispatch(h, x, y, z)
            cp.end()


def _raw_calls(dev):
    """wgpu-native's C entry points without wgpu-py's per-call error capture (~3 µs a call).
    Used only after the first, fully checked encode of a plan: every later step encodes the
    identical command stream.  None for other implementations."""
    if dev.implementation != "wgpu":
        return None
    try:
        from wgpu.backends.wgpu_native._ffi import ffi, lib
    except ImportError:  # pragma: no cover - another wgpu layout
        return None
    return lib, ffi.NULL


def _share_bindings(spec, binds):
    """Several views of one tensor (RoPE halves, q/k/v of a fused projection) would bind the
    same buffer range more than once, which WebGPU forbids for writable storage bindings
    (Dawn validates it): keep the first binding and point the others' reads at it."""
    first: dict = {}
    drop: dict[int, int] = {}
    for i, loc in enumerate(binds):
        if loc in first:
            drop[i] = first[loc]
        else:
            first[loc] = i
    if not drop:
        return spec, binds
    src = spec.wgsl
    for j, i in drop.items():
        src = re.sub(rf"^.*@binding\({j}\) var<storage, read_write> b{j}:.*\n", "", src,
                     flags=re.M)
        src = re.sub(rf"\bb{j}\[", f"b{i}[", src)
        src = re.sub(rf"&b{j}\b", f"&b{i}", src)
    keep = [i for i in range(len(binds)) if i not in drop]
    for new, old in enumerate(keep):  # binding numbers must stay dense: 0..n-1
        src = src.replace(f"@binding({old}) var", f"@binding(@{new}@) var")
    src = re.sub(r"@binding\(@(\d+)@\) var", r"@binding(\1) var", src)
    spec = dataclasses.replace(spec, wgsl=src, n_bindings=len(keep))
    return spec, [binds[i] for i in keep]


def _check_buffer(dev, nbytes: int, what: str, binding: bool = False) -> None:
    """A clear LimitError instead of a failure inside the GPU library."""
    from ..errors import LimitError

    limit = int(dev.limits.get("max_buffer_size", 1 << 62))
    if nbytes > limit:
        raise LimitError(f"{what} needs {nbytes / 2**20:.1f} MiB but the adapter "
                         f"{dev.adapter_name!r} allows buffers of {limit / 2**20:.1f} MiB")
    blimit = int(dev.limits.get("max_storage_buffer_binding_size", 1 << 62))
    if binding and nbytes > blimit:
        raise LimitError(f"{what} needs {nbytes / 2**20:.1f} MiB but the adapter "
                         f"{dev.adapter_name!r} binds at most {blimit / 2**20:.1f} MiB per "
                         "storage buffer")


def _binding_alignment(dev) -> int:
    """The device's storage-buffer offset alignment (bytes), a power of two ≥ 4; WebGPU's
    largest allowed value (256) when the adapter does not say."""
    a = int(dev.limits.get("min_storage_buffer_offset_alignment", 256) or 256)
    return a if a >= 4 and a & (a - 1) == 0 and a <= 256 else 256


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


class GPUSession(Session):
    """Session on a WebGPU device (wgpu-native or Dawn)."""

    def __init__(self, program: Program, precision: str = "strict", backend: str | None = None,
                 check_finite: bool = True, fuse: bool = True, plan_memory: bool = True,
                 device=None, share: GPUSession | None = None, group_params: bool = True):
        super().__init__(program, check_finite)
        if precision not in PRECISIONS:
            raise GraphBuildError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision = precision
        t0 = time.perf_counter()
        shared = self._shared_names(share)
        if share is not None and device is not None and device is not share.dev:
            raise GraphBuildError("share: the sessions must use the same device")
        self.dev = share.dev if share is not None else (device or get_device(backend))
        lowered = run_pipeline(program, debug="graph" in _DEBUG)
        self.lowered = lowered
        self.fuse, self.plan_memory = fuse, plan_memory
        if share is not None:
            grouped = [n for n in shared if n in share.groups.home]
            if grouped:
                raise GraphBuildError(
                    f"share: {grouped[:3]} live in a parameter group of the other session; "
                    "compile that session with group_params=False to share them")
        # the optimizer's flat parameter vectors as the parameters' own storage
        self.groups = (find_leaf_groups(lowered.graph)
                       if group_params and share is None and program.training else NO_GROUPS)
        # shared persistent tensors: the other session's buffers
        self.pinned: dict[str, object] = {n: share.pinned[n] for n in shared}
        self._make_pinned(lowered)
        g = self.groups
        align = _binding_alignment(self.dev)
        self.train = (_Executable(self, make_plan(lowered, False, fuse, plan_memory, g, align),
                                  "train")
                      if program.training or program.loss is not None else None)
        self.infer = (_Executable(self, make_plan(lowered, True, fuse, plan_memory, g, align),
                                  "infer")
                      if program.outputs else None)
        if "plan" in _DEBUG:
            for ex in (self.train, self.infer):
                if ex is not None:
                    for k in ex.plan.kernels:
                        print(getattr(k, "label", k))
        self.compile_seconds = time.perf_counter() - t0
        self._init_unshared(shared)

    # buffers -----------------------------------------------------------------------------
    def _make_pinned(self, lowered: Program) -> None:
        import wgpu

        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        for gname, (dtype, n, _) in self.groups.groups.items():
            nbytes = _round4(n * dtype.gpu_itemsize)
            _check_buffer(self.dev, nbytes, f"parameter group {gname!r}", binding=True)
            self.pinned[gname] = self.dev.device.create_buffer(size=max(nbytes, 4), usage=usage,
                                                               label=gname)
        for name, lf in lowered.graph.leaves.items():
            if name in self.pinned or name in self.groups.home:  # shared, or in a group
                continue
            nbytes = _round4(max(lf.value.size, 1) * lf.value.dtype.gpu_itemsize)
            _check_buffer(self.dev, nbytes, f"{lf.kind} {name!r} ({lf.value.type})", binding=True)
            buf = self.dev.device.create_buffer(size=max(nbytes, 4), usage=usage, label=name)
            self.pinned[name] = buf
            if lf.kind == "constant":
                self.dev.queue.write_buffer(buf, 0, _to_gpu(lf.data, lf.value.dtype))

    def _buffer(self, ex: _Executable, loc: Loc):
        if loc.pool == "temp":
            return ex.arena
        if loc.pool == "out":
            return ex.outs[loc.name]
        return self.pinned[loc.name]

    # Session primitives ----------------------------------------------------------------------
    def _upload_feeds(self, feeds):
        leaves = self.lowered.graph.leaves
        for name, arr in feeds.items():
            data = _to_gpu(arr, leaves[name].value.dtype)
            self.dev.queue.write_buffer(self.pinned[name], 0, data)

    def _submit(self, ex: _Executable, feeds):
        import wgpu

        self._upload_feeds(feeds)
        if not ex.fetch_bytes:
            self.dev.queue.submit([ex.encode(self.dev)])
            return dict
        # a readback buffer per submitted step (results are read lazily, maybe much later);
        # buffers whose results were read go back to the pool
        dst = ex.readback_pool.pop() if ex.readback_pool else self.dev.device.create_buffer(
            size=ex.fetch_bytes, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        staging = [(src, off, dst, doff, n) for src, off, doff, n in ex.fetch_copies]
        self.dev.queue.submit([ex.encode(self.dev, staging)])

        def fetch():
            dst.map_sync(wgpu.MapMode.READ)
            raw = bytes(dst.read_mapped())
            dst.unmap()
            ex.readback_pool.append(dst)
            return {name: _from_gpu(raw[off: off + t.size * t.dtype.gpu_itemsize], t)
                    for name, off, t in ex.fetch_layout}

        return fetch

    def _step(self, feeds):
        return self._submit(self.train, feeds)

    def _run(self, feeds):
        return self._submit(self.infer, feeds)()

    def _home(self, name: str):
        """(buffer, byte offset) where a persistent tensor lives."""
        if name in self.groups.home:
            gname, off = self.groups.home[name]
            return self.pinned[gname], off * self.groups.groups[gname][0].gpu_itemsize
        return self.pinned[name], 0

    def _read(self, names):
        out = {}
        leaves = self.lowered.graph.leaves
        for n in names:
            t = leaves[n].value.type
            buf, off = self._home(n)
            raw = self.dev.queue.read_buffer(buf, off,
                                             _round4(max(t.size, 1) * t.dtype.gpu_itemsize))
            out[n] = _from_gpu(bytes(raw)[: t.size * t.dtype.gpu_itemsize], t)
        return out

    def _write(self, values):
        leaves = self.lowered.graph.leaves
        for n, v in values.items():
            buf, off = self._home(n)
            self.dev.queue.write_buffer(buf, off, _to_gpu(v, leaves[n].value.dtype))

    # reports -----------------------------------------------------------------------------------
    def kernel_variants(self) -> dict[str, dict[str, int]]:
        """Kernel variants per stream (``train`` / ``infer``), e.g. how many matmuls run on
        tensor cores (``sgmat*``) under ``precision="fast"``."""
        return {tag: dict(ex.variants) for tag, ex in (("train", self.train),
                                                       ("infer", self.infer)) if ex is not None}

    def memory_report(self) -> dict:
        """Naive size (one buffer per value) vs the planned peak of intermediates, in bytes."""
        rep = {}
        for tag, ex in (("train", self.train), ("infer", self.infer)):
            if ex is None:
                continue
            p = ex.plan
            outs = sum(_round4(loc.nbytes) for loc, _ in p.fetch.values())
            rep[tag] = {"naive_bytes": p.naive_bytes, "planned_peak_bytes": p.arena_bytes + outs,
                        "arena_bytes": p.arena_bytes, "result_bytes": outs,
                        "ratio": (p.arena_bytes + outs) / max(p.naive_bytes, 1),
                        "dispatches": p.dispatch_count, "dispatches_unfused": p.dispatches_unfused}
        leaves = self.lowered.graph.leaves
        rep["persistent_bytes"] = sum(lf.value.size * lf.value.dtype.gpu_itemsize
                                      for lf in leaves.values() if lf.kind in ("param", "state"))
        rep["input_bytes"] = sum(lf.value.size * lf.value.dtype.gpu_itemsize
                                 for lf in leaves.values() if lf.kind == "input")
        return rep

    def profile(self, steps: int = 10, inference: bool = False, **feeds):
        """Per-kernel GPU times (timestamp queries) over ``steps`` steps; returns a Profile
        whose ``str`` is a table.  Profiling runs the kernels but applies no updates twice:
        the parameters do change, as in ``steps`` real steps."""
        from .profile import profile_session

        self._last_profile = profile_session(self, steps, feeds, inference)
        return self._last_profile

    def export_trace(self, path: str) -> None:
        """Chrome/Perfetto trace of the last ``profile`` call."""
        if getattr(self, "_last_profile", None) is None:
            raise RuntimeError("export_trace: call profile() first")
        self._last_profile.export_trace(path)

    def kernel_labels(self, inference: bool = False) -> list[str]:
        ex = self.infer if inference else self.train
        return [label for _, label in ex.specs] if ex else []


def _to_gpu(arr, dtype) -> np.ndarray:
    a = np.ascontiguousarray(arr, dtype=dtype.np)
    if dtype.name == "bool":
        a = a.astype(np.uint32)
    b = a.reshape(-1).view(np.uint8)
    if b.size % 4:
        b = np.concatenate([b, np.zeros(4 - b.size % 4, np.uint8)])
    return b


def _from_gpu(raw: bytes, t) -> np.ndarray:
    if t.dtype.name == "bool":
        return np.frombuffer(raw, dtype=np.uint32, count=t.size).astype(bool).reshape(t.shape)
    return np.frombuffer(raw, dtype=t.dtype.np, count=t.size).reshape(t.shape).copy()
