"""Fusion decisions: which values get their own buffer (materialized); everything else is
inlined into the kernel that consumes it (pointwise chains, reduce prologues) or read through
strides (views).  The planner builds kernels from this set."""

from __future__ import annotations

from ..graph import Graph, Value
from ..lowering import Kernel, Matmul, Pointwise, Reduce, View
from ..lowering import resolve as _lowering

_STRIDED = ("reshape", "permute", "broadcast", "slice", "split", "flip")


def materialized_values(graph: Graph, roots: list[Value], fuse: bool = True) -> set[int]:
    needed = graph.ancestors(roots)
    root_ids = {v.id for v in roots}
    consumers: dict[int, list] = {}
    for node in graph.nodes:
        if node.id in needed:
            for v in node.inputs:
                consumers.setdefault(v.id, []).append(node)
    out: set[int] = set()
    for node in graph.nodes:
        if node.id not in needed or node.opdef.leaf:
            continue
        low = _lowering(node)
        strided_view = isinstance(low, View) and low.kind in _STRIDED
        for v in node.outputs:
            if v.id in root_ids and not strided_view:
                out.add(v.id)  # (a root view is read through its base; the planner copies it
                # into its own buffer only when strides cannot express it contiguously)
            elif isinstance(low, Pointwise):
                # a literal (full) is inlined wherever a fused kernel reads it
                if node.op == "full" and all(
                        isinstance(_lowering(c), (Pointwise, Reduce))
                        for c in consumers.get(v.id, [])):
                    continue
                cons = {c.id: c for c in consumers.get(v.id, [])}
                if not fuse or len(cons) != 1:
                    out.add(v.id)
                    continue
                (c,) = cons.values()
                cl = _lowering(c)
                if not isinstance(cl, (Pointwise, Reduce)):
                    out.add(v.id)
            elif strided_view:
                continue
            elif fuse and (isinstance(low, (Matmul, Reduce)) or takes_epilogue(node)) and \
                    _epilogue_candidate(v, consumers, through_reshape=isinstance(low, Matmul)):
                continue  # computed inside its consumer's kernel, as an epilogue
            else:
                out.add(v.id)
    return out


def _epilogue_candidate(v: Value, consumers, through_reshape: bool = True) -> bool:
    """A matmul result read once, elementwise at its own shape (bias, activation, residual…),
    possibly through one reshape (a 2-D projection viewed as (batch, seq, features))."""
    cons = {c.id: c for c in consumers.get(v.id, [])}
    if len(cons) != 1:
        return False
    (c,) = cons.values()
    if through_reshape and c.op == "reshape":
        return _epilogue_candidate(c.outputs[0], consumers, through_reshape=False)
    return isinstance(_lowering(c), Pointwise) and c.outputs[0].shape == v.shape and sum(
        1 for x in c.inputs if x is v) == 1


def takes_epilogue(node) -> bool:
    """A single-output dedicated kernel whose archetype can fuse a pointwise epilogue."""
    low = _lowering(node)
    if not isinstance(low, Kernel) or len(node.outputs) != 1:
        return False
    from ..codegen.archetypes import archetype

    return archetype(low.archetype).epilogue is not None
