"""The numpy reference interpreter: runs any graph (forward, gradients, optimizer updates).

It is the oracle the GPU path is tested against, and a CPU fallback.  ``dtype=np.float64``
evaluates every float tensor in double precision regardless of its graph dtype (for gradient
checks); ``np.float32`` follows the graph's own dtypes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .errors import FeedError, GraphBuildError
from .graph import Graph, Value
from .runtime.session import Session


def evaluate(graph: Graph, outputs: Sequence[Value], env: Mapping[str, np.ndarray],
             dtype=np.float32) -> list[np.ndarray]:
    """Values of ``outputs`` given ``env`` (inputs, params and states by name)."""
    outputs = [graph[v] for v in outputs]
    needed = graph.ancestors(outputs)
    vals: dict[int, np.ndarray] = {}
    for node in graph.nodes:
        if node.id not in needed:
            continue
        if node.opdef.leaf:
            name = node.attrs["name"]
            lf = graph.leaves[name]
            if lf.kind == "constant":
                arr = lf.data
            elif name in env:
                arr = np.asarray(env[name])
            else:
                raise FeedError(f"no value for {lf.kind} {name!r} ({lf.value.type})")
            vals[node.out.id] = _as(arr, node.out, dtype)
            continue
        args = [vals[v.id] for v in node.inputs]
        with np.errstate(all="ignore"):
            res = node.opdef.reference(args, node.attrs)
        for o, r in zip(node.outputs, res):
            vals[o.id] = _as(r, o, dtype)
    return [vals[v.id] for v in outputs]


def _as(arr: np.ndarray, v: Value, dtype) -> np.ndarray:
    if v.dtype.is_float:
        want = np.dtype(dtype) if dtype is not None else v.dtype.np
        if dtype == np.float32:
            want = v.dtype.np
    else:
        want = v.dtype.np
    arr = np.asarray(arr)
    if arr.shape != v.shape:
        raise FeedError(f"internal: value {v!r} evaluated to shape {arr.shape}")
    return arr if arr.dtype == want else arr.astype(want)


class ReferenceSession(Session):
    """The Session API on the numpy interpreter: the oracle for GPU tests and a CPU fallback.

    ``dtype=np.float64`` runs everything in double precision (persistent tensors are kept in
    float64 and rounded to their graph dtype only when read out)."""

    def __init__(self, program, dtype=np.float32, check_finite: bool = True, share=None):
        super().__init__(program, check_finite)
        self.dtype = np.dtype(dtype)
        shared = self._shared_names(share)
        if share is not None and share.dtype != self.dtype:
            raise GraphBuildError(f"share: dtype {self.dtype} differs from the other "
                                  f"session's {share.dtype}")
        # sharing: one environment, so either session sees the other's writes
        self.env: dict[str, np.ndarray] = share.env if share is not None else {}
        self._init_unshared(shared)

    def _roots(self, inference: bool):
        fetch = self.program.outputs if inference else self.program.step_fetch()
        return list(fetch), list(fetch.values())

    def _step(self, feeds):
        p = self.program
        names, values = self._roots(False)
        upd = list(p.graph.updates.items())
        res = evaluate(p.graph, values + [v for _, v in upd], {**self.env, **feeds}, self.dtype)
        out = dict(zip(names, res[: len(names)]))
        for (name, _), val in zip(upd, res[len(names):]):
            self.env[name] = val
        return lambda: out

    def _run(self, feeds):
        names, values = self._roots(True)
        return dict(zip(names, evaluate(self.program.graph, values, {**self.env, **feeds},
                                        self.dtype)))

    def _read(self, names):
        pers = self.program.persistent
        return {n: self.env[n].astype(pers[n].dtype.np) for n in names}

    def _write(self, values):
        # reshape to the declared shape: callers may hand rank-0 states (``optim.step``) in as
        # shape (1,) (np.ascontiguousarray promotes rank 0 to 1-D), which the interpreter
        # would then refuse at the next step as an internal shape mismatch
        pers = self.program.persistent
        for n, v in values.items():
            want = self.dtype if pers[n].dtype.is_float else pers[n].dtype.np
            self.env[n] = np.array(v, dtype=want).reshape(pers[n].shape)
