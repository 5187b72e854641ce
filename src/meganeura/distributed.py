"""Data-parallel training over ``torch.distributed`` (gloo), launched with ``torchrun``.

WebGPU has no device-to-device collectives, so gradients meet in host memory, where gloo (CPU
tensors, any GPU vendor, several machines over TCP) averages them.  One data-parallel step is
three compiled programs over shared buffers (``compile(share=...)``), because the gradients
must leave the GPU between the backward pass and the optimizer update:

* the *gradient program*: forward + backward, every gradient (as f32) and the loss fetched as
  results.  Fetched results get their own buffers written by the kernels that compute them, so
  a gradient is final as soon as its kernel ran: the stream is submitted in *segments* that end
  where a bucket of gradients is complete, each followed by a copy of that bucket into a
  mapped-readable staging buffer.  While the GPU runs the rest of the backward, the host maps
  the first bucket and starts its asynchronous all-reduce (``async_op=True``);
* with ``accumulate=k > 1``, an *accumulation program* for the first k-1 micro-batches, which
  adds the gradients into persistent f32 states on the GPU (nothing read back: communication is
  paid once per k micro-batches); the gradient program then fetches accumulator + gradient;
* the *update program*: the optimizer, with the summed gradients fed as inputs and scaled by
  1/(ranks * k) on the GPU; it is the same update rule ``compile(optimizer=...)`` builds, on
  the same parameter buffers, so every rank applies the identical update.

The loss rides in the same buckets, so ``step().loss`` is the global mean loss at no extra
collective.  Initial parameters are broadcast from rank 0; checkpoints are written by rank 0
in the format of ``Session.save`` (interchangeable with single-process sessions and resumable
on any number of ranks); a rank that dies or hangs makes every other rank raise
``DistributedError`` within the process-group timeout, before any update of that step.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from .autodiff import grad
from .dtypes import f32
from .errors import FeedError, MeganeuraError
from .graph import Graph, Value
from .init import zeros
from .program import Program

__all__ = ["DistributedError", "RankInfo", "Context", "DataParallel", "StepStats", "init",
           "rank_info", "shard_batch", "shard_indices", "ENV_SHARE_ADAPTER", "ENV_TIMEOUT"]

ENV_SHARE_ADAPTER = "MEGANEURA_DP_SHARE_ADAPTER"
ENV_TIMEOUT = "MEGANEURA_DP_TIMEOUT"
DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait for the other ranks
GRAD_PREFIX = "dp.grad."  # fetched gradients (gradient program) = fed inputs (update program)
ACC_PREFIX = "dp.acc."  # accumulator states (accumulation program)
FIRST_MICRO = "dp.first"  # bool input: the first micro-batch overwrites the accumulators
LOSS = "dp.loss"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(MeganeuraError, RuntimeError):
    """Data-parallel setup or a collective failed (a rank died or hung, bad launch)."""


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise DistributedError("meganeura.distributed needs PyTorch (its CPU wheel is enough): "
                               "pip install 'meganeura[distributed]'") from e
    if not dist.is_available() or not dist.is_gloo_available():
        raise DistributedError("this PyTorch build has no torch.distributed gloo backend")
    return torch, dist


# ---------------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """The torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), checked."""
    env = os.environ if env is None else env
    missing = [k for k in _TORCHRUN_VARS if not env.get(k)]
    if missing:
        raise DistributedError(
            f"not launched by torchrun: {', '.join(missing)} unset; start with "
            "`torchrun --nproc-per-node N ...` (several machines: add --nnodes and "
            "--rdzv-endpoint) or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT")

    def num(key: str, default: str | None = None) -> int:
        text = env.get(key, default)
        try:
            return int(text)
        except (TypeError, ValueError):
            raise DistributedError(f"${key} must be an integer, got {text!r}") from None

    info = RankInfo(num("RANK"), num("WORLD_SIZE"), num("LOCAL_RANK"),
                    num("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE")))
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise DistributedError(f"RANK={info.rank} must lie in [0, WORLD_SIZE={info.world_size})")
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise DistributedError(f"LOCAL_RANK={info.local_rank} must lie in [0, "
                               f"LOCAL_WORLD_SIZE={info.local_world_size})")
    return info


def _timeout(timeout: float | None) -> float:
    src = "timeout"
    if timeout is None:
        text = os.environ.get(ENV_TIMEOUT, "").strip()
        if not text:
            return DEFAULT_TIMEOUT
        src = f"${ENV_TIMEOUT}"
        try:
            timeout = float(text)
        except ValueError:
            raise DistributedError(f"{src} must be a number of seconds, got {text!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise DistributedError(f"{src} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


@dataclass
class Context:
    """This rank's place in the job, its GPU device and the collective timeout (seconds)."""

    info: RankInfo
    device: object
    timeout: float

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    def collective(self, what: str, fn, step: int | None = None):
        """Run a collective; a peer that died or hung past the timeout becomes one
        ``DistributedError`` naming this rank, the operation and what stays valid."""
        try:
            return fn()
        except RuntimeError as e:  # gloo: connection closed/reset by peer, or timed out
            at = f" at step {step}" if step is not None else ""
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what}{at} failed — another rank "
                f"died, hung longer than the {self.timeout:g} s timeout, or stopped with an "
                f"error ({first}); no update was applied in this step and the last checkpoint "
                "written by rank 0 stays valid: restart the job to resume from it") from e

    def barrier(self) -> None:
        _, dist = _torch()
        self.collective("barrier", lambda: dist.barrier())

    def close(self) -> None:
        """Leave the process group (call once at the end of a healthy run)."""
        _, dist = _torch()
        if dist.is_initialized():
            dist.destroy_process_group()

    @staticmethod
    def abort(code: int = 1) -> None:
        """End this process now, after a ``DistributedError``: the process group is broken
        then (a collective may still be blocked on a hung peer), and a normal interpreter exit
        would wait on it or abort in gloo's destructor.  Flushes stdout/stderr first."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def init(backend: str | None = None, timeout: float | None = None,
         share_adapter: bool | None = None, open_device: bool = True) -> Context:
    """Join the gloo process group from the torchrun environment and open this rank's GPU:
    adapter number LOCAL_RANK among the host's adapters of the best kind.  ``timeout`` (default
    ``$MEGANEURA_DP_TIMEOUT`` or 300 s) bounds every wait for the other ranks.  More local ranks
    than adapters is an error unless ``share_adapter`` (or ``$MEGANEURA_DP_SHARE_ADAPTER=1``)
    lets ranks share them — for tests on one CPU adapter (lavapipe), never for speed.
    ``open_device=False``: the process group only (``ctx.device`` is None), for a process
    that takes part in collectives without computing on a GPU."""
    _, dist = _torch()
    info = rank_info()
    seconds = _timeout(timeout)
    if share_adapter is None:
        share_adapter = os.environ.get(ENV_SHARE_ADAPTER, "").strip() == "1"
    from .runtime.device import get_device_at

    device = get_device_at(info.local_rank, backend, bool(share_adapter)) if open_device \
        else None
    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", init_method="env://", rank=info.rank,
                                    world_size=info.world_size,
                                    timeout=timedelta(seconds=seconds))
        except (RuntimeError, ValueError) as e:
            raise DistributedError(
                f"rank {info.rank}: could not join the process group at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within "
                f"{seconds:g} s: {e}") from e
    return Context(info, device, seconds)


# ---------------------------------------------------------------------------------- data


def shard_batch(feeds: Mapping[str, np.ndarray], rank: int, world_size: int) -> dict:
    """This rank's rows (axis 0) of a global batch: rank r gets the r-th of ``world_size``
    equal slices, so every rank sees the batch a single process would have split."""
    out = {}
    for name, arr in feeds.items():
        arr = np.asarray(arr)
        if arr.ndim == 0 or arr.shape[0] % world_size:
            raise FeedError(f"shard_batch: feed {name!r} of shape {arr.shape} cannot be split "
                            f"into {world_size} equal parts along axis 0")
        n = arr.shape[0] // world_size
        out[name] = arr[rank * n:(rank + 1) * n]
    return out


def shard_indices(n: int, rank: int, world_size: int, shuffle: bool = False,
                  seed: int = 0) -> np.ndarray:
    """Sample indices of this rank for a dataset of ``n`` samples: an equal share for every
    rank (the tail that does not divide is dropped, as ``DistributedSampler(drop_last=True)``),
    the same permutation on every rank when shuffled (same ``seed``)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise FeedError(f"shard_indices: rank {rank} must lie in [0, {world_size})")
    if n < world_size:
        raise FeedError(f"shard_indices: {n} samples cannot be shared by {world_size} ranks")
    idx = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    per = n // world_size
    return idx[:per * world_size][rank::world_size]


# ---------------------------------------------------------------------------------- buckets


@dataclass
class Bucket:
    """Gradients read back and all-reduced together, in the order the backward finishes them:
    ``ready`` is the index of the last stream command touching any of them."""

    names: list[str]
    offsets: list[int]  # element offsets in the bucket's host vector
    sizes: list[int]
    ready: int
    host: np.ndarray | None = None  # f32 vector, shared with ``tensor``
    tensor: object = None  # torch view of ``host`` (no copy)
    staging: object = None  # MAP_READ buffer the segment copies into

    @property
    def elements(self) -> int:
        return self.offsets[-1] + self.sizes[-1]


def _overlaps(a, b) -> bool:
    return a.pool == b.pool and a.name == b.name and a.offset < b.offset + b.nbytes \
        and b.offset < a.offset + a.nbytes


def _last_use(ops, loc) -> int:
    """Index of the last command binding a range that overlaps ``loc`` (-1: none)."""
    from .compile.executable import Copy

    last = -1
    for i, op in enumerate(ops):
        locs = (op.src, op.dst) if isinstance(op, Copy) else op.binds
        if any(_overlaps(x, loc) for x in locs):
            last = i
    return last


def plan_buckets(stream, names: Sequence[str], bucket_bytes: int) -> list[Bucket]:
    """Fetched f32 results ``names`` of ``stream`` in buckets of about ``bucket_bytes``,
    ordered by when the stream finishes them (the backward's end first: the last layers)."""
    fetch = {f.name: f for f in stream.fetch}
    ready = {n: _last_use(stream.ops, fetch[n].loc) for n in names}
    order = sorted(names, key=lambda n: ready[n])
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    for n in order:
        size = fetch[n].type.size
        if cur is None or cur.elements * 4 >= bucket_bytes:
            cur = Bucket([], [], [], -1)
            buckets.append(cur)
        cur.offsets.append(cur.elements if cur.names else 0)
        cur.names.append(n)
        cur.sizes.append(size)
        cur.ready = max(cur.ready, ready[n])
    return buckets


def segments(buckets: Sequence[Bucket], n_ops: int) -> list[tuple[int, int, list[Bucket]]]:
    """The stream split after each bucket's last command: (start, stop, buckets read back at
    the end of that segment); the last segment runs to the end of the stream."""
    end = {id(b): min(max(b.ready + 1, 1), n_ops) for b in buckets}
    out, start = [], 0
    for stop in sorted(set(end.values()) | {n_ops}):
        out.append((start, stop, [b for b in buckets if end[id(b)] == stop]))
        start = stop
    return out


# ---------------------------------------------------------------------------------- programs


def _f32(v: Value) -> Value:
    return v if v.dtype == f32 else v.cast(f32)


def gradient_program(graph: Graph, loss: Value, accumulated: bool = False) -> Program:
    """Forward + backward of ``loss``; fetched: the loss (``LOSS``) and every gradient as f32
    (``GRAD_PREFIX + name``), plus the accumulator states when ``accumulated``.  No optimizer;
    the graph's own state updates (running statistics) stay."""
    g, grads = grad(graph, loss)
    outs = {LOSS: g[loss]}
    for name, gv in grads.items():
        v = _f32(gv)
        if accumulated:
            v = g.state(ACC_PREFIX + name, gv.shape, f32, init=zeros()) + v
        outs[GRAD_PREFIX + name] = v
    return Program(g, None, outs, grads, None, graph.fingerprint())


def accumulation_program(graph: Graph, loss: Value) -> Program:
    """Forward + backward of one early micro-batch: gradients added into f32 accumulator
    states on the GPU (the first micro-batch, input ``FIRST_MICRO`` true, overwrites them)."""
    from . import ops

    g, grads = grad(graph, loss)
    first = g.input(FIRST_MICRO, (), "bool")
    for name, gv in grads.items():
        acc = g.state(ACC_PREFIX + name, gv.shape, f32, init=zeros())
        v = _f32(gv)
        g.set_update(ACC_PREFIX + name, ops.where(first, v, acc + v))
    return Program(g, g[loss], {}, grads, None, graph.fingerprint())


def update_program(graph: Graph, names: Sequence[str], optimizer, scale: float) -> Program:
    """``optimizer``'s update of parameters ``names`` from fed f32 gradient sums
    (``GRAD_PREFIX + name``) times ``scale`` (1 / (ranks * micro-batches)): the same update rule,
    groups and state names as ``compile(graph, loss, optimizer=optimizer)``."""
    u = Graph(f"{graph.name}-update")
    grads = {}
    for name in names:
        p = graph.params[name]
        u.param(name, p.shape, p.dtype, init=graph.leaves[name].init)
        gi = u.input(GRAD_PREFIX + name, p.shape, f32)
        grads[name] = (gi * scale if scale != 1.0 else gi).cast(p.dtype)
    optimizer.apply(u, grads)
    return Program(u, None, {}, grads, optimizer, graph.fingerprint())


# ---------------------------------------------------------------------------------- training


@dataclass
class StepStats:
    """What the last step spent, in seconds, and the bytes each rank all-reduced."""

    bytes_allreduced: int = 0
    buckets: int = 0
    segments: int = 0
    map_wait_s: float = 0.0  # waiting for a bucket's segment to finish on the GPU, and mapping
    copy_s: float = 0.0  # mapped staging memory -> host vectors
    allreduce_wait_s: float = 0.0  # after the last bucket was read: exposed communication
    writeback_s: float = 0.0  # summed gradients -> update program inputs, update submitted
    step_s: float = 0.0


@dataclass(frozen=True)
class DPStep:
    """A finished data-parallel step: the mean loss over all ranks and micro-batches."""

    loss: float
    step: int


@dataclass
class _Segment:
    start: int
    stop: int
    buckets: list[Bucket] = field(default_factory=list)
    copies: list = field(default_factory=list)


class DataParallel:
    """Data-parallel training of ``loss`` (a graph built for one rank's micro-batch) with
    ``optimizer``: ``step(**feeds)`` runs this rank's part of one global step; after it every
    rank holds the same parameters.  ``accumulate``: micro-batches per step (``step`` splits each
    feed along axis 0 into that many); ``bucket_mb``: gradient bytes per all-reduce;
    ``fingerprint``: the graph identity stored in checkpoints (default: this graph's; pass the
    fingerprint of the global-batch graph to make checkpoints interchangeable across rank
    counts with strict fingerprints)."""

    def __init__(self, ctx: Context, graph: Graph, loss: Value, optimizer, *,
                 accumulate: int = 1, bucket_mb: float = 25.0, precision: str = "strict",
                 seed: int = 0, fingerprint: str | None = None, check_finite: bool = True):
        if not isinstance(ctx, Context):
            raise DistributedError(f"DataParallel: ctx must come from distributed.init(), got "
                                   f"{type(ctx).__name__}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise DistributedError(f"DataParallel: accumulate must be an int >= 1, got "
                                   f"{accumulate!r}")
        if not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < math.inf:
            raise DistributedError(f"DataParallel: bucket_mb must be > 0, got {bucket_mb!r}")
        if optimizer is None:
            raise DistributedError("DataParallel: an optimizer is required")
        if ctx.device is None:
            raise DistributedError("DataParallel: this rank has no GPU device (the context was "
                                   "made with init(open_device=False))")
        self.ctx, self.accumulate = ctx, accumulate
        self.fingerprint = fingerprint or graph.fingerprint()
        self.stats = StepStats()
        self._compile(graph, loss, optimizer, precision, check_finite)
        self._prepare_buckets(int(bucket_mb * 2**20))
        self.step_count = 0
        self.grad.init_params(seed)
        self.broadcast_state()

    # -- building ---------------------------------------------------------------------------
    def _compile(self, graph, loss, optimizer, precision, check_finite) -> None:
        """The three programs over shared buffers: the accumulation program (if any) owns the
        parameters and accumulators, the gradient program shares them, the update program
        shares the parameters with the gradient program."""
        from .compile import compile_built

        opts = {"device": self.ctx.device, "group_params": False}
        self.acc = None
        if self.accumulate > 1:
            self.acc = compile_built(accumulation_program(graph, loss), precision, None,
                                     check_finite, **opts)
        gp = gradient_program(graph, loss, accumulated=self.acc is not None)
        # only the stream a step runs: a graph with its own state updates (running statistics)
        # steps in its training stream and needs no inference stream
        self.grad = compile_built(gp, precision, None, check_finite, share=self.acc,
                                  inference=not gp.training, **opts)
        self.param_names = list(gp.grads)
        scale = 1.0 / (self.ctx.world_size * self.accumulate)
        self.update = compile_built(update_program(graph, self.param_names, optimizer, scale),
                                    precision, None, check_finite, device=self.ctx.device,
                                    share=self.grad)
        self._stream = self.grad.train if self.grad.train is not None else self.grad.infer
        self._feeds = self.grad.train_feeds if self.grad.train is not None \
            else self.grad.infer_feeds
        self._user_states = [n for n in self.grad.state_names if not n.startswith(ACC_PREFIX)]

    def _prepare_buckets(self, bucket_bytes: int) -> None:
        """Buckets in the order the backward finishes them, the stream's segments, and per
        bucket a staging buffer and a host vector that torch all-reduces in place."""
        import wgpu

        torch, _ = _torch()
        names = [LOSS] + [GRAD_PREFIX + n for n in self.param_names]
        stream = self._stream
        self.buckets = plan_buckets(stream.stream, names, bucket_bytes)
        fetch = {f.name: f for f in stream.stream.fetch}
        self._where: dict[str, tuple[Bucket, int, int]] = {}
        usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        for i, b in enumerate(self.buckets):
            b.host = np.zeros(b.elements, np.float32)
            b.tensor = torch.from_numpy(b.host)
            b.staging = self.ctx.device.device.create_buffer(size=max(b.elements * 4, 4),
                                                             usage=usage, label=f"dp-bucket{i}")
            for n, off, size in zip(b.names, b.offsets, b.sizes):
                self._where[n] = (b, off, size)
        from .runtime.executable import CopyCommand

        self._segments = []
        for start, stop, bs in segments(self.buckets, len(stream.stream.ops)):
            copies = [CopyCommand(stream.buffer(fetch[n].loc), fetch[n].loc.offset, b.staging,
                                  off * 4, fetch[n].nbytes)
                      for b in bs for n, off in zip(b.names, b.offsets)]
            self._segments.append(_Segment(start, stop, bs, copies))
        self.stats.buckets, self.stats.segments = len(self.buckets), len(self._segments)
        self.stats.bytes_allreduced = sum(b.elements * 4 for b in self.buckets)
        self._ahead: list | None = None  # the next step's segments, encoded ahead

    # -- training ---------------------------------------------------------------------------
    def step(self, **feeds) -> DPStep:
        """One global step on this rank's batch; with ``accumulate = k`` every feed holds k
        micro-batches along axis 0 (k times the rows the graph was built for)."""
        if self.accumulate == 1:
            return self.step_micro([feeds])
        micro = [{} for _ in range(self.accumulate)]
        for name, arr in feeds.items():
            arr = np.asarray(arr)
            if arr.ndim == 0 or arr.shape[0] % self.accumulate:
                raise FeedError(f"step: feed {name!r} of shape {arr.shape} cannot be split into "
                                f"accumulate={self.accumulate} micro-batches along axis 0")
            for i, part in enumerate(np.split(arr, self.accumulate)):
                micro[i][name] = part
        return self.step_micro(micro)

    def step_global(self, **feeds) -> DPStep:
        """One step on a global batch that every rank passes whole (the same data loader on
        every rank): this rank takes its rows (``shard_batch``)."""
        return self.step(**shard_batch(feeds, self.ctx.rank, self.ctx.world_size))

    def step_micro(self, micro: Sequence[Mapping[str, np.ndarray]]) -> DPStep:
        """One global step from this rank's ``accumulate`` micro-batches (feed dicts): the
        first k-1 accumulate on the GPU, the last one's gradients are read back in buckets
        while its backward still runs, all-reduced, and the update is applied."""
        if len(micro) != self.accumulate:
            raise FeedError(f"step_micro: expected {self.accumulate} micro-batches, got "
                            f"{len(micro)}")
        t0 = time.perf_counter()
        pending = [self.acc.step(**m, **{FIRST_MICRO: np.bool_(i == 0)})
                   for i, m in enumerate(micro[:-1])]
        self._submit_gradients(micro[-1])
        loss = self._reduce(pending)
        self._apply()
        self.step_count += 1
        self.stats.step_s = time.perf_counter() - t0
        return DPStep(loss, self.step_count)

    def _submit_gradients(self, feeds: Mapping[str, np.ndarray]) -> None:
        """The gradient program, one submit per segment, each ending with its buckets' copies
        into their staging buffers; the segments encoded ahead by the previous step when
        there are (``$MEGANEURA_PREENCODE``).  They are encoded before ``_reduce`` maps the
        staging buffers and submitted after it unmapped them."""
        from .runtime.executable import preencode_enabled
        from .runtime.session import check_feeds

        arrays = check_feeds(self._feeds, feeds, self.grad.check_finite, self.grad.feed_ranges)
        ahead = preencode_enabled()  # a bad setting fails before anything is submitted
        self.grad.buffers.write(arrays)
        queue = self.ctx.device.queue
        prepared, self._ahead = self._ahead, None
        self._stream.pinned.materialize()
        if prepared is None:
            for seg in self._segments:
                queue.submit([self._encode(seg)])
        else:
            for cb in prepared:
                queue.submit([cb])
        if ahead:  # the next step's segments, while the GPU runs these (GPUStream.submit)
            self._ahead = [self._encode(seg) for seg in self._segments]

    def _encode(self, seg: _Segment):
        return self._stream.encode_range(seg.start, seg.stop, seg.copies)

    def _reduce(self, pending) -> float:
        """Read the buckets back in the order the GPU finishes them, starting each bucket's
        asynchronous all-reduce as soon as it is on the host; returns the global mean loss."""
        import wgpu

        _, dist = _torch()
        st, step = self.stats, self.step_count + 1
        st.map_wait_s = st.copy_s = 0.0
        works = []
        for seg in self._segments:
            for b in seg.buckets:
                t0 = time.perf_counter()
                b.staging.map_sync(wgpu.MapMode.READ)
                t1 = time.perf_counter()
                mapped = b.staging.read_mapped(copy=False)
                np.copyto(b.host, np.frombuffer(mapped, np.float32, count=b.elements))
                del mapped
                b.staging.unmap()
                st.map_wait_s += t1 - t0
                st.copy_s += time.perf_counter() - t1
                if LOSS in b.names:  # the early micro-batches' losses join the sum
                    b.host[b.offsets[b.names.index(LOSS)]] += sum(r.loss for r in pending)
                works.append(self.ctx.collective(
                    "all-reduce of gradients",
                    lambda b=b: dist.all_reduce(b.tensor, async_op=True), step))
        t0 = time.perf_counter()
        for w in works:
            self.ctx.collective("all-reduce of gradients", w.wait, step)
        st.allreduce_wait_s = time.perf_counter() - t0
        b, off, _ = self._where[LOSS]
        return float(b.host[off]) / (self.ctx.world_size * self.accumulate)

    def _apply(self) -> None:
        """Summed gradients into the update program's inputs, then the update (scaled there)."""
        t0 = time.perf_counter()
        vals = {}
        for n in self.param_names:
            b, off, size = self._where[GRAD_PREFIX + n]
            vals[GRAD_PREFIX + n] = b.host[off:off + size]
        self.update.buffers.write(vals)
        self.update.train.submit()
        self.stats.writeback_s = time.perf_counter() - t0

    # -- state ------------------------------------------------------------------------------
    def get_params(self) -> dict[str, np.ndarray]:
        return self.update.get_params()

    def get_state(self) -> dict[str, np.ndarray]:
        """Parameters, the graph's own states and the optimizer states: what a single-process
        session's checkpoint holds (the accumulators are left out)."""
        state = self.update.get_state()
        if self._user_states:
            state.update(self.grad._read(self._user_states))
        return state

    def state_types(self) -> dict:
        pers = {**self.grad.program.persistent, **self.update.program.persistent}
        return {n: pers[n].type for n in [*self.update.program.persistent, *self._user_states]}

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Set parameters and states (names as in ``get_state``) on this rank only."""
        mine = self.update.program.persistent
        self.update.set_params({k: v for k, v in values.items() if k in mine})
        rest = {k: v for k, v in values.items() if k not in mine}
        if rest:
            self.grad.set_params(rest)

    def broadcast_state(self) -> None:
        """Rank 0's parameters and states to every rank (after init or a load)."""
        torch, dist = _torch()
        state = self.get_state()
        for name in sorted(state):
            arr = state[name]  # (ascontiguousarray would make a rank-0 array 1-D)
            t = torch.from_numpy(np.ascontiguousarray(arr).reshape(arr.shape))
            self.ctx.collective(f"broadcast of {name!r}", lambda t=t: dist.broadcast(t, 0))
            state[name] = t.numpy()
        if self.ctx.rank != 0:
            self.set_state(state)

    def save(self, path: str | os.PathLike, extra: Mapping[str, str] | None = None) -> bool:
        """Rank 0 writes an atomic checkpoint (``Session.save``'s format; loadable by a
        single-process session of the same graph); other ranks do nothing.  True on rank 0."""
        if self.ctx.rank != 0:
            return False
        from .checkpoint import save_checkpoint

        save_checkpoint(path, self.get_state(), self.fingerprint, self.step_count, extra=extra)
        return True

    def load(self, path: str | os.PathLike, strict_fingerprint: bool = True) -> None:
        """Rank 0 reads a checkpoint (written with any number of ranks, or by a single-process
        session) and broadcasts it; every rank raises if rank 0 could not read it."""
        torch, dist = _torch()
        from .checkpoint import load_checkpoint

        tensors, step, err = {}, 0, None
        if self.ctx.rank == 0:
            try:
                tensors, step = load_checkpoint(path, self.state_types(), self.fingerprint,
                                                strict_fingerprint)
            except (MeganeuraError, OSError) as e:
                err = e
        flag = torch.tensor([int(err is None), step], dtype=torch.int64)
        self.ctx.collective("broadcast of the checkpoint status", lambda: dist.broadcast(flag, 0))
        if err is not None:
            raise err
        if not int(flag[0]):
            raise DistributedError(f"rank 0 could not load checkpoint {os.fspath(path)!r}")
        if self.ctx.rank == 0:
            self.set_state(tensors)
        self.broadcast_state()
        self.step_count = int(flag[1])
