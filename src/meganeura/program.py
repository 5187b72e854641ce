"""From a user's graph to a Program: forward, backward and optimizer updates in one graph.

This is the front half of ``compile``: autodiff and the optimizer rewrite the graph; what
follows (passes, plan, codegen, runtime) only sees the resulting Program."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .autodiff import grad
from .errors import GraphBuildError
from .graph import Graph, TensorType, Value


@dataclass
class Program:
    graph: Graph
    loss: Value | None
    outputs: dict[str, Value]
    grads: dict[str, Value] = field(default_factory=dict)
    optimizer: object | None = None
    model_fingerprint: str = ""

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
        return roots

    @property
    def persistent(self) -> dict[str, Value]:
        """Parameters and states: tensors that live across steps (and go into checkpoints)."""
        return {n: lf.value for n, lf in self.graph.leaves.items() if lf.kind in ("param", "state")}


def build_program(graph: Graph, loss: Value | None = None,
                  outputs: Mapping[str, Value] | None = None, optimizer=None) -> Program:
    """Differentiate ``loss`` and append ``optimizer``'s updates (training), or keep the forward
    graph only (inference: ``optimizer=None``)."""
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
    fp = graph.fingerprint()
    if optimizer is not None:
        g2, grads = grad(graph, loss)
        optimizer.apply(g2, grads)
    else:
        g2, grads = graph.copy(), {}
    return Program(g2, g2[loss] if loss is not None else None,
                   {k: g2[v] for k, v in outputs.items()}, grads, optimizer, fp)


def _source_input(graph: Graph, v: Value) -> str | None:
    """The fed input whose values ``v`` holds unchanged (through views), if any."""
    from .ops.lowering import View

    while not v.node.opdef.leaf:
        if not isinstance(v.node.opdef.lowering, View) or not v.node.inputs:
            return None
        v = v.node.inputs[0]
    lf = graph.leaf_of(v)
    return lf.name if lf is not None and lf.kind == "input" else None
