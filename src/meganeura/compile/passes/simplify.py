"""Dead-code elimination and common-subexpression elimination."""

from __future__ import annotations

from ...graph import DType
from ...program import Program
from .rebuild import rebuild


def _key(a):
    if isinstance(a, dict):
        return tuple(sorted((k, _key(v)) for k, v in a.items()))
    if isinstance(a, (list, tuple)):
        return tuple(_key(x) for x in a)
    if isinstance(a, DType):
        return ("dtype", a.name)
    return a


def eliminate_dead_code(program: Program) -> Program:
    roots = program.roots(inference=False)
    live = program.graph.ancestors(roots)
    # leaves stay (inputs/params/states are part of the interface even if unused)
    keep = live | {n.id for n in program.graph.nodes if n.opdef.leaf}
    return rebuild(program, lambda g, n, ins: None, keep)


def eliminate_common_subexpressions(program: Program) -> Program:
    seen: dict = {}

    def rewrite(g, node, ins):
        key = (node.op, tuple(v.id for v in ins), _key(node.attrs))
        if key in seen:
            return seen[key]
        outs = g._add_node(node.op, ins, node.attrs, [o.type for o in node.outputs], loc=node.loc)
        seen[key] = outs
        return outs

    return rebuild(program, rewrite)


_SHAPE_ONLY = ("reshape", "broadcast_to", "permute", "slice")


def fold_constant_views(program: Program) -> Program:
    """A view of a ``full`` is a ``full`` of the view's shape (no buffer, inlined as a literal)."""

    def rewrite(g, node, ins):
        if node.op in _SHAPE_ONLY and ins[0].node.op == "full":
            a = ins[0].node.attrs
            return [g.full(node.out.shape, a["value"], a["dtype"])]
        return None

    return rebuild(program, rewrite)


_REDUCTIONS = ("sum", "mean", "max", "min")


def drop_trivial_reductions(program: Program) -> Program:
    """A reduction over axes that all have size 1 is a reshape (e.g. the batch-1 sum that
    follows every weight-gradient matmul): no kernel, no buffer."""

    def rewrite(g, node, ins):
        if node.op in _REDUCTIONS and all(ins[0].shape[a] == 1 for a in node.attrs["axes"]):
            return [g.apply("reshape", ins[0], shape=node.out.shape)
                    if ins[0].shape != node.out.shape else ins[0]]
        return None

    return rebuild(program, rewrite)


def simplify(program: Program) -> Program:
    program = drop_trivial_reductions(fold_constant_views(program))
    return eliminate_dead_code(eliminate_common_subexpressions(program))
