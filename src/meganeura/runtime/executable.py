"""An ``Executable`` made concrete on one device: buffers, pipelines and bind groups built
once; ``encode`` records a stream's fixed command list, ``submit`` runs it.

Knows nothing of graphs, ops or passes: it executes the finished plan it is given."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..compile.executable import Copy, Dispatch, Executable, Loc, Stream, round4
from ..errors import LimitError
from .device import pipeline_key


def check_buffer(dev, nbytes: int, what: str, binding: bool = False) -> None:
    """A clear LimitError instead of a failure inside the GPU library."""
    limit = int(dev.limits.get("max_buffer_size", 1 << 62))
    if nbytes > limit:
        raise LimitError(f"{what} needs {nbytes / 2**20:.1f} MiB but the adapter "
                         f"{dev.adapter_name!r} allows buffers of {limit / 2**20:.1f} MiB")
    blimit = int(dev.limits.get("max_storage_buffer_binding_size", 1 << 62))
    if binding and nbytes > blimit:
        raise LimitError(f"{what} needs {nbytes / 2**20:.1f} MiB but the adapter "
                         f"{dev.adapter_name!r} binds at most {blimit / 2**20:.1f} MiB per "
                         "storage buffer")


class PinnedBuffers:
    """The session-lifetime buffers: parameter groups, and every leaf not in a group (shared
    sessions pass the other session's buffers in ``shared``)."""

    def __init__(self, dev, exe: Executable, shared: dict[str, object]):
        import wgpu

        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.dev, self.exe = dev, exe
        self.buffers: dict[str, object] = dict(shared)
        self.pending: set[str] = set()  # leaves whose initial values are not written yet
        self._make_initial = None
        for g in exe.groups:
            nbytes = round4(g.elements * g.dtype.gpu_itemsize)
            check_buffer(dev, nbytes, f"parameter group {g.name!r}", binding=True)
            self.buffers[g.name] = dev.device.create_buffer(size=max(nbytes, 4), usage=usage,
                                                            label=g.name)
        for name, leaf in exe.leaves.items():
            if name in self.buffers or name in exe.group_home:  # shared, or in a group
                continue
            nbytes = round4(max(leaf.type.size, 1) * leaf.type.dtype.gpu_itemsize)
            check_buffer(dev, nbytes, f"{leaf.kind} {name!r} ({leaf.type})", binding=True)
            buf = dev.device.create_buffer(size=max(nbytes, 4), usage=usage, label=name)
            self.buffers[name] = buf
            if leaf.kind == "constant":
                dev.queue.write_buffer(buf, 0, to_gpu(leaf.data, leaf.type.dtype))

    def home(self, name: str):
        """(buffer, byte offset) where a leaf lives (its own buffer or its group's)."""
        buf, off = self.exe.home(name)
        return self.buffers[buf], off

    def defer_init(self, names, make) -> None:
        """Initial values of ``names`` are made (``make(names) -> {name: array}``) and written
        only when something first needs them (a dispatch, a read): a compile followed by
        ``set_params``/``load`` never pays for random values it overwrites (SmolLM2: sampling
        and uploading 135 M initial values was 1.7 s of a 2.1 s inference compile).  Writes
        before then take their names out of the pending set."""
        self.pending, self._make_initial = set(names), make

    def materialize(self) -> None:
        """Write the initial values still pending (see ``defer_init``)."""
        if self.pending:
            names, self.pending = sorted(self.pending), set()
            self.write(self._make_initial(names))

    def read(self, names) -> dict:
        """Persistent tensors back to the host (waits for the GPU)."""
        self.materialize()
        out = {}
        for n in names:
            t = self.exe.leaves[n].type
            buf, off = self.home(n)
            nbytes = t.size * t.dtype.gpu_itemsize
            raw = self.dev.queue.read_buffer(buf, off, round4(max(nbytes, 1)))
            out[n] = from_gpu(bytes(raw)[:nbytes], t)
        return out

    def write(self, values) -> None:
        """Host arrays (already checked) into their tensors' buffers."""
        self.pending.difference_update(values)
        for n, v in values.items():
            buf, off = self.home(n)
            self.dev.queue.write_buffer(buf, off, to_gpu(v, self.exe.leaves[n].type.dtype))


SEGMENTS_ENV = "MEGANEURA_SUBMIT_SEGMENTS"
DEFAULT_SEGMENTS = (12, 96)  # command index where each submitted segment ends (the rest last)
# the cuts of a step encoded ahead (``GPUStream.prepare``): submitting a recorded command
# buffer still costs Dawn about 2 µs per dispatch (it records the Vulkan commands then), a
# dispatch runs 2-10 µs, so each segment may be a few times the work already queued
PREPARED_SEGMENTS = (8, 24, 72, 216, 648)
PREENCODE_ENV = "MEGANEURA_PREENCODE"


def preencode_enabled(env: str | None = None) -> bool:
    """Whether a stream encodes its next step right after submitting one
    (``$MEGANEURA_PREENCODE``: 1, the default, or 0)."""
    raw = (os.environ.get(PREENCODE_ENV, "1") if env is None else env).strip()
    if raw not in ("0", "1"):
        raise ValueError(f"${PREENCODE_ENV}={raw!r}: expected 1 (encode the next step while "
                         "the GPU runs this one, the default) or 0")
    return raw == "1"


@dataclass
class PreparedStep:
    """A step encoded ahead: its command buffers, submitted in order, and the readback buffer
    its fetch copies go to (None when the stream fetches nothing)."""

    command_buffers: list
    readback: object | None


def segment_bounds(n: int, env: str | None = None) -> list[int]:
    """Where a step of ``n`` commands is cut into separately submitted command buffers:
    ``[0, c1, c2, …, n]`` from ``$MEGANEURA_SUBMIT_SEGMENTS`` (comma-separated cut points;
    ``0`` or empty: one command buffer), default ``DEFAULT_SEGMENTS``.  Short first segments
    let the GPU start early; each cut costs one ``queue.submit`` on the host and ends a
    compute pass."""
    raw = os.environ.get(SEGMENTS_ENV) if env is None else env
    if raw is None:
        cuts = DEFAULT_SEGMENTS
    else:
        try:
            cuts = tuple(int(c) for c in raw.replace(" ", "").split(",") if c)
        except ValueError:
            raise ValueError(f"${SEGMENTS_ENV}={raw!r}: expected comma-separated command "
                             f"indices, e.g. '12,96' (or 0 for one command buffer)") from None
        if any(c < 0 for c in cuts):
            raise ValueError(f"${SEGMENTS_ENV}={raw!r}: cut points must be ≥ 0")
    inner = sorted({c for c in cuts if 0 < c < n})
    return [0, *inner, n]


class GPUStream:
    """One ``Stream`` on the device: its arena, result buffers, pipelines and bind groups."""

    def __init__(self, dev, stream: Stream, pinned: PinnedBuffers):
        import wgpu

        self.stream, self.dev = stream, dev
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        check_buffer(dev, stream.arena_bytes, f"the {stream.tag} plan's intermediate arena")
        self.arena = dev.device.create_buffer(size=max(stream.arena_bytes, 256), usage=usage,
                                              label=f"{stream.tag}-arena")
        self.outs = {name: dev.device.create_buffer(size=n, usage=usage,
                                                    label=f"{stream.tag}-{name}")
                     for name, n in stream.out_buffers.items()}
        self.pinned = pinned  # the session's PinnedBuffers (shared by its streams)
        t0 = time.perf_counter()
        # every distinct pipeline of the stream at once (concurrently: Device.pipelines)
        pipes = dev.pipelines([op.spec for op in stream.ops if isinstance(op, Dispatch)])
        t1 = time.perf_counter()
        self.commands = [self._command(op, pipes) for op in stream.ops]
        # seconds spent building (bench/compile_time.py reports them)
        self.build_times = {"pipelines": t1 - t0, "commands": time.perf_counter() - t1}
        self.checked = False  # set once an encode of this fixed stream passed validation
        self._raw_runs = None  # the stream with native handles, built at the first raw encode
        self._segments: dict[tuple[int, int], list | None] = {}  # checked ranges (encode_range)
        self._bounds: dict[tuple, list[int]] = {}  # ($SEGMENTS_ENV, default cuts) -> bounds
        self.readback_pool: list = []  # readback buffers whose results were read
        self.prepared: PreparedStep | None = None  # the next step, encoded ahead (submit)

    def buffer(self, loc: Loc):
        if loc.pool == "temp":
            return self.arena
        if loc.pool == "out":
            return self.outs[loc.name]
        return self.pinned.buffers[loc.name]

    def _command(self, op: Dispatch | Copy, pipes: dict):
        """A prebuilt command: a copy, or a dispatch with its pipeline (from ``pipes``, by
        ``pipeline_key``) and its bind group."""
        if isinstance(op, Copy):
            return CopyCommand(self.buffer(op.src), op.src.offset, self.buffer(op.dst),
                               op.dst.offset, op.nbytes)
        pipeline = pipes[pipeline_key(op.spec)]
        layout = self.dev.bind_group_layout(op.spec.n_bindings)[0]
        entries = [{"binding": i, "resource": {"buffer": self.buffer(loc), "offset": loc.offset,
                                               "size": round4(loc.nbytes)}}
                   for i, loc in enumerate(op.binds)]
        bg = self.dev.device.create_bind_group(layout=layout, entries=entries)
        return DispatchCommand(pipeline, bg, op.spec.workgroups)

    def fetch_copies(self, dst) -> list[CopyCommand]:
        """Copies of every fetched result into the readback buffer ``dst``."""
        return [CopyCommand(self.buffer(f.loc), f.loc.offset, dst, f.offset, f.nbytes)
                for f in self.stream.fetch]

    def submit(self, fetch: bool = True):
        """Run the stream once; returns a function that waits for the fetched results and
        returns them by name (``dict`` when nothing is fetched; ``fetch=False``: the results
        stay on the GPU, as the benchmarks time a step).  The step encoded ahead (``prepare``)
        is submitted if there is one, else the step is encoded and submitted segment by
        segment (``launch``); then, unless ``$MEGANEURA_PREENCODE`` is 0, the next step is
        encoded while the GPU runs this one.  The command stream never changes (fixed buffers
        and bind groups) and feeds are written with ``queue.write_buffer``, which the queue
        orders before the next submit, so a step encoded ahead runs on the new feeds."""
        ahead = preencode_enabled()  # a bad setting fails before anything is submitted
        want = fetch and bool(self.stream.fetch)
        step, self.prepared = self.prepared, None
        if step is not None and (step.readback is not None) != want:
            if step.readback is not None:  # never submitted: the buffer is free
                self.readback_pool.append(step.readback)
            step = None
        # deferred initial values: written by the first encode, so already written whenever a
        # prepared step exists; kept as a one-line guard of that invariant
        self.pinned.materialize()
        if step is None:
            dst = self._readback() if want else None
            self.launch(self.fetch_copies(dst) if dst is not None else ())
        else:
            dst = step.readback
            for cb in step.command_buffers:
                self.dev.queue.submit([cb])
        if ahead:
            try:
                self.prepared = self.prepare(want)
            except Exception:  # noqa: BLE001 - this step is submitted and its results must
                # stay reachable; the next call encodes on demand and raises the same error
                self.prepared = None
        return dict if dst is None else self._fetcher(dst)

    def prepare(self, fetch: bool = True) -> PreparedStep:
        """The next step's command buffers, cut at ``PREPARED_SEGMENTS`` (or
        ``$MEGANEURA_SUBMIT_SEGMENTS``), with its result copies into a readback buffer
        (``fetch``, where the stream fetches anything)."""
        dst = self._readback() if fetch and self.stream.fetch else None
        copies = self.fetch_copies(dst) if dst is not None else ()
        bounds = self._cuts(PREPARED_SEGMENTS)
        if len(bounds) == 2:
            return PreparedStep([self.encode(copies)], dst)
        last = len(bounds) - 2
        cbs = [self.encode_range(a, b, copies if i == last else ())
               for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        self.checked = True
        return PreparedStep(cbs, dst)

    def _readback(self):
        """A readback buffer for one step's fetched results (pooled: buffers whose results were
        read come back)."""
        import wgpu

        if self.readback_pool:
            return self.readback_pool.pop()
        return self.dev.device.create_buffer(size=self.stream.fetch_bytes,
                                             usage=wgpu.BufferUsage.MAP_READ
                                             | wgpu.BufferUsage.COPY_DST)

    def _fetcher(self, dst):
        """The function that waits for a step's results in ``dst`` (read lazily, maybe much
        later) and gives the buffer back to the pool."""
        import wgpu

        layout = self.stream.fetch

        def fetch():
            dst.map_sync(wgpu.MapMode.READ)
            raw = bytes(dst.read_mapped())
            dst.unmap()
            self.readback_pool.append(dst)
            return {f.name: from_gpu(raw[f.offset: f.offset + f.type.size
                                         * f.type.dtype.gpu_itemsize], f.type)
                    for f in layout}

        return fetch

    def launch(self, extra_copies=()) -> None:
        """Encode and submit one step, in segments (``segment_bounds``): the GPU starts on
        the first few dispatches while the host still encodes the rest, instead of idling for
        the whole encode.  On the H200 through Dawn a dispatch costs 4-10 µs of host time
        (bench/step_split.py, docs/benchmarks.md sixteenth session): with the default cuts
        the last segment's encode is most of the step and the GPU starves meanwhile (wall ≈
        launch + GPU), which is why ``submit`` encodes the next step ahead.  ``extra_copies``
        go at the very end."""
        bounds = self._cuts(DEFAULT_SEGMENTS)
        if len(bounds) == 2:
            self.dev.queue.submit([self.encode(extra_copies)])
            return
        last = len(bounds) - 2
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            self.dev.queue.submit([self.encode_range(a, b, extra_copies if i == last else ())])
        self.checked = True  # every command passed a checked encode (as a segment)

    def _cuts(self, default: tuple[int, ...]) -> list[int]:
        """``segment_bounds`` of this stream under ``$MEGANEURA_SUBMIT_SEGMENTS``, else
        ``default``: parsed once per setting, not on every step."""
        raw = os.environ.get(SEGMENTS_ENV)
        key = (raw, default)
        if key not in self._bounds:
            self._bounds[key] = segment_bounds(
                len(self.commands), raw if raw is not None else ",".join(map(str, default)))
        return self._bounds[key]

    def encode(self, extra_copies=()):
        """The stream's command buffer (``extra_copies`` appended: result readback)."""
        self.pinned.materialize()
        enc = self.dev.device.create_command_encoder()
        raw = _raw_calls(self.dev) if self.checked else None
        if raw is not None:
            self._encode_raw(enc, raw)
        else:
            self._encode_checked(enc)
        for c in extra_copies:
            c.record(enc)
        cb = enc.finish()
        self.checked = True
        return cb

    def encode_range(self, start: int, stop: int, extra_copies=()):
        """A command buffer of the stream's commands ``[start, stop)`` (``extra_copies``
        appended), for a stream submitted in segments: a data-parallel step reads gradients
        back while later segments still run (``meganeura.distributed``).  Each range is
        validated at its first encode, then encoded through the native calls like ``encode``."""
        key = (start, stop)
        self.pinned.materialize()
        enc = self.dev.device.create_command_encoder()
        raw = _raw_calls(self.dev) if key in self._segments else None
        if raw is not None:
            if self._segments[key] is None:
                self._segments[key] = self._native_runs(self.commands[start:stop])
            self._encode_raw(enc, raw, self._segments[key])
        else:
            self._encode_checked(enc, self.commands[start:stop])
        for c in extra_copies:
            c.record(enc)
        cb = enc.finish()
        self._segments.setdefault(key, None)
        return cb

    def _encode_checked(self, enc, commands=None) -> None:
        cp = last = None
        for cmd in self.commands if commands is None else commands:
            if isinstance(cmd, DispatchCommand):
                if cp is None:
                    cp, last = enc.begin_compute_pass(), None
                if cmd.pipeline is not last:
                    cp.set_pipeline(cmd.pipeline)
                cp.set_bind_group(0, cmd.bind_group)
                cp.dispatch_workgroups(*cmd.workgroups)
                last = cmd.pipeline
            else:
                if cp is not None:
                    cp.end()
                    cp = None
                cmd.record(enc)
        if cp is not None:
            cp.end()

    def _native_runs(self, commands=None) -> list:
        """Runs of dispatches between copies, with native handles (a pipeline only where it
        changes)."""
        runs, run, last = [], None, None
        for cmd in self.commands if commands is None else commands:
            if isinstance(cmd, DispatchCommand):
                if run is None:
                    run, last = [], None
                    runs.append(("pass", run))
                pipe = cmd.pipeline._internal if cmd.pipeline is not last else None
                run.append((pipe, cmd.bind_group._internal, *cmd.workgroups))
                last = cmd.pipeline
            else:
                run = None
                runs.append(("copy", cmd))
        return runs

    def _encode_raw(self, enc, raw, runs=None) -> None:
        """The checked stream again through wgpu-native's C calls, with every handle looked
        up once (``runs``: those of a segment instead of the whole stream)."""
        lib, null = raw
        if runs is None:
            if self._raw_runs is None:
                self._raw_runs = self._native_runs()
            runs = self._raw_runs
        set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
        for kind, item in runs:
            if kind == "copy":
                item.record(enc)
                continue
            cp = enc.begin_compute_pass()
            h = cp._internal
            for pipe, bg, x, y, z in item:
                if pipe is not None:
                    set_pipeline(h, pipe)
                set_bind_group(h, 0, bg, 0, null)
                dispatch(h, x, y, z)
            cp.end()


class DispatchCommand:
    __slots__ = ("pipeline", "bind_group", "workgroups")

    def __init__(self, pipeline, bind_group, workgroups):
        self.pipeline, self.bind_group, self.workgroups = pipeline, bind_group, workgroups


class CopyCommand:
    __slots__ = ("src", "src_offset", "dst", "dst_offset", "nbytes")

    def __init__(self, src, src_offset: int, dst, dst_offset: int, nbytes: int):
        self.src, self.src_offset = src, src_offset
        self.dst, self.dst_offset, self.nbytes = dst, dst_offset, nbytes

    def record(self, enc) -> None:
        enc.copy_buffer_to_buffer(self.src, self.src_offset, self.dst, self.dst_offset,
                                  self.nbytes)


def _raw_calls(dev):
    """The implementation's webgpu.h entry points, called straight through cffi: without
    wgpu-py's per-call error capture (~3 µs a call on wgpu-native) and, on both, without the
    Python wrapper's method calls per command.  Used only after the first, fully checked
    encode of a plan: every later step encodes the identical command stream.  None for other
    implementations."""
    try:
        if dev.implementation == "wgpu":
            from wgpu.backends.wgpu_native._ffi import ffi, lib
        elif dev.implementation == "dawn":
            from wgpudawn.backends.dawn._ffi import ffi, lib
        else:
            return None
    except ImportError:  # pragma: no cover - another package layout
        return None
    return lib, ffi.NULL


def to_gpu(arr, dtype):
    """``arr`` as the bytes the GPU stores for ``dtype`` (bool as u32), padded to 4 bytes."""
    import numpy as np

    a = np.ascontiguousarray(arr, dtype=dtype.np)
    if dtype.name == "bool":
        a = a.astype(np.uint32)
    b = a.reshape(-1).view(np.uint8)
    if b.size % 4:
        b = np.concatenate([b, np.zeros(4 - b.size % 4, np.uint8)])
    return b


def from_gpu(raw: bytes, t):
    """A tensor of type ``t`` from the bytes the GPU stored."""
    import numpy as np

    if t.dtype.name == "bool":
        return np.frombuffer(raw, dtype=np.uint32, count=t.size).astype(bool).reshape(t.shape)
    return np.frombuffer(raw, dtype=t.dtype.np, count=t.size).reshape(t.shape).copy()
