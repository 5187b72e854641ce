"""The GPU device: which WebGPU implementation, which adapter, its features and limits.

``get_device(backend)`` returns one cached ``Device`` per process and implementation:

* ``"wgpu"`` — wgpu-native through the ``wgpu`` package (default; runs on Mesa lavapipe too);
* ``"dawn"`` — Google's Dawn through the optional ``wgpudawn`` package (imported lazily);
* ``"auto"`` — Dawn when it imports and finds an adapter, else wgpu-native.

With ``backend=None`` the environment variable ``MEGANEURA_WEBGPU`` (``wgpu|dawn|auto``) decides,
defaulting to ``wgpu``.  Only Vulkan, Metal or D3D12 adapters are taken: wgpu-native would silently
fall back to an OpenGL adapter (no f16, no subgroups, different numerics); here that is an error
that says what was found and how to get a Vulkan driver.

The device is requested with the adapter's real limits (storage binding size, workgroup storage,
storage buffers per stage …) and the features the compiler uses when the adapter has them
(``shader-f16``, ``subgroup``, ``timestamp-query`` …).  ``Device.pipeline(spec)`` compiles a
``codegen.ir.KernelSpec`` against an explicit bind-group layout in which every binding is
``storage`` (read_write).  Compiled pipelines are cached by WGSL source and entry point in a
least-recently-used cache of ``$MEGANEURA_PIPELINE_CACHE`` entries (default 256): sessions with
the same kernels share pipeline objects while they are cached, and a process compiling many
different graphs does not keep every pipeline it ever built (a session holds its own pipelines,
so eviction never affects a live session).

``Device.pipelines(specs)`` creates the distinct pipelines of a whole plan at once, concurrently:
creating a pipeline is the driver compiling a shader (milliseconds each, hundreds per training
step), and done one after the other it was most of a compile.  How, by
``$MEGANEURA_PIPELINE_CREATE``: ``auto`` (default: Dawn's asynchronous creation on Dawn, a pool
of ``$MEGANEURA_PIPELINE_THREADS`` threads on wgpu-native), ``async``, ``threads`` (wgpu-native
only: Dawn's objects and error reporting are not thread-safe) or ``sequential``.  Errors do not
depend on the mode: the first failing kernel in plan order is raised, as ``pipeline`` raises it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import DeviceError, LimitError
from ..kernels.common import (
    BUFFER_VIEW_FEATURE,
    DEFAULT_LIMITS,  # noqa: F401  (re-exported)
)
from ..kernels.matmul import SG_FEATURE

IMPLEMENTATIONS = ("wgpu", "dawn", "auto")
ENV_VAR = "MEGANEURA_WEBGPU"
PIPELINE_CACHE_VAR = "MEGANEURA_PIPELINE_CACHE"
DEFAULT_PIPELINE_CACHE = 256  # entries; SmolLM2 training needs ~51 distinct pipelines
PIPELINE_CREATE_VAR = "MEGANEURA_PIPELINE_CREATE"
PIPELINE_CREATE_MODES = ("auto", "sequential", "threads", "async")
PIPELINE_THREADS_VAR = "MEGANEURA_PIPELINE_THREADS"
DEFAULT_PIPELINE_THREADS = 8  # at most; never more than the host's cores

# Backends we accept; everything else (OpenGL, D3D11, Null, WebGPU-in-browser) is refused.
_GOOD_BACKENDS = {"vulkan", "metal", "d3d12", "dx12"}

# Limits requested from the adapter (its real values, not WebGPU's defaults).  Underscore names;
# the wgpu-py API spells them with hyphens.
LIMIT_NAMES = (
    "max_storage_buffer_binding_size",
    "max_buffer_size",
    "max_compute_workgroup_storage_size",
    "max_storage_buffers_per_shader_stage",
    "max_compute_workgroups_per_dimension",
    "max_compute_invocations_per_workgroup",
    "max_compute_workgroup_size_x",
    "max_compute_workgroup_size_y",
    "max_compute_workgroup_size_z",
    "min_storage_buffer_offset_alignment",
    "min_uniform_buffer_offset_alignment",
    "max_uniform_buffer_binding_size",
    "max_uniform_buffers_per_shader_stage",
    "max_bind_groups",
    "max_bindings_per_bind_group",
    "max_immediate_size",
)

# Features used when present.  wgpu-native calls the subgroup feature "subgroup", Dawn "subgroups".
_WANTED_FEATURES = (
    "shader-f16",
    "subgroup",
    "subgroups",
    "timestamp-query",
    "timestamp-query-inside-passes",  # wgpu-native only
    "timestamp-query-inside-encoders",  # wgpu-native only
    "chromium-experimental-subgroup-matrix",  # Dawn only (tensor cores)
)

# Dawn needs these before its instance exists (see GPU-NOTES.md): experimental features
# (subgroup matrix) and f16 on NVIDIA drivers older than 615.71.
_DAWN_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
# Dawn quantizes timestamp queries (a browser defence against timing attacks): measured steps
# of 65.5 µs on the H200, which made per-kernel profiles of short kernels 0 or 65.5 µs.  A
# native process profiling its own kernels wants the real ticks.
_DAWN_DISABLED_TOGGLES = ("timestamp_quantization",)

# Pseudo-feature the compiler keys tensor-core matmuls on: the adapter multiplies 16x16 f16
# subgroup matrices into f32 with subgroups of exactly 32 invocations (the kernel maps
# invocations to subgroups as ``lid / 32``).  Derived from Dawn's subgroup-matrix configs.
SUBGROUP_MATRIX_F16 = SG_FEATURE

_INSTALL_HINT = (
    "install a Vulkan driver: on Debian/Ubuntu `apt-get install mesa-vulkan-drivers libvulkan1` "
    "(Mesa lavapipe runs on the CPU) or your GPU vendor's driver; on macOS Metal is built in"
)

_ADAPTER_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}


class BackendNameError(DeviceError, ValueError):
    """An unknown WebGPU implementation name (argument or ``MEGANEURA_WEBGPU``)."""


def _norm_key(name: str) -> str:
    return name.replace("-", "_")


def pipeline_cache_budget() -> int:
    """How many compiled pipelines a device keeps cached: ``$MEGANEURA_PIPELINE_CACHE`` (an
    int >= 0; 0 disables sharing between sessions), default ``DEFAULT_PIPELINE_CACHE``.  Each
    pipeline holds driver memory (compiled shader code), hence a bound."""
    raw = os.environ.get(PIPELINE_CACHE_VAR, "").strip()
    if not raw:
        return DEFAULT_PIPELINE_CACHE
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise DeviceError(f"${PIPELINE_CACHE_VAR} must be a whole number of pipelines >= 0, "
                          f"got {raw!r}")
    return n


def pipeline_create_mode(implementation: str, mode: str | None = None) -> str:
    """How ``Device.pipelines`` creates missing pipelines on ``implementation``: ``mode``, or
    ``$MEGANEURA_PIPELINE_CREATE`` when None, resolved (``auto`` → ``async`` on Dawn,
    ``threads`` on wgpu-native).  ``threads`` on Dawn is refused: Dawn's objects are not
    thread-safe and its validation errors land in one process-wide slot, so a thread could
    raise another's error."""
    src = "pipeline creation mode"
    if mode is None:
        mode, src = os.environ.get(PIPELINE_CREATE_VAR, ""), f"${PIPELINE_CREATE_VAR}"
    raw = str(mode).strip().lower() or "auto"
    if raw not in PIPELINE_CREATE_MODES:
        raise DeviceError(f"{src} must be one of {', '.join(PIPELINE_CREATE_MODES)}, "
                          f"got {mode!r}")
    if raw == "auto":
        return "async" if implementation == "dawn" else "threads"
    if raw == "threads" and implementation == "dawn":
        raise DeviceError(f"{src} threads is not safe on Dawn (its objects are not "
                          f"thread-safe); use async, sequential or auto there")
    return raw


def pipeline_threads() -> int:
    """Threads creating pipelines in mode ``threads``: ``$MEGANEURA_PIPELINE_THREADS`` (an int
    >= 1), default ``DEFAULT_PIPELINE_THREADS`` capped at the host's cores."""
    raw = os.environ.get(PIPELINE_THREADS_VAR, "").strip()
    if not raw:
        return max(1, min(DEFAULT_PIPELINE_THREADS, os.cpu_count() or 1))
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise DeviceError(f"${PIPELINE_THREADS_VAR} must be a whole number of threads >= 1, "
                          f"got {raw!r}")
    return n


def pipeline_key(spec) -> tuple:
    """What makes two kernels share a pipeline: WGSL source, entry point, binding count."""
    return (spec.wgsl, spec.entry, spec.n_bindings)


@dataclass(eq=False)
class Device:
    """An opened WebGPU device and what the compiler needs to know about it."""

    device: Any
    queue: Any
    adapter: Any
    implementation: str  # "wgpu" | "dawn"
    backend_type: str  # "Vulkan" | "Metal" | "D3D12"
    adapter_name: str
    adapter_type: str  # "DiscreteGPU" | "IntegratedGPU" | "CPU" | …
    is_cpu: bool
    features: frozenset
    limits: dict
    module: Any = field(default=None, repr=False)  # the wgpu / wgpudawn module
    _pipelines: OrderedDict = field(default_factory=OrderedDict, repr=False)  # LRU first
    pipeline_cache_size: int = field(default_factory=pipeline_cache_budget, repr=False)
    _layouts: dict = field(default_factory=dict, repr=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------ information

    @property
    def has_f16(self) -> bool:
        return "shader-f16" in self.features

    @property
    def has_subgroups(self) -> bool:
        return "subgroup" in self.features or "subgroups" in self.features

    @property
    def has_timestamps(self) -> bool:
        return "timestamp-query" in self.features

    def describe(self) -> dict:
        """Plain-data summary (for ``meganeura info``, logs and benchmark records)."""
        info = {}
        try:
            info = dict(self.adapter.info)
        except Exception:  # pragma: no cover - info is best effort
            pass
        return {
            "implementation": self.implementation,
            "backend_type": self.backend_type,
            "adapter": self.adapter_name,
            "adapter_type": self.adapter_type,
            "description": info.get("description", ""),
            "vendor": info.get("vendor", ""),
            "is_cpu": self.is_cpu,
            "features": sorted(self.features),
            "limits": dict(self.limits),
        }

    # ------------------------------------------------------------------ pipelines

    def bind_group_layout(self, n_bindings: int):
        """The explicit layout shared by all kernels with ``n_bindings`` storage bindings."""
        with self._lock:
            hit = self._layouts.get(n_bindings)
            if hit is not None:
                return hit
        maxb = self.limits.get("max_storage_buffers_per_shader_stage", 8)
        if n_bindings > maxb:
            raise LimitError(
                f"a kernel needs {n_bindings} storage buffers but the device allows "
                f"{maxb} per shader stage"
            )
        wgpu = self.module
        entries = [
            {
                "binding": i,
                "visibility": wgpu.ShaderStage.COMPUTE,
                "buffer": {"type": wgpu.BufferBindingType.storage},
            }
            for i in range(n_bindings)
        ]
        bgl = self.device.create_bind_group_layout(entries=entries)
        pl = self.device.create_pipeline_layout(bind_group_layouts=[bgl])
        with self._lock:
            self._layouts.setdefault(n_bindings, (bgl, pl))
            return self._layouts[n_bindings]

    def pipeline(self, spec):
        """The compute pipeline of a ``KernelSpec``: the cached one for the same WGSL source +
        entry when there is one (so sessions share pipelines), else a new one, which enters the
        LRU cache (evicting the least recently used beyond ``pipeline_cache_size``)."""
        return self.pipelines([spec])[pipeline_key(spec)]

    def pipelines(self, specs: Sequence, mode: str | None = None) -> dict:
        """The pipelines of many ``KernelSpec``s, by ``pipeline_key``: cache hits as they are,
        the distinct missing ones created together (``mode``: see ``pipeline_create_mode``;
        None reads ``$MEGANEURA_PIPELINE_CREATE``), then cached in plan order, so the cache
        ends in the same state whatever the mode.  The first failing kernel in plan order
        raises (limits and features are checked for all before any driver work); pipelines
        created before the error stay cached."""
        want: dict[tuple, Any] = {}
        for spec in specs:
            want.setdefault(pipeline_key(spec), spec)
        out, missing = {}, []
        with self._lock:
            for key, spec in want.items():
                hit = self._pipelines.get(key)
                if hit is None:
                    missing.append(spec)
                else:
                    self._pipelines.move_to_end(key)
                    out[key] = hit
        mode = pipeline_create_mode(self.implementation, mode)  # bad knobs fail first
        for spec in missing:
            self._check_creatable(spec)
        for n in sorted({s.n_bindings for s in missing}):  # layouts exist before any thread
            self.bind_group_layout(n)
        made = self._create_all(missing, mode)
        for spec, pipe in zip(missing, made, strict=True):
            if isinstance(pipe, Exception):
                raise pipe
            out[pipeline_key(spec)] = self._remember(pipeline_key(spec), pipe)
        return out

    def _check_creatable(self, spec) -> None:
        """Limits and features of ``spec`` (cheap, host side; before any driver work)."""
        self.check_spec(spec)
        if "enable f16;" in spec.wgsl and not self.has_f16:
            raise DeviceError(
                f"kernel {spec.name!r} uses f16 but adapter {self.adapter_name!r} "
                f"({self.implementation}) has no shader-f16 feature"
            )

    def _create_all(self, specs: list, mode: str) -> list:
        """New pipelines for ``specs`` (in order), each a pipeline or the ``DeviceError`` /
        ``LimitError`` of its kernel; one spec, or mode ``sequential``, stops at the first
        error (nothing after it is created, as the one-at-a-time path always did).  ``mode``
        is resolved (``pipeline_create_mode``)."""
        if mode == "sequential" or len(specs) < 2:
            made = []
            for spec in specs:
                made.append(self._create_caught(spec))
                if isinstance(made[-1], Exception):
                    break
            return made + [None] * (len(specs) - len(made))  # the error raises before these
        if mode == "async":
            return self._create_async(specs)
        workers = min(pipeline_threads(), len(specs))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mn-pipeline") as pool:
            return list(pool.map(self._create_caught, specs))

    def _create_caught(self, spec):
        """One new pipeline, or the exception naming its kernel (wgpu-native reports errors
        per thread, so this is safe on worker threads)."""
        _, layout = self.bind_group_layout(spec.n_bindings)
        try:
            module = self.device.create_shader_module(label=spec.name, code=spec.wgsl)
            return self.device.create_compute_pipeline(
                label=spec.name, layout=layout,
                compute={"module": module, "entry_point": spec.entry})
        except Exception as e:  # wgpu raises GPUValidationError & co. with naga's message
            return self._compile_error(spec, e)

    def _create_async(self, specs: list) -> list:
        """Shader modules one after the other (parsing WGSL; cheap), then every pipeline
        through ``create_compute_pipeline_async`` (Dawn compiles them on worker threads), then
        wait for all.  wgpu-native's async creation is synchronous: there this is sequential."""
        made: list = [None] * len(specs)
        pending = []
        for i, spec in enumerate(specs):
            _, layout = self.bind_group_layout(spec.n_bindings)
            try:
                module = self.device.create_shader_module(label=spec.name, code=spec.wgsl)
                pending.append((i, self.device.create_compute_pipeline_async(
                    label=spec.name, layout=layout,
                    compute={"module": module, "entry_point": spec.entry})))
            except Exception as e:
                made[i] = self._compile_error(spec, e)
        for i, promise in pending:
            try:
                made[i] = promise.sync_wait()
            except Exception as e:
                made[i] = self._compile_error(specs[i], e)
        return made

    def _compile_error(self, spec, e: Exception) -> DeviceError:
        """The error a kernel whose WGSL the implementation refused raises: the driver's
        message and the numbered source (``LimitError`` when the message is about a limit)."""
        msg = str(e)
        kind = LimitError if "limit" in msg.lower() else DeviceError
        err = kind(
            f"WGSL of kernel {spec.name!r} failed to compile on {self.implementation} "
            f"({self.adapter_name}):\n{msg}\n--- WGSL ---\n{_numbered(spec.wgsl)}"
        )
        err.__cause__ = e
        return err

    def _remember(self, key, pipe):
        """Cache ``pipe`` as the most recently used entry (or return the one another thread
        cached meanwhile) and trim the cache to its budget."""
        with self._lock:
            pipe = self._pipelines.get(key, pipe)
            if self.pipeline_cache_size > 0:
                self._pipelines[key] = pipe
                self._pipelines.move_to_end(key)
            while len(self._pipelines) > self.pipeline_cache_size:
                self._pipelines.popitem(last=False)
            return pipe

    def check_spec(self, spec) -> None:
        """Raise ``LimitError`` when a spec's dispatch exceeds this device's limits."""
        maxwg = self.limits.get("max_compute_workgroups_per_dimension", 65535)
        for axis, n in zip("xyz", spec.workgroups, strict=False):
            if n > maxwg:
                raise LimitError(
                    f"kernel {spec.name!r} dispatches {n} workgroups along {axis}; the device "
                    f"allows {maxwg} per dimension"
                )
        shared = spec.meta.get("workgroup_storage", 0) if spec.meta else 0
        maxs = self.limits.get("max_compute_workgroup_storage_size", 16384)
        if shared > maxs:
            raise LimitError(
                f"kernel {spec.name!r} uses {shared} bytes of workgroup storage; the device "
                f"allows {maxs}"
            )
        maxb = self.limits.get("max_storage_buffers_per_shader_stage", 8)
        if spec.n_bindings > maxb:
            raise LimitError(
                f"kernel {spec.name!r} binds {spec.n_bindings} storage buffers; the device "
                f"allows {maxb} per shader stage"
            )

    def bind_group(self, spec, buffers):
        """A bind group for ``spec`` from ``buffers``: GPUBuffers (whole) or
        ``(buffer, offset, size)`` ranges, in binding order."""
        if len(buffers) != spec.n_bindings:
            raise DeviceError(
                f"kernel {spec.name!r} has {spec.n_bindings} bindings, got {len(buffers)} buffers"
            )
        bgl, _ = self.bind_group_layout(spec.n_bindings)
        entries = []
        for i, b in enumerate(buffers):
            if isinstance(b, tuple):
                buf, off, size = b
                entries.append(
                    {"binding": i, "resource": {"buffer": buf, "offset": off, "size": size}}
                )
            else:
                entries.append(
                    {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                )
        return self.device.create_bind_group(layout=bgl, entries=entries)

    def dispatch(self, spec, buffers, *, bind_group=None) -> None:
        """Encode one dispatch of ``spec`` into a fresh command buffer and submit it (a
        convenience for tests and one-off work; sessions batch their dispatches)."""
        pipe = self.pipeline(spec)
        bg = bind_group if bind_group is not None else self.bind_group(spec, buffers)
        enc = self.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(*spec.workgroups)
        cp.end()
        self.queue.submit([enc.finish()])

    # ------------------------------------------------------------------ buffers

    @property
    def storage_usage(self) -> int:
        u = self.module.BufferUsage
        return u.STORAGE | u.COPY_SRC | u.COPY_DST

    def create_buffer(self, nbytes: int, usage: int | None = None, label: str = ""):
        """A zero-initialised buffer of at least ``nbytes`` (rounded up to 4, minimum 4)."""
        size = max(4, (int(nbytes) + 3) // 4 * 4)
        maxbuf = self.limits.get("max_buffer_size", 1 << 28)
        if size > maxbuf:
            raise LimitError(f"buffer {label!r} of {size} bytes exceeds max_buffer_size {maxbuf}")
        return self.device.create_buffer(
            label=label, size=size, usage=self.storage_usage if usage is None else usage
        )

    def upload(self, array, usage: int | None = None, label: str = ""):
        """A new buffer holding ``array`` in its GPU representation (float64 → f32,
        int64 → i32, bool → u32), padded to a multiple of 4 bytes."""
        data = to_gpu_bytes(array)
        buf = self.create_buffer(len(data), usage, label)
        if data:
            self.queue.write_buffer(buf, 0, _pad4(data))
        return buf

    def write_buffer(self, buf, array, offset: int = 0) -> None:
        data = to_gpu_bytes(array)
        if data:
            self.queue.write_buffer(buf, int(offset), _pad4(data))

    def read_buffer(self, buf, offset: int = 0, nbytes: int | None = None) -> bytes:
        """Copy ``nbytes`` from ``buf`` at ``offset`` back to the host (waits for the GPU).
        Offset and size are widened to multiples of 4 for the copy and trimmed afterwards."""
        nbytes = buf.size - offset if nbytes is None else int(nbytes)
        if nbytes <= 0:
            return b""
        lo = offset // 4 * 4
        hi = min(buf.size, (offset + nbytes + 3) // 4 * 4)
        data = bytes(self.queue.read_buffer(buf, lo, hi - lo))
        return data[offset - lo : offset - lo + nbytes]

    def read_array(self, buf, shape, dtype, offset: int = 0) -> np.ndarray:
        """Read a tensor of ``shape``/``dtype`` (a meganeura DType or numpy dtype) back."""
        from ..dtypes import as_dtype, bool_

        dt = as_dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        raw = self.read_buffer(buf, offset, n * dt.gpu_itemsize)
        if dt is bool_:
            return (np.frombuffer(raw, dtype=np.uint32) != 0).reshape(shape)
        return np.frombuffer(raw, dtype=dt.np).reshape(shape).copy()

    def sync(self) -> None:
        """Wait until all submitted work has finished, by copying 4 bytes into a mappable
        buffer and mapping it (GPU-NOTES: ``on_submitted_work_done_sync`` raises TypeError in
        wgpu 0.32).  Both buffers are kept: ``queue.read_buffer`` would create and destroy a
        staging buffer per call, host time on the critical path of every timed step."""
        import wgpu

        if not hasattr(self, "_sync_bufs"):
            self._sync_bufs = (self.create_buffer(4, label="sync"), self.device.create_buffer(
                size=4, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
                label="sync-read"))
        src, dst = self._sync_bufs
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, dst, 0, 4)
        self.queue.submit([enc.finish()])
        dst.map_sync(wgpu.MapMode.READ)
        dst.unmap()


def to_gpu_bytes(array) -> bytes:
    """The bytes of ``array`` as the GPU stores it (see ``dtypes``)."""
    a = np.asarray(array)
    if a.dtype == np.bool_:
        a = a.astype(np.uint32)
    elif a.dtype == np.float64:
        a = a.astype(np.float32)
    elif a.dtype == np.int64:
        a = a.astype(np.int32)
    elif a.dtype == np.uint64:
        a = a.astype(np.uint32)
    elif a.dtype not in (np.float32, np.float16, np.int32, np.uint32):
        raise DeviceError(f"cannot upload arrays of dtype {a.dtype} to the GPU")
    return np.ascontiguousarray(a).tobytes()


def _pad4(data: bytes) -> bytes:
    r = len(data) % 4
    return data + b"\0" * (4 - r) if r else data


def _numbered(src: str) -> str:
    return "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(src.splitlines()))


# ---------------------------------------------------------------------------------------------
# choosing the implementation and adapter

_CACHE: dict[str, Device] = {}
_CACHE_LOCK = threading.RLock()
_DAWN_CONFIGURED = False


def resolve_backend(backend: str | None = None) -> str:
    """``backend`` or ``$MEGANEURA_WEBGPU`` normalised to ``wgpu|dawn|auto`` (default wgpu)."""
    src = "backend argument"
    if backend is None:
        backend = os.environ.get(ENV_VAR, "").strip()
        src = f"${ENV_VAR}"
        if not backend:
            return "wgpu"
    if not isinstance(backend, str):
        raise BackendNameError(f"{src} must be a string, got {backend!r}")
    name = backend.strip().lower()
    aliases = {"wgpu-native": "wgpu", "wgpu_native": "wgpu", "native": "wgpu",
               "wgpudawn": "dawn"}
    name = aliases.get(name, name)
    if name not in IMPLEMENTATIONS:
        raise BackendNameError(
            f"unknown WebGPU implementation {backend!r} (from {src}); expected one of "
            f"{', '.join(IMPLEMENTATIONS)}"
        )
    return name


def get_device(backend: str | None = None) -> Device:
    """The process-wide ``Device`` for ``backend`` (``wgpu``, ``dawn`` or ``auto``; None reads
    ``$MEGANEURA_WEBGPU``).  Raises ``DeviceError`` when no Vulkan/Metal/D3D12 adapter exists."""
    name = resolve_backend(backend)
    with _CACHE_LOCK:
        dev = _CACHE.get(name)
        if dev is not None:
            return dev
        if name == "wgpu":
            dev = _open_wgpu()
        elif name == "dawn":
            dev = _open_dawn()
        else:
            dev = _open_auto()
        _CACHE[name] = dev
        _CACHE.setdefault(dev.implementation, dev)
        return dev


def get_device_at(index: int, backend: str | None = None, share: bool = False) -> Device:
    """The device on the ``index``-th adapter of the best kind present (one GPU per local rank
    of a data-parallel run: ``meganeura.distributed``).  Fewer adapters than ``index + 1`` is a
    ``DeviceError`` unless ``share`` lets ranks share one (tests on a single CPU adapter)."""
    name = resolve_backend(backend)
    if name == "auto":
        try:
            return get_device_at(index, "dawn", share)
        except DeviceError:
            name = "wgpu"
    key = f"{name}#{index}"
    with _CACHE_LOCK:
        dev = _CACHE.get(key)
        if dev is None:
            dev = _open_wgpu(index, share) if name == "wgpu" else _open_dawn(index, share)
            _CACHE[key] = dev
        return dev


def _open_auto() -> Device:
    with _CACHE_LOCK:
        if "dawn" in _CACHE:
            return _CACHE["dawn"]
    try:
        return _open_dawn()
    except DeviceError:
        pass
    with _CACHE_LOCK:
        if "wgpu" in _CACHE:
            return _CACHE["wgpu"]
    return _open_wgpu()


def _info(adapter) -> dict:
    try:
        return dict(adapter.info)
    except Exception:  # pragma: no cover
        return {}


def _describe_adapter(adapter) -> str:
    i = _info(adapter)
    name = i.get("device") or i.get("description") or "?"
    return f"{name} via {i.get('backend_type', '?')} ({i.get('adapter_type', '?')})"


def _good(adapter) -> bool:
    return str(_info(adapter).get("backend_type", "")).lower() in _GOOD_BACKENDS


def _pick(adapters):
    """The best Vulkan/Metal/D3D12 adapter (discrete > integrated > virtual > CPU), or None."""
    good = [a for a in adapters if _good(a)]
    if not good:
        return None
    good.sort(key=lambda a: _ADAPTER_RANK.get(str(_info(a).get("adapter_type", "")), 9))
    return good[0]


def _pick_at(adapters, index: int, share: bool):
    """The ``index``-th adapter of the best kind present (a host with GPUs and lavapipe: only
    the GPUs count), or None when there is no usable adapter at all."""
    best = _pick(adapters)
    if best is None:
        return None
    kind = str(_info(best).get("adapter_type", ""))
    same = [a for a in adapters if _good(a) and str(_info(a).get("adapter_type", "")) == kind]
    if index < len(same):
        return same[index]
    if share:
        return same[index % len(same)]
    names = ", ".join(_describe_adapter(a) for a in same)
    raise DeviceError(
        f"adapter {index} was asked for (one per local rank) but this host has only "
        f"{len(same)} {kind or 'usable'} adapter(s): {names}; start at most {len(same)} "
        f"process(es) per host (torchrun --nproc-per-node {len(same)}), or let ranks share "
        f"adapters (share_adapter=True / MEGANEURA_DP_SHARE_ADAPTER=1; for tests)"
    )


def _open_wgpu(index: int | None = None, share: bool = False) -> Device:
    try:
        import wgpu
    except ImportError as e:  # pragma: no cover - wgpu is a hard dependency
        raise DeviceError(f"the wgpu package is not importable: {e}") from e
    try:
        adapters = list(wgpu.gpu.enumerate_adapters_sync())
    except Exception as e:
        raise DeviceError(f"wgpu-native could not enumerate adapters: {e}; {_INSTALL_HINT}") from e
    adapter = _pick(adapters) if index is None else _pick_at(adapters, index, share)
    if adapter is None:
        found = ", ".join(_describe_adapter(a) for a in adapters) or "no adapters at all"
        raise DeviceError(
            f"wgpu-native found no Vulkan, Metal or D3D12 adapter (found: {found}); meganeura "
            f"does not use OpenGL/D3D11 adapters; {_INSTALL_HINT}"
        )
    return _make_device(wgpu, adapter, "wgpu")


def _open_dawn(index: int | None = None, share: bool = False) -> Device:
    global _DAWN_CONFIGURED
    try:
        import wgpudawn
        from wgpudawn.backends.dawn import extras
    except ImportError as e:
        raise DeviceError(
            f"backend 'dawn' needs the optional package wgpudawn (pip install "
            f"'meganeura[dawn]'): {e}"
        ) from e
    if not _DAWN_CONFIGURED:
        try:
            toggles = extras.all_toggles()
            wanted = [t for t in _DAWN_TOGGLES if t in toggles]
            unwanted = [t for t in _DAWN_DISABLED_TOGGLES if t in toggles]
            extras.set_instance_extras(enable_toggles=wanted, disable_toggles=unwanted)
        except RuntimeError:
            pass  # the instance already exists (someone requested an adapter before us)
        _DAWN_CONFIGURED = True
    adapters = []
    try:
        adapters = list(wgpudawn.gpu.enumerate_adapters_sync())
    except Exception:
        adapters = []
    adapter = _pick(adapters) if index is None else _pick_at(adapters, index, share)
    if adapter is None:
        err = ""
        try:
            a = wgpudawn.gpu.request_adapter_sync(power_preference="high-performance")
            if a is not None and _good(a):
                adapter = a
            elif a is not None:
                adapters.append(a)
        except Exception as e:
            err = f": {str(e).strip().splitlines()[0] if str(e).strip() else e}"
        if adapter is None:
            found = ", ".join(_describe_adapter(a) for a in adapters) or "no adapter"
            raise DeviceError(
                f"Dawn found no usable Vulkan, Metal or D3D12 adapter ({found}{err}); "
                f"{_INSTALL_HINT}; Dawn does not run on old lavapipe (Mesa 22), use backend "
                f"'wgpu' there"
            )
    return _make_device(wgpudawn, adapter, "dawn")


def _make_device(module, adapter, implementation: str) -> Device:
    adapter_limits = {_norm_key(k): v for k, v in dict(adapter.limits).items()}
    avail = set(adapter.features)
    features = [f for f in _WANTED_FEATURES if f in avail]
    required = {}
    for name in LIMIT_NAMES:
        if name in adapter_limits and adapter_limits[name]:
            required[name.replace("_", "-")] = adapter_limits[name]
    try:
        device = adapter.request_device_sync(
            label=f"meganeura-{implementation}",
            required_features=features,
            required_limits=required,
        )
    except Exception as e:
        # Some implementations refuse a feature they list (GPU-NOTES: cooperative-matrix); retry
        # with the essentials only rather than failing.
        essentials = [f for f in features if f in ("shader-f16", "timestamp-query")]
        try:
            device = adapter.request_device_sync(
                label=f"meganeura-{implementation}",
                required_features=essentials,
                required_limits=required,
            )
            features = essentials
        except Exception:
            raise DeviceError(
                f"{implementation} could not open a device on {_describe_adapter(adapter)}: {e}"
            ) from e
    return _describe_device(module, adapter, device, implementation, adapter_limits)


def _describe_device(module, adapter, device, implementation: str,
                     fallback_limits: dict | None = None) -> Device:
    """The ``Device`` of an opened ``device``: features and limits as the device reports them
    (what kernels may use), adapter name and type from the adapter."""
    info = _info(adapter)
    try:
        dev_features = frozenset(device.features)
    except Exception:  # pragma: no cover
        dev_features = frozenset()
    if _has_f16_subgroup_matrix(module, adapter, dev_features):
        dev_features = dev_features | {SUBGROUP_MATRIX_F16}
        if _has_buffer_view(device):
            dev_features = dev_features | {BUFFER_VIEW_FEATURE}
    try:
        limits = {_norm_key(k): v for k, v in dict(device.limits).items()}
    except Exception:  # pragma: no cover
        limits = dict(fallback_limits or {})
    name = str(info.get("device") or info.get("description") or "unknown adapter")
    adapter_type = str(info.get("adapter_type", ""))
    is_cpu = adapter_type == "CPU" or "llvmpipe" in name.lower() or "swiftshader" in name.lower()
    return Device(
        device=device,
        queue=device.queue,
        adapter=adapter,
        implementation=implementation,
        backend_type=str(info.get("backend_type", "")),
        adapter_name=name,
        adapter_type=adapter_type,
        is_cpu=is_cpu,
        features=dev_features,
        limits=limits,
        module=module,
    )


def _has_f16_subgroup_matrix(module, adapter, features) -> bool:
    """Whether the adapter reports an f16 x f16 -> f32 16x16x16 subgroup-matrix config at
    subgroup size 32 (only Dawn exposes subgroup matrices; see GPU-NOTES.md)."""
    if "chromium-experimental-subgroup-matrix" not in features or not module.__name__.startswith(
            "wgpudawn"):
        return False
    try:
        from wgpudawn.backends.dawn import extras

        configs = extras.get_adapter_properties(adapter).get("subgroup_matrix_configs", ())
    except Exception:
        return False
    return any(
        str(c.get("component_type")) == "f16" and str(c.get("result_component_type")) == "f32"
        and (c.get("m"), c.get("n"), c.get("k")) == (16, 16, 16)
        and c.get("min_subgroup_size") == 32 == c.get("max_subgroup_size")
        for c in configs
    )


_BUFFER_VIEW_PROBE = """requires buffer_view;
var<workgroup> wb: buffer<64>;
@compute @workgroup_size(1)
fn main() {
    let w = bufferView<array<vec2<u32>, 8>>(&wb, 0u);
    (*w)[0] = vec2<u32>(1u, 2u);
}
"""


def _has_buffer_view(device) -> bool:
    """Whether the device compiles WGSL's ``buffer_view`` language extension (asked only of
    Dawn devices with subgroup matrices, the packed f16 staging's users; Dawn reports no
    language features through wgpu-py, so a probe module is compiled instead)."""
    try:
        device.create_shader_module(code=_BUFFER_VIEW_PROBE)
    except Exception:
        return False
    return True


# Wrappers of devices the host application created, by id() of the raw device (the entry goes
# when no session holds the wrapper any more; a hit is checked for identity, ids are reused).
_HOSTED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def as_device(device=None, backend: str | None = None) -> Device:
    """The ``Device`` for ``compile(device=...)`` / ``load_program(device=...)``: a ``Device`` as
    is, None → ``get_device(backend)``, or a raw wgpu-py ``GPUDevice`` the host application opened
    (e.g. a render loop's) wrapped so meganeura submits on the host's queue.  The same raw device
    always gives the same wrapper, so sessions on it share one pipeline cache."""
    if device is None:
        return get_device(backend)
    if isinstance(device, Device):
        return device
    with _CACHE_LOCK:
        hit = _HOSTED.get(id(device))
        if hit is not None and hit.device is device:
            return hit
        dev = _wrap_host_device(device)
        _HOSTED[id(device)] = dev
        return dev


def _host_implementation(raw):
    """(implementation name, its wgpu-py module) of a host's raw GPUDevice: wgpu-native or
    Dawn (wgpudawn, when installed); anything else is a ``DeviceError`` saying what is taken."""
    import wgpu

    mod = type(raw).__module__
    if isinstance(raw, wgpu.GPUDevice):
        if mod.startswith("wgpu.backends.wgpu_native"):
            return "wgpu", wgpu
    elif mod.startswith("wgpudawn.backends.dawn"):
        import wgpudawn

        if isinstance(raw, wgpudawn.GPUDevice):
            return "dawn", wgpudawn
    else:
        raise DeviceError(
            f"device= takes a wgpu GPUDevice (from adapter.request_device_sync(), wgpu-native "
            f"or Dawn's wgpudawn) or a meganeura Device (meganeura.runtime.device.get_device()), "
            f"got {type(raw).__name__}"
        )
    raise DeviceError(
        f"device=: a GPUDevice of implementation {mod!r} is not supported; meganeura runs host "
        f"devices of wgpu-native (wgpu.gpu.request_adapter_sync().request_device_sync()) and "
        f"Dawn (the same through wgpudawn.gpu)"
    )


def _wrap_host_device(raw) -> Device:
    """Describe a host-created ``GPUDevice`` (wgpu-native or Dawn): its adapter, the features
    and limits it was opened with (not the adapter's: the host chose them), refusing what
    meganeura cannot run on (another implementation, an OpenGL/D3D11 adapter) with a
    ``DeviceError``."""
    implementation, module = _host_implementation(raw)
    adapter = getattr(raw, "adapter", None)
    if adapter is None or not _good(adapter):
        where = _describe_adapter(adapter) if adapter is not None else "an unknown adapter"
        raise DeviceError(
            f"device=: the host's GPUDevice runs on {where}; meganeura needs a Vulkan, Metal or "
            f"D3D12 adapter; {_INSTALL_HINT}"
        )
    return _describe_device(module, adapter, raw, implementation)


def clear_cache() -> None:
    """Forget cached devices (tests); pipelines of forgotten devices are dropped with them."""
    with _CACHE_LOCK:
        _CACHE.clear()
