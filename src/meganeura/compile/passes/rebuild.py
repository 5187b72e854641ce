"""Rebuild a graph node by node with a per-node rewrite: the common core of graph → graph passes."""

from __future__ import annotations

from collections.abc import Callable

from ...graph import Graph, Leaf, Node, Value
from ...program import Program

# rewrite(new_graph, node, mapped_inputs) -> list of new output Values, or None to copy the node
Rewrite = Callable[[Graph, Node, tuple[Value, ...]], "list[Value] | None"]


def rebuild(program: Program, rewrite: Rewrite, keep: set[int] | None = None) -> Program:
    """A new Program whose graph applies ``rewrite`` to every node (in order); nodes whose id is
    not in ``keep`` (when given) are dropped.  Leaves keep their names, kinds and inits."""
    old = program.graph
    g = Graph(old.name)
    vmap: dict[int, Value] = {}
    for node in old.nodes:
        if keep is not None and node.id not in keep:
            continue
        ins = tuple(vmap[v.id] for v in node.inputs)
        if node.opdef.leaf:
            lf = old.leaves[node.attrs["name"]]
            (nv,) = g._add_node(node.op, (), node.attrs, [node.out.type], loc=node.loc)
            g.leaves[lf.name] = Leaf(lf.kind, lf.name, nv, lf.init, lf.trainable, lf.data)
            vmap[node.out.id] = nv
            continue
        outs = rewrite(g, node, ins)
        if outs is None:
            outs = g._add_node(node.op, ins, node.attrs, [o.type for o in node.outputs],
                               loc=node.loc)
        for o, n in zip(node.outputs, outs):
            if n.type != o.type:
                raise AssertionError(f"rewrite of {node.op} changed {o.type} to {n.type}")
            vmap[o.id] = n
    g.updates = {k: vmap[v.id] for k, v in old.updates.items()}
    return Program(
        g, vmap[program.loss.id] if program.loss is not None else None,
        {k: vmap[v.id] for k, v in program.outputs.items()},
        {k: vmap[v.id] for k, v in program.grads.items() if v.id in vmap},
        program.optimizer, program.model_fingerprint,
        vmap[program.nonfinite.id] if program.nonfinite is not None else None,
        program.nonfinite_names,
    )
