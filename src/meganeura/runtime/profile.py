"""Per-kernel GPU time from timestamp queries, host encode cost, and a Chrome/Perfetto trace.

WebGPU core writes timestamps only where a compute pass begins and ends, and a pass costs
more than a dispatch inside one (H200, Dawn: an empty dispatch takes 8.2 µs in its own pass).
So each kernel is timed twice, in its own pass: dispatched once ("alone"), and 1 + R times
back to back.  Its in-stream time, what it costs inside a step's pass (the barrier before it
included), is the difference divided by R; the pass's own cost cancels.  A kernel that reads
and writes one range (an in-place update) cannot run twice without changing the step's
result: its in-stream time is estimated as its alone time less the pass overhead measured on
an empty dispatch."""

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
    alone_ns: float = 0.0  # summed over calls: each dispatch alone in its timestamped pass
    estimated: bool = False  # in place: total_ns is alone_ns less the pass overhead
    plan_label: str = ""  # the dispatch's label without the variant tag (``shown_label``)

    @property
    def mean_s(self) -> float:
        return self.total_ns / max(self.calls, 1) / 1e9

    def roofline(self, peak: DevicePeak | None) -> dict:
        """Achieved rates and the percent of the roofline bound (None without peaks)."""
        t = self.mean_s or float("inf")
        bound = peak.bound_seconds(self.flops, self.bytes, self.tensor_cores) if peak else None
        return {"label": self.label, "calls": self.calls, "mean_us": self.mean_s * 1e6,
                "alone_us": self.alone_ns / max(self.calls, 1) / 1e3,
                "estimated": self.estimated, "flops": self.flops, "bytes": self.bytes,
                "tflops": self.flops / t / 1e12, "gbps": self.bytes / t / 1e9,
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
    pass_floor_us: float | None = None  # an empty dispatch alone in its timestamped pass
    stream_floor_us: float | None = None  # the same dispatch's in-stream time
    repeats: int = 0  # R: extra back-to-back dispatches per timed pass (0: alone times only)

    @property
    def gpu_ms_per_step(self) -> float:
        """Sum of the kernels' in-stream times (their alone times when ``repeats`` is 0)."""
        return sum(k.total_ns for k in self.kernels) / 1e6 / max(self.steps, 1)

    @property
    def alone_ms_per_step(self) -> float:
        """Sum of the kernels' times alone in their passes (pass overheads included)."""
        return sum(k.alone_ns for k in self.kernels) / 1e6 / max(self.steps, 1)

    def rows(self, top: int | None = None) -> list[KernelTime]:
        rows = sorted(self.kernels, key=lambda k: -k.total_ns)
        return rows[:top] if top else rows

    def split_k_groups(self) -> list[dict]:
        """Split-K kernels with their summing kernels, as one row each (largest first): a
        split GEMM's rate is its flops over partials + sum, which the table shows apart."""
        groups: dict[str, list[KernelTime]] = {}
        for k in self.kernels:
            base, sep, _ = (k.plan_label or k.label).partition(" [split-K ")
            if sep:
                groups.setdefault(base, []).append(k)
        out = []
        for base, parts in groups.items():
            calls = next((p for p in parts if "[split-K sum]" not in p.label), parts[0]).calls
            ns = sum(p.total_ns for p in parts) / max(calls, 1)
            flops = sum(p.flops * p.calls for p in parts) / max(calls, 1)
            out.append({"label": base, "calls": calls, "dispatches": len(parts),
                        "mean_us": ns / 1e3, "tflops": flops / ns / 1e3 if ns else 0.0,
                        "estimated": any(p.estimated for p in parts)})
        return sorted(out, key=lambda r: -r["mean_us"] * r["calls"])

    def _timing_lines(self) -> list[str]:
        if self.pass_floor_us is None:
            return []
        if not self.repeats:
            return [f"per-dispatch floor of this timing: {self.pass_floor_us:.1f} µs (an empty "
                    "dispatch in its own timestamped pass: rows near it are launch-bound)"]
        return [f"µs: in-stream time per call (each kernel dispatched 1 and {1 + self.repeats} "
                f"times back to back in a timestamped pass, the difference / {self.repeats}); "
                "alone: one dispatch in its own pass",
                f"an empty dispatch: {self.stream_floor_us:.1f} µs in stream, "
                f"{self.pass_floor_us:.1f} µs alone; ~: in place, estimated as alone less "
                f"{self.pass_floor_us - self.stream_floor_us:.1f} µs"]

    def __str__(self) -> str:
        total = sum(k.total_ns for k in self.kernels) or 1.0
        lines = [f"device: {self.device}",
                 f"steps: {self.steps}; dispatches/step: {self.dispatches_per_step}; "
                 f"GPU time/step: {self.gpu_ms_per_step:.3f} ms (alone: "
                 f"{self.alone_ms_per_step:.3f}); wall/step: "
                 f"{self.step_wall_ms:.3f} ms; host encode/step: {self.encode_us_per_step:.1f} µs "
                 f"({self.encode_us_per_step / max(self.dispatches_per_step, 1):.2f} µs/dispatch)",
                 f"roofline: {self.peak.name if self.peak else 'no peaks known for this adapter'}",
                 *self._timing_lines(),
                 f"{'kernel':<56} {'calls':>5} {'µs':>8} {'alone':>7} {'total %':>7} "
                 f"{'TFLOP/s':>8} {'GB/s':>7} {'bound':>7} {'% bound':>7}"]
        for k in self.rows(25):
            r = k.roofline(self.peak)
            pct = "" if r["pct_of_bound"] is None else f"{r['pct_of_bound']:.0f}%"
            mark = "~" if k.estimated else " "
            lines.append(f"{k.label[:56]:<56} {k.calls:>5} {r['mean_us']:>7.1f}{mark} "
                         f"{r['alone_us']:>7.1f} {100 * k.total_ns / total:>6.1f}% "
                         f"{r['tflops']:>8.2f} {r['gbps']:>7.0f} {r['bound'] or '':>7} {pct:>7}")
        groups = self.split_k_groups()[:10]
        if groups:
            lines.append("split-K GEMMs, partials + sum per call:")
        for g in groups:
            mark = "~" if g["estimated"] else " "
            lines.append(f"  {g['label'][:54]:<54} {g['calls']:>5} {g['mean_us']:>7.1f}{mark} "
                         f"{'':>7} {'':>7} {g['tflops']:>8.2f}")
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


REPEATS = 7  # R: back-to-back copies of a kernel beyond the first in its in-stream pass


def profile_session(sess, steps: int, feeds: dict, inference: bool = False,
                    repeats: int = REPEATS) -> Profile:
    """Per-kernel GPU times of ``steps`` steps.  The GPU is first kept busy for
    ``WARMUP_SECONDS`` (an idle H200 runs short bursts at a fraction of its clock: measured up
    to 4× slower per kernel), then all timed steps are submitted back to back and read once at
    the end: ``steps`` with each dispatch alone in its timestamped pass, then (``repeats`` >
    0) ``steps`` with each repeatable dispatch 1 + ``repeats`` times in its pass (module
    docstring).  Every timed step is one real step: the parameters advance ``steps`` times per
    timing, as in real steps (plus the warm-up's)."""
    from .session import check_feeds

    dev = sess.dev
    if not dev.has_timestamps:
        raise DeviceError(f"adapter {dev.adapter_name!r} has no timestamp-query feature; "
                          "per-kernel GPU times are unavailable")
    if steps < 1:
        raise ValueError(f"profile: steps must be >= 1, got {steps}")
    if not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"profile: repeats must be an int >= 0, got {repeats!r}")
    ex = sess.infer if inference else sess.train
    expected = sess.infer_feeds if inference else sess.train_feeds
    sess._upload_feeds(check_feeds(expected, feeds, sess.check_finite, sess.feed_ranges))
    wall_ms, encode_us = _warm_and_time_steps(dev, ex, steps)
    dispatches = ex.stream.dispatches
    reps = [repeats if repeatable(d) else 0 for d in dispatches]
    alone = _timestamped_steps(dev, ex, steps, [0] * len(dispatches))
    floor = _pass_floor(dev, repeats)
    stream = _timestamped_steps(dev, ex, steps, reps) if repeats else alone
    overhead_ns = 1e3 * (floor.alone_us - floor.stream_us)
    times, events = _kernel_times(dispatches, reps, alone, stream, overhead_ns)
    return Profile(dev.adapter_name, steps, times, wall_ms, encode_us, len(dispatches), events,
                   peaks_for(dev.adapter_name), floor.alone_us, floor.stream_us, repeats)


def repeatable(d) -> bool:
    """Whether running dispatch ``d`` twice in a row leaves what running it once leaves: no
    range both read and written (``inplace``) and no two of its bindings overlapping (a
    conservative check, in case a written range overlaps a read one without being equal)."""
    if d.inplace:
        return False
    spans = sorted((loc.pool, loc.name, loc.offset, loc.offset + loc.nbytes) for loc in d.binds)
    return all(a[:2] != b[:2] or b[2] >= a[3] for a, b in zip(spans, spans[1:]))


def _kernel_times(dispatches, reps: list[int], alone, stream, overhead_ns: float):
    """Per-label KernelTimes and the trace's events from the two timings' per-step
    nanoseconds: in-stream = (repeated − alone) / R, or alone − overhead where R is 0 (the
    alone time itself when no step was repeated at all)."""
    labels = [shown_label(d) for d in dispatches]
    any_rep = stream is not alone
    times = {lb: KernelTime(lb, flops=d.flops, bytes=d.bytes, tensor_cores=d.tensor_cores,
                            plan_label=d.label)
             for lb, d in zip(labels, dispatches, strict=True)}
    for lb, r in zip(labels, reps, strict=True):
        times[lb].estimated |= any_rep and not r
    events: list[dict] = []
    t_cursor = 0.0
    for step_alone, step_stream in zip(alone, stream, strict=True):
        for lb, r, a, t in zip(labels, reps, step_alone, step_stream, strict=True):
            if any_rep:
                dur = (t - a) / r if r else a - overhead_ns
            else:
                dur = a
            dur = max(float(dur), 0.0)
            kt = times[lb]
            kt.calls += 1
            kt.total_ns += dur
            kt.alone_ns += float(a)
            events.append({"name": lb, "ph": "X", "pid": 1, "tid": 1,
                           "ts": t_cursor / 1e3, "dur": dur / 1e3})
            t_cursor += dur
    return list(times.values()), events


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


def _timestamped_steps(dev, ex, steps: int, reps: list[int]) -> list[np.ndarray]:
    """Nanoseconds of every dispatch of ``steps`` steps, each in its own timestamped pass,
    dispatched 1 + ``reps[i]`` times there."""
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
                _timed_pass(enc, qs, i, cmd.pipeline, cmd.bind_group, cmd.workgroups, reps[i])
                i += 1
            else:
                cmd.record(enc)
        enc.resolve_query_set(qs, 0, count, resolve, stride * k)
        dev.queue.submit([enc.finish()])
    raw = np.frombuffer(dev.read_buffer(resolve, 0, stride * steps), dtype=np.uint64)
    ts = raw.astype(np.float64).reshape(steps, stride // 8)
    period = _timestamp_period(dev)
    return [np.maximum(t[1:2 * n:2] - t[0:2 * n:2], 0.0) * period for t in ts]


def _timed_pass(enc, qs, i: int, pipeline, bind_group, workgroups, repeats: int = 0) -> None:
    """One dispatch, 1 + ``repeats`` times back to back, in its own compute pass, timestamps
    at its begin and end into query slots 2i and 2i + 1 of ``qs``: how every row of the
    profile (and its floor) is timed."""
    cp = enc.begin_compute_pass(timestamp_writes={
        "query_set": qs, "beginning_of_pass_write_index": 2 * i,
        "end_of_pass_write_index": 2 * i + 1})
    cp.set_pipeline(pipeline)
    cp.set_bind_group(0, bind_group)
    for _ in range(1 + repeats):
        cp.dispatch_workgroups(*workgroups)
    cp.end()


FLOOR_PASSES = 32
_FLOOR_SPEC = KernelSpec(
    name="profile_floor", n_bindings=1, workgroups=(1, 1, 1),
    wgsl="@group(0) @binding(0) var<storage, read_write> out: array<u32>;\n"
         "@compute @workgroup_size(1) fn main() { out[0] = out[0] + 1u; }\n")


@dataclass(frozen=True)
class PassFloor:
    """An empty dispatch timed as the kernels are (H200, Dawn: 8.2 µs alone in its pass,
    docs/benchmarks.md, fourteenth session): rows near ``alone_us`` are launch-bound, and
    alone − in-stream is the pass's own cost."""

    alone_us: float
    stream_us: float


def _pass_floor(dev, repeats: int) -> PassFloor:
    """Median µs of a one-invocation dispatch alone in its timestamped pass, and its in-stream
    time from passes of 1 + ``repeats`` (equal to alone when ``repeats`` is 0)."""
    import wgpu

    n = FLOOR_PASSES
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=4 * n)
    resolve = dev.device.create_buffer(size=32 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE
                                       | wgpu.BufferUsage.COPY_SRC)
    pipe, buf = dev.pipeline(_FLOOR_SPEC), dev.create_buffer(4, label="profile_floor")
    bg = dev.bind_group(_FLOOR_SPEC, [buf])
    enc = dev.device.create_command_encoder()
    for i in range(2 * n):
        _timed_pass(enc, qs, i, pipe, bg, _FLOOR_SPEC.workgroups, repeats if i % 2 else 0)
    enc.resolve_query_set(qs, 0, 4 * n, resolve, 0)
    dev.queue.submit([enc.finish()])
    t = np.frombuffer(dev.read_buffer(resolve, 0, 32 * n), dtype=np.uint64).astype(np.float64)
    d = np.maximum(t[1::2] - t[0::2], 0.0) * _timestamp_period(dev) / 1e3
    alone = float(np.median(d[0::2]))
    if not repeats:
        return PassFloor(alone, alone)
    return PassFloor(alone, max(float(np.median(d[1::2])) - alone, 0.0) / repeats)


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
