"""From a user's graph to a Program: forward, backward and optimizer updates in one graph.

This is the front half of ``compile``: autodiff and the optimizer rewrite the graph; what
follows (passes, plan, codegen, runtime) only sees the resulting Program."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .autodiff import grad
from .dtypes import f32
from .errors import GraphBuildError
from .graph import Graph, TensorType, Value

#: the result key of the non-finite flags a ``nan_check="step"`` training step fetches
NONFINITE = "__nonfinite__"
NAN_CHECKS = (None, "off", "step")
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass
class Program:
    graph: Graph
    loss: Value | None
    outputs: dict[str, Value]
    grads: dict[str, Value] = field(default_factory=dict)
    optimizer: object | None = None
    model_fingerprint: str = ""
    #: nan_check="step": one f32 flag per checked value (1 where it holds NaN/inf), fetched
    #: with the loss; ``nonfinite_names`` says what each flag checks ("loss", parameter names)
    nonfinite: Value | None = None
    nonfinite_names: tuple[str, ...] = ()

    @property
    def training(self) -> bool:
        return bool(self.graph.updates)

    @property
    def feeds(self) -> dict[str, TensorType]:
        """Inputs the step/run needs (only those the computed values depend on)."""
        roots = self.roots(inference=False)
        needed = self.graph.ancestors(roots)
        return {n: v.type for n, v in self.graph.inputs.items() if v.node.id in needed}

    @property
    def feed_ranges(self) -> dict[str, list]:
        """Inputs whose values an op restricts (``OpDef.operand_ranges``: class labels), found
        through value-preserving views (reshape, permute…): input name -> [ValueRange]."""
        out: dict[str, list] = {}
        for node in self.graph.nodes:
            rule = node.opdef.operand_ranges
            if rule is None:
                continue
            ranges = rule([v.type for v in node.inputs], node.attrs)
            for i, rng in ranges.items():
                name = _source_input(self.graph, node.inputs[i])
                if name is not None:
                    out.setdefault(name, []).append(rng)
        return out

    def inference_feeds(self) -> dict[str, TensorType]:
        needed = self.graph.ancestors(list(self.outputs.values()))
        return {n: v.type for n, v in self.graph.inputs.items() if v.node.id in needed}

    def roots(self, inference: bool) -> list[Value]:
        if inference:
            return list(self.outputs.values())
        roots = list(self.outputs.values()) + list(self.graph.updates.values())
        if self.loss is not None:
            roots.append(self.loss)
        if self.nonfinite is not None:
            roots.append(self.nonfinite)
        return roots

    def step_fetch(self) -> dict[str, Value]:
        """What a training step fetches: the outputs, the loss and the non-finite flags."""
        fetch = dict(self.outputs)
        if self.loss is not None:
            fetch["__loss__"] = self.loss
        if self.nonfinite is not None:
            fetch[NONFINITE] = self.nonfinite
        return fetch

    @property
    def persistent(self) -> dict[str, Value]:
        """Parameters and states: tensors that live across steps (and go into checkpoints)."""
        return {n: lf.value for n, lf in self.graph.leaves.items() if lf.kind in ("param", "state")}


def build_program(graph: Graph, loss: Value | None = None,
                  outputs: Mapping[str, Value] | None = None, optimizer=None,
                  nan_check: str | None = None) -> Program:
    """Differentiate ``loss`` and append ``optimizer``'s updates (training), or keep the forward
    graph only (inference: ``optimizer=None``).  ``nan_check="step"`` guards every update
    against a non-finite loss or gradient (:func:`_nonfinite_guard`)."""
    if not isinstance(graph, Graph):
        raise GraphBuildError(f"compile: expected a Graph, got {type(graph).__name__}")
    outputs = dict(outputs or {})
    for name, v in outputs.items():
        if not isinstance(v, Value) or v.graph is not graph:
            raise GraphBuildError(f"compile: output {name!r} is not a value of this graph")
    if loss is not None and (not isinstance(loss, Value) or loss.graph is not graph):
        raise GraphBuildError("compile: loss is not a value of this graph")
    if optimizer is not None and loss is None:
        raise GraphBuildError("compile: an optimizer needs a loss to minimize")
    if loss is None and not outputs:
        raise GraphBuildError("compile: nothing to compute (give loss= and/or outputs=)")
    guard = _check_nan_check(nan_check, optimizer)
    fp = graph.fingerprint()
    flags, names = None, ()
    if optimizer is not None:
        g2, grads = grad(graph, loss)
        ok = None
        if guard:
            flags, names, ok = _nonfinite_guard(g2, g2[loss], grads)
        optimizer.apply(g2, grads, guard=ok)
    else:
        g2, grads = graph.copy(), {}
    return Program(g2, g2[loss] if loss is not None else None,
                   {k: g2[v] for k, v in outputs.items()}, grads, optimizer, fp, flags, names)


def _check_nan_check(nan_check, optimizer) -> bool:
    if nan_check not in NAN_CHECKS:
        raise GraphBuildError(f"compile: nan_check must be one of {NAN_CHECKS}, got "
                              f"{nan_check!r}")
    if nan_check == "step" and optimizer is None:
        raise GraphBuildError("compile: nan_check='step' guards training updates; it needs "
                              "loss= and optimizer=")
    return nan_check == "step"


def _nonfinite_guard(graph: Graph, loss: Value, grads: Mapping[str, Value]):
    """The on-GPU check of ``nan_check="step"``: one flag per value (loss, then each gradient)
    that is 1 when some element is NaN/inf (beyond the f32 range), reduced in the step itself
    and fetched with the loss, so detection costs no extra submit or sync.  Returns the flags,
    their names and the bool scalar ``ok`` with which every update selects the old value when
    anything was non-finite (``where(ok, new, old)``: one bad batch does not poison the
    weights or the optimizer's moments).  Already-registered updates (user states such as
    running statistics) are guarded here; the optimizer guards its own."""
    from . import ops

    def flag(v: Value) -> Value:
        x = v if v.dtype == f32 else v.cast(f32)
        bad = ops.logical_not(ops.abs(x) <= _F32_MAX).cast(f32)
        return ops.max(bad).reshape(1) if x.ndim else bad.reshape(1)

    names = ("loss", *grads)
    flags = ops.concat([flag(loss)] + [flag(grads[n]) for n in grads], 0)
    ok = ops.max(flags) <= 0.0
    for name, new in list(graph.updates.items()):
        graph.set_update(name, ops.where(ok, new, graph.leaves[name].value))
    return flags, names, ok


def _source_input(graph: Graph, v: Value) -> str | None:
    """The fed input whose values ``v`` holds unchanged (through views), if any."""
    from .ops.lowering import View

    while not v.node.opdef.leaf:
        if not isinstance(v.node.opdef.lowering, View) or not v.node.inputs:
            return None
        v = v.node.inputs[0]
    lf = graph.leaf_of(v)
    return lf.name if lf is not None and lf.kind == "input" else None
