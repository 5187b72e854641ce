"""Dead-code elimination and common-subexpression elimination."""

from __future__ import annotations

from ...graph import DType, TensorType
from ...ops.lowering import Pointwise, resolve
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


def sink_reshapes_below_activations(program: Program) -> Program:
    """``f(reshape(k))`` → ``reshape(f(k))`` for a one-input elementwise ``f`` (gelu, relu…)
    when ``k`` is a dedicated kernel's result that only this reshape reads (a conv1d is a
    conv2d over a height-1 image viewed back as (N, C, L)).  The activation then reads the
    kernel's result at its own shape and becomes the kernel's epilogue: one dispatch and one
    round trip of the activation's input saved.  The reshape is a view: no copy appears."""
    from ..fusion import takes_epilogue

    readers: dict[int, int] = {}
    for node in program.graph.nodes:
        for v in node.inputs:
            readers[v.id] = readers.get(v.id, 0) + 1

    def rewrite(g, node, ins):
        if len(node.inputs) != 1 or len(node.outputs) != 1 or node.opdef.leaf:
            return None
        if not isinstance(resolve(node), Pointwise) or node.inputs[0].node.op != "reshape":
            return None
        r = node.inputs[0].node
        k = r.inputs[0]
        if readers.get(k.id) != 1 or not takes_epilogue(k.node):
            return None
        src = ins[0].node.inputs[0]  # k in the new graph (the reshape was copied already)
        (y,) = g._add_node(node.op, (src,), node.attrs,
                           [TensorType(src.shape, node.out.dtype)], loc=node.loc)
        return [g.apply("reshape", y, shape=node.out.shape)]

    return rebuild(program, rewrite)


def simplify(program: Program) -> Program:
    program = drop_trivial_reductions(fold_constant_views(program))
    program = sink_reshapes_below_activations(program)
    return eliminate_dead_code(eliminate_common_subexpressions(program))
