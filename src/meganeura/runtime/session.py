"""Sessions: the user-facing object of a compiled program (feeds, results, state I/O).

``Session`` is the API shared by every backend (this GPU runtime and the numpy reference):
a backend implements four primitives — run the training step, run inference, read and write
persistent tensors — and inherits feed validation, parameter management and checkpoints.
``GPUSession`` implements them on a WebGPU device from a compiled ``Executable``."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np

from ..compile.executable import Executable
from ..errors import FeedError, GraphBuildError, NonFiniteError
from ..graph import TensorType
from ..init import init_leaves
from ..program import NONFINITE, Program
from .executable import GPUStream, PinnedBuffers


class StepResult:
    """What a training step produced.  Values are fetched lazily: nothing waits for the GPU
    until ``loss`` or ``outputs`` is read.  Under ``nan_check="step"`` the first read checks
    the step's non-finite flags and raises ``NonFiniteError`` (every read, the step having
    applied no update); ``on_nonfinite`` is called once, then."""

    def __init__(self, fetch: Callable[[], dict[str, np.ndarray]], step: int,
                 flag_names: tuple[str, ...] = (), on_nonfinite: Callable[[], None] | None = None):
        self._fetch = fetch
        self._cache: dict[str, np.ndarray] | None = None
        self._error: tuple | None = None
        self._flag_names, self._on_nonfinite = flag_names, on_nonfinite
        self.step = step

    def _values(self) -> dict[str, np.ndarray]:
        if self._cache is None:
            vals = dict(self._fetch())
            flags = vals.pop(NONFINITE, None)
            self._error = _nonfinite(flags, self._flag_names, self.step)
            self._cache = vals
            if self._error is not None and self._on_nonfinite is not None:
                self._on_nonfinite()
        if self._error is not None:
            raise NonFiniteError(*self._error)
        return self._cache

    @property
    def loss(self) -> float:
        v = self._values().get("__loss__")
        if v is None:
            raise AttributeError("this session was compiled without a loss")
        return float(v)

    @property
    def outputs(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self._values().items() if k != "__loss__"}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.outputs[name]

    def __repr__(self) -> str:
        return f"StepResult(step={self.step})"


def _nonfinite(flags, names: tuple[str, ...], step: int) -> tuple | None:
    """NonFiniteError's arguments when some flag is set (None when all is finite): the loss
    or the first parameter whose gradient held NaN/inf, then the others."""
    if flags is None:
        return None
    bad = [names[i] for i in np.flatnonzero(np.asarray(flags).reshape(-1) != 0)]
    if not bad:
        return None
    first = "the loss" if bad[0] == "loss" else f"the gradient of parameter {bad[0]!r}"
    more = [repr(n) for n in bad[1:]]
    also = f" (also non-finite gradients of {', '.join(more[:8])}" \
        f"{', …' if len(more) > 8 else ''})" if more else ""
    msg = (f"step {step}: NaN/inf in {first}{also}; the update was not applied (parameters "
           f"and optimizer state keep their values from step {step - 1})")
    return msg, bad[0], tuple(bad), step


def _checked_value(what: str, arr: np.ndarray, t: TensorType, check_finite: bool) -> np.ndarray:
    """``arr`` converted to ``t``'s dtype, refusing a wrong kind of dtype, integers out of
    range and (``check_finite``) values that are NaN/inf as stored."""
    _check_dtype(what, arr, t)
    with np.errstate(over="ignore", invalid="ignore"):
        conv = np.ascontiguousarray(arr, dtype=t.dtype.np).reshape(t.shape)
    if t.dtype.is_float and check_finite and not np.isfinite(conv).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(conv))[0])
        raise FeedError(f"{what} has NaN/inf values as {t.dtype.name}; the first at index "
                        f"{idx} (value {arr[idx].item()!r})")
    return conv


def check_feeds(expected: Mapping[str, TensorType], feeds: Mapping[str, object],
                check_finite: bool = True,
                ranges: Mapping[str, list] | None = None) -> dict[str, np.ndarray]:
    """Validate feeds before anything is submitted: names, shapes, dtypes, finiteness (of
    the values as the device will hold them, after conversion to the input's dtype) and the
    value ranges ops impose (``Program.feed_ranges``: class labels).  Returns the converted
    arrays; a bad feed raises FeedError and nothing runs."""
    _check_names(expected, feeds)
    out = {}
    for name, t in expected.items():
        arr = np.asarray(feeds[name])
        if arr.shape != t.shape:
            raise FeedError(f"feed {name!r} has shape {arr.shape}, expected {t.shape} ({t})")
        _check_dtype(f"feed {name!r}", arr, t)
        with np.errstate(over="ignore", invalid="ignore"):
            conv = np.ascontiguousarray(arr, dtype=t.dtype.np).reshape(t.shape)
        if t.dtype.is_float and check_finite:
            _check_finite(name, arr, conv, t)
        for rng in (ranges or {}).get(name, ()):
            idx = rng.first_violation(conv)
            if idx is not None:
                raise FeedError(f"feed {name!r}: {rng.what} {int(conv[idx])} at index "
                                f"{idx} is outside [{rng.lo}, {rng.hi})")
        # (ascontiguousarray makes rank-0 arrays 1-D: keep the declared shape)
        out[name] = conv
    return out


def _check_names(expected, feeds) -> None:
    unknown = sorted(set(feeds) - set(expected))
    missing = sorted(set(expected) - set(feeds))
    if unknown or missing:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(f"{n!r} ({expected[n]})" for n in missing))
        if unknown:
            parts.append("unknown " + ", ".join(repr(n) for n in unknown))
        raise FeedError("; ".join(parts) + f" — expected feeds: {sorted(expected)}")


def _check_dtype(what: str, arr: np.ndarray, t: TensorType) -> None:
    """The kind of ``arr``'s dtype fits ``t`` (float, integer in range, bool); ``what`` names
    the array in the error ("feed 'x'", "set_params: 'w'")."""
    if t.dtype.is_float:
        if not np.issubdtype(arr.dtype, np.floating):
            raise FeedError(f"{what} has dtype {arr.dtype}, expected floating ({t})")
    elif t.dtype.is_int:
        if not np.issubdtype(arr.dtype, np.integer):
            raise FeedError(f"{what} has dtype {arr.dtype}, expected integers ({t})")
        info = np.iinfo(t.dtype.np)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise FeedError(f"{what} has values outside the {t.dtype.name} range")
    elif arr.dtype != np.bool_:
        raise FeedError(f"{what} has dtype {arr.dtype}, expected bool ({t})")


def _check_finite(name: str, arr: np.ndarray, conv: np.ndarray, t: TensorType) -> None:
    """NaN/inf as the GPU will see them: a float64 1e39 becomes inf in f32."""
    ok = np.isfinite(conv)
    if ok.all():
        return
    idx = tuple(int(i) for i in np.argwhere(~ok)[0])
    bad = int(ok.size - np.count_nonzero(ok))
    how = "" if not np.isfinite(arr[idx]) else f" after conversion to {t.dtype.name}"
    raise FeedError(f"feed {name!r} has {bad} NaN/inf value(s){how}; the first at index "
                    f"{idx} (fed value {arr[idx].item()!r})")


class Session(ABC):
    """A compiled program ready to train (``step``) and infer (``run``)."""

    def __init__(self, program: Program, check_finite: bool = True):
        self.program = program
        self.check_finite = check_finite
        # each is a walk over the graph: done once, not at every step/run
        self.feed_ranges = program.feed_ranges
        self.train_feeds = program.feeds if program.training else {}
        self.infer_feeds = program.inference_feeds() if program.outputs else {}
        self.step_count = 0

    # backend primitives --------------------------------------------------------------------
    @abstractmethod
    def _step(self, feeds: dict[str, np.ndarray]) -> Callable[[], dict[str, np.ndarray]]:
        """Run one training step; return a function fetching loss/outputs when called."""

    @abstractmethod
    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def _read(self, names: list[str]) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def _write(self, values: dict[str, np.ndarray]) -> None: ...

    # public API ------------------------------------------------------------------------------
    @property
    def graph(self):
        return self.program.graph

    @property
    def param_names(self) -> list[str]:
        return list(self.program.graph.params)

    @property
    def state_names(self) -> list[str]:
        return list(self.program.graph.states)

    def step(self, **feeds) -> StepResult:
        """One training step (forward, backward, optimizer update).  For a graph whose
        states have updates (``Graph.set_update``) but no loss or optimizer, e.g. a KV-cache
        decode step: one run that returns the outputs and applies the updates."""
        if not self.program.training:
            raise FeedError("step(): this session has no optimizer (compiled for inference); "
                            "use run()")
        arrays = check_feeds(self.train_feeds, feeds, self.check_finite, self.feed_ranges)
        fetch = self._step(arrays)
        self.step_count += 1
        return StepResult(fetch, self.step_count, self.program.nonfinite_names,
                          self._skipped_step)

    def _skipped_step(self) -> None:
        """A nan_check'ed step turned out non-finite (no update was applied): it does not
        count."""
        self.step_count = max(0, self.step_count - 1)

    def run(self, **feeds) -> dict[str, np.ndarray]:
        """Inference: the named outputs for these feeds (parameters unchanged)."""
        if not self.program.outputs:
            raise FeedError("run(): the session was compiled without outputs=")
        arrays = check_feeds(self.infer_feeds, feeds, self.check_finite, self.feed_ranges)
        return self._run(arrays)

    def init_params(self, seed: int = 0) -> None:
        """Deterministic initial parameters and states (identical on every backend).  The seed
        must be a non-negative int: 1.5 would silently become 1 and -1 fail deep in numpy."""
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
                or seed < 0:
            raise FeedError(f"init_params: seed must be a non-negative int, got {seed!r}")
        self._write(init_leaves(self.program.graph, int(seed)))
        self.step_count = 0

    def _shared_names(self, other: Session | None) -> list[str]:
        """Persistent tensors this session shares with ``other`` (``compile(share=other)``):
        those with the same name in both programs, which must then have the same type."""
        if other is None:
            return []
        if type(other) is not type(self):
            raise GraphBuildError(f"share: cannot share tensors between a "
                                  f"{type(self).__name__} and a {type(other).__name__}")
        mine, theirs = self.program.persistent, other.program.persistent
        names = [n for n in mine if n in theirs]
        bad = [f"{n!r} ({mine[n].type} vs {theirs[n].type})" for n in names
               if mine[n].type != theirs[n].type]
        if bad:
            raise GraphBuildError("share: tensors with the same name but different types: "
                                  + ", ".join(bad))
        return names

    def _init_unshared(self, shared: list[str]) -> None:
        """Construction-time init: the default values of every persistent tensor not shared
        (shared ones keep the values the other session holds)."""
        vals = init_leaves(self.program.graph, 0)
        self._write({k: v for k, v in vals.items() if k not in set(shared)})
        self.step_count = 0

    def get_params(self) -> dict[str, np.ndarray]:
        return self._read(self.param_names)

    def get_state(self) -> dict[str, np.ndarray]:
        """Parameters and optimizer/model states (everything a checkpoint holds)."""
        return self._read(list(self.program.persistent))

    def set_params(self, values: Mapping[str, np.ndarray], strict: bool = False) -> None:
        """Set some (``strict``: all) parameters/states; checked before anything is written:
        names, shapes, dtypes, integer ranges and finiteness as stored (a NaN written into a
        weight would otherwise surface steps later as a NaN loss far from its cause)."""
        if not isinstance(values, Mapping):
            raise FeedError(f"set_params: expected a dict of tensor name -> array, got "
                            f"{type(values).__name__}")
        pers = self.program.persistent
        unknown = sorted(map(str, set(values) - set(pers)))
        if unknown:
            raise FeedError(f"set_params: unknown tensors {unknown}; known: {sorted(pers)}")
        if strict:
            missing = sorted(set(self.param_names) - set(values))
            if missing:
                raise FeedError(f"set_params: missing parameters {missing}")
        checked = {}
        for name, arr in values.items():
            t = pers[name].type
            arr = np.asarray(arr)
            if arr.shape != t.shape:
                raise FeedError(f"set_params: {name!r} has shape {arr.shape}, expected {t.shape}")
            checked[name] = _checked_value(f"set_params: {name!r}", arr, t, self.check_finite)
        self._write(checked)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic checkpoint (params, optimizer state, step, graph fingerprint)."""
        from ..checkpoint import save_checkpoint

        save_checkpoint(path, self.get_state(), self.program.model_fingerprint, self.step_count)

    def load(self, path: str | os.PathLike, strict_fingerprint: bool = True) -> None:
        """Restore a checkpoint; a mismatch names the tensors and changes nothing."""
        from ..checkpoint import load_checkpoint

        pers = {n: v.type for n, v in self.program.persistent.items()}
        tensors, step = load_checkpoint(path, pers, self.program.model_fingerprint,
                                        strict_fingerprint)
        self._write(tensors)
        self.step_count = step


class GPUSession(Session):
    """Session on a WebGPU device (wgpu-native or Dawn), running a compiled ``Executable``."""

    def __init__(self, program: Program, executable: Executable, device,
                 check_finite: bool = True, share: GPUSession | None = None):
        super().__init__(program, check_finite)
        shared = self._shared_names(share)
        self.executable, self.dev = executable, device
        if share is not None:  # the values this session takes over must exist first
            share.buffers.materialize()
        self.precision = executable.precision
        self.compile_seconds = executable.compile_seconds
        self.buffers = PinnedBuffers(device, executable,
                                     {n: share.buffers.buffers[n] for n in shared})
        self.train = GPUStream(device, executable.train, self.buffers) \
            if executable.train is not None else None
        self.infer = GPUStream(device, executable.infer, self.buffers) \
            if executable.infer is not None else None
        self._init_unshared(shared)

    def _init_unshared(self, shared: list[str]) -> None:
        """Initial values of the unshared parameters and states, deferred to their first use
        (``PinnedBuffers.defer_init``): the same values as an eager init, computed per name."""
        graph, skip = self.program.graph, set(shared)
        names = [n for n, lf in graph.leaves.items() if lf.kind in ("param", "state")
                 and n not in skip]
        self.buffers.defer_init(names, lambda ns: init_leaves(graph, 0, names=ns))
        self.step_count = 0

    # Session primitives ----------------------------------------------------------------------
    def _upload_feeds(self, feeds):
        self.buffers.write(feeds)

    def _submit(self, stream: GPUStream, feeds):
        self._upload_feeds(feeds)
        return stream.submit()

    def _step(self, feeds):
        return self._submit(self.train, feeds)

    def _run(self, feeds):
        if self.infer is None:
            raise FeedError("run(): this session was compiled to train only (compile_built("
                            "inference=False)); it has no inference stream")
        return self._submit(self.infer, feeds)()

    def gpu_buffer(self, name: str) -> tuple:
        """``(GPUBuffer, byte offset, byte size)`` where persistent tensor ``name`` (a parameter
        or optimizer state) lives, for a host sharing the device to copy or bind it in its own
        passes (e.g. draw with the weights) without a round trip through the CPU.  The buffer has
        STORAGE | COPY_SRC | COPY_DST usage; work the host submits on the queue is ordered
        with the session's steps."""
        if name not in self.program.persistent:
            raise KeyError(f"{name!r} is not a parameter or state of this session; it has "
                           f"{sorted(self.program.persistent)[:8]}")
        t = self.executable.leaves[name].type
        self.buffers.materialize()  # the host may read the buffer right away
        buf, off = self.buffers.home(name)
        return buf, off, max(t.size, 1) * t.dtype.gpu_itemsize

    def _read(self, names):
        return self.buffers.read(names)

    def _write(self, values):
        self.buffers.write(values)

    # reports -----------------------------------------------------------------------------------
    def _streams(self):
        return [(tag, s) for tag, s in (("train", self.train), ("infer", self.infer))
                if s is not None]

    def kernel_variants(self) -> dict[str, dict[str, int]]:
        """Kernel variants per stream (``train`` / ``infer``), e.g. how many matmuls run on
        tensor cores (``sgmat*``) under ``precision="fast"``."""
        return {tag: dict(Counter(d.variant for d in s.stream.dispatches))
                for tag, s in self._streams()}

    def memory_report(self) -> dict:
        """Naive size (one buffer per value) vs the planned peak of intermediates, in bytes."""
        rep = {}
        for tag, s in self._streams():
            p = s.stream
            outs = sum(f.nbytes for f in p.fetch)
            rep[tag] = {"naive_bytes": p.naive_bytes, "planned_peak_bytes": p.arena_bytes + outs,
                        "arena_bytes": p.arena_bytes, "result_bytes": outs,
                        "ratio": (p.arena_bytes + outs) / max(p.naive_bytes, 1),
                        "dispatches": len(p.dispatches),
                        "dispatches_unfused": p.dispatches_unfused}
        leaves = self.executable.leaves.values()
        rep["persistent_bytes"] = sum(lf.type.size * lf.type.dtype.gpu_itemsize
                                      for lf in leaves if lf.kind in ("param", "state"))
        rep["input_bytes"] = sum(lf.type.size * lf.type.dtype.gpu_itemsize
                                 for lf in leaves if lf.kind == "input")
        return rep

    def profile(self, steps: int = 10, inference: bool = False, repeats: int | None = None,
                **feeds):
        """Per-kernel GPU times (timestamp queries) over ``steps`` steps; returns a Profile
        whose ``str`` is a table.  Each kernel's time is its in-stream cost, from passes that
        dispatch it 1 and 1 + ``repeats`` times (default ``profile.REPEATS``; 0 times each
        dispatch alone in its pass only, pass overhead included).  Profiling runs the kernels
        but applies no updates twice: the parameters do change, as in real steps."""
        from .profile import REPEATS, profile_session

        reps = REPEATS if repeats is None else repeats
        self._last_profile = profile_session(self, steps, feeds, inference, reps)
        return self._last_profile

    def export_trace(self, path: str) -> None:
        """Chrome/Perfetto trace of the last ``profile`` call."""
        if getattr(self, "_last_profile", None) is None:
            raise RuntimeError("export_trace: call profile() first")
        self._last_profile.export_trace(path)

    def export(self, path, weights: str = "f32") -> None:
        """Write this compiled program with its current parameters as an artifact folder
        that ``mn.load_program`` (or the browser runtime in web/) runs without the compiler;
        ``weights="f16"`` stores the parameters as f16 (upcast to f32 on load)."""
        from .artifact import export_session

        export_session(self, path, weights)

    def kernel_labels(self, inference: bool | None = None) -> list[str]:
        """The dispatches' labels of one stream, in order: the training stream, or the
        inference one with ``inference=True`` (default: training where the session has it,
        else inference, so an inference-only session does not answer with nothing)."""
        if inference is None:
            inference = self.train is None
        s = self.infer if inference else self.train
        return [d.label for d in s.stream.dispatches] if s else []
