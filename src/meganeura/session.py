"""The Session API shared by every backend (GPU runtime and the numpy reference).

A backend implements four primitives — run the training step, run inference, read and write
persistent tensors — and inherits feed validation, parameter management and checkpoints."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import numpy as np

from .errors import FeedError, GraphBuildError
from .graph import TensorType
from .init import init_leaves
from .program import Program


class StepResult:
    """What a training step produced.  Values are fetched lazily: nothing waits for the GPU
    until ``loss`` or ``outputs`` is read."""

    def __init__(self, fetch: Callable[[], dict[str, np.ndarray]], step: int):
        self._fetch = fetch
        self._cache: dict[str, np.ndarray] | None = None
        self.step = step

    def _values(self) -> dict[str, np.ndarray]:
        if self._cache is None:
            self._cache = self._fetch()
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


def check_feeds(expected: Mapping[str, TensorType], feeds: Mapping[str, object],
                check_finite: bool = True) -> dict[str, np.ndarray]:
    """Validate feeds before anything is submitted: names, shapes, dtypes, finiteness."""
    unknown = sorted(set(feeds) - set(expected))
    missing = sorted(set(expected) - set(feeds))
    if unknown or missing:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(f"{n!r} ({expected[n]})" for n in missing))
        if unknown:
            parts.append("unknown " + ", ".join(repr(n) for n in unknown))
        raise FeedError("; ".join(parts) + f" — expected feeds: {sorted(expected)}")
    out = {}
    for name, t in expected.items():
        arr = np.asarray(feeds[name])
        if arr.shape != t.shape:
            raise FeedError(f"feed {name!r} has shape {arr.shape}, expected {t.shape} ({t})")
        if t.dtype.is_float:
            if not (np.issubdtype(arr.dtype, np.floating)):
                raise FeedError(f"feed {name!r} has dtype {arr.dtype}, expected floating ({t})")
            if check_finite and not np.isfinite(arr).all():
                bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
                raise FeedError(f"feed {name!r} contains {bad} NaN/inf values")
        elif t.dtype.is_int:
            if not np.issubdtype(arr.dtype, np.integer):
                raise FeedError(f"feed {name!r} has dtype {arr.dtype}, expected integers ({t})")
            info = np.iinfo(t.dtype.np)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise FeedError(f"feed {name!r} has values outside the {t.dtype.name} range")
        elif arr.dtype != np.bool_:
            raise FeedError(f"feed {name!r} has dtype {arr.dtype}, expected bool ({t})")
        # (ascontiguousarray makes rank-0 arrays 1-D: keep the declared shape)
        out[name] = np.ascontiguousarray(arr, dtype=t.dtype.np).reshape(t.shape)
    return out


class Session(ABC):
    """A compiled program ready to train (``step``) and infer (``run``)."""

    def __init__(self, program: Program, check_finite: bool = True):
        self.program = program
        self.check_finite = check_finite
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
        arrays = check_feeds(self.program.feeds, feeds, self.check_finite)
        fetch = self._step(arrays)
        self.step_count += 1
        return StepResult(fetch, self.step_count)

    def run(self, **feeds) -> dict[str, np.ndarray]:
        """Inference: the named outputs for these feeds (parameters unchanged)."""
        if not self.program.outputs:
            raise FeedError("run(): the session was compiled without outputs=")
        arrays = check_feeds(self.program.inference_feeds(), feeds, self.check_finite)
        return self._run(arrays)

    def init_params(self, seed: int = 0) -> None:
        """Deterministic initial parameters and states (identical on every backend)."""
        self._write(init_leaves(self.program.graph, seed))
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
        """Set some (``strict``: all) parameters/states; checked before anything is written."""
        pers = self.program.persistent
        unknown = sorted(set(values) - set(pers))
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
            if t.dtype.is_float and not np.issubdtype(arr.dtype, np.floating):
                raise FeedError(f"set_params: {name!r} has dtype {arr.dtype}, expected {t}")
            checked[name] = np.ascontiguousarray(arr, dtype=t.dtype.np)
        self._write(checked)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic checkpoint (params, optimizer state, step, graph fingerprint)."""
        from .checkpoint import save_checkpoint

        save_checkpoint(path, self.get_state(), self.program.model_fingerprint, self.step_count)

    def load(self, path: str | os.PathLike, strict_fingerprint: bool = True) -> None:
        """Restore a checkpoint; a mismatch names the tensors and changes nothing."""
        from .checkpoint import load_checkpoint

        pers = {n: v.type for n, v in self.program.persistent.items()}
        tensors, step = load_checkpoint(path, pers, self.program.model_fingerprint,
                                        strict_fingerprint)
        self._write(tensors)
        self.step_count = step
