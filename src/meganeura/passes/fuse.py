"""Fusion decisions: which values get their own buffer (materialized); everything else is
inlined into the kernel that consumes it (pointwise chains, reduce prologues) or read through
strides (views).  The planner builds kernels from this set."""

from __future__ import annotations

from ..graph import Graph, Value
from ..lowering import Pointwise, Reduce, View


def _lowering(node):
    low = node.opdef.lowering
    if callable(low) and not isinstance(low, (Pointwise, View, Reduce)):
        low = low(node.attrs, [v.type for v in node.inputs], [o.type for o in node.outputs])
    return low


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
        for v in node.outputs:
            if v.id in root_ids:
                out.add(v.id)
            elif node.op == "full":
                continue  # a literal inlined wherever it is read
            elif isinstance(low, Pointwise):
                cons = {c.id: c for c in consumers.get(v.id, [])}
                if not fuse or len(cons) != 1:
                    out.add(v.id)
                    continue
                (c,) = cons.values()
                cl = _lowering(c)
                if not isinstance(cl, (Pointwise, Reduce)):
                    out.add(v.id)
            elif isinstance(low, View) and low.kind in ("reshape", "permute", "broadcast",
                                                         "slice", "split"):
                continue
            else:
                out.add(v.id)
    return out
