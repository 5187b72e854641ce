"""Per-kernel GPU time from timestamp queries, host encode cost, and a Chrome/Perfetto trace.

Profiling encodes each dispatch in its own compute pass with begin/end timestamp writes (the
WebGPU core way; passes add a little overhead, so the sum can exceed the plain step time)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import DeviceError
from ..kernels.ir import KernelSpec
from .executable import DispatchCommand
from .roofline import DevicePeak, peaks_for


@dataclass
class KernelTime:
    label: str
    calls: int = 0
    total_ns: float = 0.0
    flops: int = 0  # per call
    bytes: int = 0  # per call, compulsory
    tensor_cores: bool = False

    @property
    def mean_s(self) -> float:
        return self.total_ns / max(self.calls, 1) / 1e9

    def roofline(self, peak: DevicePeak | None) -> dict:
        """Achieved rates and the percent of the roofline bound (None without peaks)."""
        t = self.mean_s or float("inf")
        bound = peak.bound_seconds(self.flops, self.bytes, self.tensor_cores) if peak else None
        return {"label": self.label, "calls": self.calls, "mean_us": self.mean_s * 1e6,
                "flops": self.flops, "bytes": self.bytes, "tflops": self.flops / t / 1e12,
                "gbps": self.bytes / t / 1e9,
                "bound": peak.binding_limit(self.flops, self.bytes, self.tensor_cores)
                if peak else None,
                "pct_of_bound": None if bound is None else 100 * bound / t}


@dataclass
class Profile:
    device: str
    steps: int
    kernels: list[KernelTime]
    step_wall_ms: float
    encode_us_per_step: float
    dispatches_per_step: int
    events: list[dict] = field(default_factory=list)
    peak: DevicePeak | None = None
    pass_floor_us: float | None = None  # an empty dispatch timed like the kernels

    @property
    def gpu_ms_per_step(self) -> float:
        return sum(k.total_ns for k in self.kernels) / 1e6 / max(self.steps, 1)

    def rows(self, top: int | None = None) -> list[KernelTime]:
        rows = sorted(self.kernels, key=lambda k: -k.total_ns)
        return rows[:top] if top else rows

    def __str__(self) -> str:
        total = sum(k.total_ns for k in self.kernels) or 1.0
        lines = [f"device: {self.device}",
                 f"steps: {self.steps}; dispatches/step: {self.dispatches_per_step}; "
                 f"GPU time/step: {self.gpu_ms_per_step:.3f} ms; wall/step: "
                 f"{self.step_wall_ms:.3f} ms; host encode/step: {self.encode_us_per_step:.1f} µs "
                 f"({self.encode_us_per_step / max(self.dispatches_per_step, 1):.2f} µs/dispatch)",
                 f"roofline: {self.peak.name if self.peak else 'no peaks known for this adapter'}",
                 *([f"per-dispatch floor of this timing: {self.pass_floor_us:.1f} µs (an empty "
                    "dispatch in its own timestamped pass: rows near it are launch-bound)"]
                   if self.pass_floor_us is not None else []),
                 f"{'kernel':<56} {'calls':>5} {'mean µs':>9} {'total %':>7} {'TFLOP/s':>8} "
                 f"{'GB/s':>7} {'bound':>7} {'% bound':>7}"]
        for k in self.rows(25):
            r = k.roofline(self.peak)
            pct = "" if r["pct_of_bound"] is None else f"{r['pct_of_bound']:.0f}%"
            lines.append(f"{k.label[:56]:<56} {k.calls:>5} {r['mean_us']:>9.1f} "
                         f"{100 * k.total_ns / total:>6.1f}% {r['tflops']:>8.2f} "
                         f"{r['gbps']:>7.0f} {r['bound'] or '':>7} {pct:>7}")
        return "\n".join(lines)

    def roofline(self, top: int | None = None) -> list[dict]:
        """Per kernel (largest total time first): flops, bytes, achieved TFLOP/s and GB/s,
        which limit binds and the percent of that bound reached."""
        return [k.roofline(self.peak) for k in self.rows(top)]

    def export_trace(self, path: str) -> None:
        """Chrome trace-event JSON (open in ui.perfetto.dev or chrome://tracing)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ns"}, f)


WARMUP_SECONDS = 0.5  # GPUs clock down when idle: keep this one busy before timing


def shown_label(d) -> str:
    """The dispatch's label with the emitter's ``label_tag`` after its first word (the
    elementwise kernels' vector variant: ``pointwise[3]x4 (134515008,) mul,sub``, ``copy x4
    (8, 8)->(8, 8)``), so a profile shows which variant ran."""
    tag = d.spec.meta.get("label_tag", "")
    if not tag:
        return d.label
    head, sep, rest = d.label.partition(" ")
    return f"{head}{tag if head.endswith(']') else ' ' + tag}{sep}{rest}"


def profile_session(sess, steps: int, feeds: dict, inference: bool = False) -> Profile:
    """Per-kernel GPU times of ``steps`` steps.  The GPU is first kept busy for
    ``WARMUP_SECONDS`` (an idle H200 runs short bursts at a fraction of its clock: measured up
    to 4× slower per kernel), then all timed steps are submitted back to back, each dispatch in
    its own timestamped pass, and read once at the end."""
    from .session import check_feeds

    dev = sess.dev
    if not dev.has_timestamps:
        raise DeviceError(f"adapter {dev.adapter_name!r} has no timestamp-query feature; "
                          "per-kernel GPU times are unavailable")
    if steps < 1:
        raise ValueError(f"profile: steps must be >= 1, got {steps}")
    ex = sess.infer if inference else sess.train
    expected = sess.infer_feeds if inference else sess.train_feeds
    sess._upload_feeds(check_feeds(expected, feeds, sess.check_finite, sess.feed_ranges))
    wall_ms, encode_us = _warm_and_time_steps(dev, ex, steps)
    dispatches = ex.stream.dispatches
    labels = [shown_label(d) for d in dispatches]
    times = {lb: KernelTime(lb, flops=d.flops, bytes=d.bytes, tensor_cores=d.tensor_cores)
             for lb, d in zip(labels, dispatches, strict=True)}
    durations = _timestamped_steps(dev, ex, steps)
    events: list[dict] = []
    t_cursor = 0.0
    for step_durs in durations:
        for lb, dur in zip(labels, step_durs, strict=True):
            times[lb].calls += 1
            times[lb].total_ns += dur
            events.append({"name": lb, "ph": "X", "pid": 1, "tid": 1,
                           "ts": t_cursor / 1e3, "dur": dur / 1e3})
            t_cursor += dur
    return Profile(dev.adapter_name, steps, list(times.values()), wall_ms, encode_us,
                   len(dispatches), events, peaks_for(dev.adapter_name), _pass_floor_us(dev))


def _warm_and_time_steps(dev, ex, steps: int) -> tuple[float, float]:
    """Warm the GPU up (pipelines compiled, clocks raised), then the host encode cost and the
    wall time of ``steps`` plain steps submitted back to back."""
    t_end = time.perf_counter() + WARMUP_SECONDS
    while True:
        dev.queue.submit([ex.encode()])
        dev.sync()
        if time.perf_counter() >= t_end:
            break
    t0 = time.perf_counter()
    cbs = [ex.encode() for _ in range(steps)]
    encode_us = (time.perf_counter() - t0) / steps * 1e6
    t0 = time.perf_counter()
    for cb in cbs:
        dev.queue.submit([cb])
    dev.sync()
    return (time.perf_counter() - t0) / steps * 1e3, encode_us


def _timestamped_steps(dev, ex, steps: int) -> list[np.ndarray]:
    """Nanoseconds of every dispatch of ``steps`` steps (one timestamped pass each)."""
    import wgpu

    n = len(ex.stream.dispatches)
    count = 2 * max(n, 1)
    qsets = [dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=count)
             for _ in range(steps)]
    stride = -(-8 * count // 256) * 256  # resolve offsets are multiples of 256 bytes
    resolve = dev.device.create_buffer(size=stride * steps,
                                       usage=wgpu.BufferUsage.QUERY_RESOLVE
                                       | wgpu.BufferUsage.COPY_SRC)
    for k, qs in enumerate(qsets):
        enc = dev.device.create_command_encoder()
        i = 0
        for cmd in ex.commands:
            if isinstance(cmd, DispatchCommand):
                _timed_pass(enc, qs, i, cmd.pipeline, cmd.bind_group, cmd.workgroups)
                i += 1
            else:
                cmd.record(enc)
        enc.resolve_query_set(qs, 0, count, resolve, stride * k)
        dev.queue.submit([enc.finish()])
    raw = np.frombuffer(dev.read_buffer(resolve, 0, stride * steps), dtype=np.uint64)
    ts = raw.astype(np.float64).reshape(steps, stride // 8)
    period = _timestamp_period(dev)
    return [np.maximum(t[1:2 * n:2] - t[0:2 * n:2], 0.0) * period for t in ts]


def _timed_pass(enc, qs, i: int, pipeline, bind_group, workgroups) -> None:
    """One dispatch in its own compute pass, timestamps at its begin and end into query slots
    2i and 2i + 1 of ``qs``: how every row of the profile (and its floor) is timed."""
    cp = enc.begin_compute_pass(timestamp_writes={
        "query_set": qs, "beginning_of_pass_write_index": 2 * i,
        "end_of_pass_write_index": 2 * i + 1})
    cp.set_pipeline(pipeline)
    cp.set_bind_group(0, bind_group)
    cp.dispatch_workgroups(*workgroups)
    cp.end()


FLOOR_PASSES = 32
_FLOOR_SPEC = KernelSpec(
    name="profile_floor", n_bindings=1, workgroups=(1, 1, 1),
    wgsl="@group(0) @binding(0) var<storage, read_write> out: array<u32>;\n"
         "@compute @workgroup_size(1) fn main() { out[0] = out[0] + 1u; }\n")


def _pass_floor_us(dev) -> float:
    """Median µs of a one-invocation dispatch in its own timestamped pass, timed as the
    kernels are: what every row includes for the pass around it (H200, Dawn: 8.2 µs,
    docs/benchmarks.md, fourteenth session), so a small kernel's row is read against it."""
    import wgpu

    n = FLOOR_PASSES
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * n)
    resolve = dev.device.create_buffer(size=16 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE
                                       | wgpu.BufferUsage.COPY_SRC)
    pipe, buf = dev.pipeline(_FLOOR_SPEC), dev.create_buffer(4, label="profile_floor")
    bg = dev.bind_group(_FLOOR_SPEC, [buf])
    enc = dev.device.create_command_encoder()
    for i in range(n):
        _timed_pass(enc, qs, i, pipe, bg, _FLOOR_SPEC.workgroups)
    enc.resolve_query_set(qs, 0, 2 * n, resolve, 0)
    dev.queue.submit([enc.finish()])
    t = np.frombuffer(dev.read_buffer(resolve, 0, 16 * n), dtype=np.uint64).astype(np.float64)
    return float(np.median(np.maximum(t[1::2] - t[0::2], 0.0))) * _timestamp_period(dev) / 1e3


def _timestamp_period(dev) -> float:
    """Nanoseconds per timestamp tick (WebGPU reports ns; older natives expose a period)."""
    q = dev.queue
    fn = getattr(q, "get_timestamp_period", None)
    if fn is not None:
        try:
            return float(fn())
        except Exception:  # noqa: BLE001
            return 1.0
    return 1.0
