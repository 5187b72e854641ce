"""Fusion decisions: which values get their own buffer (materialized); everything else is
inlined into the kernel that consumes it (pointwise chains, reduce prologues) or read through
strides (views).  The scheduler (``schedule.py``) builds kernels from this set.

Not a graph → graph pass (it rewrites nothing): a query the scheduler asks of the graph, so it
lives next to the scheduler rather than in ``passes/``."""

from __future__ import annotations

from ..graph import Graph, Value
from ..ops.lowering import Kernel, Matmul, Pointwise, Reduce, View
from ..ops.lowering import resolve as _lowering

_STRIDED = ("reshape", "permute", "broadcast", "slice", "split", "flip")


def materialized_values(graph: Graph, roots: list[Value], fuse: bool = True) -> set[int]:
    needed = graph.ancestors(roots)
    root_ids = {v.id for v in roots}
    consumers: dict[int, list] = {}
    position: dict[int, int] = {}  # node id -> index (kernels are scheduled in graph order)
    for i, node in enumerate(graph.nodes):
        position[node.id] = i
        if node.id in needed:
            for v in node.inputs:
                consumers.setdefault(v.id, []).append(node)
    # last read of each value's buffer: a view is read through its base, so the readers of a
    # view count as readers of the base (propagated backwards through chains of views)
    last_use = {vid: max(position[c.id] for c in cs) for vid, cs in consumers.items()}
    for node in reversed(graph.nodes):
        if node.id in needed and node.inputs and isinstance(_lowering(node), View):
            mine = max((last_use.get(v.id, -1) for v in node.outputs), default=-1)
            base = node.inputs[0]
            last_use[base.id] = max(last_use.get(base.id, -1), mine)
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
                if fuse and len(cons) > 1 and _recompute(node, cons.values(), out, graph,
                                                         position, last_use):
                    continue  # cheap: each consumer recomputes it (no kernel, no buffer)
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
                    _epilogue_candidate(v, consumers, root_ids,
                                        through_reshape=isinstance(low, Matmul)):
                continue  # computed inside its consumer's kernel, as an epilogue
            else:
                out.add(v.id)
    return out


RECOMPUTE_MAX_INPUTS = 2


def _recompute(node, consumers, materialized: set[int], graph: Graph, position,
               last_use) -> bool:
    """A one-op elementwise value read by several fused kernels (pointwise chains, reduce
    prologues) is recomputed in each instead of stored: one dispatch and a write + reads of
    the value saved, at the price of one instruction per consumer.  Only when its inputs are
    themselves stored (or leaves, literals, views), so recomputation never cascades, and the
    inputs it keeps alive past their own last use are together no larger than the value
    itself (whose buffer would have lived until then): memory never grows at any point."""
    if node.op == "full" or len(node.outputs) != 1 or len(node.inputs) > RECOMPUTE_MAX_INPUTS:
        return False
    if not all(isinstance(_lowering(c), (Pointwise, Reduce)) for c in consumers):
        return False
    until = max(position[c.id] for c in consumers)
    extended = 0  # elements kept alive longer than they would be
    for x in node.inputs:
        while x.id not in materialized and graph.leaf_of(x) is None and \
                isinstance(_lowering(x.node), View) and x.node.inputs:
            if _moves_last_axis(x.node):
                return False  # a transposed read is uncoalesced: once, into a stored value
            x = x.node.inputs[0]  # a view reads its base through strides
        if graph.leaf_of(x) is not None or x.node.op == "full":
            continue  # persistent or a literal: nothing to keep alive
        if x.id not in materialized:
            return False
        if last_use.get(x.id, -1) < until:
            extended += x.size
    return extended <= node.outputs[0].size


def _moves_last_axis(node) -> bool:
    """A permute whose innermost axis is not the input's innermost (a transpose): adjacent
    output elements are far apart in memory."""
    low = _lowering(node)
    if not isinstance(low, View) or low.kind != "permute":
        return False
    perm = node.attrs["perm"]
    return perm[-1] != len(perm) - 1


def _epilogue_candidate(v: Value, consumers, root_ids: set[int],
                        through_reshape: bool = True) -> bool:
    """A matmul result read once, elementwise at its own shape (bias, activation, residual…),
    possibly through one reshape (a 2-D projection viewed as (batch, seq, features)) that is
    not itself fetched (a fetched view is read from the result's buffer, which must exist)."""
    cons = {c.id: c for c in consumers.get(v.id, [])}
    if len(cons) != 1:
        return False
    (c,) = cons.values()
    if through_reshape and c.op == "reshape":
        return c.outputs[0].id not in root_ids and _epilogue_candidate(
            c.outputs[0], consumers, root_ids, through_reshape=False)
    return isinstance(_lowering(c), Pointwise) and c.outputs[0].shape == v.shape and sum(
        1 for x in c.inputs if x is v) == 1


def takes_epilogue(node) -> bool:
    """A single-output dedicated kernel whose archetype can fuse a pointwise epilogue."""
    low = _lowering(node)
    if not isinstance(low, Kernel) or len(node.outputs) != 1:
        return False
    from ..kernels.archetypes import archetype

    return archetype(low.archetype).epilogue is not None
